"""The proxy's upstream pool against a raw asyncio server on loopback: framings (length, chunked with trailers,
close-delimited, none), keep-alive reuse, a stale connection retried, malformed answers and timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from guard.asgi._upstream import UpstreamBroken, UpstreamPool, UpstreamTimeout, UpstreamUnavailable

pytestmark = pytest.mark.anyio

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
                        read_timeout=read_timeout)


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


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SMTP ready\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", UpstreamUnavailable),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", UpstreamBroken),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", UpstreamBroken),
        (b"", UpstreamUnavailable),
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
