"""WebSocket upgrades on judged paths, for :class:`~guard.asgi.GuardMiddleware` and ``guard proxy``'s relay.

guard judges HTTP requests and responses, not WebSocket messages, so an upgrade on a path some policy matches (a
request policy, or a response policy watching it, whatever its media type and ``Content-Type`` condition, unless
it names only methods no message stands for (HEAD, OPTIONS, TRACE, CONNECT, DELETE): a message carries what a
request with a body would, so a policy for
``POST /v1/**`` covers a WebSocket under ``/v1/``; :meth:`guard.policy._match.HttpMatcher.may_judge_messages`) is
refused: with a 403
JSON body ``{code: websocket_not_judged, message, policy}`` where the server supports the ASGI
``websocket.http.response`` extension (uvicorn does), else a close with code 1008 and the same reason.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Scope, Send

from guard.asgi._subject import ClientHeader, head_subject, header_map
from guard.asgi._target import path_views
from guard.engine import Guard
from guard.errors import BodyError

__all__ = ["NOT_JUDGED", "deny_upgrade", "judged_by", "refuse_invalid_upgrade", "refuse_judged_upgrade"]

NOT_JUDGED = "websocket_not_judged"
_POLICY_VIOLATION = 1008  # RFC 6455 7.4.1


def judged_by(guard: Guard, scope: Scope, client_header: ClientHeader | None) -> str | None:
    """The id of a policy whose ``match.http`` may judge what the upgrade ``scope`` (canonical, with its host and
    headers) would carry (:meth:`~guard.policy._match.HttpMatcher.may_judge_messages`), else ``None``. The path
    is matched in each of its :func:`~guard.asgi._target.path_views`: refused if any matches; ``"(invalid
    request)"`` for headers no subject can be built from."""
    try:
        headers = header_map(scope)
        heads = [head_subject({**scope, "method": "GET"}, headers, client_header, view)
                 for view in path_views(scope["path"])]  # fmt: skip
    except BodyError:
        return "(invalid request)"
    for head in heads:
        for policy in guard.policies:
            if policy.http is not None and policy.http.may_judge_messages(head):
                return policy.id
    return None


async def refuse_judged_upgrade(scope: Scope, send: Send, policy: str) -> None:
    """Refuse the upgrade ``scope`` that ``policy`` (its id) would judge: 403 ``websocket_not_judged`` or close 1008."""
    message = (f"guard does not judge WebSocket messages, and policy {policy!r} matches {scope['path']}; serve "
               "this path without a WebSocket or narrow the policy's match")
    await deny_upgrade(scope, send, 403, {"code": NOT_JUDGED, "message": message, "policy": policy}, _POLICY_VIOLATION)


async def refuse_invalid_upgrade(scope: Scope, send: Send, exc: BodyError) -> None:
    """Refuse an upgrade whose target cannot be made canonical: ``exc``'s 4xx ``{code, message, field}``, or close
    1008."""
    await deny_upgrade(scope, send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field},
                       _POLICY_VIOLATION)


async def deny_upgrade(scope: Scope, send: Send, status: int, payload: dict[str, Any], close_code: int) -> None:
    """Refuse an upgrade: an HTTP ``status`` with the JSON ``payload`` where the server supports the ASGI
    ``websocket.http.response`` extension, else a close with ``close_code`` and the message as its reason."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = json.dumps(payload, separators=(",", ":")).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": close_code, "reason": str(payload["message"])[:120]})
