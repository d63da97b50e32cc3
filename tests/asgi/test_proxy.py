"""The reverse proxy against a real upstream (both under uvicorn on loopback): bodies both ways, status and headers,
hop-by-hop removal, incremental streaming, 502/504, health, metrics, the guard in front, and the CLI builder."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from guard.asgi.admin import admin_app
from guard.asgi.limits import DEFAULT_STREAM_FLUSH_S, DEFAULT_STREAM_HOLD_CHARS, BodyLimits
from guard.asgi.middleware import GuardMiddleware
from guard.asgi.proxy import ProxyApp, ProxyConfig, ReverseProxy, _client_trace_context, _forward_headers, proxy_app
from guard.asgi.server import server_options
from guard.cli import build_parser, main
from guard.cli.cmd_proxy import build
from guard.engine import Guard
from guard.engine.cache import CacheConfig, RedisCache
from guard.engine.telemetry import Telemetry
from guard.errors import PolicyError
from guard.policy import load_text
from tests._backends import ScriptedBackend
from tests.asgi._apps import ATTACK, BENIGN, POLICY, scripted_answers, sha
from tests.asgi._servers import raw_request, serve_in_thread
from tests.asgi.test_decode import POLYGLOT

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
TOKEN = "alice-review-token-0123456789"
E2E_POLICY = Path(__file__).parent / "fixtures" / "e2e_policy.yaml"


class Upstream:
    """The protected service: echoes, streams behind gates, odd headers, gzip, slow and broken responses."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gates = [threading.Event() for _ in range(4)]
        self.app = Starlette(
            routes=[
                Route("/{prefix}/echo", self.echo, methods=["POST", "PUT", "GET"]),
                Route("/v1/stream", self.stream, methods=["POST"]),
                Route("/public/headers", self.headers, methods=["GET", "HEAD"]),
                Route("/public/gzip", self.gzipped),
                Route("/public/slow", self.slow),
                Route("/public/break", self.broken),
            ]
        )

    async def echo(self, request: Request) -> Response:
        self.calls.append(request.url.path)
        body = b"".join([chunk async for chunk in request.stream()])
        return JSONResponse(
            {
                "sha256": hashlib.sha256(body).hexdigest(),
                "length": len(body),
                "headers": dict(request.headers),
                "query": request.url.query,
                "path": request.url.path,
            },
            status_code=201 if request.method == "PUT" else 200,
        )

    async def stream(self, request: Request) -> Response:
        self.calls.append(request.url.path)
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(len(self.gates)):
                if i:
                    deadline = time.monotonic() + 5
                    while not self.gates[i].is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.002)
                yield f"part {i}\n".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    async def headers(self, request: Request) -> Response:
        response = Response(
            b"hello",
            status_code=203,
            headers={"x-custom": "1", "x-hop": "secret", "connection": "x-hop", "keep-alive": "timeout=5"},
        )
        response.set_cookie("a", "1")
        response.set_cookie("b", "2")
        return response

    async def gzipped(self, request: Request) -> Response:
        return Response(
            gzip.compress(b"compressed " * 100), headers={"content-encoding": "gzip"}, media_type="text/plain"
        )

    async def slow(self, request: Request) -> Response:
        await asyncio.sleep(2)
        return Response(b"late")

    async def broken(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first part\n"
            raise RuntimeError("upstream crashed mid-body")

        return StreamingResponse(chunks(), media_type="text/plain")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    service = Upstream()
    with serve_in_thread(service.app) as url:
        yield service, url


@contextmanager
def _served(app: ProxyApp, lifespan: str = "off", **review: Any) -> Iterator[tuple[str, str]]:
    """The proxied app and its admin app, each on its own loopback port: ``(proxy URL, admin URL)``."""
    admin = admin_app(app.guard, review_store=app.guarded.review_store, metrics=app.guarded.metrics, **review)
    with serve_in_thread(app, lifespan=lifespan) as proxy, serve_in_thread(admin) as admin_url:
        yield proxy, admin_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_guarded_and_unguarded_bodies_reach_the_upstream_intact(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    _, url = upstream
    body = json.dumps({"message": BENIGN}).encode()
    big = b"z" * (5 << 20)  # above the 1 MiB inspection cap, on a path no policy matches: streamed, not capped
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url)), proxy_headers=False) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            guarded = await client.post(
                "/v1/echo?x=1&y=%20",
                content=body,
                headers={
                    "content-type": "application/json",
                    "connection": "x-secret",
                    "x-secret": "hop",
                    "x-forwarded-for": "10.0.0.1",
                },
            )
            unguarded = await client.post("/public/echo", content=big, headers={"x-guard-decision-id": "forged"})
            put = await client.put("/v1/echo", content=body, headers={"content-type": "application/json"})
    assert guarded.status_code == 200 and "x-guard-decision-id" in guarded.headers  # judged and allowed
    seen = guarded.json()
    assert seen["sha256"] == sha(body) and seen["query"] == "x=1&y=%20"
    assert seen["headers"]["host"] == url.removeprefix("http://") and "x-secret" not in seen["headers"]
    assert seen["headers"]["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
    assert seen["headers"]["x-forwarded-proto"] == "http"
    assert seen["headers"]["x-guard-decision-id"] == guarded.headers["x-guard-decision-id"]  # for the app's logs
    assert unguarded.json()["sha256"] == sha(big) and "x-guard-decision-id" not in unguarded.headers
    assert "x-guard-decision-id" not in unguarded.json()["headers"]  # a client's own is never sent on
    assert put.status_code == 201


async def test_status_headers_and_encodings_are_kept(make_guard: GuardFactory, upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url))) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            response = await client.get("/public/headers")
            head = await client.head("/public/headers")
            zipped = await client.get("/public/gzip")
    assert response.status_code == 203 and response.text == "hello" and response.headers["x-custom"] == "1"
    assert response.headers.get_list("set-cookie") == ["a=1; Path=/; SameSite=lax", "b=2; Path=/; SameSite=lax"]
    assert "x-hop" not in response.headers and "keep-alive" not in response.headers
    assert head.status_code == 203 and head.content == b""
    assert zipped.headers["content-encoding"] == "gzip" and zipped.text == "compressed " * 100


async def test_streaming_is_incremental_through_the_proxy(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    service, url = upstream
    for gate in service.gates:
        gate.clear()
    lines: list[str] = []
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url))) as proxy:
        async with (
            httpx.AsyncClient(base_url=proxy, timeout=10) as client,
            client.stream("POST", "/v1/stream", json={"message": BENIGN}) as response,
        ):
            assert response.status_code == 200 and "x-guard-decision-id" in response.headers
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) < len(service.gates):
                    service.gates[len(lines)].set()  # the upstream sends part n+1 only after part n arrived
    assert lines == [f"part {i}" for i in range(len(service.gates))]


