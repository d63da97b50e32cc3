"""Reading a request body with a cap on received bytes, and replaying it to the application.

The cap counts bytes as they arrive: a small or lying ``Content-Length`` does not help an oversized body, and a large
declared length is refused before anything is read. Memory stays under ``limit`` plus one ASGI message.
A client that disconnects mid-body ends the read with ``None``; nothing is raised. A body that takes longer than
``timeout_s`` to arrive, or that sends nothing for ``idle_s``, is refused with 408. Bodies read with a
:class:`BodyBytes` count their bytes into it as they arrive, so the bytes held across requests stay bounded.

Deadlines (:class:`Deadline`) cost no timer per request: each registers its task in a table that one sweeper per
event loop checks every :data:`SWEEP_INTERVAL_S` seconds, cancelling the reads past their deadline (so a deadline
fires up to that much late). A timer per request (``asyncio.timeout``) costs about 20 us on a busy loop, most of a
cache hit's budget.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Self

from starlette.types import Message, Receive

from guard.errors import BodyError, Overloaded

__all__ = ["AMBIGUOUS_LENGTH", "BODY_TIMEOUT", "BODY_TOO_LARGE", "SWEEP_INTERVAL_S", "BodyBytes", "BodyShare",
           "Deadline", "ReplayReceive", "check_framing", "declared_length", "read_body"]

SWEEP_INTERVAL_S = 0.25

BODY_TOO_LARGE = "body_too_large"
BODY_TIMEOUT = "body_timeout"
AMBIGUOUS_LENGTH = "ambiguous_length"
_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() removes


def _too_large(limit: int, seen: int, declared: bool) -> BodyError:
    what = "declares" if declared else "sent at least"
    return BodyError(
        413, BODY_TOO_LARGE, f"the request body {what} {seen} bytes; the inspection limit is {limit} bytes"
    )


class _Sweeper:
    """The deadlines of one event loop, checked every :data:`SWEEP_INTERVAL_S` while any is registered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.deadlines: dict[asyncio.Task[object], float] = {}
        self.expired: set[asyncio.Task[object]] = set()
        self.scheduled = False

    def schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_later(SWEEP_INTERVAL_S, self.sweep)

    def sweep(self) -> None:
        self.scheduled = False
        now = time.monotonic()
        for task, deadline in list(self.deadlines.items()):
            if deadline <= now:
                del self.deadlines[task]
                self.expired.add(task)
                task.cancel()
        if self.deadlines:
            self.schedule()


_SWEEPERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper] = weakref.WeakKeyDictionary()


