"""The proxy's upstream pool against a raw asyncio server on loopback: framings (length, chunked with trailers,
close-delimited, none, interim 1xx), keep-alive reuse and when a connection is not reused, a stale connection
retried, malformed answers, timeouts, and a large body read in bounded pieces for a slow reader; on asyncio's loop and
on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from guard.asgi._upstream import (
    MAX_HEAD_BYTES,
    READ_BYTES,
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
    UpstreamUnavailable,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Each test on asyncio's own loop and on uvloop (what ``guard proxy`` serves on where it is installed)."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    return "asyncio", {"use_uvloop": request.param == "uvloop"}

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int, list[int]]:
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def _pool(port: int, read_timeout: float = 2.0) -> UpstreamPool:
    return UpstreamPool("127.0.0.1", port, tls=None, max_connections=4, connect_timeout=1.0,
                        read_timeout=read_timeout, queue_timeout=5.0)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return head + await reader.readexactly(int(line.split(b":")[1]))
    if b"transfer-encoding: chunked" in head:
        body = b""
        while (line := await reader.readuntil(b"\r\n")) != b"0\r\n":
            body += await reader.readexactly(int(line, 16) + 2)
        await reader.readuntil(b"\r\n")
        return head + body
    return head


async def _get(pool: UpstreamPool, method: str = "GET", body: list[bytes] | None = None,
               headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, bytes]:
    async def pieces() -> AsyncIterator[bytes]:
        for piece in body or []:
            yield piece

    response = await pool.request(method, b"/x", [(b"host", b"up"), *(headers or [])],
                                  pieces() if body is not None else None)
    try:
        data = b"".join([piece async for piece in response.body()])
    finally:
        await response.aclose()
    return response.status, data


async def test_keep_alive_is_reused_and_framings_are_read() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n",  # to a HEAD: no body follows
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await _read_request(reader)
            writer.write(answer)
            await writer.drain()

    server, port, connections = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"hello")
        assert await _get(pool, "POST", [b"ab", b"cd"]) == (200, b"abcde")  # a body without length goes chunked
        assert await _get(pool) == (204, b"")
        assert await _get(pool, "HEAD") == (200, b"")
        await pool.aclose()
    assert len(connections) == 1


async def test_pieces_as_they_trickle_in_and_an_interim_response_first() -> None:
    answer = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
              b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await _read_request(reader)
            for i in range(len(answer)):  # one byte a write: every parser state split across reads
                writer.write(answer[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    server, port, connections = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"hello world")
        assert await _get(pool, "POST", [b"x"], [(b"content-length", b"1")]) == (200, b"hello world")
        await pool.aclose()
    assert len(connections) == 1


async def test_bytes_nobody_asked_for_drop_the_connection() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA",  # more than the length said
        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody",  # a body to a HEAD
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answers[len(connections) - 1])
        await writer.drain()
        await reader.read()  # until the pool closes its side

    server, port, connections = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"ok")
        assert await _get(pool, "HEAD") == (200, b"")
        assert await _get(pool) == (200, b"ok")
        await pool.aclose()
    assert len(connections) == 3


async def test_a_large_body_is_read_in_bounded_pieces_while_the_reader_is_slow() -> None:
    size = 4 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // READ_BYTES):
            writer.write(b"x" * READ_BYTES)
            await writer.drain()

    server, port, _ = await _serve(handler)
    async with server:
        pool = _pool(port)
        response = await pool.request("GET", b"/big", [(b"host", b"up")], None)
        received, held = 0, []
        try:
            async for piece in response.body():
                assert 0 < len(piece) <= READ_BYTES
                received += len(piece)
                await asyncio.sleep(0.001)  # a slow client: the upstream must wait, not fill our memory
                held.append(sum(map(len, response._conn.pieces)))
        finally:
            await response.aclose()
        await pool.aclose()
    assert received == size and response.complete
    assert max(held) <= READ_BYTES + 256 * 1024  # the high-water mark plus at most one socket read


async def test_close_delimited_and_connection_close_are_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        await writer.drain()

    server, port, connections = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"until the end")
        assert await _get(pool) == (200, b"until the end")
        await pool.aclose()
    assert len(connections) == 2


async def test_a_close_delimited_body_whose_close_follows_it_at_once_is_read_whole() -> None:
    """The upstream's FIN arriving right after the body (one write, then close) ends a close-delimited body (RFC 9112
    6.3): a reader that goes on between the FIN and the transport's end (here: it yields to the loop after each
    piece, as the proxy does while it relays one) gets the body, never "closed before the end"."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")  # closed by _serve

    server, port, _ = await _serve(handler)
    async with server:
        pool = _pool(port)
        for _ in range(50):
            response = await pool.request("GET", b"/x", [(b"host", b"up")], None)
            pieces = []
            try:
                async for piece in response.body():
                    pieces.append(piece)
                    await asyncio.sleep(0)
            finally:
                await response.aclose()
            assert b"".join(pieces) == b"until the end" and response.complete
        await pool.aclose()


async def test_a_stale_connection_is_retried_once_without_a_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # then close without a word: the pooled connection is stale

    server, port, connections = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"ok")
        await asyncio.sleep(0.05)
        assert await _get(pool) == (200, b"ok")
        await pool.aclose()
    assert len(connections) == 2


