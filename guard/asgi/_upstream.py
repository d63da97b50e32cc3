"""The proxy's HTTP/1.1 client to its one upstream: a pool of keep-alive connections, each an asyncio protocol whose
responses are parsed by httptools (llhttp, the parser uvicorn serves with).

One host, one protocol, no redirects, no cookies, no proxies from the environment: what a reverse proxy needs, at a
fraction of a general client's per-request cost (connection reuse is a pop from a list; bytes are parsed where they
arrive, with no stream buffer and no task switch in between). Bodies stream both ways: a response body is handed on
in pieces of at most :data:`READ_BYTES`, and the connection stops reading from the upstream while more than
:data:`READ_BYTES` wait for the client, so memory per request stays bounded whatever the body size. A response with a
``Content-Length`` is handed on once its first body bytes are in (within the read timeout); any other as soon as its
head is, so a stream's head is never held back.

Response framing follows RFC 9112 6.3: no body for ``HEAD``, 1xx, 204 and 304; ``Transfer-Encoding: chunked``
(de-chunked; trailers are dropped); ``Content-Length``; else until the upstream closes (a reset breaks such a body
rather than ending it). llhttp refuses what servers could read two ways: ``Content-Length`` with ``Transfer-Encoding``,
differing lengths, folded or malformed header lines; a status outside 100-599 (which uvicorn cannot send on) and a
Transfer-Encoding other than ``chunked`` alone (the header is hop-by-hop: the client would get the coded bytes as the
body) are refused too. A connection goes back to the pool only after its response was read to the end with a known
length and neither side said ``Connection: close``, and not after a response without a body (``HEAD``, 204, 304) whose
head announces one: that body may still come, late, and be read as the next request's answer. Idle connections older
than :data:`KEEPALIVE_EXPIRY_S`, closed by the upstream, or sent bytes while no request was out (checked again when one
is taken) are dropped; a request with a body takes a connection only once its first piece is in, so its head is written
at once. A request without a body that fails on a reused connection before any response byte (the upstream closed it
meanwhile) is sent once more on a new connection.

Errors: :class:`UpstreamTimeout` (no connection, no bytes within the read timeout, or none of the request body taken
for as long), :class:`UpstreamUnavailable` (refused, reset, malformed response head), :class:`UpstreamBroken` (the
response broke after its head), :class:`UpstreamBusy` (every connection of the pool stayed in use for the queue
timeout).
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
import time
from collections.abc import AsyncIterator

import httptools

__all__ = [
    "IDEMPOTENT_METHODS",
    "KEEPALIVE_EXPIRY_S",
    "MAX_HEAD_BYTES",
    "READ_BYTES",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]

#: Largest body piece handed on, and the most response bytes held for a slow client before reading pauses.
READ_BYTES = 64 * 1024
#: Longest response head (status line and headers) accepted.
MAX_HEAD_BYTES = 64 * 1024
#: Idle connections older than this are not reused (below uvicorn's and most servers' 5 s keep-alive timeout).
KEEPALIVE_EXPIRY_S = 4.0
#: Methods a request may be sent again with on a new connection when a reused one was closed before an answer (RFC
#: 9110 section 9.2.2: a client should not retry a non-idempotent request on its own; the upstream may have run it).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

Headers = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The upstream could not be used; ``kind`` names how (the proxy's ``upstream_errors`` label)."""

    kind = "unavailable"


class UpstreamTimeout(UpstreamError):
    """No connection, or no response bytes, within the configured timeout (504)."""

    kind = "timeout"


class UpstreamUnavailable(UpstreamError):
    """The upstream could not be connected to, closed the connection before answering, or answered with something that is not HTTP/1.1 (502)."""

    kind = "unavailable"


class UpstreamBroken(UpstreamError):
    """The upstream broke after the response started (the client connection is aborted)."""

    kind = "broken_stream"


class UpstreamBusy(UpstreamError):
    """Every connection of the pool stayed in use (slow clients, a slow upstream) for the queue timeout."""

    kind = "busy"


class _Stale(Exception):
    """A reused connection failed before any response byte."""


def _framed(piece: bytes, chunked: bool) -> bytes:
    """A body piece as sent: as it is, or as one chunk (an empty piece as nothing: a chunk of size 0 ends a body)."""
    if not piece:
        return b""
    return b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece


