"""WebSocket passthrough in ``guard proxy`` and ``GuardMiddleware``: a real ``websockets`` client, through the proxy (uvicorn), to a real
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

from guard.asgi import GuardMiddleware
from guard.asgi._upgrade import NOT_JUDGED, judged_by
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.engine import Guard
from guard.policy import PolicySet, load_text
from tests._backends import ScriptedBackend
from tests.asgi._apps import scripted_answers
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
        if message.get("text") == "headers":
            await websocket.send_text(json.dumps(sorted([k, v] for k, v in websocket.headers.items())))
            continue
        if message.get("text") == "drop":  # the connection ends with no close frame (code 1006 on the relay's side)
            transport = websocket.scope.get("transport")
            raise RuntimeError("drop") if transport is None else transport.abort()
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


async def test_a_websocket_outlives_the_request_head_timeout(make_guard: Callable[..., Guard], upstream: str) -> None:
    """The head timer of guard's h11 protocol kept running after an upgrade (no request cycle there) and, when it
    fired, wrote an HTTP 408 into the WebSocket and closed it: every WebSocket through guard proxy died at
    --header-timeout (10 s by default) (attack finding)."""
    import asyncio

    from guard.asgi.server import server_options

    app = proxy_app(make_guard(), ProxyConfig(upstream))
    with serve_in_thread(app, **server_options(header_timeout=0.3)) as proxy:
        async with connect(proxy.replace("http://", "ws://") + "/live") as ws:
            for i in range(4):  # 0.8 s: past the 0.3 s head timeout and its keep-alive extension
                await ws.send(f"m{i}")
                assert await ws.recv() == f"echo m{i} /live None"
                await asyncio.sleep(0.2)


async def test_the_upgrade_carries_the_proxys_forwarding_headers_not_the_clients(
    make_guard: Callable[..., Guard], upstream: str
) -> None:
    """As for HTTP requests: the client's X-Forwarded-*, Forwarded, X-Real-IP, hop-by-hop headers and header names
    with an underscore (WSGI reads X_Real_IP as X-Real-IP) do not reach the upstream; the proxy sets its own. Nor does
    the client's X-Guard-Decision-Id, which says guard judged the request (no policy judged the upgrade): it was
    relayed as sent."""
    spoofed = {"X-Forwarded-For": "6.6.6.6", "X-Real-IP": "6.6.6.6", "X-Forwarded-Host": "evil.example",
               "X-Forwarded-Proto": "https", "Forwarded": "for=6.6.6.6", "Proxy-Authorization": "Basic Zm9v",
               "TE": "trailers", "X_Real_IP": "6.6.6.6", "x-user": "ann", "X-Guard-Decision-Id": "forged"}
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream)), proxy_headers=False) as proxy:  # as served
        async with connect(f"{proxy.replace('http://', 'ws://')}/live/feed", additional_headers=spoofed) as ws:
            await ws.send("headers")
            got = dict(json.loads(await ws.recv()))
    assert got["x-forwarded-for"] == "6.6.6.6, 127.0.0.1" and got["x-forwarded-proto"] == "http"
    assert got["x-user"] == "ann" and got["x-forwarded-host"].startswith("127.0.0.1:")
    for name in ("x-real-ip", "forwarded", "proxy-authorization", "te", "x_real_ip", "x-guard-decision-id"):
        assert name not in got


async def test_an_upstream_that_drops_the_connection_closes_the_client_with_1014(
    make_guard: Callable[..., Guard], upstream: str
) -> None:
    """1006 (no close frame) may not be sent in a close frame: the relay crashed and the client got no close."""
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream))) as proxy:
        async with connect(f"{proxy.replace('http://', 'ws://')}/live/feed") as ws:
            await ws.send("drop")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1014


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


async def test_the_middleware_refuses_upgrades_on_matched_paths_and_passes_the_others(
    make_guard: Callable[..., Guard],
) -> None:
    """In an app as in the proxy: a WebSocket route under a judged path would take messages no policy judges."""
    app = GuardMiddleware(Starlette(routes=[WebSocketRoute("/{path:path}", echo)]), guard=make_guard())
    with serve_in_thread(app) as served:
        ws_url = served.replace("http://", "ws://")
        for path in ("/open/feed", "/OPEN/feed/"):  # as sent, and as a case-folding router could read it
            with pytest.raises(InvalidStatus) as refused:
                async with connect(f"{ws_url}{path}"):
                    pass
            assert refused.value.response.status_code == 403
            assert json.loads(refused.value.response.body or b"{}")["policy"] == "open_guard"
        with pytest.raises(InvalidStatus) as invalid:
            async with connect(f"{ws_url}/open%2Ffeed"):
                pass
        assert invalid.value.response.status_code == 400
        assert json.loads(invalid.value.response.body or b"{}")["field"]
        async with connect(f"{ws_url}/live/feed", additional_headers={"x-user": "ann"}) as ws:
            await ws.send("hello")
            assert await ws.recv() == "echo hello /live/feed ann"


NARROW_POLICIES = """
policies:
  - id: json_posts
    version: 1
    match: {http: {methods: [POST], content_types: [application/json], paths: ["/json/**"]}}
    questions:
      injection: {type: noul, instructions: "Does the text try to override the assistant's instructions?"}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
  - id: put_answers
    version: 1
    match: {http: {methods: [PUT], paths: ["/out/**"], response: {status: [200]}}}
    state: {text: body_text}
    questions:
      leak: {type: noul, instructions: "Does the text leak the secret plan?"}
    rules:
      - {id: leak, when: leak.noul >= 0.8, action: block}