async def test_blocked_requests_never_reach_the_upstream(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    service, url = upstream
    before = len(service.calls)
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url))) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            blocked = await client.post("/v1/echo", json={"message": ATTACK})
            too_big = await client.post(
                "/v1/echo", content=b"{" + b" " * (2 << 20) + b"}", headers={"content-type": "application/json"}
            )
    assert blocked.status_code == 403 and blocked.json()["rule"] == "prompt_injection"
    assert too_big.status_code == 413
    assert len(service.calls) == before


async def test_an_encoded_body_that_reads_as_text_as_sent_never_reaches_the_upstream(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    """A deflate stream that is also JSON: the upstream reads the bytes as sent (attack finding: a 200 through the
    proxy while guard judged the inflated noise)."""
    service, url = upstream
    before = len(service.calls)
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url))) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            responses = [await client.post("/v1/echo", content=POLYGLOT, headers={
                "content-encoding": "deflate", **({"content-type": media} if media else {})})
                for media in (None, "text/plain", "application/json")]
    assert [(r.status_code, r.json()["code"]) for r in responses] == [(400, "ambiguous_encoding")] * 3
    assert len(service.calls) == before


async def test_upstream_errors_are_502_and_504(make_guard: GuardFactory, upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    guard = make_guard()
    with serve_in_thread(proxy_app(guard, ProxyConfig(f"http://127.0.0.1:{_free_port()}"))) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            down = await client.get("/public/echo")
            guarded_down = await client.post("/v1/echo", json={"message": BENIGN})
    assert down.status_code == guarded_down.status_code == 502
    assert down.json()["code"] == "upstream_unavailable"
    assert "x-guard-decision-id" in guarded_down.headers  # the guard allowed (its decision); the upstream failed
    assert "x-guard-decision-id" not in down.headers
    with _served(proxy_app(guard, ProxyConfig(url, read_timeout=0.3))) as (proxy, admin):
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            started = time.perf_counter()
            slow = await client.get("/public/slow")
            assert time.perf_counter() - started < 1.5
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/public/break")  # aborted, never a complete-looking truncated body
            metrics = (await client.get(f"{admin}/_guard/metrics")).text
    assert slow.status_code == 504 and slow.json()["code"] == "upstream_timeout"
    assert 'guard_proxy_upstream_errors_total{kind="timeout"} 1.0' in metrics
    assert 'guard_proxy_upstream_errors_total{kind="broken_stream"} 1.0' in metrics


async def test_a_malformed_upstream_head_is_a_502(make_guard: GuardFactory) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with serve_in_thread(proxy_app(make_guard(), ProxyConfig(f"http://127.0.0.1:{port}"))) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                response = await client.get("/public/echo")
    assert response.status_code == 502 and response.json()["code"] == "upstream_unavailable"
    assert "Transfer-Encoding can't be present with Content-Length" in response.json()["message"]


RESPONSE_POLICY = r"""
policies:
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: leak, when: 'state.text.contains("SECRET")', action: block}
"""


async def test_an_upstream_that_breaks_before_anything_reached_the_client_is_a_502_or_504(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A response policy holds the response back until it is judged: an upstream that broke or stalled mid-body
    then gave the client uvicorn's plain-text 500 and logged a traceback (attack finding). Once the response has
    started (a path no response policy watches), the connection is still aborted."""
    release = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = (await reader.readuntil(b"\r\n\r\n")).split(b" ")[1]
        if path.endswith(b"/chunked"):  # one chunk, then the connection closes
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"10\r\nhello world 1234\r\n")
        else:  # 11 of the 100 bytes promised, then a close (or, for /stall, nothing more)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\nhello world")
        await writer.drain()
        if path.endswith(b"/stall"):
            await release.wait()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tracebacks = _Recorder()
    guard = Guard(load_text(RESPONSE_POLICY), backends=ScriptedBackend(lambda request: {}))
    app = proxy_app(guard, ProxyConfig(f"http://127.0.0.1:{port}", read_timeout=0.5))
    async with server:
        with serve_in_thread(app) as proxy:
            logging.getLogger("uvicorn.error").addHandler(tracebacks)  # configured by uvicorn; caplog never sees it
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                short, chunked, stalled = [await client.get(f"/out/{path}") for path in ("short", "chunked", "stall")]
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get("/public/short")  # started unjudged: aborted, never a complete-looking body
        release.set()
    logging.getLogger("uvicorn.error").removeHandler(tracebacks)
    await guard.aclose()
    assert (short.status_code, short.json()["code"]) == (502, "upstream_unavailable")
    assert (chunked.status_code, chunked.json()["code"]) == (502, "upstream_unavailable")
    assert (stalled.status_code, stalled.json()["code"]) == (504, "upstream_timeout")
    assert "hello" not in short.text + chunked.text + stalled.text
    answered = [r.getMessage() for r in caplog.records if "before anything reached the client" in r.getMessage()]
    assert len(answered) == 3
    assert [r.getMessage().strip() for r in tracebacks.records] == ["Exception in ASGI application"]  # the abort


class _Recorder(logging.Handler):
    """A logging handler that keeps the records it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_health_metrics_and_review_admin(make_guard: GuardFactory, upstream: tuple[Upstream, str]) -> None:
    """The admin endpoints answer on the admin listener only; on the proxied listener their paths are forwarded to
    the upstream like any other (which has no such routes: 404 from the upstream, not guard's health)."""
    _, url = upstream
    app = proxy_app(make_guard(), ProxyConfig(url))
    with _served(app, "on", reviewers={"alice": TOKEN}) as (proxy, admin):
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            health = await client.get(f"{admin}/_guard/health")
            held = await client.post("/v1/echo", json={"message": "maybe show me the config"})
            review_id = held.json()["review_id"]
            assert (await client.get(f"{admin}/_guard/admin/reviews/")).status_code == 401
            auth = {"authorization": f"Bearer {TOKEN}"}
            pending = (await client.get(f"{admin}/_guard/admin/reviews/", headers=auth)).json()
            await client.post(f"{admin}/_guard/admin/reviews/{review_id}/approve", headers=auth)
            released = await client.post(held.json()["release_url"],
                                         headers={"x-guard-release-token": held.json()["release_token"]})
            metrics = (await client.get(f"{admin}/_guard/metrics")).text
            on_proxied = {path: await client.get(path, headers=auth) for path in (
                "/_guard/health", "/_guard/metrics", "/_guard/live", "/_guard/admin/reviews/",
                "/_guard/admin/reviews/console")}
            elsewhere = await client.get(f"{admin}/v1/echo")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert held.status_code == 202 and [i["id"] for i in pending["items"]] == [review_id]
    assert released.status_code == 200 and released.json()["path"] == "/v1/echo"
    assert 'guard_http_guarded_requests_total{guard_action="escalate",guard_policy_id="api_guard"} 1.0' in metrics
    assert 'guard_http_reviews_total{event="released"} 1.0' in metrics
    for path, response in on_proxied.items():
        assert response.status_code == 404 and response.text == "Not Found", path  # the upstream's own 404
    assert elsewhere.status_code == 404 and elsewhere.json()["code"] == "not_found"


async def test_liveness_and_readiness_stay_up_when_degraded(
    make_guard: GuardFactory, upstream: tuple[Upstream, str], private_redis: Any, tmp_path: Path
) -> None:
    """A failed hot reload (last good policies still judging) and a Redis outage are ``degraded``, not an outage:
    liveness and readiness stay 200 so Kubernetes neither restarts nor unroutes the gateway."""
    _, url = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.read_text())
    guard = Guard.from_files(policy, backends=ScriptedBackend(scripted_answers), redis_url=private_redis.url)
    try:
        with _served(proxy_app(guard, ProxyConfig(url))) as (proxy, admin):
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                ok = await client.get(f"{admin}/_guard/health")
                policy.write_text("policies: [{id: broken")  # a bad ConfigMap update
                with pytest.raises(PolicyError):
                    guard.reload()
                reload_failed = await client.get(f"{admin}/_guard/health")
                still_judged = await client.post("/v1/echo", json={"message": ATTACK})
                private_redis.stop()
                await client.post("/v1/echo", json={"message": BENIGN + " after redis"})  # a cache error
                redis_down = await client.get(f"{admin}/_guard/health")
                live = await client.get(f"{admin}/_guard/live")
    finally:
        await guard.aclose()
    assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["ready"] is True
    assert reload_failed.status_code == 200 and reload_failed.json()["status"] == "degraded"
    assert reload_failed.json()["checks"]["policy_reload"] == "reload_failed"
    assert "details" not in reload_failed.json()  # no error text (it quotes the policy) without an admin token
    assert still_judged.status_code == 403  # the last good policy set is serving
    assert redis_down.status_code == 200 and redis_down.json()["status"] == "degraded"
    assert redis_down.json()["checks"]["cache"] != "ok"
    assert live.status_code == 200 and live.json() == {"status": "alive"}


async def test_admin_list_answers_without_a_trailing_slash(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    _, url = upstream
    with _served(proxy_app(make_guard(), ProxyConfig(url)), reviewers={"alice": TOKEN}) as (_, admin):
        async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
            auth = {"authorization": f"Bearer {TOKEN}"}
            bare = await client.get("/_guard/admin/reviews", headers=auth)
            slash = await client.get("/_guard/admin/reviews/", headers=auth)
            query = await client.get("/_guard/admin/reviews?status=all", headers=auth)
            denied = await client.get("/_guard/admin/reviews")
    assert bare.status_code == slash.status_code == query.status_code == 200
    assert bare.json() == slash.json() == {"items": [], "count": 0}
    assert denied.status_code == 401


def test_config_validation() -> None:
    for bad in ("ftp://x", "http://", "http://x/?q=1", "localhost:80", "http://127.0.0.1:99999"):
        with pytest.raises(ValueError, match="upstream"):
            ProxyConfig(bad)
    with pytest.raises(ValueError):
        ProxyConfig("http://x", read_timeout=0)
    assert ProxyConfig("http://[::1]:9000/@org/api").upstream  # an '@' starting a path segment is no password's end


def test_cli_refuses_bad_arguments(upstream: tuple[Upstream, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = upstream
    monkeypatch.setenv("GUARD_TEST_SHORT_TOKEN", "alice:short")
    parser = build_parser()
    for bad in (
        ["--listen", "nowhere"],
        ["--listen", "x:99999"],
        ["--review-tokens-env", "GUARD_TEST_UNSET_VAR"],
        ["--review-tokens-env", "GUARD_TEST_SHORT_TOKEN"],
        ["--review-insecure-loopback", "--admin-listen", "0.0.0.0:9901"],
        ["--admin-listen", "127.0.0.1:8080"],
        ["--admin-listen", "nowhere"],
        ["--upstream", "ftp://x"],
    ):  # the numbers' ranges are argparse's: tests/cli/test_cmd_proxy.py
        argv = ["proxy", "--policy", str(POLICY), "--upstream", url, "--backend", "compact", *bad]
        with pytest.raises(ValueError):
            build(parser.parse_args(argv))
    assert main(["proxy", "--policy", "/nonexistent.yaml", "--upstream", url]) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"connect_timeout": -1}, "ProxyConfig.connect_timeout is -1; it must be positive seconds"),
        ({"read_timeout": 0}, "ProxyConfig.read_timeout is 0; it must be positive seconds"),
        ({"queue_timeout": float("nan")}, "ProxyConfig.queue_timeout is nan; it must be positive seconds"),
        ({"body_idle_timeout": 0}, "ProxyConfig.body_idle_timeout is 0; it must be positive seconds"),
        ({"max_connections": 0}, "ProxyConfig.max_connections is 0; it must be at least 1"),
        ({"max_websockets": 0}, "ProxyConfig.max_websockets is 0; it must be at least 1"),
        ({"max_head_bytes": 100}, "ProxyConfig.max_head_bytes is 100; it must be at least 1024"),
    ],
)
def test_proxy_config_names_the_field_that_is_wrong(options: dict[str, Any], message: str) -> None:
    """A bad timeout said "connect_timeout, read_timeout, queue_timeout and body_idle_timeout must be positive
    seconds", which of them left to guess; max_websockets=0 was taken (every WebSocket refused)."""
    with pytest.raises(ValueError) as info:
        ProxyConfig("http://127.0.0.1:9", **options)
    assert str(info.value) == message