def _readable(conn: _Connection) -> bool:
    """Whether bytes, or the upstream's close, wait on an idle connection that the event loop has not handed to it yet
    (bytes nobody asked for: the connection is not reused)."""
    assert conn.transport is not None
    poller = select.poll()
    poller.register(conn.transport.get_extra_info("socket"), select.POLLIN)
    return bool(poller.poll(0))


def _wake(waiter: asyncio.Future[bool] | None, woken: bool = True) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(woken)


class _Connection(asyncio.Protocol):
    """One connection and the exchange on it: the response being parsed (head, body pieces, end) as the protocol
    receives it. httptools calls the ``on_*`` methods from :meth:`data_received`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the upstream closed, or we did
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None  # None while no request is out
        self._waiter: asyncio.Future[bool] | None = None
        self._write_paused = False
        self._drained: asyncio.Future[bool] | None = None
        self._reset(head_only=False)

    def _reset(self, *, head_only: bool) -> None:
        self.status, self.headers, self.pieces = 0, [], collections.deque()
        self.head_done = self.complete = self.received = self.reusable = self.sized = False
        self.error: str | None = None
        self._head_only, self._interim, self._until_close = head_only, False, False
        self._encodings: list[bytes] = []  # the Transfer-Encoding values
        self._length: bytes | None = None  # the Content-Length sent
        self._head_bytes = 0  # bytes read while the head was not complete
        self._header_bytes = 0  # bytes in the header names and values so far
        self._buffered = 0  # body bytes waiting in pieces

    # transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self.complete:  # bytes nobody asked for: this connection's framing cannot be trusted
            self.reusable = False
            self.close()
            return
        self.received = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101: what follows is another protocol
            self.reusable = False
        except httptools.HttpParserError as exc:
            self.error = self.error or str(exc) or type(exc).__name__
            self.close()
        if not self.head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and self.error is None:
                self.error = f"the response head is longer than {MAX_HEAD_BYTES} bytes"
                self.close()
        elif self._buffered > READ_BYTES and not self.complete and self.transport is not None:
            self.transport.pause_reading()  # the client is slower than the upstream
        _wake(self._waiter)

    def eof_received(self) -> bool:
        self._closed_by_upstream(ended=True)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed_by_upstream(ended=exc is None)
        _wake(self._drained)

    def _closed_by_upstream(self, *, ended: bool) -> None:
        """The connection ended (the upstream's FIN, or the transport's end) or broke (a reset, ``ended`` false):
        a close-delimited body is complete only when it ended (RFC 9112 6.3); the reader is woken."""
        self.closed = True
        if ended and self.head_done and not self.complete and self._until_close and self.error is None:
            self.complete = True
        _wake(self._waiter)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._drained)

    def close(self, *, abort: bool = False) -> None:
        """Close the connection; with ``abort``, at once, dropping what was not sent yet (a request cut off, which a
        graceful close would hold, with its socket, until an upstream that stopped reading took it)."""
        self.closed = True
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    # parser events (httptools)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the head: trailers, dropped
            name = name.lower()
            value = value.rstrip(b" \t")  # optional whitespace (RFC 9110 5.5) llhttp keeps; the client's h11 refuses it
            self.headers.append((name, value))
            if name == b"transfer-encoding":
                self._encodings.append(value)
            elif name == b"content-length":
                self._length = value
            self._header_bytes += len(name) + len(value)
            if self._header_bytes > MAX_HEAD_BYTES:  # in the bytes of one read: stop the parser here
                self.error = f"the response head is longer than {MAX_HEAD_BYTES} bytes"
                raise ValueError(self.error)

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        if self.head_done:  # a second response after the one asked for: ignored, and the connection not reused
            self.reusable = False
            return
        status = parser.get_status_code()
        if not 100 <= status <= 599 or status == 101:  # 101: the proxy never asks to switch protocols here
            self.error = f"the upstream answered with status {status}, which cannot be relayed"
            raise ValueError(self.error)
        if 100 <= status < 200:  # an interim response: the real one follows
            self._interim = True
            self.headers, self._encodings, self._length = [], [], None
            return
        encoding = b", ".join(self._encodings).lower().rstrip()
        no_body = self._head_only or status < 200 or status in (204, 304)
        if encoding and not no_body and [coding.strip() for coding in encoding.split(b",")] != [b"chunked"]:
            # a body coded otherwise (gzip) would reach the client without the header that says so (hop-by-hop)
            self.error = f"the upstream's Transfer-Encoding {encoding[:60].decode('latin-1')!r} is not chunked alone"
            raise ValueError(self.error)
        self.status, self.head_done = status, True
        self.reusable = parser.should_keep_alive()
        self._until_close = not no_body and not encoding.endswith(b"chunked") and self._length is None
        if self._until_close:
            self.reusable = False
        self.sized = self._length is not None and not no_body
        if no_body:
            self.complete = True
            if encoding or self._length not in (None, b"0"):  # the body it leaves out may still come, late
                self.reusable = False

    def on_body(self, body: bytes) -> None:
        if self.complete:  # a body to a HEAD request, or after the end
            self.reusable = False
            return
        self.pieces.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True

    # the exchange, as the pool and the response use it

    def begin(self, method: str) -> None:
        """Ready to read the response to a ``method`` request."""
        self._reset(head_only=method == "HEAD")
        self._parser = httptools.HttpResponseParser(self)

    def end(self) -> bool:
        """Stop reading this exchange; whether the connection may carry another request."""
        self._parser = None
        return self.complete and self.reusable and not self.pieces and not self.closed

    async def wait(self, timeout: float) -> None:
        """Until the protocol has news (bytes, the end, a close).

        Raises:
            TimeoutError: nothing within ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, waiter, False)
        try:
            woken = await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if not woken:
            raise TimeoutError

    async def drain(self, timeout: float) -> None:
        """Until the transport's write buffer is below its high-water mark (or the connection closed).

        Raises:
            UpstreamTimeout: the upstream read none of it for ``timeout`` seconds.
        """
        while self._write_paused and not self.closed:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._drained
            except TimeoutError:
                raise UpstreamTimeout("the upstream stopped reading the request body") from None
        self._drained = None

    def take_piece(self) -> bytes:
        """The next body piece, at most :data:`READ_BYTES` (reading resumes once the held bytes fit again)."""
        piece = self.pieces.popleft()
        if len(piece) > READ_BYTES:
            self.pieces.appendleft(piece[READ_BYTES:])
            piece = piece[:READ_BYTES]
        self._buffered -= len(piece)
        if self._buffered <= READ_BYTES and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        return piece