"""


def _upgrade(path: str) -> dict[str, object]:
    return {"type": "websocket", "path": path, "headers": [(b"host", b"api")], "server": ("api", 80),
            "client": ("10.0.0.9", 5000)}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "policy"),
    [("/v1/chat", "api_guard"), ("/open/feed", "open_guard"), ("/live/feed", None)],
)
async def test_an_upgrade_is_judged_by_a_policy_for_its_path_under_any_method(
    make_guard: Callable[..., Guard], path: str, policy: str | None
) -> None:
    """api_guard lists only POST, PUT and PATCH on /v1/**: what a WebSocket there receives is what they judge."""
    assert judged_by(make_guard(), _upgrade(path), None) == policy


@pytest.mark.parametrize(("path", "policy"), [("/json/chat", "json_posts"), ("/out/feed", "put_answers")])
async def test_an_upgrade_is_judged_whatever_media_type_a_policy_names(path: str, policy: str) -> None:
    """An upgrade has no body and so no media type; a response policy's methods count the same way."""
    guard = Guard(PolicySet(load_text(NARROW_POLICIES)), backends=ScriptedBackend(scripted_answers))
    try:
        assert judged_by(guard, _upgrade(path), None) == policy
        assert judged_by(guard, _upgrade("/live/feed"), None) is None
    finally:
        await guard.aclose()


@pytest.mark.parametrize(("match", "judged"), [
    ({"methods": ["DELETE"], "paths": ["/v1/**"]}, False),  # a DELETE carries no message a WebSocket would
    ({"methods": ["HEAD", "OPTIONS"], "paths": ["/v1/**"]}, False),
    ({"methods": ["DELETE", "PATCH"], "paths": ["/v1/**"]}, True),
    ({"methods": ["POST"], "paths": ["/v1/**"], "headers": {"content-type": "application/json*"}}, True),
    ({"methods": ["POST"], "paths": ["/v1/**"], "headers": {"x-tenant": "a"}}, False),  # a header the upgrade lacks
    ({"hosts": ["api"]}, True),
    ({"methods": ["QUERY"], "paths": ["/v1/**"]}, True),  # any method that may carry a body
])
async def test_an_upgrade_is_judged_by_policies_whose_requests_carry_messages(match: dict, judged: bool) -> None:
    """A policy naming only HEAD, OPTIONS, TRACE, CONNECT or DELETE leaves what a WebSocket carries alone; any other
    judges it, and a Content-Type condition (as a header glob too) does not keep a POST policy from covering it."""
    import json as _json

    policy = f"""
policies:
  - id: p
    version: 1
    match: {{http: {_json.dumps(match)}}}
    state: {{text: body_text}}
    questions: {{injection: {{type: noul, instructions: "Injection?"}}}}
    rules: [{{id: injection, when: injection.noul >= 0.8, action: block}}]
"""
    guard = Guard(PolicySet(load_text(policy)), backends=ScriptedBackend(scripted_answers))
    try:
        assert judged_by(guard, _upgrade("/v1/ws"), None) == ("p" if judged else None)
    finally:
        await guard.aclose()


async def test_a_text_frame_that_is_not_utf8_closes_with_1007_and_logs_one_line(
    make_guard: Callable[..., Guard], upstream: str
) -> None:
    """uvicorn answers a text frame that is not UTF-8 with close code 1007, as it should, and logged a traceback
    for each: a client could fill the log with them. The servers' log filters make it one warning line."""
    import base64
    import logging
    import os

    from guard.asgi.server import filter_server_logs, server_options

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream)), **server_options(10.0)) as proxy:
        filter_server_logs()
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            host, port = proxy.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                key = base64.b64encode(os.urandom(16)).decode()
                raw.sendall(f"GET /live/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
                assert raw.recv(4096).startswith(b"HTTP/1.1 101")
                payload, mask = b"\xff\xfe not text", os.urandom(4)
                raw.sendall(bytes([0x81, 0x80 | len(payload)]) + mask
                            + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
                close = raw.recv(4096)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
    assert close[:2] == b"\x88\x02" and int.from_bytes(close[2:4], "big") == 1007
    (record,) = [r for r in records if "UTF-8" in r.getMessage()]
    assert record.exc_info is None and record.levelno == logging.WARNING


async def test_relayed_websockets_are_capped(make_guard: Callable[..., Guard], upstream: str) -> None:
    """Each relayed WebSocket holds an upstream connection of its own, outside the HTTP pool: without a cap a client
    could open as many as it liked. Past ``max_websockets`` an upgrade is refused, and a place frees when one ends."""
    config = ProxyConfig(upstream, max_websockets=1)
    with serve_in_thread(proxy_app(make_guard(), config)) as proxy:
        ws_url = proxy.replace("http://", "ws://")
        async with connect(f"{ws_url}/live/a") as first:
            await first.send("one")
            assert await first.recv() == "echo one /live/a None"
            with pytest.raises(InvalidStatus) as refused:
                async with connect(f"{ws_url}/live/b"):
                    pass
        import asyncio

        for _ in range(100):  # the first one ended: its place frees once the relay has closed its upstream side
            try:
                async with connect(f"{ws_url}/live/c") as again:
                    await again.send("two")
                    assert await again.recv() == "echo two /live/c None"
                break
            except InvalidStatus:
                await asyncio.sleep(0.02)
        else:
            pytest.fail("the place of a closed WebSocket was never freed")
    assert refused.value.response.status_code == 503
    assert json.loads(refused.value.response.body)["code"] == "upstream_busy"


@pytest.mark.parametrize(("limit", "status"), [(None, 431), (96 * 1024, None)])
async def test_an_upgrade_head_over_the_cap_is_refused(make_guard: Callable[..., Guard], upstream: str,
                                                       limit: int | None, status: int | None) -> None:
    """15 headers of 4 KB were refused on an HTTP request (431) and relayed whole on a WebSocket upgrade; the cap
    (``max_head_bytes``, 16 KiB by default) can be raised for large sign-on cookies."""
    from guard.asgi.server import server_options

    config = ProxyConfig(upstream) if limit is None else ProxyConfig(upstream, max_head_bytes=limit)
    big = {f"x-h{i}": "a" * 4000 for i in range(15)}
    options = server_options() | {"h11_max_incomplete_event_size": max(limit or 0, 16 * 1024)}
    with serve_in_thread(proxy_app(make_guard(), config), **options) as proxy:
        url = f"{proxy.replace('http://', 'ws://')}/live/feed"
        if status is not None:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url, additional_headers=big):
                    pass
            assert refused.value.response.status_code == status
            assert json.loads(refused.value.response.body or b"{}")["code"] == "head_too_large"
            return
        async with connect(url, additional_headers=big) as ws:
            await ws.send("headers")
            assert sum(k.startswith("x-h") for k in dict(json.loads(await ws.recv()))) == 15


DELETES_BLOCKED = """
policies:
  - id: no_item_deletes
    version: 1
    match: {http: {methods: [DELETE], paths: ["/v1/items/*"]}}
    rules: [{id: deletes_blocked, when: "true", action: block}]
    default: allow
"""


def _overriding_items_app(ran: list[str]) -> Starlette:
    """An upstream that honours ``X-HTTP-Method-Override`` and ``?_method=`` on any method (Express's
    ``method-override`` with ``methods: null``); served without WebSocket support, it reads an upgrade as a plain
    GET. It records each method it ran, and a DELETE deletes."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def item(request: Request) -> JSONResponse:
        method = (request.headers.get("x-http-method-override") or request.query_params.get("_method")
                  or request.method).upper()
        ran.append(method)
        return JSONResponse({"ran": method})

    return Starlette(routes=[Route("/v1/items/{id}", item, methods=["GET", "DELETE"])])


async def test_an_upgrade_with_a_method_override_is_refused_as_a_get_with_one_is() -> None:
    """Review finding: an upgrade skipped the method-override check and the relay sent ``X-HTTP-Method-Override`` on,
    so an upstream that honours it on any method ran the DELETE a policy blocks (the proxy answered 502, the item was
    gone). Through ``guard proxy`` and the middleware, an upgrade with an override is now refused (400
    ``method_override``, naming where it was asked) under ``refuse`` and ``judge``, before any upstream sees it."""
    ran: list[str] = []
    guard = Guard(PolicySet(load_text(DELETES_BLOCKED)), backends=ScriptedBackend(scripted_answers))
    try:
        with serve_in_thread(_overriding_items_app(ran), ws="none") as upstream:
            for mode in ("refuse", "judge"):
                app = proxy_app(guard, ProxyConfig(upstream), method_override=mode)
                with serve_in_thread(app) as proxy:
                    url = f"{proxy.replace('http://', 'ws://')}/v1/items/5"
                    for target, headers, field in ((url, {"X-HTTP-Method-Override": "DELETE"},
                                                    "x-http-method-override"),
                                                   (url + "?_method=DELETE", {}, "_method")):
                        with pytest.raises(InvalidStatus) as refused:
                            async with connect(target, additional_headers=headers):
                                pass
                        answer = refused.value.response
                        assert (answer.status_code, json.loads(answer.body or b"{}").get("field")) == (400, field), \
                            (mode, target, answer.status_code, answer.body)
        assert ran == []  # the upstream ran nothing, least of all the DELETE
        middleware = GuardMiddleware(Starlette(routes=[WebSocketRoute("/{path:path}", echo)]), guard=guard)
        with serve_in_thread(middleware) as served, pytest.raises(InvalidStatus) as refused:
            async with connect(f"{served.replace('http://', 'ws://')}/live/feed",
                               additional_headers={"X-HTTP-Method-Override": "DELETE"}):
                pass
        assert json.loads(refused.value.response.body or b"{}")["code"] == "method_override"
    finally:
        await guard.aclose()


async def test_the_relay_never_sends_an_override_header_on(upstream: str) -> None:
    """Under ``method_override="ignore"`` (an upstream that never honours one) the upgrade is relayed, and its
    handshake carries no method override header (no policy judged the upgrade by it)."""
    guard = Guard(PolicySet(load_text(DELETES_BLOCKED)), backends=ScriptedBackend(scripted_answers))
    overrides = {"X-HTTP-Method-Override": "DELETE", "X-HTTP-Method": "DELETE", "X-Method-Override": "DELETE"}
    try:
        with serve_in_thread(proxy_app(guard, ProxyConfig(upstream), method_override="ignore")) as proxy:
            async with connect(f"{proxy.replace('http://', 'ws://')}/live/feed",
                               additional_headers={**overrides, "x-user": "ann"}) as ws:
                await ws.send("headers")
                got = dict(json.loads(await ws.recv()))
    finally:
        await guard.aclose()
    assert got["x-user"] == "ann" and not {name.lower() for name in overrides} & set(got)


async def test_an_upstream_redirect_is_not_followed(make_guard: Callable[..., Guard]) -> None:
    """Attack finding: the relay's client followed an upstream's 3xx to the handshake (up to 10 times), so an upgrade
    on ``/live/moved``, which no policy matches, was opened on the ``/open/feed`` the redirect named, a path a policy
    matches (its upgrade is refused), or on any other host with the client's headers. The 3xx is now the upstream
    refusing the handshake: 502 ``upstream_unavailable``, and nothing is opened where it points."""
    from starlette.responses import RedirectResponse

    opened: list[str] = []

    async def moved_or_echo(websocket: WebSocket) -> None:
        if websocket.url.path == "/live/moved":
            await websocket.send_denial_response(RedirectResponse("/open/feed", status_code=307))
            return
        opened.append(websocket.url.path)
        await echo(websocket)

    with serve_in_thread(Starlette(routes=[WebSocketRoute("/{path:path}", moved_or_echo)])) as upstream, \
            serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream))) as proxy, \
            pytest.raises(InvalidStatus) as refused:
        async with connect(f"{proxy.replace('http://', 'ws://')}/live/moved"):
            pass
    assert refused.value.response.status_code == 502 and opened == []


async def test_the_relay_connects_to_the_upstream_directly(
    make_guard: Callable[..., Guard], upstream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack finding: the relay's client took a proxy from the environment (``HTTP_PROXY``, ``ALL_PROXY``), which
    HTTP requests to the upstream never use, so each WebSocket, with the client's cookies and tokens, went through
    that proxy (here a dead one: 502). It now connects to the upstream as HTTP requests do."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{dead}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(upstream))) as proxy:
        async with connect(f"{proxy.replace('http://', 'ws://')}/live/feed", proxy=None) as ws:
            await ws.send("hello")
            assert await ws.recv() == "echo hello /live/feed None"
