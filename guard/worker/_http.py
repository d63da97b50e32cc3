"""HTTP plumbing of the worker: error bodies, the deadline header, and racing work against a client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard._body import check_framing
from guard._headers import REPEATED_HEADER, sole_header
from guard.backends._providers import MODEL_NOT_FOUND, MODEL_REVISION_HEADER, TIMEOUT_HEADER
from guard.errors import BodyError

__all__ = [
    "BODY_TOO_LARGE",
    "CANARY_FAILED",
    "INTERNAL_ERROR",
    "INVALID_HEADER",
    "INVALID_JSON",
    "INVALID_REQUEST",
    "MALFORMED_ANSWER",
    "MODEL_NOT_FOUND",
    "MODEL_REVISION_HEADER",
    "NOT_FOUND",
    "NOT_READY",
    "OVERLOADED",
    "REPEATED_HEADER",
    "REQUEST_ID_HEADER",
    "TIMEOUT",
    "TIMEOUT_HEADER",
    "UNAUTHORIZED",
    "UNAVAILABLE",
    "ClientGone",
    "FramingMiddleware",
    "RequestIdMiddleware",
    "error_response",
    "parse_timeout",
    "request_id",
    "unless_disconnected",
]

T = TypeVar("T")

#: Error codes of the worker's ``{code, message, field, errors}`` bodies (OPA ``ErrorV1`` style).
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
INVALID_HEADER = "invalid_header"
BODY_TOO_LARGE = "body_too_large"
OVERLOADED = "overloaded"
NOT_READY = "not_ready"
CANARY_FAILED = "canary_failed"
UNAUTHORIZED = "unauthorized"
TIMEOUT = "timeout"
UNAVAILABLE = "unavailable"
MALFORMED_ANSWER = "malformed_answer"
NOT_FOUND = "not_found"
INTERNAL_ERROR = "internal_error"

#: The header a response's request id travels in (echoed from the request, else generated).
REQUEST_ID_HEADER = "x-request-id"
_MAX_REQUEST_ID = 128

def request_id(raw: bytes | None) -> bytes:
    """The caller's request id when it is 1 to 128 visible ASCII characters, else a new random one (32 hex)."""
    if raw and len(raw) <= _MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in raw):
        return raw
    return uuid.uuid4().hex.encode()


class RequestIdMiddleware:
    """ASGI middleware: every HTTP response carries :data:`REQUEST_ID_HEADER` (see :func:`request_id`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = REQUEST_ID_HEADER.encode()
        rid = request_id(next((v for k, v in scope["headers"] if k == key), None))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != key]
                message = {**message, "headers": [*headers, (key, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class FramingMiddleware:
    """ASGI middleware: a request whose body is framed both by ``Content-Length`` and ``Transfer-Encoding`` is
    answered 400 ``ambiguous_length`` (:func:`~guard._body.check_framing`) with ``Connection: close`` and never served:
    a front proxy that reads the length would take what follows the chunks for part of this request, and the worker
    would serve it as another (RFC 9112 section 6.3). A request sending ``Content-Type`` more than once is answered
    400 :data:`REPEATED_HEADER` (field ``headers.content-type``) and never served: the field holds one value (RFC 9110
    section 8.3), and a front proxy reading another copy than the worker would inspect the body as another kind."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                check_framing(scope["headers"])
            except BodyError as exc:
                response = error_response(exc.status, exc.code, exc.reason, field=exc.field)
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
            try:
                sole_header(scope["headers"], "content-type")
            except BodyError as exc:
                response = error_response(exc.status, exc.code, exc.reason, field=f"headers.{exc.field}")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its answer was ready; there is nobody to answer."""


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    field: str | None = None,
    errors: Sequence[Mapping[str, Any]] = (),
    retry_after: float | None = None,
) -> JSONResponse:
    """A JSON error: ``{"code", "message", "field", "errors": [{"field", "message"}]}`` (+ ``Retry-After``).

    Args:
        status: HTTP status.
        code: snake_case code (module constants).
        message: one sentence naming the value and the limit.
        field: the first field at fault (defaults to ``errors[0]["field"]``).
        errors: every field at fault, each ``{"field", "message"}``.
        retry_after: seconds; sent as whole seconds rounded up in ``Retry-After`` and as a number in the body.
    """
    errors_list = [dict(e) for e in errors]
    if field is None and errors_list:
        field = str(errors_list[0].get("field", ""))
    body: dict[str, Any] = {"code": code, "message": message, "field": field, "errors": errors_list}
    headers: dict[str, str] = {}
    if retry_after is not None:
        seconds = max(1, math.ceil(retry_after))
        headers["retry-after"] = str(seconds)
        body["retry_after"] = seconds
    return JSONResponse(body, status_code=status, headers=headers)


def parse_timeout(headers: Headers, default_s: float, maximum_s: float) -> float:
    """Seconds the caller will wait: the :data:`TIMEOUT_HEADER` value capped at ``maximum_s``, else ``default_s``.

    Raises:
        BodyError: 400 ``invalid_header`` when the header is not a number of milliseconds > 0; 400
            :data:`REPEATED_HEADER` when it is sent more than once (field ``headers.x-request-timeout-ms``: which copy
            a front proxy read is unknown).
    """
    try:
        value_bytes = sole_header(headers.raw, TIMEOUT_HEADER)
    except BodyError as exc:
        raise BodyError(exc.status, exc.code, exc.reason, field=f"headers.{exc.field}") from None
    if value_bytes is None:
        return default_s
    raw = value_bytes.decode("latin-1")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise BodyError(
            400,
            INVALID_HEADER,
            f"{TIMEOUT_HEADER} {raw[:40]!r} must be a number of milliseconds > 0",
            field=f"headers.{TIMEOUT_HEADER}",
        )
    return min(value / 1000.0, maximum_s)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` while listening for the client's disconnect; on disconnect cancel ``work``.

    Call only after the whole body was received: from then on ``receive`` yields only ``http.disconnect``.
    Cancelling ``work`` cancels its queued request, so the batcher drops it before compute.

    Raises:
        ClientGone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # our own handler was cancelled (server shutdown): take the work down with it
        watcher.cancel()
        task.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()
