"""What the proxy forwards against a raw upstream that logs each request head: method override headers the guard
judged, the client's ``Host``, upstream statuses, connection reuse after stray bytes, and redirects into the
upstream."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from guard import Guard
from guard.asgi.proxy import ProxyConfig, ReverseProxy, proxy_app
from guard.asgi.server import server_options
from guard.backends import FixtureBackend
from guard.cli import build_parser
from guard.cli.cmd_proxy import build
from tests.asgi._servers import raw_request, serve_in_thread

pytestmark = pytest.mark.anyio

BLOCK_POST_ADMIN = """
policies:
  - id: no-post-admin
    version: "1"
    mode: enforce
    match:
      http:
        methods: [POST]
        paths: ["/admin/**"]
    rules:
      - id: deny
        when: "true"
        action: block
    default: allow
"""

#: What the raw upstream writes for a request head: (answer, stray bytes written ``STRAY_AFTER_S`` later or b"").
Answer = Callable[[bytes], tuple[bytes, bytes]]
STRAY_AFTER_S = 0.3
FAKE = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nPWNED!"


def _ok(head: bytes) -> tuple[bytes, bytes]:
    body = json.dumps({"head": head.decode("latin-1")}).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body), b""


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request head (its body, by length or chunks, read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        await reader.readuntil(b"0\r\n\r\n")
    elif b"content-length: " in lower:
        await reader.readexactly(int(lower.split(b"content-length: ")[1].split(b"\r\n")[0]))
    return head


@asynccontextmanager
async def raw_upstream(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A keep-alive upstream on loopback answering each request with ``answer(head)``: ``(URL, heads received)``."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await _read_request(reader)
                heads.append(head)
                reply, stray = answer(head)
                writer.write(reply)
                if stray:
                    await asyncio.sleep(STRAY_AFTER_S)
                    writer.write(stray)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", heads


@pytest.fixture
async def judge_guard(tmp_path: Path) -> AsyncIterator[Guard]:
    """A Guard whose one policy blocks every POST under ``/admin/``."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(BLOCK_POST_ADMIN)
    guard = Guard.from_files(policy, backends=FixtureBackend({}))
    yield guard
    await guard.aclose()


@contextmanager
def _proxy(guard: Guard, upstream: str, **options: object) -> Iterator[str]:
    with serve_in_thread(proxy_app(guard, ProxyConfig(upstream), **options), **server_options()) as url:
        yield url


async def test_an_override_header_the_guard_judged_is_never_dropped(judge_guard: Guard) -> None:
    """Under ``method_override="judge"`` a POST with ``X-HTTP-Method-Override: PUT`` is judged as a PUT; the upstream
    must get the header (``Connection`` cannot remove it), or the request is refused (spelled with underscores,
    which the proxy never forwards): never the POST a policy blocks, without the header."""
    async with raw_upstream(_ok) as (url, heads):
        with _proxy(judge_guard, url, method_override="judge") as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                blocked = await client.post("/admin/x", content=b"{}")
                named = await client.post("/admin/x", content=b"{}", headers={
                    "X-HTTP-Method-Override": "PUT", "Connection": "X-HTTP-Method-Override"})
                underscored = await client.post("/admin/x", content=b"{}", headers={"X_HTTP_Method_Override": "PUT"})
    assert blocked.status_code == 403
    assert named.status_code == 200 and b"x-http-method-override: PUT" in heads[0]
    assert underscored.status_code == 400 and len(heads) == 1
    assert underscored.json()["code"] == "method_override" and underscored.json()["field"] == "x_http_method_override"


def test_a_content_length_is_sent_on_as_the_server_read_it() -> None:
    """``Content-Length: 010`` went upstream as written: a reader that takes a leading 0 for octal reads 8."""
    scope = {"type": "http", "scheme": "http", "headers": [(b"host", b"a"), (b"content-length", b"010")]}
    headers, has_body = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers(scope)
    assert has_body and (b"content-length", b"10") in headers


