"""The proxy's HTTP/1.1 client to its one upstream: a pool of keep-alive connections over asyncio streams.

One host, one protocol, no redirects, no cookies, no proxies from the environment: what a reverse proxy needs, at a
fraction of a general client's per-request cost (connection reuse is a pop from a list). Bodies stream both ways in
pieces of at most :data:`READ_BYTES`, so memory per request stays bounded whatever the body size.

Response framing follows RFC 9112 6.3: no body for ``HEAD``, 1xx, 204 and 304; ``Transfer-Encoding: chunked``
(de-chunked here; trailers are read and dropped); ``Content-Length``; else until the upstream closes. A connection goes
back to the pool only after its response was read to the end with a known length and neither side said ``Connection:
close``; idle connections older than :data:`KEEPALIVE_EXPIRY_S` or closed by the upstream are dropped. A request
without a body that fails on a reused connection before any response byte (the upstream closed it meanwhile) is sent
once more on a new connection.

Errors: :class:`UpstreamTimeout` (no connection, or no bytes within the read timeout), :class:`UpstreamUnavailable`
(refused, reset, malformed response), :class:`UpstreamBroken` (the response broke after it started).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator

__all__ = [
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

#: Most bytes read from the upstream at once (a body piece sent on to the client).
READ_BYTES = 64 * 1024
#: Longest response head (status line and headers) accepted.
MAX_HEAD_BYTES = 64 * 1024
#: Idle connections older than this are not reused (below uvicorn's and most servers' 5 s keep-alive timeout).
KEEPALIVE_EXPIRY_S = 4.0

Headers = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The upstream could not be used; ``kind`` names how (the proxy's ``upstream_errors`` label)."""

    kind = "unavailable"


class UpstreamTimeout(UpstreamError):
    kind = "timeout"


class UpstreamUnavailable(UpstreamError):
    kind = "unavailable"