class Deadline:
    """``with Deadline(30.0): await ...``: raise TimeoutError if the block is still awaiting 30 s after it began (or
    after the last :meth:`extend`), or at ``until`` (a ``time.monotonic()``) if that comes first; checked by the loop's
    sweeper, so up to :data:`SWEEP_INTERVAL_S` late.

    Only the current task is cancelled, and only while inside the block; a cancellation from elsewhere passes
    through unchanged.
    """

    __slots__ = ("_seconds", "_sweeper", "_task", "_until")

    def __init__(self, seconds: float, until: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        sweeper = _SWEEPERS.get(loop)
        if sweeper is None:
            sweeper = _SWEEPERS[loop] = _Sweeper(loop)
        self._sweeper, self._seconds, self._until = sweeper, seconds, until
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task under an ASGI server
            raise RuntimeError("Deadline needs a running task")
        self._task = task

    def extend(self) -> None:
        """Start the time again from now, never past ``until`` (e.g. after each chunk, for an idle timeout)."""
        at = time.monotonic() + self._seconds
        self._sweeper.deadlines[self._task] = at if self._until is None else min(at, self._until)

    def __enter__(self) -> Self:
        self.extend()
        self._sweeper.schedule()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        sweeper = self._sweeper
        sweeper.deadlines.pop(self._task, None)
        if self._task in sweeper.expired:
            sweeper.expired.discard(self._task)
            if kind is asyncio.CancelledError:
                self._task.uncancel()
                raise TimeoutError(f"no progress within {self._seconds:g} s") from None


def check_framing(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Refuse a request framing its body both by ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112 section 6.1:
    a front proxy reading the length sees one request where the chunks end earlier and the rest is read as another).
    ``headers`` are an ASGI scope's.

    Raises:
        BodyError: 400 ``ambiguous_length``.
    """
    names = {k.lower() for k, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise BodyError(400, AMBIGUOUS_LENGTH, "the request has both Content-Length and Transfer-Encoding",
                        field="content-length")


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


class BodyBytes:
    """The bytes of request bodies held in memory across requests (``held``), counted as they arrive, at most
    ``limit``.

    ``with body_bytes.share() as share: await read_body(..., held=share)``: the share counts one request's bytes and
    gives them all back when the block exits, however it exits.
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def check_room(self, size: int = 0) -> None:
        """Raise :class:`~guard.errors.Overloaded` (retry after 1 s) when ``size`` more bytes (at least one) would take
        the bodies held past the limit."""
        if self.held + max(size, 1) > self.limit:
            raise Overloaded("memory for request bodies", self.limit, 1.0, counted="bytes")

    def share(self) -> BodyShare:
        """A new request's share, empty until its body arrives."""
        return BodyShare(self)


class BodyShare:
    """One request's bytes in a :class:`BodyBytes`; ``add`` raises :class:`~guard.errors.Overloaded` when they would
    take the total past its limit (the bytes already counted stay counted until the block exits)."""

    __slots__ = ("_pool", "held")

    def __init__(self, pool: BodyBytes) -> None:
        self._pool = pool
        self.held = 0

    def add(self, size: int) -> None:
        self._pool.check_room(size)
        self._pool.held += size
        self.held += size

    def add_held(self, size: int) -> None:
        """Count ``size`` more bytes this request holds beyond its body (what encoding it made: an image's pixel
        tensors), refused as :meth:`add` refuses them while other requests hold bytes; a request alone takes them
        past the limit, so one whose own bytes exceed it is served, one at a time."""
        if self._pool.held > self.held:
            self._pool.check_room(size)
        self._pool.held += size
        self.held += size

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._pool.held -= self.held
        self.held = 0


async def read_body(
    receive: Receive,
    limit: int,
    declared: int | None = None,
    timeout_s: float | None = None,
    *,
    idle_s: float | None = None,
    held: BodyShare | None = None,
    started: float | None = None,
) -> bytes | None:
    """Receive the whole body, refusing it as soon as more than ``limit`` bytes have arrived.

    Args:
        receive: the ASGI receive callable of an ``http`` scope.
        limit: most bytes accepted.
        declared: the ``Content-Length``, if any; only a value over ``limit`` is acted on (413 before reading).
        timeout_s: most seconds for the whole body; ``None`` = no limit.
        idle_s: most seconds without a body byte (from the call, then from each part that arrives); ``None`` = no
            limit.
        held: a :meth:`BodyBytes.share` that counts each part as it arrives.
        started: the ``time.monotonic()`` from which ``timeout_s`` counts, when reading the body began before this
            call (the middleware read up to its first part to learn whether there is one); default now.

    Returns:
        The body bytes, or ``None`` if the client disconnected first.

    Raises:
        BodyError: 413 ``body_too_large``; 408 ``body_timeout``.
        Overloaded: a part would take the bytes ``held`` counts into past their limit.
    """
    if declared is not None and declared > limit:
        raise _too_large(limit, declared, True)
    if timeout_s is None and idle_s is None:
        return await _read(receive, limit, held, None)
    until = None if timeout_s is None else (time.monotonic() if started is None else started) + timeout_s
    if idle_s is None:
        deadline, idle = Deadline(timeout_s or 0.0, until), None
    else:  # one deadline per task: the idle one, extended after each part but never past the whole body's
        deadline = idle = Deadline(idle_s, until)
    try:
        with deadline:
            return await _read(receive, limit, held, idle)
    except TimeoutError:
        if until is not None and time.monotonic() >= until:
            message = f"the request body did not arrive within {timeout_s:g} s"
        else:
            message = f"no byte of the request body arrived for {idle_s:g} s"
        raise BodyError(408, BODY_TIMEOUT, message, field="body") from None


async def _read(receive: Receive, limit: int, held: BodyShare | None, idle: Deadline | None) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, size, False)
            if held is not None:
                held.add(len(chunk))
            if idle is not None:
                idle.extend()
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