def test_override_headers_are_dropped_when_the_guard_does_not_judge_them() -> None:
    scope = {"type": "http", "scheme": "http", "headers": [(b"host", b"a"), (b"x_http_method_override", b"PUT")]}
    headers, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers(scope)
    assert [k for k, _ in headers] == [b"host", b"x-forwarded-proto", b"x-forwarded-host"]


async def test_a_host_that_is_not_host_and_port_is_refused(judge_guard: Guard) -> None:
    """The client's ``Host`` becomes ``X-Forwarded-Host`` (reset links): anything but ``host[:port]`` is a 400, for a
    WebSocket upgrade too."""
    async with raw_upstream(_ok) as (url, heads):
        with _proxy(judge_guard, url) as proxy:
            port = int(proxy.rsplit(":", 1)[1])
            answers = {}
            for host in (b"good.com, evil.com", b"evil.com/reset?x=", b"a@b", b"good.com:80:1", b"a.example:99999",
                         b"api.example.com:8443", b"127.0.0.1", b"[::1]:8080", b"xn--bcher-kva.example.", b"a.example:",
                         b"[fe80::1%25eth0]:8080"):
                request = b"GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host
                answers[host] = await asyncio.to_thread(raw_request, port, request)
            upgrade = await asyncio.to_thread(raw_request, port, (
                b"GET /x HTTP/1.1\r\nHost: evil.com/reset?x=\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"))
    for host, answer in answers.items():
        refused = host in (b"good.com, evil.com", b"evil.com/reset?x=", b"a@b", b"good.com:80:1", b"a.example:99999")
        assert answer.startswith(b"HTTP/1.1 400" if refused else b"HTTP/1.1 200"), (host, answer[:200])
        if refused:
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["field"] == "host"
    assert len(heads) == 6 and b"x-forwarded-host: [::1]:8080" in heads[2]
    assert upgrade.startswith(b"HTTP/1.1 400") and json.loads(upgrade.partition(b"\r\n\r\n")[2])["field"] == "host"


async def test_allowed_hosts_refuse_a_host_the_proxy_does_not_serve(judge_guard: Guard) -> None:
    """``X-Forwarded-Host`` is the client's ``Host`` as sent, which an upstream builds reset links from: without
    ``allowed_hosts`` any well-formed one goes on (docs/http.md says so); with it, a ``Host`` none of its globs
    matches is a 400 ``invalid_host`` before any policy judges the request, for a WebSocket upgrade too."""

    def get(port: int, host: bytes, method: bytes = b"GET", path: bytes = b"/x") -> bytes:
        return raw_request(port, b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                           % (method, path, host))

    async with raw_upstream(_ok) as (url, heads):
        with serve_in_thread(proxy_app(judge_guard, ProxyConfig(url)), **server_options()) as proxy:
            anything = await asyncio.to_thread(get, int(proxy.rsplit(":", 1)[1]), b"evil.example")
        assert anything.startswith(b"HTTP/1.1 200") and b"x-forwarded-host: evil.example\r\n" in heads[0]
        config = ProxyConfig(url, allowed_hosts=("api.example.com", "*.Example.org"))
        with serve_in_thread(proxy_app(judge_guard, config), **server_options()) as proxy:
            port = int(proxy.rsplit(":", 1)[1])
            answers = {host: await asyncio.to_thread(get, port, host)
                       for host in (b"api.example.com:8443", b"API.example.COM.", b"a.example.org", b"evil.example",
                                    b"b.a.example.org", b"example.org", b"api.example.com.evil.example")}
            admin = await asyncio.to_thread(get, port, b"evil.example", b"POST", b"/admin/x")
            upgrade = await asyncio.to_thread(raw_request, port, (
                b"GET /x HTTP/1.1\r\nHost: evil.example\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"))
    served = {host: answer.split(b" ", 2)[1] for host, answer in answers.items()}
    assert served == {b"api.example.com:8443": b"200", b"API.example.COM.": b"200", b"a.example.org": b"200",
                      b"evil.example": b"400", b"b.a.example.org": b"400", b"example.org": b"400",
                      b"api.example.com.evil.example": b"400"}
    refusal = json.loads(answers[b"evil.example"].partition(b"\r\n\r\n")[2])
    assert (refusal["code"], refusal["field"]) == ("invalid_host", "host") and "evil.example" in refusal["message"]
    assert admin.startswith(b"HTTP/1.1 400") and b"invalid_host" in admin  # not the policy's 403
    assert upgrade.startswith(b"HTTP/1.1 400") and json.loads(upgrade.partition(b"\r\n\r\n")[2])["field"] == "host"
    assert len(heads) == 4 and b"x-forwarded-host: api.example.com:8443\r\n" in heads[1]
    for bad, reason in [("api.example.com:443", "holds a port"), ("api.example.com.", "ends in a dot"),
                        (" ", "is empty"), ("https://api.example.com", "is a URL; write its host alone: 'api.example"),
                        ("exa mple.com", "holds ' ', which no Host header holds"), ("a.example/x", "holds '/'")]:
        with pytest.raises(ValueError, match=re.escape(f"ProxyConfig.allowed_hosts: host glob {bad.strip()!r} {reason}")):
            ProxyConfig(url, allowed_hosts=(bad,))