def test_cli_a_short_store_key_or_an_unwritable_decision_log_is_named(
    upstream: tuple[Upstream, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The short key's message did not name $GUARD_STORE_KEY; a --decision-log in a missing folder printed a raw
    errno text; one that is a symbolic link was written through."""
    _, url = upstream
    argv = ["proxy", "--policy", str(POLICY), "--upstream", url, "--backend", "http://127.0.0.1:9",
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]  # fmt: skip
    monkeypatch.setenv("GUARD_STORE_KEY", "abc")
    assert main([*argv, "--redis-url", "redis://127.0.0.1:1/9"]) == 2
    err = capsys.readouterr().err
    assert err == "guard proxy: --redis-url: $GUARD_STORE_KEY has 3 bytes; at least 16\n"  # the key Redis entries are sealed with
    log = tmp_path / "missing" / "d.jsonl"
    assert main([*argv, "--decision-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"guard proxy: --decision-log {log}: no such directory") and err.count("\n") == 1, err
    assert main([*argv, "--decision-log", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"guard proxy: --decision-log {tmp_path}: is a directory, not a file"), err
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    assert main([*argv, "--decision-log", str(link)]) == 2
    err = capsys.readouterr().err
    assert err == f"guard proxy: --decision-log {link}: is a symbolic link (the decision log follows one only to a " \
                  "pipe, a terminal or the process's stdout or stderr)\n", err
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_cli_a_decision_log_fifo_no_process_reads_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """guard proxy waited for ever, before listening, for a reader of its --decision-log FIFO."""
    fifo = tmp_path / "decisions.fifo"
    os.mkfifo(fifo)
    argv = ["proxy", "--policy", str(POLICY), "--upstream", "http://127.0.0.1:9", "--backend", "http://127.0.0.1:9",
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--decision-log", str(fifo)]  # fmt: skip
    status: list[int] = []
    started = threading.Thread(target=lambda: status.append(main(argv)), daemon=True)
    started.start()
    started.join(30)  # a bound for the old behaviour, which never returned
    if started.is_alive():  # let the old open return; the proxy it starts ends with the test process
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert status == [2]
    assert capsys.readouterr().err == f"guard proxy: --decision-log {fifo}: no reader on FIFO (start the process " \
                                      "that reads it first)\n"


def test_cli_sighup_opens_the_decision_log_again(tmp_path: Path) -> None:
    """logrotate's postrotate sends SIGHUP, which ended guard proxy; it opens the decision log's path again."""
    log = tmp_path / "decisions.jsonl"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "guard", "proxy", "--policy", str(POLICY), "--upstream", "http://127.0.0.1:9",
         "--backend", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--decision-log", str(log)], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proxy.stderr is not None
        while "guard proxy: http://" not in (line := proxy.stderr.readline()):  # the handler is set before this
            assert line, "guard proxy ended before it served"
        log.rename(tmp_path / "decisions.jsonl.1")
        proxy.send_signal(signal.SIGHUP)
        for _ in range(1000):  # the writer thread opens it again
            if log.exists() or proxy.poll() is not None:
                break
            time.sleep(0.01)
        assert proxy.poll() is None and log.exists()
    finally:
        proxy.terminate()
        proxy.wait(30)


def test_cli_stream_flush_and_hold_reach_the_response_judge(upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    argv = ["proxy", "--policy", str(POLICY), "--upstream", url, "--backend", "http://127.0.0.1:9"]
    cases = (([], DEFAULT_STREAM_FLUSH_S, DEFAULT_STREAM_HOLD_CHARS),
             (["--stream-flush", "0.05", "--stream-hold", "0"], 0.05, 0), (["--stream-flush", "0"], None, 64))
    for extra, flush, hold in cases:
        runtime = build(build_parser().parse_args([*argv, *extra]))
        limits = runtime.app.guarded.limits
        assert (limits.stream_flush_s, limits.stream_hold_chars) == (flush, hold)
        asyncio.run(runtime.aclose())


def test_cli_cache_local_ttl_reaches_the_cache(upstream: tuple[Upstream, str], redis_url: str) -> None:
    _, url = upstream
    argv = ["proxy", "--policy", str(POLICY), "--upstream", url, "--backend", "http://127.0.0.1:9",
            "--redis-url", redis_url]  # fmt: skip
    for extra, expected in (([], CacheConfig().local_ttl), (["--cache-local-ttl", "0"], 0.0)):
        runtime = build(build_parser().parse_args([*argv, *extra]))
        cache = runtime.app.guard.cache
        assert isinstance(cache, RedisCache) and cache.config.local_ttl == expected and cache.config.url == redis_url
        asyncio.run(runtime.aclose())


async def test_cli_proxy_end_to_end_with_a_real_model(
    upstream: tuple[Upstream, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, golden_checkpoint: Path
) -> None:
    """``guard proxy`` as built by the CLI, with the tiny Clef checkpoint answering on CPU (random weights: the
    verdict is arbitrary, but it is a real model's, reached through every layer)."""
    _, url = upstream
    monkeypatch.setenv("GUARD_TEST_REVIEW_TOKENS", f"alice:{TOKEN}")
    log = tmp_path / "decisions.jsonl"
    args = build_parser().parse_args(
        [
            "proxy",
            "--policy",
            str(E2E_POLICY),
            "--upstream",
            url,
            "--listen",
            "127.0.0.1:0",
            "--backend",
            f"local:{golden_checkpoint}",
            "--review-tokens-env",
            "GUARD_TEST_REVIEW_TOKENS",
            "--decision-log",
            str(log),
            "--decision-headers",
            "full",
        ]
    )
    runtime = build(args)
    assert (runtime.admin_host, runtime.admin_port) == ("127.0.0.1", 9901)  # the default admin listener
    with serve_in_thread(runtime.app, lifespan="on") as proxy, serve_in_thread(runtime.admin) as admin_url:
        async with httpx.AsyncClient(base_url=proxy, timeout=120) as client:
            response = await client.post("/v1/echo", json={"message": BENIGN})
            public = await client.get("/public/echo")
            admin = await client.get(f"{admin_url}/_guard/admin/reviews/",
                                     headers={"authorization": f"Bearer {TOKEN}"})
            health = await client.get(f"{admin_url}/_guard/health")
    assert response.headers["x-guard-policy"] == "e2e@1" and "x-guard-fail-mode" not in response.headers
    assert response.headers["x-guard-rule"] in ("default", "likely_injection")
    assert response.status_code == (200 if response.headers["x-guard-action"] == "allow" else 403)
    assert public.status_code == 200 and admin.status_code == 200 and health.json()["status"] == "ok"
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["backend"] == "clef-local" and record["fail_mode"] is None
    assert sum(record["answers"]["injection"].values()) == pytest.approx(1.0)


def test_a_client_cannot_tell_the_upstream_which_host_or_scheme_it_reached() -> None:
    """The client's X-Forwarded-Proto/-Host, Forwarded and X-Real-IP are dropped and the proxy's own set (an upstream
    that reads the first value built reset links for the client's host); ``trust_forwarded`` keeps them for a
    proxy of the operator's in front (one that terminates TLS)."""
    spoofed = [(b"host", b"good.example"), (b"x-forwarded-host", b"evil.example"), (b"x-forwarded-proto", b"https"),
               (b"forwarded", b"for=1.2.3.4;proto=https;host=evil.example"), (b"x-real-ip", b"1.2.3.4")]
    scope = {"type": "http", "scheme": "http", "client": ("10.0.0.9", 5000), "headers": spoofed}
    headers, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers(scope)
    assert headers == [(b"host", b"127.0.0.1:9"), (b"x-forwarded-for", b"10.0.0.9"),
                       (b"x-forwarded-proto", b"http"), (b"x-forwarded-host", b"good.example")]
    trusted, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9", trust_forwarded=True))._headers(scope)
    assert trusted == [*spoofed[1:], (b"host", b"127.0.0.1:9"), (b"x-forwarded-for", b"10.0.0.9")]
    bare, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers({**scope, "headers": spoofed[1:]})  # no Host
    assert not any(k in (b"x-forwarded-host", b"forwarded", b"x-real-ip") for k, _ in bare)


def test_a_client_cannot_claim_tls_a_port_or_a_prefix_through_other_forwarded_headers() -> None:
    """Rack reads ``X-Forwarded-Ssl: on``, ``X-Forwarded-Scheme``, ``Front-End-Https`` and ``X-Url-Scheme`` as
    HTTPS, Werkzeug's ProxyFix ``X-Forwarded-Port`` and ``-Prefix``, Tornado (``xheaders=True``) and Jupyter
    ``X-Scheme``; CloudFront's, IIS ARR's and other frameworks' scheme and host headers too: the client's are dropped
    like its ``X-Forwarded-Proto`` (its ``X-Forwarded-For`` is appended to); ``trust_forwarded`` keeps them."""
    claimed = [(b"x-forwarded-ssl", b"on"), (b"X-Forwarded-Scheme", b"https"), (b"x-forwarded-port", b"443"),
               (b"x-forwarded-prefix", b"/admin"), (b"x-forwarded-server", b"evil.example"),
               (b"front-end-https", b"on"), (b"x-url-scheme", b"https"), (b"X-Scheme", b"https"),
               (b"cloudfront-forwarded-proto", b"https"), (b"x-arr-ssl", b"on"), (b"forwarded-proto", b"https"),
               (b"x-host", b"evil.example"), (b"x-original-host", b"evil.example")]
    scope = {"type": "http", "scheme": "http", "client": ("10.0.0.9", 5000),
             "headers": [(b"host", b"good.example"), *claimed, (b"x-forwarded-for", b"10.0.0.1")]}
    headers, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers(scope)
    assert headers == [(b"host", b"127.0.0.1:9"), (b"x-forwarded-for", b"10.0.0.1, 10.0.0.9"),
                       (b"x-forwarded-proto", b"http"), (b"x-forwarded-host", b"good.example")]
    trusted, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9", trust_forwarded=True))._headers(scope)
    assert [(k.lower(), v) for k, v in claimed] == trusted[:len(claimed)]


def test_headers_that_rewrite_the_target_are_not_sent_upstream() -> None:
    """IIS URL Rewrite and older Symfony and Zend route on ``X-Original-URL`` / ``X-Rewrite-URL``: a POST to /other,
    which no policy judged, reached such an upstream naming /v1/admin (attack finding). They are dropped, even for a
    trusted proxy in front."""
    scope = {"type": "http", "scheme": "http", "client": ("10.0.0.9", 5000), "headers": [
        (b"host", b"good.example"), (b"X-Original-URL", b"/v1/admin"), (b"x-rewrite-url", b"/v1/admin"),
        (b"x-note", b"kept")]}
    for config in (ProxyConfig("http://127.0.0.1:9"), ProxyConfig("http://127.0.0.1:9", trust_forwarded=True)):
        headers, _ = ReverseProxy(config)._headers(scope)
        names = [k for k, _ in headers]
        assert b"x-original-url" not in names and b"x-rewrite-url" not in names and b"x-note" in names


def test_header_names_with_an_underscore_are_not_sent_upstream() -> None:
    """WSGI, CGI and PHP read ``X_Real_IP`` as ``X-Real-IP`` (and ``X_Debug`` as the ``X-Debug`` a policy judged
    absent): such names are dropped, as nginx drops them by default."""
    scope = {"type": "http", "scheme": "http", "client": ("10.0.0.9", 5000), "headers": [
        (b"host", b"api.example"), (b"X_Real_IP", b"6.6.6.6"), (b"x_forwarded_host", b"evil.example"),
        (b"X_Debug", b"1"), (b"x-debug-id", b"kept"),
    ]}  # fmt: skip
    headers, _ = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))._headers(scope)
    assert [k for k, _ in headers] == [b"x-debug-id", b"host", b"x-forwarded-for", b"x-forwarded-proto",
                                      b"x-forwarded-host"]


async def test_a_request_that_finds_every_upstream_connection_busy_gets_a_503(make_guard: GuardFactory) -> None:
    """A slow client or upstream holds a connection; one that waits longer than the queue timeout for a free one is
    answered 503 ``upstream_busy`` (it waited for good), and the upstream's health is not marked failing."""
    release = threading.Event()

    async def slow(request: Request) -> Response:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return Response("slow")

    upstream_app = Starlette(routes=[Route("/slow", slow), Route("/fast", lambda r: Response("fast"))])
    with serve_in_thread(upstream_app) as url:
        app = proxy_app(make_guard(), ProxyConfig(url, max_connections=1, queue_timeout=0.5))
        with serve_in_thread(app, proxy_headers=False) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                held = asyncio.ensure_future(client.get("/slow"))
                await asyncio.sleep(0.3)
                busy = await client.get("/fast")
                release.set()
                assert (await held).text == "slow"
                after = await client.get("/fast")
    assert busy.status_code == 503 and busy.json()["code"] == "upstream_busy" and busy.headers["retry-after"] == "1"
    assert after.status_code == 200 and app.proxy.health.calls_failed == 0


def test_upstream_headers_drop_every_hop_by_hop_header_and_what_connection_names() -> None:
    proxy = ReverseProxy(ProxyConfig("http://127.0.0.1:9"))
    scope = {"type": "http", "scheme": "https", "client": ("10.0.0.9", 5000), "headers": [
        (b"Host", b"api.example"), (b"Connection", b"X-One, keep-alive"), (b"x-one", b"1"), (b"connection", b"x-two"),
        (b"X-Two", b"2"), (b"Keep-Alive", b"timeout=5"), (b"TE", b"trailers"), (b"Content-Length", b"3"),
        (b"X-Forwarded-For", b"10.0.0.1"), (b"x-forwarded-for", b"10.0.0.2"), (b"Expect", b"100-continue"),
        (b"X-Kept", b"yes"),
    ]}  # fmt: skip
    headers, has_body = proxy._headers(scope)
    assert has_body
    assert headers == [
        (b"content-length", b"3"), (b"x-kept", b"yes"), (b"host", b"127.0.0.1:9"),
        (b"x-forwarded-for", b"10.0.0.1, 10.0.0.2, 10.0.0.9"), (b"x-forwarded-proto", b"https"),
        (b"x-forwarded-host", b"api.example"),
    ]  # fmt: skip
    # a Content-Length that Connection names is dropped: the body still goes (chunked, as the pool sends a body
    # without a length)
    named, has_body = proxy._headers({**scope, "headers": [(b"connection", b"content-length"),
                                                           (b"content-length", b"3")]})
    assert has_body and not any(k == b"content-length" for k, _ in named)
    assert proxy._headers({**scope, "headers": [(b"host", b"h")]})[1] is False
    # what the body is, as guard read it, goes on whatever Connection names
    body_meaning = [(b"connection", b"close, Content-Type, content-encoding"), (b"content-type", b"application/json"),
                    (b"content-encoding", b"gzip")]
    kept, _ = proxy._headers({**scope, "headers": body_meaning})
    assert (b"content-type", b"application/json") in kept and (b"content-encoding", b"gzip") in kept
    # Content-Length next to Transfer-Encoding: the body was read by its chunks, so it goes chunked, without the length
    both, has_body = proxy._headers({**scope, "headers": [(b"content-length", b"2"), (b"transfer-encoding", b"chunked")]})
    assert has_body and not any(k in (b"content-length", b"transfer-encoding") for k, _ in both)


async def test_a_request_with_both_framings_cannot_smuggle_a_second_request(make_guard: GuardFactory,
                                                                            upstream: tuple[Upstream, str]) -> None:
    """Content-Length: 2 and Transfer-Encoding: chunked on a path no policy judges, the chunked body holding ``{}``
    and then a second request with an attack for a judged path: the upstream must never get the first two bytes and
    a second request guard never judged. Such a request is refused (RFC 9112 section 6.1 allows it), nothing sent on."""
    server, url = upstream
    inner = json.dumps({"prompt": ATTACK}).encode()
    smuggled = (b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(inner)) + inner
    body = b"{}" + smuggled
    head = (b"POST /public/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    calls = len(server.calls)
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url)), **server_options()) as proxy:  # as guard proxy
        answer = raw_request(int(proxy.rsplit(":", 1)[1]), head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        await asyncio.sleep(0.2)  # a smuggled second request would reach the upstream right after the first
    assert answer.startswith(b"HTTP/1.1 400")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "ambiguous_length"
    assert server.calls[calls:] == []


async def test_connect_is_refused_and_never_forwarded(make_guard: GuardFactory, upstream: tuple[Upstream, str]) -> None:
    """A CONNECT asks for a tunnel: forwarded, an upstream's 2xx answer made the server drop the response body
    mid-way (h11 reads it as an open tunnel)."""
    server, url = upstream
    calls = len(server.calls)
    with serve_in_thread(proxy_app(make_guard(), ProxyConfig(url)), **server_options()) as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        for head in (b"CONNECT /public/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                     b"CONNECT /public/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"):
            answer = raw_request(port, head)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["code"] == "invalid_target" and body["field"] == "method" and "CONNECT" in body["message"]
    assert server.calls[calls:] == []

async def test_connection_cannot_remove_the_decision_id_or_the_tenant_or_client_header(make_guard: GuardFactory
                                                                                       ) -> None:
    """``Connection: x-guard-decision-id, x-tenant, x-real-ip`` from a client removed, after ``GuardMiddleware`` set
    it, the decision's id the upstream logs by, the tenant header the guard read and the client header it judged the
    client address by: all go on; another named header does not."""
    config = ProxyConfig("http://127.0.0.1:9", trust_forwarded=True)
    app = proxy_app(make_guard(), config, tenant_header="X-Tenant", client_header="X-Real-IP")
    scope = {"type": "http", "scheme": "http", "headers": [
        (b"host", b"api.example"), (b"connection", b"X-Guard-Decision-Id, x-tenant, x-real-ip, x-other"),
        (b"x-tenant", b"acme"), (b"x-real-ip", b"10.0.0.7"), (b"x-other", b"1"), (b"x-guard-decision-id", b"d-1")]}
    headers, _ = app.proxy._headers(scope)
    assert (b"x-guard-decision-id", b"d-1") in headers and (b"x-tenant", b"acme") in headers
    assert (b"x-real-ip", b"10.0.0.7") in headers
    assert not any(k == b"x-other" for k, _ in headers)
    plain, _ = ReverseProxy(config)._headers(scope)  # no tenant or client header configured
    assert (b"x-guard-decision-id", b"d-1") in plain
    assert (b"x-tenant", b"acme") not in plain and (b"x-real-ip", b"10.0.0.7") not in plain


DRY_RUN_POLICY = r"""
policies:
  - id: dry-run-only
    version: 1
    match: {http: {methods: [POST], paths: ["/v1/**"]}}
    state: {text: body_text}
    rules:
      - id: live-writes
        when: "!('x-dry-run' in subject.headers) || subject.headers['x-dry-run'] != 'true'"
        action: block
"""
#: The same rule reading the header through a macro: it may read any header.
ANY_HEADER_POLICY = DRY_RUN_POLICY.replace(
    "!('x-dry-run' in subject.headers) || subject.headers['x-dry-run'] != 'true'",
    "!subject.headers.exists(h, h == 'x-dry-run')")


#: A policy that reads no header, for the guard behind one that judges X-Dry-Run.
NO_HEADER_POLICY = DRY_RUN_POLICY.replace("dry-run-only", "audit").replace(
    "!('x-dry-run' in subject.headers) || subject.headers['x-dry-run'] != 'true'", "false")


@pytest.mark.parametrize(("policy", "stacked"), [(DRY_RUN_POLICY, False), (ANY_HEADER_POLICY, False),
                                                 (DRY_RUN_POLICY, True)])
async def test_connection_cannot_remove_a_header_a_policy_read(
    upstream: tuple[Upstream, str], policy: str, stacked: bool
) -> None:
    """A policy blocks writes unless ``X-Dry-Run: true``: a client that sent it with ``Connection: x-dry-run`` was
    allowed, and the upstream, without the header, ran the write for real. A header a policy reads goes on whatever
    ``Connection`` names; another named header does not, unless a rule may read any header (then none is removed).
    ``stacked``: the policy is an outer ``GuardMiddleware``'s, in front of a proxy whose own guard reads no header
    (the inner guard replaced the outer one's names, and the header was removed again)."""
    _, url = upstream
    guard = Guard(load_text(policy), backends=ScriptedBackend(lambda request: {}))
    inner = Guard(load_text(NO_HEADER_POLICY if stacked else policy), backends=ScriptedBackend(lambda request: {}))
    app = proxy_app(inner, ProxyConfig(url))
    with serve_in_thread(GuardMiddleware(app, guard=guard) if stacked else app, proxy_headers=False) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            live = await client.post("/v1/echo", content=b"write")
            dry = await client.post("/v1/echo", content=b"write", headers={
                "x-dry-run": "true", "x-other": "1", "connection": "x-dry-run, x-other"})
    await guard.aclose()
    await inner.aclose()
    assert live.status_code == 403 and dry.status_code == 200
    sent = dry.json()["headers"]
    assert sent["x-dry-run"] == "true"
    assert ("x-other" in sent) is (policy == ANY_HEADER_POLICY)


def test_response_headers_drop_hop_by_hop_ones_and_keep_the_rest_in_order() -> None:
    kept = [(b"content-type", b"text/plain"), (b"Set-Cookie", b"a=1"), (b"set-cookie", b"b=2")]
    dropped = [(b"Connection", b"x-hop"), (b"X-Hop", b"1"), (b"transfer-encoding", b"chunked"), (b"Upgrade", b"h2c"),
               (b"Proxy-Authenticate", b"Basic"), (b"trailer", b"x-t")]
    assert _forward_headers([*dropped[:3], kept[0], *dropped[3:], *kept[1:]]) == kept


async def test_the_decision_span_continues_the_clients_traceparent_only_when_trusted(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    _, url = upstream
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    body = json.dumps({"message": BENIGN}).encode()
    seen: dict[bool, list[tuple[str, str | None, str]]] = {}
    for trusted in (False, True):
        guard = make_guard(telemetry=Telemetry(tracer_provider=provider))
        with serve_in_thread(proxy_app(guard, ProxyConfig(url, trust_traceparent=trusted))) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
                for header in (traceparent, "00-not-a-trace-01"):
                    response = await client.post("/v1/echo", content=body,
                                                 headers={"content-type": "application/json", "traceparent": header})
                    assert response.status_code == 200
                    assert response.json()["headers"]["traceparent"] == header  # forwarded as it came, either way
        seen[trusted] = [
            (format(s.context.trace_id, "032x"), s.parent and format(s.parent.span_id, "016x"), s.name)
            for s in exporter.get_finished_spans()
        ]
        exporter.clear()
    # Trusted: the first decision is a child of the client's span; a malformed header starts a trace of its own.
    (joined, own) = seen[True]
    assert joined[:2] == (trace_id, parent_id)
    assert own[0] != trace_id and own[1] is None
    # Not trusted (the default): every decision starts its own trace.
    assert all(t != trace_id and parent is None for t, parent, _ in seen[False])
    provider.shutdown()


def test_repeated_trace_headers_and_a_bad_tracestate(caplog: pytest.LogCaptureFixture) -> None:
    """W3C Trace Context: several ``traceparent`` headers are invalid (the last one won), several ``tracestate`` ones
    are joined with commas (the last one won); OpenTelemetry's warning quoting a bad ``tracestate`` was logged on every
    request (attack finding), and is still logged outside a client's headers."""
    parent = b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01"
    other = b"00-" + b"c" * 32 + b"-" + b"b" * 16 + b"-01"

    def read(*headers: tuple[bytes, bytes]) -> trace.SpanContext:
        return trace.get_current_span(_client_trace_context({"headers": list(headers)})).get_span_context()

    assert read((b"traceparent", parent)).trace_id == int("a" * 32, 16)
    assert not read((b"traceparent", parent), (b"traceparent", other)).is_valid
    joined = read((b"traceparent", parent), (b"tracestate", b"x=1"), (b"tracestate", b"y=2"))
    assert dict(joined.trace_state) == {"x": "1", "y": "2"}
    with caplog.at_level(logging.DEBUG):
        bad = read((b"traceparent", parent), (b"tracestate", b"k=\xff\xfe-client-text"))
        assert bad.is_valid and not bad.trace_state and "client-text" not in caplog.text
        trace.TraceState.from_header(["k=\xff-own-text"])
    assert "own-text" in caplog.text


def test_cli_a_review_store_it_cannot_read_is_logged_at_start_and_degrades_health(
    upstream: tuple[Upstream, str], redis_url: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong ``--review-redis-url`` showed nowhere until the first escalation got a 503."""
    _, url = upstream
    monkeypatch.setenv("GUARD_STORE_KEY", "k" * 32)
    monkeypatch.setenv("GUARD_REVIEW_TOKENS", f"alice:{TOKEN}")
    argv = ["proxy", "--policy", str(POLICY), "--upstream", url, "--backend", "http://127.0.0.1:9",
            "--review-redis-url", f"redis://127.0.0.1:{_free_port()}/0", "--review-tokens-env", "GUARD_REVIEW_TOKENS",
            "--canary-interval", "0"]  # fmt: skip
    runtime = build(build_parser().parse_args(argv))

    async def start_and_report() -> dict[str, Any]:
        await runtime.app.on_startup()
        try:
            return runtime.admin.health.report()
        finally:
            await runtime.aclose()

    with caplog.at_level("ERROR", logger="guard.proxy"):
        report = asyncio.run(start_and_report())
    assert any("review store cannot be read" in r.getMessage() for r in caplog.records)
    assert report["checks"]["review_store"] == "last_call_failed"


LEAVING_POLICY = r"""
policies:
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: leak, when: 'state.text.contains("SECRET-PLAN")', action: block}
"""


class Endless:
    """An upstream whose ``/out/sse`` (watched) and ``/public/sse`` stream SSE events for ever (``?leak_at=N``: the
    N-th is ``SECRET-PLAN``), counting those made and the streams that ended (cancelled, once the proxy closed the
    connection)."""

    def __init__(self) -> None:
        self.made = 0
        self.ended = 0
        self.app = Starlette(routes=[Route("/out/sse", self.sse), Route("/public/sse", self.sse)])

    async def sse(self, request: Request) -> Response:
        leak_at = int(request.query_params.get("leak_at", 0))

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in itertools.count(1):
                    self.made += 1
                    token = "SECRET-PLAN" if i == leak_at else f"token {i} "
                    yield f'data: {{"choices": [{{"delta": {{"content": "{token}"}}}}]}}\n\n'.encode()
                    await asyncio.sleep(0.005)
            finally:
                self.ended += 1

        return StreamingResponse(events(), media_type="text/event-stream")


@contextmanager
def _stoppable(app: Any) -> Iterator[tuple[str, Callable[[], float]]]:
    """``app`` under uvicorn in a thread: its URL and a function that asks it to stop and returns the seconds it took
    (at most 10: then it is forced to)."""
    server = _ProxyServer(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)

    def stop() -> float:
        started = time.monotonic()
        server.should_exit = True
        thread.join(10)
        took = time.monotonic() - started
        server.force_exit = True  # a server still waiting for a relay: the test failed; do not leave it running
        thread.join(10)
        return took

    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", stop
    finally:
        stop()


class _ProxyServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread cannot own signal handlers
        pass


def _read_some_and_leave(url: str) -> int:
    """Read a few events of an endless stream, then close the connection; the status code."""
    with httpx.Client(timeout=10) as client, client.stream("GET", url) as response:
        got = 0
        for piece in response.iter_raw():
            got += len(piece)
            if got > 2000:
                break
        return response.status_code


def _until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_mid_stream_stops_the_relay_and_frees_its_upstream_connection() -> None:
    """uvicorn's ``send`` returns quietly once the client has gone: the proxy watches ``receive`` for the disconnect
    and stops reading (and judging) the upstream, which sees its connection closed. With one upstream connection, the
    next request gets it; the client's leaving is counted; the server stops without waiting for a relay."""
    upstream = Endless()
    guard = Guard(load_text(LEAVING_POLICY), backends=ScriptedBackend(lambda request: {}))
    with serve_in_thread(upstream.app) as url:
        app = proxy_app(guard, ProxyConfig(url, max_connections=1, queue_timeout=2))
        with _stoppable(app) as (proxy, stop):
            statuses = [_read_some_and_leave(f"{proxy}{path}") for path in ("/out/sse", "/public/sse")]
            ended = _until(lambda: upstream.ended == 2)
            made = upstream.made
            time.sleep(0.3)
            still = upstream.made - made
            statuses.append(_read_some_and_leave(f"{proxy}/out/sse"))
            stopped_in = stop()
    guard.close()
    assert ended and still == 0, (upstream.ended, still)  # the upstream streams were cancelled, not read on
    assert statuses == [200, 200, 200]  # the one upstream connection was free again each time
    metrics = app.guarded.metrics.render().decode()
    assert "guard_http_client_disconnects_total 3.0" in metrics, metrics
    assert stopped_in < 5, stopped_in


def test_a_stream_a_response_policy_blocks_mid_way_stops_the_relay_and_is_no_disconnect() -> None:
    """The client has its whole answer (the events before the leak, then ``guard_blocked``): the proxy stops reading
    the endless upstream, and the end is the policy's, not a client that left."""
    upstream = Endless()
    guard = Guard(load_text(LEAVING_POLICY), backends=ScriptedBackend(lambda request: {}))
    limits = BodyLimits(stream_window_bytes=1024, stream_flush_s=None)  # judged in the upstream's sends
    with serve_in_thread(upstream.app) as url:
        app = proxy_app(guard, ProxyConfig(url), limits=limits)
        with _stoppable(app) as (proxy, stop), httpx.Client(base_url=proxy, timeout=10) as client:
            blocked = client.get("/out/sse", params={"leak_at": 100})
            ended = _until(lambda: upstream.ended == 1)
            stopped_in = stop()
    guard.close()
    assert blocked.status_code == 200 and "event: guard_blocked" in blocked.text and "SECRET" not in blocked.text
    assert ended and upstream.made < 1000
    assert "guard_http_client_disconnects_total" not in app.guarded.metrics.render().decode()
    assert stopped_in < 5, stopped_in


def test_cli_warns_when_an_escalating_policy_has_no_reviewers(
    upstream: tuple[Upstream, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway image's default command served policies/api_abuse_compact.yaml, which escalates, without reviewer
    tokens: requests were held that nobody could answer, and nothing said so. Now a warning names the policy."""
    _, url = upstream
    compact = Path(__file__).parents[2] / "policies" / "api_abuse_compact.yaml"
    argv = ["proxy", "--policy", str(compact), "--upstream", url, "--backend", "http://127.0.0.1:9"]
    monkeypatch.setenv("GUARD_TEST_REVIEW_TOKENS", f"alice:{TOKEN}")
    for extra, warned in (([], True), (["--review-tokens-env", "GUARD_TEST_REVIEW_TOKENS"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="guard.proxy"):
            runtime = build(build_parser().parse_args([*argv, *extra]))
        asyncio.run(runtime.aclose())
        messages = [r.getMessage() for r in caplog.records if r.name == "guard.proxy"]
        assert any("'api-abuse-compact' escalates" in m and "--review-tokens-env" in m for m in messages) is warned


async def test_a_released_request_reaches_the_upstream_with_its_decision_id_and_no_review_headers(
    make_guard: GuardFactory, upstream: tuple[Upstream, str]
) -> None:
    _, url = upstream
    app = proxy_app(make_guard(), ProxyConfig(url))
    with _served(app, reviewers={"alice": TOKEN}) as (proxy, admin):
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
            held = [(await client.post("/v1/echo", json={"message": "maybe show me the config"})).json()
                    for _ in range(2)]
            for item in held:
                await client.post(f"{admin}/_guard/admin/reviews/{item['review_id']}/approve",
                                  headers={"authorization": f"Bearer {TOKEN}"})
            by_url = await client.post(held[0]["release_url"], headers={
                "x-guard-release-token": held[0]["release_token"], "x-guard-decision-id": "forged"})
            by_resend = await client.post("/v1/echo", json={"message": "maybe show me the config"}, headers={
                "x-guard-release-token": held[1]["release_token"], "x-guard-review-id": held[1]["review_id"],
                "x-guard-decision-id": "forged"})
    for item, released in zip(held, (by_url, by_resend), strict=True):
        seen = released.json()["headers"]
        assert released.status_code == 200 and seen["x-guard-decision-id"] == item["decision_id"]
        assert "x-guard-release-token" not in seen and "x-guard-review-id" not in seen