async def test_a_non_idempotent_request_is_not_sent_again_on_a_stale_connection() -> None:
    """A bodyless POST on a connection the upstream closed after reading it may have run there: it is not sent a
    second time (RFC 9110 section 9.2.2); the client gets the 502."""
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await _read_request(reader))
        if requests[-1].startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            requests.append(await _read_request(reader))  # the POST on the kept-alive connection: read, no answer

    server, port, _ = await _serve(handler)
    async with server:
        pool = _pool(port)
        assert await _get(pool) == (200, b"ok")
        with pytest.raises(UpstreamUnavailable):
            await _get(pool, "POST")
        await pool.aclose()
    assert sum(r.startswith(b"POST") for r in requests) == 1


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SMTP ready\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", UpstreamBroken),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", UpstreamBroken),
        (b"", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\nok", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\nx: 1\n\n", UpstreamUnavailable),  # bare LF
        (b"HTTP/1.1 200 OK\r\nx: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n", UpstreamBroken),  # closed before the body
        (b"HTTP/1.1 099 Odd\r\ncontent-length: 0\r\n\r\n", UpstreamUnavailable),  # no such status: crashed the app
        (b"HTTP/1.1 000 Odd\r\ncontent-length: 0\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n", UpstreamUnavailable),
        # a transfer coding the proxy would drop with the header (hop-by-hop), the coded bytes sent on as the body
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n\x1f\x8b", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n\x1f\x8b\r\n0\r\n\r\n", UpstreamUnavailable),
    ],
)
async def test_malformed_answers_are_errors(answer: bytes, error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()

    server, port, _ = await _serve(handler)
    async with server:
        with pytest.raises(error):
            await _get(_pool(port))


async def test_what_follows_a_complete_response_in_one_read_changes_nothing() -> None:
    """A response and an extra message in the same packet: the extra one (a 204, a 100) is ignored and the connection
    is not reused; it replaced the status, or dropped every header of the real response. Header values lose the
    trailing whitespace llhttp keeps (the client's h11 refuses it)."""
    for extra in (b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n"):
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, extra: bytes = extra) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-keep: yes   \r\n\r\nok" + extra)
            await writer.drain()
            await reader.read()

        server, port, connections = await _serve(handler)
        async with server:
            pool = _pool(port)
            response = await pool.request("GET", b"/x", [(b"host", b"up")], None)
            body = b"".join([piece async for piece in response.body()])
            assert (response.status, body) == (200, b"ok"), extra
            assert (b"x-keep", b"yes") in response.headers and (b"content-length", b"2") in response.headers
            await response.aclose()
            await _get(pool)
            await pool.aclose()
        assert len(connections) == 2, extra  # the first one was not reused


async def test_silence_is_a_timeout_and_no_listener_is_unavailable() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(2)

    server, port, _ = await _serve(handler)
    async with server:
        with pytest.raises(UpstreamTimeout):
            await _get(_pool(port, read_timeout=0.2))
    with pytest.raises(UpstreamUnavailable):
        await _get(_pool(port))


async def test_a_reset_ends_a_close_delimited_body_as_broken() -> None:
    """Attack finding: a reset (RST) from the upstream in the middle of a body framed by the connection's end was read
    as that end, so the proxy ended a truncated body as if it were complete. Only the upstream's FIN ends one; a
    reset breaks it."""
    import socket
    import struct

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nthe first half")
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a RST
        writer.transport.abort()

    server, port, _ = await _serve(handler)
    async with server:
        pool = _pool(port)
        response = await pool.request("GET", b"/x", [(b"host", b"up")], None)
        pieces = []
        try:
            with pytest.raises(UpstreamBroken):
                async for piece in response.body():
                    pieces.append(piece)
        finally:
            await response.aclose()
        assert b"".join(pieces) == b"the first half" and not response.complete
        await pool.aclose()


async def test_an_upstream_that_stops_reading_the_body_is_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack finding: an upstream that took the head and then read no more of a large body (stuck, or waiting on
    something else) held the request for ever: the proxy waited on its full send buffer with no timeout. It is now
    a timeout once the upstream takes no bytes for the read timeout, and the connection is dropped at once with what
    was not sent (a graceful close held it, and its socket, until the upstream read it all)."""
    from guard.asgi import _upstream

    lost: list[Exception | None] = []
    connection_lost = _upstream._Connection.connection_lost

    def recorded(self: _upstream._Connection, exc: Exception | None) -> None:
        lost.append(exc)
        connection_lost(self, exc)

    monkeypatch.setattr(_upstream._Connection, "connection_lost", recorded)
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await done.wait()

    server, port, _ = await _serve(handler)
    async with server:
        piece = b"x" * READ_BYTES
        try:
            with pytest.raises(UpstreamTimeout, match="stopped reading"):
                async with asyncio.timeout(3):
                    await _get(_pool(port, read_timeout=0.3), "POST", [piece] * 1000,
                               [(b"content-length", b"%d" % (len(piece) * 1000))])
            for _ in range(100):
                if lost:
                    break
                await asyncio.sleep(0.01)
            assert len(lost) == 1
        finally:
            done.set()