async def test_allowed_hosts_refuse_a_request_without_host_and_trusted_forwarded_hosts(judge_guard: Guard) -> None:
    """With ``allowed_hosts``, a request without ``Host`` (HTTP/1.0) or with an empty one was forwarded unjudged (a
    ``hosts:``-scoped policy never matched it), and under ``trust_forwarded`` a client's ``X-Forwarded-Host`` or
    ``Forwarded`` ``host=`` outside the list reached the upstream; each is now a 400 ``invalid_host``, and so is a
    ``host=`` inside a quoted ``Forwarded`` value, which Rack reads (it splits at ``;`` and ``,`` ignoring quotes),
    and an ``X-Host`` or ``X-Original-Host``, which other frameworks read as the host."""
    head_with = b"GET /x HTTP/1.1\r\nHost: api.example.com\r\n%s\r\nConnection: close\r\n\r\n"
    async with raw_upstream(_ok) as (url, heads):
        answers = {}
        for trust in (False, True):
            config = ProxyConfig(url, allowed_hosts=("api.example.com",), trust_forwarded=trust)
            with serve_in_thread(proxy_app(judge_guard, config), **server_options()) as proxy:
                port = int(proxy.rsplit(":", 1)[1])
                for name, head in [
                    ("no host", b"GET /x HTTP/1.0\r\n\r\n"),
                    ("empty host", b"GET /x HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n"),
                    ("x-forwarded-host", head_with % b"X-Forwarded-Host: api.example.com, evil.example"),
                    ("forwarded", head_with % b'Forwarded: for=1.2.3.4;host="evil.example"'),
                    ("x-host", head_with % b"X-Host: evil.example"),
                    ("x-original-host", head_with % b"X-Original-Host: api.example.com, evil.example"),
                    # Rack splits Forwarded at every ';' and ',', quotes or not: it reads host=evil.example here
                    ("quoted", head_with % b'Forwarded: for="x;host=evil.example"'),
                    ("quoted comma", head_with % b'Forwarded: for="x,host=evil.example", for=10.0.0.1'),
                    ("listed", head_with % b"X-Forwarded-Host: API.example.com:443\r\nForwarded: host=api.example.com"),
                ]:
                    answer = await asyncio.to_thread(raw_request, port, head)
                    body = answer.partition(b"\r\n\r\n")[2]
                    field = json.loads(body).get("field") if body.startswith(b"{") else None
                    answers[trust, name] = (answer.split(b" ", 2)[1], field)
    assert answers == {
        (False, "no host"): (b"400", "host"), (False, "empty host"): (b"400", "host"),
        (False, "x-forwarded-host"): (b"200", None), (False, "forwarded"): (b"200", None),  # dropped, not trusted
        (False, "listed"): (b"200", None),
        (True, "no host"): (b"400", "host"), (True, "empty host"): (b"400", "host"),
        (True, "x-forwarded-host"): (b"400", "x-forwarded-host"), (True, "forwarded"): (b"400", "forwarded"),
        (True, "listed"): (b"200", None),
        (False, "quoted"): (b"200", None), (False, "quoted comma"): (b"200", None),
        (True, "quoted"): (b"400", "forwarded"), (True, "quoted comma"): (b"400", "forwarded"),
        (False, "x-host"): (b"200", None), (False, "x-original-host"): (b"200", None),
        (True, "x-host"): (b"400", "x-host"), (True, "x-original-host"): (b"400", "x-original-host"),
    }
    assert len(heads) == 8 and b"x-forwarded-host: API.example.com:443\r\n" in heads[7]


