"""Slow and stalled clients over real sockets (uvicorn on loopback, and ``guard proxy`` as a process): a request head
that does not arrive in time is answered 408 and closed, a judged body that stalls is refused with 408, a forwarded
body that stalls is cut, and a request being served is never cut by the head timer."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.asgi.limits import BodyLimits
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.asgi.server import head_timeout_protocol
from guard.engine import Guard
from tests._otlp import Receiver
from tests.asgi._apps import BENIGN, POLICY, guarded_app
from tests.asgi._servers import serve_in_thread
from tests.worker._serve import serve_app_in_thread

GuardFactory = Callable[..., Guard]
REPO = Path(__file__).resolve().parents[2]


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _closed_within(conn: socket.socket, seconds: float) -> tuple[bytes, float]:
    """Read until the server closes; ``(what it sent, seconds it took)``."""
    conn.settimeout(seconds)
    started, data = time.monotonic(), b""
    try:
        while chunk := conn.recv(4096):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    except OSError:
        pass
    return data, time.monotonic() - started


async def _slow(request: Request) -> JSONResponse:
    await asyncio.sleep(1.2)
    return JSONResponse({"slow": True})


def test_a_head_that_does_not_arrive_in_time_is_closed() -> None:
    app = Starlette(routes=[Route("/slow", _slow)])
    with serve_in_thread(app, http=head_timeout_protocol(0.5), timeout_keep_alive=1) as base:
        port = _port(base)
        trickling = []
        for _ in range(30):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            trickling.append(conn)
        silent = socket.create_connection(("127.0.0.1", port))
        results = [_closed_within(c, 5) for c in [*trickling, silent]]
        # a served request outlives the head timer, and the next head on the connection is timed again
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(5)
        first = b""
        while b'{"slow":true}' not in first and (chunk := kept.recv(4096)):
            first += chunk
        kept.sendall(b"GET /slow HTTP/1.1\r\n")
        after_keepalive = _closed_within(kept, 6)
    for data, took in results:
        assert data.startswith(b"HTTP/1.1 408") and took < 3
    assert first.startswith(b"HTTP/1.1 200") and b'{"slow":true}' in first
    assert after_keepalive[0].startswith(b"HTTP/1.1 408") and after_keepalive[1] < 4
    for conn in [*trickling, silent, kept]:
        conn.close()


@pytest.mark.parametrize("head", [
    b"GET /slow HTTP/1.1\r\nHost: x\r\nx-request-id: a\rb\r\n\r\n",
    b"GET /slow HTTP/1.1\r\nHost: x\r\nx-request-id: a\x00b\r\n\r\n",
    b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "GET /v1/models/\u00e9 HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
], ids=["cr-in-header", "nul-in-header", "negative-length", "utf8-target"])
def test_a_request_that_is_not_http_is_refused_with_a_json_error(head: bytes) -> None:
    """h11 refuses these before the app runs; uvicorn answered them in text, the only refusal that was not JSON."""
    app = Starlette(routes=[Route("/slow", _slow)])
    with serve_in_thread(app, http=head_timeout_protocol(5)) as base:
        conn = socket.create_connection(("127.0.0.1", _port(base)))
        conn.sendall(head)
        data, took = _closed_within(conn, 5)
        conn.close()
    status, _, body = data.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in status.lower()
    assert json.loads(body)["code"] == "invalid_http" and took < 5


async def _echo_as_read(scope: dict, receive: Callable, send: Callable) -> None:
    """Start the response, then read the body and send it back a chunk at a time."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        await send({"type": "http.response.body", "body": message.get("body", b""), "more_body": True})
        if not message.get("more_body"):
            break
    await send({"type": "http.response.body", "body": b""})


def test_a_malformed_chunk_after_the_response_began_only_closes_the_connection() -> None:
    """A second response head written into a response that has begun would be read as part of its body."""
    with serve_in_thread(_echo_as_read, http=head_timeout_protocol(5)) as base:
        conn = socket.create_connection(("127.0.0.1", _port(base)))
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        time.sleep(0.3)
        conn.sendall(b"zz\r\nnot a chunk\r\n")
        data, took = _closed_within(conn, 5)
        conn.close()
    assert data.startswith(b"HTTP/1.1 200") and b"first" in data and took < 5
    assert b"invalid_http" not in data and b"HTTP/1.1 400" not in data


