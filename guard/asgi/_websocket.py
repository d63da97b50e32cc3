"""WebSocket passthrough for ``guard proxy``: paths no policy matches are relayed to the upstream, message for message.

guard judges HTTP requests and responses, not WebSocket messages, so a WebSocket upgrade on a path some policy matches
(a request policy, or a response policy watching it, as a ``GET`` with the upgrade's headers) is refused: with a
403 JSON body ``{code: websocket_not_judged, message, policy}`` where the server supports the ASGI
``websocket.http.response`` extension (uvicorn does), else a close with code 1008 and the same reason. Any other
upgrade is opened to the upstream (an unreachable or refusing upstream: 502 ``upstream_unavailable``, or a close with
1014) (``ws://`` or ``wss://`` for ``http://`` or ``https://``, the same host, path prefix
and path rules as HTTP), the subprotocol the upstream picks is accepted, and text and binary messages are relayed both
ways until either side closes; the close code goes to the other side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, WebSocketException

from guard.asgi._subject import head_subject, header_map
from guard.engine import Guard
from guard.errors import BodyError

__all__ = ["NOT_JUDGED", "WebSocketRelay"]

logger = logging.getLogger("guard.proxy")

NOT_JUDGED = "websocket_not_judged"
#: Request headers of the upgrade not sent on to the upstream (the relay makes its own handshake).
_HANDSHAKE = frozenset({b"host", b"connection", b"upgrade", b"sec-websocket-key", b"sec-websocket-version",
                        b"sec-websocket-extensions", b"sec-websocket-protocol", b"content-length"})
_POLICY_VIOLATION = 1008
_UPSTREAM_UNAVAILABLE = 1014  # "bad gateway"
#: Close codes no endpoint may send (RFC 6455 7.4.1: 1005, 1006 and 1015 only report what happened), and the code
#: the relay sends the client in their place: 1000 for "no status", 1014 ("bad gateway") for an abnormal end.
_UNSENDABLE = {1005: 1000, 1006: 1014, 1015: 1014}


class WebSocketRelay:
    """Refuse upgrades on judged paths; relay the others to ``base`` (the proxy's upstream URL).

    Args:
        guard: the engine whose policies say which paths are judged.
        base: the upstream base URL (``http(s)://host[:port][/prefix]``).
        upgrade_headers: the upgrade request's headers to send on, as the proxy sends an HTTP request's
            (:meth:`~guard.asgi.proxy.ReverseProxy.upgrade_headers`); the handshake's own are left out here.
        open_timeout: seconds for the upstream handshake.
        client_header: the header naming the client, as the middleware reads it.
    """

    def __init__(self, guard: Guard, base: httpx.URL, upgrade_headers: Callable[[Scope], list[tuple[bytes, bytes]]],
                 *, open_timeout: float, client_header: str | None) -> None:
        self.guard = guard
        self.upgrade_headers = upgrade_headers
        self.open_timeout = open_timeout
        self.client_header = client_header
        scheme = "wss" if base.scheme == "https" else "ws"
        self._base = f"{scheme}://{base.netloc.decode('ascii')}{base.path.rstrip('/')}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        policy = self._judged_by(scope)
        if policy is not None:
            await self._refuse(scope, send, policy)
            return
        if (await receive())["type"] != "websocket.connect":
            return
        query = scope.get("query_string", b"").decode("latin-1")
        url = self._base + scope["raw_path"].decode("latin-1") + (f"?{query}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.upgrade_headers(scope)
                   if k.lower() not in _HANDSHAKE]
        try:
            upstream = await connect(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                                     open_timeout=self.open_timeout, max_size=None, compression=None)
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            code = exc.response.status_code if isinstance(exc, InvalidStatus) else None
            logger.warning("websocket upstream %s refused or unreachable for path %r (%s)", self._base, scope["path"],
                           code or type(exc).__name__)  # never the query: browsers send WebSocket tokens in it
            reason = f"the upstream refused or could not be reached ({code or type(exc).__name__})"
            await _deny(scope, send, 502, {"code": "upstream_unavailable", "message": reason, "field": None},
                        _UPSTREAM_UNAVAILABLE)
            return
        async with upstream:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            await self._relay(upstream, receive, send)

    def _judged_by(self, scope: Scope) -> str | None:
        """The id of a policy that matches the upgrade as a ``GET`` (or watches its response), else ``None``."""
        path: str = scope["path"]
        views = dict.fromkeys([path, (path.rstrip("/") or "/").lower()])  # as sent and as folded: refused if either
        for view in views:
            try:
                head = head_subject({**scope, "method": "GET"}, header_map(scope), self.client_header, view)
            except BodyError:
                return "(invalid request)"
            policy = self.guard.match(head)
            if policy is not None:
                return policy.id
            watching = self.guard.watching(head)
            if watching:
                return watching[0].id
        return None

    async def _refuse(self, scope: Scope, send: Send, policy: str) -> None:
        message = (f"guard does not judge WebSocket messages, and policy {policy!r} matches {scope['path']}; serve "
                   "this path without a WebSocket or narrow the policy's match")
        await _deny(scope, send, 403, {"code": NOT_JUDGED, "message": message, "policy": policy}, _POLICY_VIOLATION)

    @staticmethod
    async def _relay(upstream: ClientConnection, receive: Receive, send: Send) -> None:
        async def client_to_upstream() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    code = message.get("code", 1000)
                    await upstream.close(_UNSENDABLE.get(code, code))
                    return
                if message.get("text") is not None:
                    await upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send(message["bytes"])

        async def upstream_to_client() -> None:
            try:
                async for data in upstream:
                    key = "text" if isinstance(data, str) else "bytes"
                    await send({"type": "websocket.send", key: data})
            except ConnectionClosed:
                pass
            code = upstream.close_code or 1000
            with contextlib.suppress(OSError, RuntimeError, WebSocketException):  # the client may be gone already
                await send({"type": "websocket.close", "code": _UNSENDABLE.get(code, code),
                            "reason": upstream.close_reason or ""})

        tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, OSError):
                    await task


async def _deny(scope: Scope, send: Send, status: int, payload: dict[str, Any], close_code: int) -> None:
    """Refuse an upgrade: an HTTP ``status`` with the JSON ``payload`` where the server supports the ASGI
    ``websocket.http.response`` extension, else a close with ``close_code`` and the message as its reason."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = json.dumps(payload, separators=(",", ":")).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": close_code, "reason": str(payload["message"])[:120]})