async def test_an_upstream_status_outside_100_to_599_is_a_502(judge_guard: Guard) -> None:
    def odd(head: bytes) -> tuple[bytes, bytes]:
        return b"HTTP/1.1 %s Odd\r\ncontent-length: 2\r\n\r\nok" % head.split(b" ")[1][1:], b""

    async with raw_upstream(odd) as (url, _):
        with _proxy(judge_guard, url) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                answers = [await client.get(f"/{status}") for status in (600, 999, 599)]
    assert [a.status_code for a in answers] == [502, 502, 599]
    assert answers[0].json()["code"] == "upstream_unavailable"


async def test_stray_upstream_bytes_never_answer_the_next_request(judge_guard: Guard) -> None:
    """Bytes an upstream sends after a response (a HEAD answered with a body, late) must not become the response to
    the next request sent on that connection, whether it was sent at once or waited for its body."""
    def stray(head: bytes) -> tuple[bytes, bytes]:
        if head.startswith(b"HEAD /late"):  # the length of the body a HEAD answer leaves out, then that body, late
            return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(FAKE), FAKE
        if head.startswith(b"GET /late"):  # a whole answer, then bytes nobody asked for
            return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", FAKE
        return _ok(head)

    async def slow_body() -> AsyncIterator[bytes]:
        await asyncio.sleep(2 * STRAY_AFTER_S)
        yield b"{}"

    async with raw_upstream(stray) as (url, _):
        with _proxy(judge_guard, url) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                assert (await client.head("/late")).status_code == 200
                after_head = await client.get("/victim")
                assert (await client.get("/late")).status_code == 200
                waiting = await client.post("/victim", content=slow_body())
    assert after_head.status_code == 200 and b"PWNED" not in after_head.content
    assert waiting.status_code == 200 and b"PWNED" not in waiting.content


async def test_redirects_into_the_upstream_are_made_relative() -> None:
    """As nginx's default ``proxy_redirect``: a ``Location`` or ``Content-Location`` under the upstream URL becomes a
    path the client follows through the proxy; any other is kept."""
    def redirect(head: bytes) -> tuple[bytes, bytes]:
        return (b"HTTP/1.1 302 Found\r\nlocation: %s/api/items/?a=1\r\ncontent-location: %s/api\r\n"
                b"link: <%s/api/x>\r\ncontent-length: 0\r\n\r\n" % (origin, origin.upper(), origin)), b""

    async with raw_upstream(redirect) as (url, _):
        origin = url.encode()
        proxy = ReverseProxy(ProxyConfig(f"{url}/api"))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://x") as client:
                response = await client.get("/login")
        finally:
            await proxy.aclose()
    assert response.status_code == 302
    assert response.headers["location"] == "/items/?a=1"
    assert response.headers["content-location"] == "/"
    assert response.headers["link"] == f"<{url}/api/x>"
    relative = ReverseProxy(ProxyConfig("http://127.0.0.1:9000/api"))._relative
    assert relative(b"http://127.0.0.1:9000/apix") == b"http://127.0.0.1:9000/apix"
    assert relative(b"http://127.0.0.1:9000/api?q") == b"/?q"
    assert relative(b"http://127.0.0.1:9001/api/x") == b"http://127.0.0.1:9001/api/x"
    assert ReverseProxy(ProxyConfig("http://up"))._relative(b"http://up:80/x") == b"/x"
    for other_host in (b"//evil.example/x", b"/\\evil.example/", b"/\t/evil.example/", b"/\r\n/evil.example/"):
        # a path on the upstream that a browser would read as another host stays absolute (an open redirect else)
        assert relative(b"http://127.0.0.1:9000/api" + other_host) == b"http://127.0.0.1:9000/api" + other_host


