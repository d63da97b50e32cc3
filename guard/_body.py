"""Reading a request body with a cap on received bytes, and replaying it to the application.

The cap counts bytes as they arrive: a small or lying ``Content-Length`` does not help an oversized body, and a large
declared length is refused before anything is read. Memory stays under ``limit`` plus one ASGI message.
A client that disconnects mid-body ends the read with ``None``; nothing is raised. A body that takes longer than
``timeout_s`` to arrive is refused with 408 (one timer for the whole read, not one per message).
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive

from guard.errors import BodyError

__all__ = ["BODY_TIMEOUT", "BODY_TOO_LARGE", "ReplayReceive", "declared_length", "read_body"]

BODY_TOO_LARGE = "body_too_large"
BODY_TIMEOUT = "body_timeout"
_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() removes


def _too_large(limit: int, seen: int, declared: bool) -> BodyError:
    what = "declares" if declared else "sent at least"
    return BodyError(
        413, BODY_TOO_LARGE, f"the request body {what} {seen} bytes; the inspection limit is {limit} bytes"
    )


def declared_length(raw: bytes | str | None) -> int | None:
    """The ``Content-Length`` value (raw bytes, or the latin-1 text of a header map), or ``None`` when absent; a
    malformed one (anything but ASCII digits around optional whitespace) is a 400."""
    if raw is None:
        return None
    text = raw.strip(_ASCII_SPACE) if isinstance(raw, str) else raw.strip()  # str.strip() would also take U+00A0
    if not (text.isdigit() and text.isascii()):  # str.isdigit alone would take "²"
        shown = raw.encode("latin-1", "replace") if isinstance(raw, str) else raw
        raise BodyError(400, "invalid_content_length", f"Content-Length {shown[:40]!r} is not a non-negative integer",
                        field="content-length")
    return int(text)


async def read_body(
    receive: Receive, limit: int, declared: int | None = None, timeout_s: float | None = None
) -> bytes | None:
    """Receive the whole body, refusing it as soon as more than ``limit`` bytes have arrived.

    Args:
        receive: the ASGI receive callable of an ``http`` scope.
        limit: most bytes accepted.
        declared: the ``Content-Length``, if any; only a value over ``limit`` is acted on (413 before reading).
        timeout_s: most seconds for the whole body; ``None`` = no limit.

    Returns:
        The body bytes, or ``None`` if the client disconnected first.

    Raises:
        BodyError: 413 ``body_too_large``; 408 ``body_timeout``.
    """
    if declared is not None and declared > limit:
        raise _too_large(limit, declared, True)
    if timeout_s is None:
        return await _read(receive, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(receive, limit)
    except TimeoutError:
        raise BodyError(408, BODY_TIMEOUT, f"the request body did not arrive within {timeout_s:g} s",
                        field="body") from None


async def _read(receive: Receive, limit: int) -> bytes | None:
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise _too_large(limit, len(body), False)
        return body
    chunks = [body]
    size = len(body)
    while True:
        if size > limit:
            raise _too_large(limit, size, False)
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if chunk:
            chunks.append(chunk)
            size += len(chunk)
        if not message.get("more_body", False):
            if size > limit:
                raise _too_large(limit, size, False)
            return b"".join(chunks)


class ReplayReceive:
    """A ``receive`` that hands the application the body the middleware already consumed, then gets out of the way.

    States (Starlette's ``_CachedRequest`` names them): *not consumed*: the first call returns the whole body as one
    ``http.request`` message, byte for byte; *consumed*: every later call goes to the real ``receive``, so the
    application still sees ``http.disconnect`` when the client leaves. A disconnect seen while reading never gets here:
    the middleware stops without calling the application.
    """

    __slots__ = ("_body", "_receive", "_replayed")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body = body
        self._receive = receive
        self._replayed = False

    async def __call__(self) -> Message:
        if not self._replayed:
            self._replayed = True
            body, self._body = self._body, b""
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()