class UpstreamBroken(UpstreamError):
    kind = "broken_stream"


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.idle_since = reader, writer, 0.0

    def usable(self, now: float) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing() and now - self.idle_since < KEEPALIVE_EXPIRY_S

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """A response whose head was read; iterate :meth:`body` once, then :meth:`aclose` (always, also on errors).

    Attributes:
        status: the status code. headers: ``[(lower-case name, value)]`` as received.
        complete: the whole body has been read (already true while the last piece is being yielded).
    """

    def __init__(self, pool: UpstreamPool, conn: _Connection, status: int, headers: Headers, framing: str,
                 length: int, reusable: bool) -> None:
        self.status, self.headers = status, headers
        self._pool, self._conn, self._framing, self._length, self._reusable = pool, conn, framing, length, reusable
        self._done = self.complete = framing == "none"

    async def body(self) -> AsyncIterator[bytes]:
        """The body, de-chunked, in pieces of at most :data:`READ_BYTES`.

        Raises:
            UpstreamTimeout: no bytes within the read timeout. UpstreamBroken: the body ended early or is malformed.
        """
        reader, timeout = self._conn.reader, self._pool.read_timeout
        try:
            if self._framing == "length":
                left = self._length
                async for piece in _exactly(reader, left, timeout):
                    left -= len(piece)
                    self.complete = not left
                    yield piece
            elif self._framing == "chunked":
                async for piece in self._chunks(reader, timeout):
                    yield piece
            elif self._framing == "close":
                while True:
                    async with asyncio.timeout(timeout):
                        piece = await reader.read(READ_BYTES)
                    if not piece:
                        break
                    yield piece
        except TimeoutError as exc:
            raise UpstreamTimeout("the upstream went silent mid-body") from exc
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UpstreamBroken(f"the response body broke off ({type(exc).__name__})") from exc
        self._done = self.complete = True

    @staticmethod
    async def _chunks(reader: asyncio.StreamReader, timeout: float) -> AsyncIterator[bytes]:
        while True:
            async with asyncio.timeout(timeout):
                line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)  # ValueError: malformed
            if size == 0:
                async with asyncio.timeout(timeout):
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, dropped
                        pass
                return
            async for piece in _exactly(reader, size, timeout):
                yield piece
            async with asyncio.timeout(timeout):
                if await reader.readexactly(2) != b"\r\n":
                    raise UpstreamBroken("a chunk does not end with CRLF")

    async def aclose(self) -> None:
        """Give the connection back when the response was read whole and may be reused, else close it."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and self._reusable:
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
    """

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None, max_connections: int,
                 connect_timeout: float, read_timeout: float) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.max_connections, self.connect_timeout, self.read_timeout = max_connections, connect_timeout, read_timeout
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
            UpstreamTimeout, UpstreamUnavailable: see the module doc (errors of ``body`` itself propagate).
        """
        chunked = body is not None and not any(k == b"content-length" for k, _ in headers)
        head = b"".join([method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n",
                         *(b"%s: %s\r\n" % (k, v) for k, v in headers),
                         b"transfer-encoding: chunked\r\n\r\n" if chunked else b"\r\n"])
        await self._slots.acquire()
        try:
            conn = self._take()
            try:
                return await self._exchange(conn or await self._open(), conn is not None, method, head, body, chunked)
            except _Stale:
                if body is not None:
                    raise UpstreamUnavailable("the upstream closed the connection before answering") from None
            return await self._exchange(await self._open(), False, method, head, None, False)
        except BaseException:
            self._slots.release()
            raise

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _open(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls,
                                                               limit=MAX_HEAD_BYTES)
        except TimeoutError as exc:
            raise UpstreamTimeout("no connection to the upstream in time") from exc
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to the upstream ({type(exc).__name__})") from exc
        return _Connection(reader, writer)

    async def _exchange(self, conn: _Connection, reused: bool, method: str, head: bytes,
                        body: AsyncIterator[bytes] | None, chunked: bool) -> UpstreamResponse:
        try:
            writer = conn.writer
            if body is None:
                writer.write(head)
            else:  # the head goes out with the first piece: one write (one syscall) for the usual one-piece body
                first = True
                async for piece in body:
                    data = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
                    writer.write(head + data if first else data)
                    first = False
                    await writer.drain()
                writer.write((head if first else b"") + (b"0\r\n\r\n" if chunked else b""))
            await writer.drain()
            async with asyncio.timeout(self.read_timeout):
                while True:
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
                    http10, status, headers = _parse_head(raw)
                    if status >= 200 or status == 101:
                        break
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            if reused and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                raise _Stale from exc
            raise UpstreamUnavailable(f"the upstream closed the connection ({type(exc).__name__})") from exc
        except TimeoutError as exc:
            conn.close()
            raise UpstreamTimeout("the upstream did not answer in time") from exc
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            conn.close()
            raise UpstreamUnavailable(f"the upstream's answer is not usable ({type(exc).__name__})") from exc
        except BaseException:
            conn.close()
            raise
        return _response(self, conn, method, http10, status, headers)

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_connections or conn.reader.at_eof():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def aclose(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


async def _exactly(reader: asyncio.StreamReader, size: int, timeout: float) -> AsyncIterator[bytes]:
    """``size`` bytes in pieces of at most :data:`READ_BYTES`, as they arrive."""
    while size:
        async with asyncio.timeout(timeout):
            piece = await reader.read(min(size, READ_BYTES))
        if not piece:
            raise UpstreamBroken("the upstream closed before the end of the body")
        size -= len(piece)
        yield piece


class _Stale(Exception):
    """A reused connection failed before any response byte."""


def _parse_head(raw: bytes) -> tuple[bool, int, Headers]:
    """``(HTTP/1.0?, status, headers)`` of a response head (``ValueError`` when malformed; folded lines are
    refused)."""
    lines = raw[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(rest) < 3 or not rest[:3].isdigit():
        raise ValueError(f"bad status line {lines[0][:40]!r}")
    headers: Headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise ValueError(f"bad header line {line[:40]!r}")
        headers.append((name.lower(), value.strip()))
    return version == b"HTTP/1.0", int(rest[:3]), headers


def _response(
    pool: UpstreamPool, conn: _Connection, method: str, http10: bool, status: int, headers: Headers
) -> UpstreamResponse:
    """The response with its framing (RFC 9112 6.3) and whether its connection may be reused."""
    tokens = {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}
    reusable = not http10 and b"close" not in tokens
    encoding = [v for k, v in headers if k == b"transfer-encoding"]
    lengths = {v for k, v in headers if k == b"content-length"}
    if method == "HEAD" or status < 200 or status in (204, 304):
        return UpstreamResponse(pool, conn, status, headers, "none", 0, reusable and status != 101)
    if encoding:
        if not b", ".join(encoding).lower().rstrip().endswith(b"chunked"):
            return UpstreamResponse(pool, conn, status, headers, "close", 0, False)
        return UpstreamResponse(pool, conn, status, headers, "chunked", 0, reusable)
    if lengths:
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            conn.close()
            raise UpstreamUnavailable("the upstream sent conflicting or malformed Content-Length headers")
        return UpstreamResponse(pool, conn, status, headers, "length", int(next(iter(lengths))), reusable)
    return UpstreamResponse(pool, conn, status, headers, "close", 0, False)