class UpstreamResponse:
    """A response whose head was read; iterate :meth:`body` once, then :meth:`aclose` (always, also on errors).

    Attributes:
        status: the status code. headers: ``[(lower-case name, value)]`` as received.
        complete: the whole body has been read (already true while the last piece is being yielded).
    """

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self.status, self.headers = conn.status, conn.headers
        self._pool, self._conn = pool, conn
        self.complete = conn.complete and not conn.pieces

    async def body(self) -> AsyncIterator[bytes]:
        """The body, de-chunked, in pieces of at most :data:`READ_BYTES`.

        Raises:
            UpstreamTimeout: no bytes within the read timeout. UpstreamBroken: the body ended early or is malformed.
        """
        conn, timeout = self._conn, self._pool.read_timeout
        while True:
            if conn.pieces:
                piece = conn.take_piece()
                self.complete = conn.complete and not conn.pieces
                yield piece
            elif conn.complete:
                self.complete = True
                return
            elif conn.error is not None:
                raise UpstreamBroken(f"the response body is malformed ({conn.error})")
            elif conn.closed:
                raise UpstreamBroken("the upstream closed before the end of the body")
            else:
                try:
                    await conn.wait(timeout)
                except TimeoutError:
                    raise UpstreamTimeout("the upstream went silent mid-body") from None

    async def aclose(self) -> None:
        """Give the connection back when the response was read whole and may be reused, else close it."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if conn.end():
            self._pool._release(conn)
        else:
            conn.close()
        self._pool._slots.release()


class UpstreamPool:
    """Keep-alive connections to one ``host:port``.

    Args:
        host, port: the upstream. tls: an SSL context for ``https`` upstreams (``None``: plain TCP).
        max_connections: most connections open at once (more requests wait for one) and kept idle.
        connect_timeout, read_timeout: seconds.
        queue_timeout: most seconds a request waits for a free connection when all are in use (then
            :class:`UpstreamBusy`).
    """

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None, max_connections: int,
                 connect_timeout: float, read_timeout: float, queue_timeout: float) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.max_connections, self.connect_timeout, self.read_timeout = max_connections, connect_timeout, read_timeout
        self.queue_timeout = queue_timeout
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)  # held from request() to the response's aclose()

    async def request(self, method: str, target: bytes, headers: Headers,
                      body: AsyncIterator[bytes] | None) -> UpstreamResponse:
        """Send one request and read the response head.

        Args:
            method: e.g. ``"POST"``. target: origin-form path and query. headers: sent as given (``host``
                included); without a ``content-length``, a body is sent chunked.
            body: the body pieces, or ``None`` for none.

        Raises:
            UpstreamTimeout, UpstreamUnavailable, UpstreamBusy: see the module doc (errors of ``body`` itself
                propagate).
        """
        lines = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
        sized = False
        for k, v in headers:
            lines.append(b"%s: %s\r\n" % (k, v))
            sized = sized or k == b"content-length"
        chunked = body is not None and not sized
        lines.append(b"transfer-encoding: chunked\r\n\r\n" if chunked else b"\r\n")
        head = b"".join(lines)
        try:
            async with asyncio.timeout(self.queue_timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise UpstreamBusy(f"all {self.max_connections} upstream connections stayed in use for "
                               f"{self.queue_timeout:g} s") from None
        try:
            # a connection is taken only once the request can be written at once: until then it stays idle, where
            # bytes the upstream sends on it close it (they would be read as this request's answer)
            first = None if body is None else await anext(body, b"")
            conn = self._take()
            try:
                return await self._exchange(conn or await self._open(), conn is not None, method, head, first, body,
                                            chunked)
            except _Stale:
                if body is not None or method not in IDEMPOTENT_METHODS:  # the upstream may have acted on it
                    raise UpstreamUnavailable("the upstream closed the connection before answering") from None
            return await self._exchange(await self._open(), False, method, head, None, None, False)
        except BaseException:
            self._slots.release()
            raise

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_EXPIRY_S and not _readable(conn):
                return conn
            conn.close()
        return None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.tls)
        except TimeoutError as exc:
            raise UpstreamTimeout("no connection to the upstream in time") from exc
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to the upstream ({type(exc).__name__})") from exc
        return conn

    async def _exchange(self, conn: _Connection, reused: bool, method: str, head: bytes, first: bytes | None,
                        body: AsyncIterator[bytes] | None, chunked: bool) -> UpstreamResponse:
        """Write the request (``first``: the body's first piece, already read from ``body``) and read the response
        head."""
        transport = conn.transport
        assert transport is not None
        conn.begin(method)  # from here on, what the upstream sends is this request's answer
        try:
            # the head goes out with the first piece: one write (one syscall) for the usual one-piece body
            transport.write(head + _framed(first, chunked) if first else head)
            if body is not None:
                await conn.drain(self.read_timeout)
                if not conn.closed:
                    async for piece in body:
                        transport.write(_framed(piece, chunked))
                        await conn.drain(self.read_timeout)
                        if conn.closed:
                            break
                if chunked:
                    transport.write(b"0\r\n\r\n")
            # with a Content-Length, the head is handed on with the first body bytes (they usually follow at once):
            # one wake-up for both
            while not (conn.head_done and (conn.pieces or conn.complete or conn.closed or not conn.sized)):
                if not conn.head_done and conn.error is not None:
                    raise UpstreamUnavailable(f"the upstream's answer is not usable ({conn.error})")
                if not conn.head_done and conn.closed:
                    if reused and not conn.received:
                        raise _Stale
                    raise UpstreamUnavailable("the upstream closed the connection before answering")
                await conn.wait(self.read_timeout)
        except TimeoutError as exc:
            conn.end()
            conn.close(abort=True)
            raise UpstreamTimeout("the upstream did not answer in time") from exc
        except BaseException:
            conn.end()
            conn.close(abort=True)
            raise
        return UpstreamResponse(self, conn)

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_connections:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def aclose(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
