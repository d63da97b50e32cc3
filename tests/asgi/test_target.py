"""Request targets: only origin-form paths are accepted, and the path policies match is the path the application routes
on and the proxy forwards (SSRF through a non-origin-form target; dot segments, merged slashes, encoded and refused
characters). Raw sockets against real uvicorn servers: an HTTP client library would normalise the targets first."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from guard._rootpath import route_path
from guard.asgi._target import canonical_path, canonical_scope, request_target
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.asgi.server import server_options
from guard.engine import Guard
from guard.errors import BodyError
from tests.asgi._apps import ATTACK, BENIGN, guarded_app
from tests.asgi._servers import raw_request, serve_in_thread

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]


# The canonical form ---------------------------------------------------------------------------------------------

CANONICAL = [
    ("/", "/", "/"),
    ("/v1/chat", "/v1/chat", "/v1/chat"),
    ("/x/../v1/chat", "/v1/chat", "/v1/chat"),
    ("/./v1/chat", "/v1/chat", "/v1/chat"),
    ("//v1/chat", "/v1/chat", "/v1/chat"),
    ("/v1//chat//", "/v1/chat/", "/v1/chat/"),
    ("/%2e%2e/v1/chat", "/v1/chat", "/v1/chat"),
    ("/%2E./v1/chat", "/v1/chat", "/v1/chat"),
    ("/x/%2e/../v1/chat", "/v1/chat", "/v1/chat"),
    ("/../../v1/chat", "/v1/chat", "/v1/chat"),
    ("/v1/chat/..", "/v1/", "/v1/"),
    ("/v1/.", "/v1/", "/v1/"),
    ("/v1/%63hat", "/v1/chat", "/v1/chat"),
    ("/v1/%7euser", "/v1/~user", "/v1/~user"),
    ("/v1/caf%c3%a9", "/v1/caf\u00e9", "/v1/caf%C3%A9"),
    ("/v1/a%20b%3F", "/v1/a b?", "/v1/a%20b%3F"),
    ("/v1/100%25", "/v1/100%", "/v1/100%25"),
    ("/.well-known/x", "/.well-known/x", "/.well-known/x"),
    ("/v1/a..b/.c", "/v1/a..b/.c", "/v1/a..b/.c"),
]


@pytest.mark.parametrize(("raw", "path", "raw_path"), CANONICAL)
def test_canonical_form(raw: str, path: str, raw_path: str) -> None:
    target = canonical_path(raw)
    assert target.path == path and target.raw_path == raw_path.encode()
    assert canonical_path(raw_path) == target  # idempotent: forwarding the canonical form changes nothing


REFUSED = [
    ("@127.0.0.1:19002/internal/admin", "not a path starting with '/'"),
    ("http://x/v1/chat", "not a path starting with '/'"),
    ("x/y", "not a path starting with '/'"),
    ("*", "not a path starting with '/'"),
    ("127.0.0.1:19002", "not a path starting with '/'"),
    ("", "not a path starting with '/'"),
    ("/%2fv1/chat", "encoded slash"),
    ("/v1%2Fchat", "encoded slash"),
    ("/v1\\chat", "backslash"),
    ("/v1%5cchat", "encoded backslash"),
    ("/v1;x/chat", "path parameters"),
    ("/x/..;/v1/chat", "path parameters"),
    ("/v1/chat#frag", "fragment"),
    ("/v1/%zz", "two hex digits"),
    ("/v1/%2", "two hex digits"),
    ("/v1/%ff", "not UTF-8"),
    ("/v1/%00", "control character"),
    ("/v1/%0a", "control character"),
    ("/v1/\u00e9", "not printable ASCII"),
]


@pytest.mark.parametrize(("raw", "reason"), REFUSED)
def test_refused_targets(raw: str, reason: str) -> None:
    with pytest.raises(BodyError, match=reason) as info:
        canonical_path(raw)
    assert info.value.status == 400 and info.value.code == "invalid_target" and info.value.field == "path"


def test_scope_path_wins_when_raw_path_disagrees() -> None:
    """An outer layer rewrote ``path`` (or there is no ``raw_path``): the application routes on ``path``."""
    rewritten = {"type": "http", "path": "/x/../v1/chat", "raw_path": b"/other", "query_string": b""}
    assert request_target(rewritten) == ("/v1/chat", b"/v1/chat")
    assert request_target({"type": "http", "path": "/v1/caf\u00e9"}) == ("/v1/caf\u00e9", b"/v1/caf%C3%A9")
    decoded_slash = {"type": "http", "path": "//v1/chat", "raw_path": b"/%2Fv1/chat", "query_string": b""}
    with pytest.raises(BodyError, match="encoded slash"):  # raw_path agrees with path, and it shows the %2F
        request_target(decoded_slash)
    with pytest.raises(BodyError, match="query string") as info:
        request_target({"type": "http", "path": "/v1", "raw_path": b"/v1", "query_string": b"a=1#x"})
    assert info.value.field == "query"



def _below(root: str, path: str) -> dict[str, Any]:
    """The scope of ``path`` (sent as is) under ``root_path`` ``root``: the path starts with it, as uvicorn
    ``--root-path`` and Starlette's ``Mount`` make it."""
    return {"type": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": root}


def test_the_root_path_is_kept_and_never_climbed_out_of() -> None:
    """Dot segments and empty segments are resolved below the root path only; a ``..`` that would climb above it is
    refused (removing it with the root path's segment gave a path that no longer starts with the root path, which
    Starlette then routed inside the mount or app as if it did)."""
    for path, canonical in (("/api/x/../v1/chat", "/api/v1/chat"), ("/api//v1/./chat", "/api/v1/chat"),
                            ("/api/v1/chat/..", "/api/v1/"), ("/api/..%2fx", None), ("/a/b/c/..", "/a/b/")):
        root = "/a/b" if path.startswith("/a/") else "/api"
        if canonical is None:
            with pytest.raises(BodyError, match="encoded slash"):
                canonical_scope(_below(root, path))
            continue
        assert canonical_scope(_below(root, path))["path"] == canonical, path
    for root, path in (("/api", "/api/../v1/chat"), ("/api", "/api/%2e%2e/v1/chat"), ("/api", "/api/v1/../../x"),
                       ("/api", "/api/./.."), ("/api/", "/api/../v1"), ("/a/b", "/a/b/../c")):
        with pytest.raises(BodyError, match=f"climbs above the root path '{root.rstrip('/')}'") as info:
            canonical_scope(_below(root, path))
        assert (info.value.status, info.value.code, info.value.field) == (400, "invalid_target", "path")
    assert [route_path(_below("/api", p)) for p in ("/api/v1/chat", "/api", "/apix/v1", "/v1")] == [
        "/v1/chat", "", "/apix/v1", "/v1"]


def test_a_root_path_left_out_of_the_path_is_put_in_front() -> None:
    """hypercorn ``--root-path`` and Daphne leave the root path out of ``scope["path"]`` (uvicorn puts it in front).
    Policies match the whole path (``POST /api/v1/**``), so ``/v1/chat`` under ``/api`` was matched as ``/v1/chat``,
    judged by no policy, and routed by Starlette (on the whole path, as it is not below the root path) to the same
    handler as ``/api/v1/chat``. Now the root path is put in front as uvicorn does, and Starlette routes the result the
    same; a ``..`` then climbs above it as under uvicorn."""
    for sent, path, raw, routed in (("/v1/chat", "/api/v1/chat", b"/api/v1/chat", "/v1/chat"),
                                    ("/apix/v1", "/api/apix/v1", b"/api/apix/v1", "/apix/v1"),
                                    ("/apix/../v1/chat", "/api/v1/chat", b"/api/v1/chat", "/v1/chat"),
                                    ("/v1/caf%C3%A9", "/api/v1/caf\u00e9", b"/api/v1/caf%C3%A9", "/v1/caf\u00e9"),
                                    ("/", "/api/", b"/api/", "/")):
        scope = {**_below("/api", sent), "path": unquote(sent)}
        rooted = canonical_scope(scope)
        assert (rooted["path"], rooted["raw_path"], rooted["root_path"]) == (path, raw, "/api"), sent
        assert route_path(rooted) == routed, sent
    assert canonical_scope({**_below("/api", "/v1/chat"), "raw_path": None})["path"] == "/api/v1/chat"
    with pytest.raises(BodyError, match="climbs above the root path '/api'"):
        canonical_scope(_below("/api", "/../v1/chat"))
    for target in ("*", "x/y", "http://x/v1/chat", ""):  # not made a path below the root path: refused as ever
        with pytest.raises(BodyError, match="not a path starting with '/'"):
            canonical_scope(_below("/api", target))
    for sent in ("/api/v1/chat", "/api", "/api/"):  # a path below its root path is left as it is
        scope = _below("/api", sent)
        assert canonical_scope(scope) is scope


def test_a_root_path_loses_its_trailing_slash() -> None:
    """uvicorn ``--root-path /api/`` joins the root path and ``/v1/chat`` into ``/api//v1/chat``; merging the slashes
    gave ``/api/v1/chat`` with ``root_path`` still ``/api/``, which Starlette no longer read as below the root path
    and routed whole: 404 for every request the middleware rewrote. The root path now loses its trailing slash, and
    the application routes on what it would have routed on without the middleware."""
    for root, sent, path, routed in (("/api/", "/api//v1/chat", "/api/v1/chat", "/v1/chat"),
                                     ("/api/", "/api//", "/api/", "/"),
                                     ("/api/", "/v1/chat", "/api/v1/chat", "/v1/chat"),
                                     ("/api//", "/api///v1", "/api/v1", "/v1"),
                                     ("/", "/v1//chat", "/v1/chat", "/v1/chat"),
                                     ("/", "/v1/chat", "/v1/chat", "/v1/chat")):
        scope = _below(root, sent)
        rooted = canonical_scope(scope)
        assert (rooted["path"], rooted["root_path"], route_path(rooted)) == (path, root.rstrip("/"), routed), sent


# Real servers ---------------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """An upstream that answers every path and records what it was sent."""

    name: str
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        self.seen.append(
            {
                "path": request.url.path,
                "raw_path": request.scope["raw_path"].decode("latin-1"),
                "query": request.scope["query_string"].decode("latin-1"),
            }
        )
        return JSONResponse({"who": self.name, "path": request.url.path, "length": len(body)})

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{p:path}", self.handle, methods=["GET", "POST", "DELETE"])])


@pytest.fixture
def servers(make_guard: GuardFactory) -> Iterator[tuple[int, Recorder, Recorder, int]]:
    """(proxy port, upstream, a second 'internal' service, its port): the proxy forwards to the upstream only."""
    upstream, internal = Recorder("upstream"), Recorder("internal")
    with (
        serve_in_thread(upstream.app) as up,
        serve_in_thread(internal.app) as other,
        # served as `guard proxy` serves it (its h11-based protocol), so guard's own target check answers
        serve_in_thread(proxy_app(make_guard(), ProxyConfig(up), decision_headers="full"), **server_options()) as proxy,
    ):
        yield int(proxy.rsplit(":", 1)[1]), upstream, internal, int(other.rsplit(":", 1)[1])


def _request(method: str, target: str, text: str | None = None) -> bytes:
    body = json.dumps({"message": text}).encode() if text is not None else b""
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    return head + body


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _json(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


async def _send(port: int, method: str, target: str, text: str | None = None) -> bytes:
    return await asyncio.to_thread(raw_request, port, _request(method, target, text))


async def test_proxy_never_forwards_to_another_host(servers: tuple[int, Recorder, Recorder, int]) -> None:
    """The reported case (``POST @127.0.0.1:<port>/internal/admin``: the part before ``@`` became userinfo and the
    request went to the other port) and its variants, with and without a body, on paths no policy matches."""
    port, upstream, internal, other = servers
    targets = [
        f"@127.0.0.1:{other}/internal/admin",
        f"@127.0.0.1:{other}",
        f"http://127.0.0.1:{other}/internal/admin",
        f"127.0.0.1:{other}",
        "x/y",
        "*",
        f":{other}/internal/admin",
    ]
    for target in targets:
        for method, text in (("POST", BENIGN), ("GET", None), ("DELETE", None)):
            raw = await _send(port, method, target, text)
            assert _status(raw) == 400, (method, target, raw[:300])
            assert _json(raw)["code"] == "invalid_target" and _json(raw)["field"] == "path"
    slashes = await _send(port, "GET", f"//127.0.0.1:{other}/internal/admin")  # a path: it stays on the upstream
    assert _status(slashes) == 200 and _json(slashes)["who"] == "upstream"
    assert upstream.seen[-1]["raw_path"] == f"/127.0.0.1:{other}/internal/admin"
    assert internal.seen == [] and len(upstream.seen) == 1


TRICKS = [
    "/x/../v1/chat",
    "/./v1/chat",
    "//v1/chat",
    "/%2e%2e/v1/chat",
    "/public/%2E%2E/v1/chat",
    "/v1//./chat",
    "/v1/%63hat",
    "/../v1/chat",
]


@pytest.mark.parametrize("target", TRICKS)
async def test_proxy_judges_the_path_it_forwards(servers: tuple[int, Recorder, Recorder, int], target: str) -> None:
    port, upstream, _, _ = servers
    attack = await _send(port, "POST", target, ATTACK)
    assert _status(attack) == 403 and _json(attack)["rule"] == "prompt_injection"
    assert upstream.seen == []  # judged as /v1/chat, never forwarded
    benign = await _send(port, "POST", target, BENIGN)
    assert _status(benign) == 200 and b"x-guard-policy: api_guard@3" in benign.lower()
    assert upstream.seen == [{"path": "/v1/chat", "raw_path": "/v1/chat", "query": ""}]


@pytest.mark.parametrize(
    "target",
    [
        "/%2fv1/chat",
        "/v1%2Fchat",
        "/v1\\chat",
        "/v1%5Cchat",
        "/v1;x/chat",
        "/x/..;/v1/chat",
        "/v1/%ff",
        "/v1/%00",
        "/v1/chat?a=1#x",
        "/v1/chat#x",
    ],
)
async def test_proxy_refuses_what_servers_read_differently(
    servers: tuple[int, Recorder, Recorder, int], target: str
) -> None:
    port, upstream, _, _ = servers
    for method, text in (("POST", ATTACK), ("GET", None)):
        raw = await _send(port, method, target, text)
        assert _status(raw) == 400 and _json(raw)["code"] == "invalid_target", raw[:300]
    assert upstream.seen == []


async def test_proxy_keeps_encoded_characters_and_the_query(servers: tuple[int, Recorder, Recorder, int]) -> None:
    port, upstream, _, _ = servers
    raw = await _send(port, "POST", "/v1/caf%c3%a9/a%20b?x=%2e%2E&y=/?&z=%ZZ", BENIGN)
    assert _status(raw) == 200
    assert upstream.seen == [
        {"path": "/v1/caf\u00e9/a b", "raw_path": "/v1/caf%C3%A9/a%20b", "query": "x=%2e%2E&y=/?&z=%ZZ"}
    ]


def _app_with_routes(guard: Guard) -> tuple[Starlette, list[str]]:
    """Specific routes (no catch-all) behind the middleware: ``POST /v1/chat`` (guarded) and ``GET /public/page``
    (no policy matches); records the paths the app routed on."""
    routed: list[str] = []

    async def chat(request: Request) -> Response:
        await request.body()
        routed.append(request.url.path)
        return JSONResponse({"path": request.url.path, "raw_path": request.scope["raw_path"].decode()})

    async def page(request: Request) -> Response:
        routed.append(request.url.path)
        return JSONResponse({"path": request.url.path})

    routes = [Route("/v1/chat", chat, methods=["POST"]), Route("/public/page", page, methods=["GET"])]
    return guarded_app(guard, routes=routes), routed


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_middleware_routes_the_app_on_the_path_it_matched(make_guard: GuardFactory, http: str) -> None:
    """In front of an in-process app (real uvicorn with either of its parsers, raw sockets): the app routes on the
    canonical path the guard matched, so ``/x/../v1/chat`` is judged and served as ``/v1/chat``, never served
    unjudged; requests no policy matches are routed on the canonical path too. httptools (llhttp) refuses some
    targets itself, with uvicorn's plain-text 400, before the guard sees them."""
    app, routed = _app_with_routes(make_guard())
    with serve_in_thread(app, http=http) as url:
        port = int(url.rsplit(":", 1)[1])
        for target in TRICKS:
            attack = await _send(port, "POST", target, ATTACK)
            assert _status(attack) == 403, (target, attack[:300])
            benign = await _send(port, "POST", target, BENIGN)
            assert _status(benign) == 200 and _json(benign) == {"path": "/v1/chat", "raw_path": "/v1/chat"}, target
        for target in ("/public/a/../page", "//public//page", "/public/%70age"):
            public = await _send(port, "GET", target)
            assert _status(public) == 200 and b"x-guard-decision-id" not in public.lower(), target
        for target in ("@127.0.0.1:1/v1/chat", "/%2fv1/chat", "/v1%5cchat", "/v1;x/chat", "/public%2fpage"):
            refused = await _send(port, "POST", target, ATTACK)
            body = refused.partition(b"\r\n\r\n")[2]
            by_server = http == "httptools" and body == b"Invalid HTTP request received."
            assert _status(refused) == 400 and (by_server or _json(refused)["code"] == "invalid_target"), target
    assert routed == ["/v1/chat"] * len(TRICKS) + ["/public/page"] * 3


def test_canonical_paths_answer_the_same_every_time() -> None:
    from guard.asgi import _target

    def scope(raw: bytes | bytearray, path: str) -> dict[str, Any]:
        return {"type": "http", "path": path, "raw_path": raw, "query_string": b""}

    plain = scope(b"/v1/echo", "/v1/echo")
    assert [_target.canonical_scope(plain) is plain for _ in range(2)] == [True, True]
    # The same raw path under another decoded path (an outer layer rewrote it) is re-encoded, remembered or not.
    rewritten = _target.canonical_scope(scope(b"/v1/echo", "/v1/other"))
    assert (rewritten["path"], rewritten["raw_path"]) == ("/v1/other", b"/v1/other")
    assert _target.canonical_scope(scope(bytearray(b"/v1/echo"), "/v1/echo"))["path"] == "/v1/echo"
    with pytest.raises(BodyError):
        _target.canonical_scope(scope(b"/v1/a%2Fb", "/v1/a/b"))


@pytest.mark.parametrize("served", ["mount", "root_path"])
async def test_dot_segments_never_climb_out_of_a_mount_or_root_path(make_guard: GuardFactory, served: str) -> None:
    """Inside ``Mount("/v1", ...)`` or under uvicorn ``--root-path /v1`` (real uvicorn, raw sockets), ``scope["path"]``
    starts with the root path and policies match it whole (``POST /v1/**`` judges ``/v1/chat``). A ``..`` that would
    climb above the root path is refused: ``/v1/../chat`` was made ``/chat``, which no policy matched and Starlette
    still routed inside the mount, unjudged. Dot segments below the root path are removed as anywhere else."""
    routed: list[str] = []

    async def chat(request: Request) -> Response:
        await request.body()
        routed.append(request.scope["path"])
        return JSONResponse({"path": request.scope["path"], "root_path": request.scope["root_path"]})

    inner = guarded_app(make_guard(), routes=[Route("/chat", chat, methods=["POST"])])
    app = Starlette(routes=[Mount("/v1", app=inner)]) if served == "mount" else inner
    config = {"root_path": "/v1"} if served == "root_path" else {}
    prefix = "/v1" if served == "mount" else ""  # behind --root-path, the proxy in front has taken the prefix off
    with serve_in_thread(app, **config) as url:
        port = int(url.rsplit(":", 1)[1])
        for target in ("/../chat", "/%2e%2e/chat", "/x/../../chat", "/./../chat"):
            refused = await _send(port, "POST", prefix + target, ATTACK)
            assert _status(refused) == 400, (target, refused[:300])
            assert _json(refused)["code"] == "invalid_target" and _json(refused)["field"] == "path"
            assert "root path '/v1'" in _json(refused)["message"]
        for target in ("/chat", "/x/../chat", "/./chat", "//chat"):
            assert _status(await _send(port, "POST", prefix + target, ATTACK)) == 403, target
            benign = await _send(port, "POST", prefix + target, BENIGN)
            assert _status(benign) == 200 and _json(benign) == {"path": "/v1/chat", "root_path": "/v1"}, target
    assert routed == ["/v1/chat"] * 4


async def _post_under(app: Any, root_path: str, path: str, text: str) -> int:
    """POST ``{"message": text}`` to ``app`` with ``scope["path"]`` ``path`` and ``scope["root_path"]``
    ``root_path`` (raw ASGI, as a server would hand it); returns the response status."""
    messages = [{"type": "http.request", "body": json.dumps({"message": text}).encode(), "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": root_path,
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5000),
             "server": ("testserver", 80)}
    await app(scope, receive, send)
    return int(sent[0]["status"])


@pytest.mark.parametrize(("root_path", "sent"), [
    ("/v1", "/v1/chat"),  # uvicorn --root-path /v1: the root path is in the path
    ("/v1", "/chat"),  # hypercorn --root-path /v1, Daphne: it is not
    ("/v1/", "/v1//chat"),  # uvicorn --root-path /v1/: joined with a double slash
])
async def test_every_root_path_convention_is_judged_and_routed_alike(make_guard: GuardFactory, root_path: str,
                                                                    sent: str) -> None:
    """``POST /v1/**`` judges the request whichever way the server puts the root path in ``scope``, and the
    application routes it to the same handler. A server that leaves the root path out of the path had the request
    matched as ``/chat`` (no policy: served unjudged); under ``--root-path /v1/`` every rewritten path was answered
    404 (the merged ``/v1/chat`` was not below ``/v1/``)."""
    routed: list[tuple[str, str, str]] = []

    async def chat(request: Request) -> Response:
        await request.body()
        routed.append((request.scope["path"], request.scope["root_path"], request.state.guard.action))
        return JSONResponse({})

    app = guarded_app(make_guard(), routes=[Route("/chat", chat, methods=["POST"])])
    assert await _post_under(app, root_path, sent, ATTACK) == 403
    assert await _post_under(app, root_path, sent, BENIGN) == 200
    assert routed == [("/v1/chat", "/v1", "allow")]
