"""WebSocket passthrough in ``guard proxy``: a real ``websockets`` client, through the proxy (uvicorn), to a real
upstream WebSocket endpoint (Starlette under uvicorn); upgrades on paths a policy matches are refused with a reason."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator

import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from guard.asgi._websocket import NOT_JUDGED
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.engine import Guard
from tests.asgi._servers import serve_in_thread

pytestmark = pytest.mark.anyio


async def echo(websocket: WebSocket) -> None:
    await websocket.accept(subprotocol="chat.v1" if "chat.v1" in websocket.scope["subprotocols"] else None)
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("text") == "bye":
            await websocket.close(4001, "bye to you")
            return
        if message.get("text") is not None:
            await websocket.send_text(f"echo {message['text']} {websocket.url.path} {websocket.headers.get('x-user')}")
        else:
            await websocket.send_bytes(message["bytes"][::-1])


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    app = Starlette(routes=[WebSocketRoute("/{path:path}", echo)])
    with serve_in_thread(app) as url:
        yield url


async def test_unmatched_paths_are_relayed_both_ways(make_guard: Callable[..., Guard], upstream: str) -> None:
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream))) as proxy:
        ws_url = proxy.replace("http://", "ws://")
        async with connect(f"{ws_url}/live/feed?x=1", subprotocols=["chat.v1"],
                           additional_headers={"x-user": "ann"}) as ws:
            assert ws.subprotocol == "chat.v1"
            await ws.send("hello")
            assert await ws.recv() == "echo hello /live/feed ann"
            await ws.send(b"\x00\x01\x02")
            assert await ws.recv() == b"\x02\x01\x00"
            await ws.send("bye")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001


async def test_matched_paths_are_refused_with_a_reason(make_guard: Callable[..., Guard], upstream: str) -> None:
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream))) as proxy:
        ws_url = proxy.replace("http://", "ws://")
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{ws_url}/open/feed"):  # the test policy's open_guard matches /open/** (any method)
                pass
    response = refused.value.response
    assert response.status_code == 403
    body = json.loads(response.body or b"{}")
    assert body["code"] == NOT_JUDGED and body["policy"] == "open_guard" and "/open/feed" in body["message"]


async def test_an_unreachable_upstream_is_a_502(make_guard: Callable[..., Guard],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """... and its log line names the path, never the query, where browsers put a WebSocket's token."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    app = proxy_app(make_guard(), ProxyConfig(f"http://127.0.0.1:{dead}"))
    with caplog.at_level("WARNING", logger="guard.asgi"), serve_in_thread(app) as proxy, \
            pytest.raises(InvalidStatus) as refused:
        async with connect(proxy.replace("http://", "ws://") + "/live/feed?access_token=SECRET-WS-TOKEN"):
            pass
    assert refused.value.response.status_code == 502
    assert json.loads(refused.value.response.body or b"{}")["code"] == "upstream_unavailable"
    logged = [r.getMessage() for r in caplog.records if "websocket upstream" in r.getMessage()]
    assert logged and "/live/feed" in logged[0] and "SECRET-WS-TOKEN" not in logged[0]