@pytest.mark.anyio
async def test_a_stalled_judged_body_is_refused_and_a_stalled_forwarded_body_cut(make_guard: GuardFactory) -> None:
    guard = make_guard()
    app = guarded_app(guard, limits=BodyLimits(body_timeout_s=0.5))
    with serve_in_thread(app) as base:
        conn = socket.create_connection(("127.0.0.1", _port(base)))
        conn.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n" + b'{"message": "' + b"a" * 60000)  # near the limit, stalled
        judged = _closed_within(conn, 5)
        conn.close()
    assert judged[0].startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in judged[0] and judged[1] < 3

    upstream = Starlette(routes=[Route("/public/sink", _slow, methods=["POST"])])
    with (serve_in_thread(upstream) as url,
          serve_in_thread(proxy_app(guard, ProxyConfig(url, body_idle_timeout=0.5))) as proxy):
        conn = socket.create_connection(("127.0.0.1", _port(proxy)))
        conn.sendall(b"POST /public/sink HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        forwarded = _closed_within(conn, 5)
        conn.close()
    assert forwarded[0].startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in forwarded[0]
    assert forwarded[1] < 3


@pytest.mark.anyio
async def test_a_body_of_many_documents_is_refused_or_read_off_the_event_loop(make_guard: GuardFactory) -> None:
    """4 MiB of JSON Lines in a 4 KB gzip body held the gateway's event loop 3.5 s per request, every other request
    waiting (attack finding): more '[' and '{' than ``max_json_containers`` are refused before parsing, and a large
    or encoded body is read on a thread, the loop still ticking."""
    import gzip

    from tests.asgi._apps import client_for

    arrays = gzip.compress(b"\n".join([b"[]"] * ((4 << 20) // 3)))
    strings = gzip.compress(b"\n".join([b'"a"'] * ((3 << 20) // 4)))  # no bracket: read line by line
    gaps: list[float] = []

    async def ticking() -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - before)

    ticker = asyncio.ensure_future(ticking())
    async with client_for(guarded_app(make_guard())) as client:
        headers = {"content-type": "text/plain", "content-encoding": "gzip"}
        refused = await client.post("/v1/echo", content=arrays, headers=headers)
        read = await client.post("/v1/echo", content=strings, headers=headers)
    ticker.cancel()
    assert refused.status_code == 413 and refused.json()["code"] == "body_too_complex"
    assert read.status_code == 200
    assert max(gaps) < 0.5, max(gaps)  # a bound on a stall, not a speed claim (inline, the read held it ~1.2 s)


@pytest.mark.anyio
async def test_the_container_cap_reads_only_what_is_parsed_as_json() -> None:
    """Counted on every body, the cap refused an opaque upload (random bytes hold brackets) and ordinary JSON of 20,000
    points; and the method-override lookup on a path judged only for DELETE still parsed 4 MiB of gzipped ``[]`` on
    the event loop, uncapped (review findings)."""
    import gzip

    from guard.policy import load_text
    from tests._backends import ScriptedBackend
    from tests.asgi._apps import client_for

    policy = """
policies:
  - id: deletes
    version: 1
    match: {http: {methods: [DELETE], paths: ["/v1/**"]}}
    rules: [{id: refuse, when: "true", action: block}]
  - id: posts
    version: 1
    match: {http: {methods: [POST], paths: ["/v1/form/**"]}}
    rules: [{id: never, when: "false", action: block}]
"""
    guard = Guard(load_text(policy), backends=ScriptedBackend(lambda r: {}))
    app = guarded_app(guard, limits=BodyLimits(opaque_media="metadata", max_body_bytes=4 << 20))
    noise = bytes(range(256)) * 8192  # 2 MiB, 16,384 brackets among them
    points = json.dumps({"type": "LineString", "coordinates": [[i, i + 1] for i in range(20_000)]})
    nested = gzip.compress(b'{"_method": "DELETE", "a": [' + b",".join([b"[]"] * 300_000) + b"]}")
    field = "[" + ",".join(["[]"] * 300_000) + ', "\\u0041"]'  # a form value an app may json.loads
    async with client_for(app) as client:
        half = "[" + ",".join(["[]"] * 150_000) + ', "\\u0041"]'  # 150,001 brackets: two are over the cap
        in_parts = await client.post("/v1/form/x", files={"a": (None, half), "b": (None, half)})
        in_part = await client.post("/v1/form/x", files={"data": (None, field)})
        in_form = await client.post("/v1/form/x", data={"data": field})  # percent-encoded: not the body's brackets
        plain_form = await client.post("/v1/form/x", data={"data": "[1, 2]"})
        opaque = await client.post("/v1/form/up", content=noise, headers={"content-type": "application/octet-stream"})
        geo = await client.post("/v1/form/geo", content=points, headers={"content-type": "application/json"})
        hidden = await client.post("/v1/echo", content=nested,
                                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    await guard.aclose()
    assert opaque.status_code == 200 and geo.status_code == 200
    assert hidden.status_code == 413 and hidden.json()["code"] == "body_too_complex"
    assert in_part.status_code == in_form.status_code == in_parts.status_code == 413, (in_part.text, in_form.text)
    assert plain_form.status_code == 200  # judged and allowed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_guard_proxy_serves_two_listeners_and_times_out_slow_heads(tmp_path: Path) -> None:
    """``guard proxy`` as a process: health on the admin listener only (the proxied one forwards the path), slow
    heads closed on both, a clean exit on SIGTERM; the HTTP counters both on /_guard/metrics and over OTLP."""
    upstream = Starlette(routes=[Route("/{p:path}", lambda r: JSONResponse({"upstream": r.url.path}),
                                       methods=["GET", "POST"])])
    otlp = Receiver()
    with serve_in_thread(upstream) as url, serve_app_in_thread(otlp.app, ready_path=None) as collector:
        listen, admin = _free_port(), _free_port()
        env = {**os.environ, "GUARD_TEST_REVIEWERS": "alice:alice-review-token-0123456789",
               "OTEL_EXPORTER_OTLP_ENDPOINT": collector, "OTEL_TRACES_EXPORTER": "none"}
        process = subprocess.Popen(
            [sys.executable, "-m", "guard", "proxy", "--policy", str(POLICY), "--upstream", url,
             "--backend", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{listen}",
             "--admin-listen", f"127.0.0.1:{admin}", "--header-timeout", "0.5",
             "--review-tokens-env", "GUARD_TEST_REVIEWERS"],  # --log-level info: the access log is on
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:  # until the start-up canary run has tried the (unreachable) backend
                try:
                    health = httpx.get(f"http://127.0.0.1:{admin}/_guard/health", timeout=2)
                    if health.json()["checks"]["backends"]["default"] != "starting":
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None and time.monotonic() < deadline, "guard proxy did not start"
                time.sleep(0.2)
            proxied = httpx.get(f"http://127.0.0.1:{listen}/_guard/health", timeout=5)
            httpx.get(f"http://127.0.0.1:{listen}/_guard/health?api_key=SECRETQUERY123&q=hi&subscription-key=SECRETAPIM"
                      "&code=SECRETCODE&key%5B%5D=SECRETKEYS", timeout=5)
            reviews = httpx.get(f"http://127.0.0.1:{admin}/_guard/admin/reviews/", timeout=5,
                                headers={"authorization": "Bearer alice-review-token-0123456789"})
            judged = httpx.post(f"http://127.0.0.1:{listen}/v1/echo", json={"message": BENIGN}, timeout=5)
            scraped = httpx.get(f"http://127.0.0.1:{admin}/_guard/metrics", timeout=5).text
            slow = [socket.create_connection(("127.0.0.1", p)) for p in (listen, admin)]
            for conn in slow:
                conn.sendall(b"GET / HTTP/1.1\r\n")
            closed = [_closed_within(conn, 5) for conn in slow]
        finally:
            process.terminate()
            stdout, stderr = process.communicate(timeout=30)
    # no backend answers at 127.0.0.1:9: health says so (every judged request fails closed); a remote backend is
    # every replica's, so it is degraded, not a reason to take this replica (and all the others) out of rotation
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert health.json()["checks"]["backends"] == {"default": "unreachable"}, health.text
    assert proxied.status_code == 200 and proxied.json() == {"upstream": "/_guard/health"}
    assert reviews.status_code == 200 and reviews.json() == {"items": [], "count": 0}
    assert judged.status_code == 503 and json.loads(judged.text)["code"] == "decision_unavailable"  # no backend
    assert all(data.startswith(b"HTTP/1.1 408") and took < 3 for data, took in closed)
    assert process.returncode == 0 and "Traceback" not in stderr
    # the access log shows the query with a secret-named parameter's value masked, as the decision log does
    assert ("/_guard/health?api_key=[redacted]&q=hi&subscription-key=[redacted]&code=[redacted]&key%5B%5D=[redacted] "
            "HTTP/1.1") in stdout and "SECRET" not in stdout + stderr
    assert 'guard_http_guarded_requests_total{guard_action="block",guard_policy_id=' in scraped
    assert "otel_scope" not in scraped  # the label names the docs list, the same as a middleware's own registry
    assert scraped.count("# TYPE target_info") <= 1
    assert "guard.http.guarded_requests" in otlp.metric_names()  # exported at shutdown