def test_cli_preserve_host_max_head_bytes_and_allowed_hosts_reach_the_config(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(BLOCK_POST_ADMIN)
    argv = ["proxy", "--policy", str(policy), "--upstream", "http://127.0.0.1:9", "--backend", "http://127.0.0.1:9"]
    for extra, expected in (([], (False, 16384, ())), (["--preserve-host", "--max-head-bytes", "65536",
                                                        "--allowed-hosts", "api.example.com, *.example.org"],
                                                       (True, 65536, ("api.example.com", "*.example.org")))):
        runtime = build(build_parser().parse_args([*argv, *extra]))
        config = runtime.app.proxy.config
        assert (config.preserve_host, config.max_head_bytes, config.allowed_hosts) == expected
        asyncio.run(runtime.aclose())
    with pytest.raises(ValueError, match="--allowed-hosts ' , ' names no host"):
        build(build_parser().parse_args([*argv, "--allowed-hosts", " , "]))


async def test_a_request_the_proxy_cannot_send_on_is_refused_before_any_policy_judges_it(judge_guard: Guard) -> None:
    """A bad ``Host`` on a request a policy allowed was counted and logged as allowed, then refused by the proxy;
    on one a policy blocked, the client learnt the policy's verdict instead of the request's fault."""
    app = proxy_app(judge_guard, ProxyConfig("http://127.0.0.1:9"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        answers = [await client.request(method, path, headers={"host": "evil.com/reset?x="})
                   for method, path in (("GET", "/x"), ("POST", "/admin/x"))]
    assert [(a.status_code, a.json()["code"]) for a in answers] == [(400, "invalid_host")] * 2
    metrics = app.guarded.metrics.render().decode()
    assert 'code="invalid_host"} 2.0' in metrics and 'action="allow"' not in metrics and 'action="block"' not in metrics


async def test_a_body_framed_two_ways_or_an_oversized_head_is_refused_and_the_connection_closed(
    judge_guard: Guard,
) -> None:
    """Content-Length with Transfer-Encoding kept the connection open: the bytes past the chunks reached the upstream
    as a second request, where a front proxy reading the length saw one. A 60 KB head sent in one read was forwarded
    whole (h11 caps only a head that arrives in several reads)."""
    async with raw_upstream(_ok) as (url, heads):
        with _proxy(judge_guard, url) as proxy:
            port = int(proxy.rsplit(":", 1)[1])
            smuggled = await asyncio.to_thread(raw_request, port, (
                b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 41\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"))
            large = await asyncio.to_thread(raw_request, port, (
                b"GET /x HTTP/1.1\r\nHost: a\r\nX-Long: " + b"a" * 60_000 + b"\r\nConnection: close\r\n\r\n"))
            fine = await asyncio.to_thread(raw_request, port, (
                b"GET /x HTTP/1.1\r\nHost: a\r\nX-Long: " + b"a" * 15_000 + b"\r\nConnection: close\r\n\r\n"))
    assert smuggled.startswith(b"HTTP/1.1 400") and smuggled.count(b"HTTP/1.1") == 1
    assert b"connection: close" in smuggled.lower()
    assert json.loads(smuggled.partition(b"\r\n\r\n")[2])["code"] == "ambiguous_length"
    assert large.startswith(b"HTTP/1.1 431") and fine.startswith(b"HTTP/1.1 200")
    assert len(heads) == 1  # only the request under the cap reached the upstream
