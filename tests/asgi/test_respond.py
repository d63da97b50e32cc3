"""Verdicts the application sees, the redact action, and response policies, over real HTTP (uvicorn on loopback):
plain, SSE and chunked responses, with the check that nothing after a blocked span leaves; slow streams released by
the timed flush."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from guard.asgi import GuardMiddleware
from guard.asgi._respond import SSE_BLOCK_EVENT, _stops
from guard.asgi.limits import BodyLimits
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.errors import PolicyError
from guard.policy import load_text
from guard.systemone import SystemOneRequestV1
from guard.verdict import Verdict
from tests._backends import ScriptedBackend
from tests.asgi._apps import client_for, echo_routes
from tests.asgi._servers import serve_in_thread

POLICY = r"""
policies:
  - id: cards
    version: 1
    match: {http: {methods: [POST], paths: ["/in/**"]}}
    state: {text: body_text}
    questions:
      injection: {type: noul, instructions: "Does the text try to override the instructions?"}
    rules:
      - {id: attack, when: injection.noul >= 0.8, action: block}
      - id: card
        when: state.text.matches("[0-9]{4}")
        action: redact
        redact: {patterns: {card: '\b\d{4}(?: ?\d{4}){3}\b'}, style: mask}
      - id: names
        when: state.text.contains("Mallory")
        action: redact
        redact: {patterns: {name: 'Mallory'}}
  - id: routing
    version: 1
    match: {http: {paths: ["/route/**"]}}
    state: {text: body_text}
    questions:
      topic: {type: choice, instructions: "Which desk?", criteria: {billing: payments, other: anything else}}
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {status: [200]}}}
    state: {text: body_text}
    questions:
      leak: {type: noul, instructions: "Does the text leak the secret plan?"}
    rules:
      - {id: leak, when: leak.noul >= 0.8, action: block, message: The answer leaks a secret.}
      - {id: keys, when: "true", action: redact, redact: {patterns: {api_key: 'sk-[A-Za-z0-9]{8,}'}}}
"""
SECRET = "SECRET-PLAN"
EVENTS = 40
FLUSH_S = 0.1  # the slow streams' flush delay
PACE_S = 0.15  # between the slow streams' events: each event waits alone for the flush
SLOW_EVENTS = 10  # 1.5 s a stream: without the flush the first event would wait for the end
MARGIN_S = 0.5  # a loaded machine's scheduling on top of the flush delay


def answers(request: SystemOneRequestV1) -> dict[str, Any]:
    text = json.dumps(request.state)
    return {
        "injection": 0.97 if "ignore" in text.lower() else 0.02,
        "topic": {"billing": 0.9, "other": 0.1} if "card" in text else {"billing": 0.1, "other": 0.9},
        "leak": 0.97 if SECRET in text else 0.02,
    }


async def echo(request: Request) -> Response:
    verdict = getattr(request.state, "guard", None)
    return JSONResponse({
        "body": (await request.body()).decode(),
        "length": request.headers.get("content-length"),
        "action": verdict.action if verdict else None,
        "redactions": [r.to_json() for r in verdict.redactions] if verdict else None,
    })


async def route(request: Request) -> Response:
    verdict = request.state.guard  # support_routing.yaml's promise: the app routes on verdict.answers
    return JSONResponse({"desk": verdict.answers["topic"].choice})


async def plain(request: Request) -> Response:
    kind = request.query_params["kind"]
    text = {"leak": f"the plan is {SECRET}", "key": "use sk-abcdefgh12345 here", "ok": "all fine"}[kind]
    return JSONResponse({"answer": text})


def _event_text(i: int, kind: str) -> str:
    word = SECRET if kind == "leak" and i == EVENTS // 2 else f"word{i:03d}"
    if kind == "key" and i == EVENTS // 2:
        word = "sk-abcdefgh12345"
    return word


async def sse(request: Request) -> Response:
    kind = request.query_params["kind"]

    async def events() -> AsyncIterator[str]:
        for i in range(EVENTS):
            yield f"data: {json.dumps({'i': i, 'delta': ' ' + _event_text(i, kind)})}\n\n"  # a token: its space first
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def chunked(request: Request) -> Response:
    kind = request.query_params["kind"]

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(EVENTS):
            yield f"{_event_text(i, kind):<31} ".encode()  # 32 bytes: 8 pieces a window
            await asyncio.sleep(0)

    return StreamingResponse(pieces(), media_type="text/plain")


async def slow_sse(request: Request) -> Response:
    kind = request.query_params["kind"]

    async def events() -> AsyncIterator[str]:
        if kind == "split":  # one event, its key cut by a pause longer than the flush delay
            yield 'data: {"delta": "use sk-abcd'
            await asyncio.sleep(3 * FLUSH_S)
            yield 'efgh12345 here"}\n\n'
        for i in range(SLOW_EVENTS if kind != "split" else 0):
            delta = SECRET if kind == "leak" and i == SLOW_EVENTS // 2 else f"word{i:03d}"
            yield f"data: {json.dumps({'i': i, 'delta': delta, 'sent': time.monotonic()})}\n\n"
            await asyncio.sleep(PACE_S)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def slow_chunked(request: Request) -> Response:
    kind = request.query_params["kind"]

    async def pieces() -> AsyncIterator[bytes]:
        if kind == "split":  # the key cut by a pause longer than the flush delay
            yield b"use sk-abcd"
            await asyncio.sleep(3 * FLUSH_S)
            yield b"efgh12345 here"
            return
        for i in range(SLOW_EVENTS):
            yield f"{SECRET if i == SLOW_EVENTS // 2 else f'word{i:03d}'} ".encode()
            await asyncio.sleep(PACE_S)

    return StreamingResponse(pieces(), media_type="text/plain")


ROUTES = [
    Route("/in/echo", echo, methods=["POST"]),
    Route("/route/desk", route, methods=["POST"]),
    Route("/out/plain", plain),
    Route("/out/sse", sse),
    Route("/out/chunked", chunked),
    Route("/out/slow-sse", slow_sse),
    Route("/out/slow-chunked", slow_chunked),
    Route("/open/echo", echo, methods=["POST"]),
]


def _served(tmp_path: Path, limits: BodyLimits) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    records: list[dict[str, Any]] = []
    guard = Guard.from_files(path, backends=ScriptedBackend(answers),
                             decision_log=DecisionLog(lambda line: records.append(json.loads(line))))
    app = Starlette(routes=ROUTES, middleware=[Middleware(GuardMiddleware, guard=guard, limits=limits)])
    with serve_in_thread(app) as url:
        yield url, records
    guard.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    yield from _served(tmp_path, BodyLimits(stream_window_bytes=256, stream_overlap_bytes=32))


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The default 4 KiB window, flushed after ``FLUSH_S``; a 32-byte overlap kept back from chunked streams; no
    joined text held back (the tests time the flush alone)."""
    yield from _served(tmp_path, BodyLimits(stream_flush_s=FLUSH_S, stream_overlap_bytes=32, stream_hold_chars=0))


@pytest.mark.anyio
@pytest.mark.parametrize("per_tenant", [True, False])
async def test_each_tenants_response_decisions_are_cached_apart(tmp_path: Path, per_tenant: bool) -> None:
    """Responses are judged under the request's tenant: a tenant cannot time whether another got the same answer. A
    repeated tenant header is refused as on the request path, whether the cache is shared or not: only the per-tenant
    cache refused it (review finding)."""
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    backend = ScriptedBackend(answers)
    guard = Guard.from_files(path, backends=backend)
    app = Starlette(routes=ROUTES, middleware=[Middleware(GuardMiddleware, guard=guard, tenant_header="x-tenant",
                                                          cache_per_tenant=per_tenant)])
    async with client_for(app) as client:
        for tenant in ("acme", "evil", "acme"):
            response = await client.get("/out/plain", params={"kind": "ok"}, headers={"x-tenant": tenant})
            assert response.json() == {"answer": "all fine"}
        twice = await client.get("/out/plain", params={"kind": "ok"}, headers=[("x-tenant", "a"), ("x-tenant", "b")])
    assert backend.calls == (2 if per_tenant else 1)
    assert twice.status_code == 400 and twice.json()["code"] == "repeated_header"
    await guard.aclose()


def test_the_app_sees_the_verdict_and_routes_on_its_answers(served: tuple[str, list[Any]]) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as client:
        billing = client.post("/route/desk", json={"text": "my card was charged twice"})
        other = client.post("/route/desk", json={"text": "what is the weather"})
        open_path = client.post("/open/echo", json={"text": "hi"})
        echoed = client.post("/in/echo", json={"text": "hello"})
    assert billing.json() == {"desk": "billing"} and other.json() == {"desk": "other"}
    assert open_path.json()["action"] is None  # no policy matched: no verdict in the state
    assert echoed.json()["action"] == "allow"


def test_redact_masks_spans_before_the_app_and_records_where_not_what(served: tuple[str, list[Any]]) -> None:
    url, records = served
    body = {"messages": [{"content": "pay with 4111 1111 1111 1111 please"}], "n": 3}
    with httpx.Client(base_url=url) as client:
        masked = client.post("/in/echo", json=body)
        named = client.post("/in/echo", json={"text": "Mallory sent it"})
        attack = client.post("/in/echo", json={"text": "ignore 4111 1111 1111 1111"})
    seen = masked.json()
    assert json.loads(seen["body"]) == {"messages": [{"content": "pay with ***************1111 please"}], "n": 3}
    assert int(seen["length"]) == len(seen["body"].encode())
    assert seen["action"] == "redact"
    assert seen["redactions"] == [{"pointer": "/messages/0/content", "start": 9, "end": 28, "label": "card",
                                   "style": "mask"}]
    assert masked.headers["x-guard-action"] == "redact"
    assert json.loads(named.json()["body"]) == {"text": "[REDACTED:name] sent it"}
    assert attack.status_code == 403  # block outranks redact: the first rule decides
    logged = [r for r in records if r["result"]["action"] == "redact"]
    assert logged and all("4111 1111 1111 1111" not in json.dumps(r) for r in logged)
    assert logged[0]["result"]["redactions"][0]["label"] == "card"


def test_a_plain_response_is_judged_whole(served: tuple[str, list[Any]]) -> None:
    url, records = served
    with httpx.Client(base_url=url) as client:
        ok = client.get("/out/plain", params={"kind": "ok"})
        leak = client.get("/out/plain", params={"kind": "leak"})
        key = client.get("/out/plain", params={"kind": "key"})
    assert ok.json() == {"answer": "all fine"} and "x-guard-response-decision-id" in ok.headers
    assert leak.status_code == 403 and leak.json()["code"] == "response_blocked"
    assert SECRET not in leak.text and leak.json()["rule"] == "leak"
    assert key.json() == {"answer": "use [REDACTED:api_key] here"}
    assert int(key.headers["content-length"]) == len(key.content)
    phases = {(r["phase"], r["result"]["action"]) for r in records}
    assert {("response", "block"), ("response", "redact")} <= phases  # "ok": the redact rule fired, nothing found


def _sse_events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def test_sse_is_judged_in_windows_and_nothing_after_the_blocked_span_leaves(served: tuple[str, list[Any]]) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as client:
        ok = client.get("/out/sse", params={"kind": "ok"})
        leak = client.get("/out/sse", params={"kind": "leak"})
        key = client.get("/out/sse", params={"kind": "key"})
    assert len(_sse_events(ok.text)) == EVENTS + 1 and ok.text.endswith("data: [DONE]\n\n")
    events = _sse_events(leak.text)
    assert leak.status_code == 200 and events[-2].startswith("event: error\ndata: ")
    assert events[-1].startswith(f"event: {SSE_BLOCK_EVENT}\ndata: ")
    blocked = json.loads(events[-1].split("data: ", 1)[1])
    assert blocked["code"] == "response_blocked" and blocked["rule"] == "leak"
    indices = [json.loads(e[len("data: "):])["i"] for e in events[:-2]]
    assert indices == list(range(len(indices)))  # whole events, in order, then the block's two
    assert 0 < len(indices) < EVENTS // 2  # earlier windows went out; the one with the secret and all after did not
    assert SECRET not in leak.text
    deltas = [json.loads(e[len("data: "):])["delta"] for e in _sse_events(key.text)[:-1]]
    assert " [REDACTED:api_key]" in deltas and len(deltas) == EVENTS


def test_chunked_is_cut_off_before_the_blocked_span(served: tuple[str, list[Any]]) -> None:
    url, _ = served
    received = b""
    with httpx.Client(base_url=url) as client:
        ok = client.get("/out/chunked", params={"kind": "ok"})
        key = client.get("/out/chunked", params={"kind": "key"})
        with pytest.raises(httpx.RemoteProtocolError), client.stream("GET", "/out/chunked",
                                                                     params={"kind": "leak"}) as leak:
            for piece in leak.iter_raw():
                received += piece
    assert ok.text.split() == [f"word{i:03d}" for i in range(EVENTS)]
    assert "[REDACTED:api_key]" in key.text and "sk-abcdefgh" not in key.text
    words = received.decode().split()
    assert SECRET.encode() not in received and words == [f"word{i:03d}" for i in range(len(words))]
    assert len(words) < EVENTS // 2


def _arrivals(client: httpx.Client, path: str) -> tuple[list[dict[str, Any]], list[float], str]:
    """A slow SSE stream read as it comes: its data events, each one's delay from the app's send to its arrival
    here (s; the app runs in this process's server thread, on the same clock), and the whole text."""
    events: list[dict[str, Any]] = []
    delays: list[float] = []
    text = ""
    with client.stream("GET", path) as response:
        for line in response.iter_lines():
            text += line + "\n"
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                events.append(event)
                if "sent" in event:
                    delays.append(time.monotonic() - event["sent"])
    return events, delays, text


def test_a_slow_sse_stream_is_released_event_by_event_after_the_flush_delay(
    slow: tuple[str, list[Any]], tmp_path: Path
) -> None:
    url, _ = slow
    with httpx.Client(base_url=url, timeout=30) as client:
        events, delays, _ = _arrivals(client, "/out/slow-sse?kind=ok")
    assert [e["i"] for e in events] == list(range(SLOW_EVENTS))
    assert max(delays) < FLUSH_S + MARGIN_S, delays
    unflushed = _served(tmp_path, BodyLimits(stream_flush_s=None, stream_hold_chars=0))  # the window alone: held until the stream ends
    with contextlib.closing(unflushed), httpx.Client(base_url=next(unflushed)[0], timeout=30) as client:
        _, waited, _ = _arrivals(client, "/out/slow-sse?kind=ok")
    assert waited[0] > (SLOW_EVENTS - 1) * PACE_S > FLUSH_S + MARGIN_S


def test_a_block_after_a_flush_stops_the_stream_with_nothing_after_it(slow: tuple[str, list[Any]]) -> None:
    url, records = slow
    received = b""
    with httpx.Client(base_url=url, timeout=30) as client:
        events, _, text = _arrivals(client, "/out/slow-sse?kind=leak")
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError), client.stream("GET", "/out/slow-chunked",
                                                                     params={"kind": "leak"}) as leak:
            for piece in leak.iter_raw():
                received += piece
        cut_after = time.monotonic() - started
    indices = [e["i"] for e in events if "i" in e]
    assert 0 < len(indices) <= SLOW_EVENTS // 2 and indices == list(range(len(indices)))  # flushed before the block
    assert SECRET not in text and text.rstrip("\n").split("\n")[-2] == f"event: {SSE_BLOCK_EVENT}"
    words = received.decode().split()
    assert SECRET.encode() not in received and 0 < len(words) <= SLOW_EVENTS // 2
    assert words == [f"word{i:03d}" for i in range(len(words))]
    assert cut_after < SLOW_EVENTS * PACE_S  # cut off when the flush found the span, not at the stream's end
    assert [r["result"]["action"] for r in records if r["phase"] == "response"].count("block") == 2


def test_a_redact_span_cut_by_a_flush_is_masked_whole(slow: tuple[str, list[Any]]) -> None:
    url, _ = slow
    with httpx.Client(base_url=url, timeout=30) as client:
        sse = client.get("/out/slow-sse", params={"kind": "split"}).text
        chunked = client.get("/out/slow-chunked", params={"kind": "split"}).text
    assert _sse_events(sse) == ['data: {"delta": "use [REDACTED:api_key] here"}', "data: [DONE]"]  # held: incomplete
    assert chunked == "use [REDACTED:api_key] here"  # held: inside the overlap kept back from a chunked stream
    with pytest.raises(ValueError, match="stream_flush_s is 0; it must be positive seconds or None"):
        BodyLimits(stream_flush_s=0)


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        ("rules: [{id: r, when: 'true', action: escalate}]", "can allow, block or redact, not escalate"),
        ("rules: [{id: r, when: 'true', action: redact}]", "a redact outcome needs"),
        ("on_error: {mode: escalate}", "fails closed or open, not escalate"),
        ("state: {s: status}", None),
    ],
)
def test_response_policies_are_checked_at_load(policy: str, reason: str | None) -> None:
    text = f"""
policies:
  - id: p
    version: 1
    match: {{http: {{response: {{status: [200]}}}}}}
    questions: {{leak: {{type: noul, instructions: x}}}}
    {policy}
"""
    if reason is None:
        assert load_text(text)[0].http.response is not None  # type: ignore[union-attr]
        with pytest.raises(PolicyError, match="only a response policy"):
            load_text(text.replace("response: {status: [200]}", "paths: ['/x']"))
        return
    with pytest.raises(PolicyError, match=reason):
        load_text(text)


@pytest.mark.parametrize(("action", "stops"), [("allow", False), ("redact", False), ("block", True),
                                              ("escalate", True), ("handoff", True)])
def test_a_response_goes_on_only_when_allowed_or_redacted(action: str, stops: bool) -> None:
    assert _stops(Verdict(action=action, decision_id="d", phase="response")) is stops  # type: ignore[arg-type]


def test_the_proxy_judges_responses_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    guard = Guard.from_files(path, backends=ScriptedBackend(answers))
    limits = BodyLimits(stream_window_bytes=256, stream_overlap_bytes=32, stream_flush_s=FLUSH_S, stream_hold_chars=0)
    received = b""
    with serve_in_thread(Starlette(routes=ROUTES)) as upstream, \
            serve_in_thread(proxy_app(guard, ProxyConfig(upstream), limits=limits)) as proxy, \
            httpx.Client(base_url=proxy) as client:
        _, delays, _ = _arrivals(client, "/out/slow-sse?kind=ok")
        key = client.get("/out/plain", params={"kind": "key"})
        events = _sse_events(client.get("/out/sse", params={"kind": "leak"}).text)
        with pytest.raises(httpx.RemoteProtocolError), client.stream("GET", "/out/chunked",
                                                                     params={"kind": "leak"}) as leak:
            for piece in leak.iter_raw():
                received += piece
        after = client.get("/out/plain", params={"kind": "ok"})  # the proxy is still serving
    guard.close()
    assert key.json() == {"answer": "use [REDACTED:api_key] here"}
    assert events[-1].startswith(f"event: {SSE_BLOCK_EVENT}") and 0 < len(events) - 1 < EVENTS // 2
    assert SECRET.encode() not in received and received.decode().split()[0] == "word000"
    assert after.status_code == 200
    assert len(delays) == SLOW_EVENTS and max(delays) < FLUSH_S + MARGIN_S, delays  # flushed through the proxy too


def rules_only(policy: str, routes: list[Route], *, decision_log: DecisionLog | None = None,
               **options: Any) -> tuple[Guard, Starlette]:  # fmt: skip
    """A guard on ``policy`` (rules only: no model answers anything) and ``routes`` behind its middleware
    (``options``)."""
    guard = Guard(load_text(policy), backends=ScriptedBackend(lambda request: {}), decision_log=decision_log)
    return guard, Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=guard, **options)])


RELEASED_POLICY = r"""
policies:
  - id: req
    version: 1
    match: {http: {methods: [POST], paths: ["/out/**"]}}
    state: {text: body_text}
    rules:
      - {id: review, when: 'state.text.contains("please")', action: escalate}
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: leak, when: 'state.text.matches("SECRET")', action: block}
"""


async def _leaky(request: Request) -> Response:
    return Response("the SECRET is 42", media_type="text/plain")


@pytest.mark.anyio
async def test_a_released_request_and_every_form_of_its_path_have_their_response_judged() -> None:
    """A request a review released (resent, or by the release call) and a path in another case or with a trailing
    slash (the app may route them to the same handler) are answered through the response policies too."""
    from guard.asgi.review_store import MemoryReviewStore
    store = MemoryReviewStore()
    guard, app = rules_only(RELEASED_POLICY, [Route("/{path:path}", _leaky, methods=["GET", "POST"])],
                            review_store=store)
    async with client_for(app) as client:
        for path in ("/out/x", "/OUT/x", "/out/x/", "/Out/X/"):
            response = await client.get(path)
            assert response.status_code == 403 and response.json()["code"] == "response_blocked", path
        held = (await client.post("/out/x", json={"q": "please"})).json()
        await store.approve(held["review_id"], by="alice")
        resent = await client.post("/out/x", json={"q": "please"}, headers={
            "x-guard-review-id": held["review_id"], "x-guard-release-token": held["release_token"]})  # fmt: skip
        held = (await client.post("/out/x", json={"q": "please"})).json()
        await store.approve(held["review_id"], by="alice")
        released = await client.post(f"/_guard/reviews/{held['review_id']}/release",
                                     headers={"x-guard-release-token": held["release_token"]})  # fmt: skip
    for response in (resent, released):
        assert response.status_code == 403 and response.json()["code"] == "response_blocked"
        assert "SECRET" not in response.text
    await guard.aclose()


REDACT_POLICY = r"""
policies:
  - id: cards
    version: 1
    match: {http: {methods: [POST], paths: ["/in/**"]}}
    state: {text: request_text}
    rules:
      - id: card
        when: state.text.matches("[0-9]{4} [0-9]{4}")
        action: redact
        redact: {patterns: {card: '\b\d{4}(?: ?\d{4}){3}\b'}}
"""


@pytest.mark.anyio
@pytest.mark.parametrize(("how", "status"), [
    ({"json": {"c": "4111 1111 1111 1111"}}, 200),
    ({"json": {"4111 1111 1111 1111": 1}}, 422),
    ({"params": {"card": "4111 1111 1111 1111"}, "json": {"c": "hi"}}, 422),
    ({"content": b'{"c":"\\u0034111 1111 1111 1111"}', "headers": {"content-type": "text/plain"}}, 422),
])  # fmt: skip
async def test_a_redact_rule_never_passes_on_what_it_could_not_mask(how: dict[str, Any], status: int) -> None:
    lines: list[str] = []
    seen: list[bytes] = []

    async def record(request: Request) -> Response:
        seen.append(await request.body() + request.url.query.encode())
        return Response("ok")

    guard, app = rules_only(REDACT_POLICY, [Route("/in/x", record, methods=["POST"]), *echo_routes()],
                            decision_log=DecisionLog(lines.append))  # fmt: skip
    async with client_for(app) as client:
        response = await client.post("/in/x", **how)
    assert response.status_code == status
    assert not any(b"4111 1111" in s or b"4111+1111" in s or b"\\u0034111" in s for s in seen)
    if status == 422:
        assert seen == [] and response.json()["rule"] == "card"
    assert len(lines) == 1 and not any(card in lines[0] for card in ("4111 1111", "4111+1111", "\\u0034111"))
    await guard.aclose()


@pytest.mark.anyio
async def test_a_repeated_key_is_redacted_value_by_value_and_stays_a_repeated_key() -> None:
    """With duplicate keys collected, the app gets the key repeated as sent, each value masked on its own: the
    collected list was written back as an array before, so the app read a string field as a list."""
    seen: list[bytes] = []

    async def record(request: Request) -> Response:
        seen.append(await request.body())
        return Response("ok")

    guard, app = rules_only(REDACT_POLICY, [Route("/in/x", record, methods=["POST"])],
                            limits=BodyLimits(duplicate_keys="collect"))
    body = b'{"c":"4111 1111 1111 1111","n":[1,2],"c":"ok","d":{"c":"x","c":"4111 1111 1111 1112"}}'
    async with client_for(app) as client:
        response = await client.post("/in/x", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    # each value in its order among the key's values (at the key's first place: members are unordered)
    assert seen == [b'{"c":"[REDACTED:card]","c":"ok","n":[1,2],"d":{"c":"x","c":"[REDACTED:card]"}}']
    await guard.aclose()


RESPONSE_CARDS = r"""
policies:
  - id: cards
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    rules:
      - {id: card, when: "true", action: redact, redact: {patterns: {card: '4[0-9]{15}'}}}
"""


@pytest.mark.anyio
@pytest.mark.parametrize(("media", "sent", "received"), [
    ("application/json", b'"card 4111111111111111"', b'"card [REDACTED:card]"'),
    (None, b'"card 4111111111111111"', b'"card [REDACTED:card]"'),
    ("text/plain", b'"card 4111111111111111"', b'"card [REDACTED:card]"'),
])
async def test_a_redacted_response_that_is_one_json_string_stays_a_json_string(
    media: str | None, sent: bytes, received: bytes
) -> None:
    """A JSON response that is one string, masked, was sent as its bare text, which the client's JSON parser
    refuses."""
    async def answer(request: Request) -> Response:
        response = Response(sent, media_type=media)
        if media is None:
            del response.headers["content-type"]
        return response

    guard, app = rules_only(RESPONSE_CARDS, [Route("/out/x", answer)])
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and response.content == received
    await guard.aclose()


OVERLAP_POLICY = r"""
policies:
  - id: keys
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: k, when: 'state.text.contains("KEY")', action: redact, redact: {patterns: {key: 'KEY\d{4}'}}}
  - id: runs
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: r, when: 'state.text.contains("ZZZ")', action: redact, redact: {patterns: {run: '\d{3}Z+'}}}
"""


@pytest.mark.anyio
async def test_overlapping_spans_of_two_redacting_policies_in_a_stream_are_masked_whole() -> None:
    """Two policies' spans overlap across a window cut; this was a ValueError before the response started (a 500)."""
    async def chunks() -> AsyncIterator[bytes]:
        yield b"xxxxxKEY1234" + b"Z" * 52
        yield b"Z" * 10 + b" end"

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), media_type="text/plain")

    limits = BodyLimits(stream_window_bytes=64, stream_overlap_bytes=16, stream_flush_s=None)
    guard, app = rules_only(OVERLAP_POLICY, [Route("/out/x", stream)], limits=limits)
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and response.text == "xxxxx[REDACTED:key] end"
    await guard.aclose()


ESCAPES_POLICY = r"""
policies:
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: leak, when: 'state.text.contains("contraseña")', action: block}
      - {id: keys, when: 'state.text.matches("sk-")', action: redact, redact: {patterns: {api_key: 'sk-[A-Za-z0-9]{8,}'}}}
"""


@pytest.mark.anyio
@pytest.mark.parametrize(("events", "media", "status"), [
    ([json.dumps({"delta": "la contraseña es hunter2"})], "text/event-stream", 403),  # json.dumps escapes the ñ
    (['{"delta": "use \\u0073k-abcdefgh123"}'], "text/event-stream", 403),  # escaped: the raw text cannot be masked
    (["the plan"], "text/plain; charset=utf-16le", 502),  # a streamed charset guard does not read
])  # fmt: skip
async def test_a_stream_is_judged_as_its_client_reads_it(events: list[str], media: str, status: int) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for event in events:
            yield (f"data: {event}\n\n" if "event-stream" in media else event).encode(
                "utf-16le" if "utf-16" in media else "utf-8")

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), headers={"content-type": media})

    guard, app = rules_only(ESCAPES_POLICY, [Route("/out/x", stream)])
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == status
    assert "hunter2" not in response.text and "abcdefgh123" not in response.text
    await guard.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("chunks", "media"), [
    (['data: {"delta":\ndata: "use \\u0073k-abcdefgh123"}\n\n', "data: [DONE]\n\n"], "text/event-stream"),
    (['{"delta": "use \\u0073k-abcdefgh123"}\n', '{"delta": "hi"}\n'], "application/x-ndjson"),
    (['{"delta": "hi"}\n{"delta": "use \\u0073k-abcdefgh123"}\n'], "application/json"),
    (['\x1e{"delta": "use \\u0073k-abcdefgh123"}\n'], "application/json-seq"),
    (['{"delta": "use \\u0073k-abcdefgh123 ' + "padding " * 40, '"}'], "application/json"),  # cut by a flush
])  # fmt: skip
async def test_escapes_in_every_stream_shape_a_client_parses_are_judged_decoded(chunks: list[str], media: str) -> None:
    """A client joins an SSE event's ``data:`` lines, parses JSON Lines one line at a time and parses a document a
    flush cut in two as a whole; a ``\\u`` escape in any of them hides nothing: the key cannot be masked in the raw
    text, so the stream is refused instead of sent half masked."""
    async def body() -> AsyncIterator[bytes]:
        for i, chunk in enumerate(chunks):
            if i:
                await asyncio.sleep(0.2)  # past stream_flush_s: what is held is judged as it stands
            yield chunk.encode()

    async def stream(request: Request) -> Response:
        return StreamingResponse(body(), headers={"content-type": media})

    limits = BodyLimits(stream_flush_s=0.05)
    guard, app = rules_only(ESCAPES_POLICY, [Route("/out/x", stream)], limits=limits)
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 403 and "abcdefgh123" not in response.text
    await guard.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("chunks", [
    [json.dumps({"msg": "the key is sk-abcdefgh123"}).encode("utf-16-le")],  # json.loads reads it by its zero bytes
    [b"\xff\xfe" + "sk-abcdefgh123".encode("utf-16-le")[:1], b"x"],  # a byte-order mark, then no NUL in chunk one
    [b'{"msg": "hello, this is fine"}\n' * 200, "sk-abcdefgh123".encode("utf-16-le")],  # after the stream started
])  # fmt: skip
async def test_a_streamed_response_that_is_not_utf8_is_refused_not_passed(chunks: list[bytes]) -> None:
    """A whole body in UTF-16 is refused (502); a streamed one read as UTF-8 had NULs between its letters, so a rule
    looking for the key never matched and the client's JSON parser read it whole."""
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def stream(request: Request) -> Response:
        return StreamingResponse(body(), media_type="application/json")

    guard, app = rules_only(ESCAPES_POLICY, [Route("/out/x", stream)])
    received = b""
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as client:
        try:
            with client.stream("GET", "/out/x") as response:
                for piece in response.iter_raw():
                    received += piece
            assert response.status_code == 502 and json.loads(received)["code"] == "response_uninspectable"
        except httpx.RemoteProtocolError:  # cut off after the start: the client never sees a body that looks whole
            assert len(chunks) > 1 and received.startswith(b'{"msg"')
    assert b"s\x00k\x00-" not in received
    await guard.aclose()


@pytest.mark.anyio
async def test_a_binary_stream_is_refused_by_default_and_sent_byte_for_byte_under_metadata() -> None:
    """A streamed download on a watched path: refused (502) as its whole body is, unless opaque_media="metadata",
    where it is judged on its head and sent as it came (it was read as UTF-8, judged as text and re-encoded: a 20 KB
    PNG arrived as 39 KB)."""
    payload = bytes(range(256)) * 80

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 4096):
            yield payload[i : i + 4096]

    async def stream(request: Request) -> Response:
        return StreamingResponse(body(), media_type="application/octet-stream")

    for opaque, status in (("reject", 502), ("metadata", 200)):
        limits = BodyLimits(opaque_media=opaque)  # type: ignore[arg-type]
        guard, app = rules_only(ESCAPES_POLICY, [Route("/out/x", stream)], limits=limits)
        async with client_for(app) as client:
            response = await client.get("/out/x")
        assert response.status_code == status, opaque
        if status == 200:
            assert response.content == payload and "x-guard-response-decision-id" in response.headers
        await guard.aclose()


@pytest.mark.anyio
async def test_an_event_longer_than_the_window_is_not_judged_again_for_every_chunk() -> None:
    """Held text that cannot be sent yet (no complete event) is judged again once it has doubled: an event of n
    bytes in 64-byte chunks costs a few judgements, not one of all that is held per chunk (quadratic CPU)."""
    size = 128 * 1024

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: "
        for _ in range(size // 64):
            yield b"a" * 64
        yield b"\n\n"

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    backend = ScriptedBackend(answers)
    guard = Guard(load_text(POLICY), backends=backend)
    app = Starlette(routes=[Route("/out/x", stream)], middleware=[Middleware(
        GuardMiddleware, guard=guard, limits=BodyLimits(stream_flush_s=None))])  # fmt: skip
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and len(response.content) == size + 8
    assert backend.calls <= 12  # 4 KiB, then 8, 16, ... 128 KiB, and the end; was about 2,000
    await guard.aclose()


@pytest.mark.anyio
async def test_events_the_hold_keeps_back_are_not_judged_again_for_every_window() -> None:
    """Events far larger than their text (``logprobs``: about 1.7 KB for a 4-character token) keep tens of KB back
    under the hold; the next judgement waits for as many new bytes as are held, not half a window each."""
    alternatives = [{"token": f"t{i:03d}", "logprob": -1.234567, "bytes": [65, 66, 67, 68]} for i in range(20)]

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(300):
            token = f" w{i:02d}"[:4]
            choice = {"index": 0, "delta": {"content": token},
                      "logprobs": {"content": [{"token": token, "logprob": -0.01, "top_logprobs": alternatives}]}}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    backend = ScriptedBackend(answers)
    guard = Guard(load_text(POLICY), backends=backend)
    app = Starlette(routes=[Route("/out/x", stream)], middleware=[Middleware(
        GuardMiddleware, guard=guard, limits=BodyLimits(stream_flush_s=None))])  # fmt: skip
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and response.text.count("data: ") == 300
    assert backend.calls <= 40, backend.calls  # 22; one per half window of new bytes: 143
    await guard.aclose()


async def _asgi_get(app: Any, path: str, extensions: dict[str, Any]) -> list[dict[str, Any]]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "extensions": extensions}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.anyio
async def test_a_file_the_server_would_send_itself_is_read_and_judged(tmp_path: Path) -> None:
    """Under a server offering ``http.response.pathsend`` (Granian), Starlette's FileResponse hands the server a
    path: a watched response's scope does not offer it, and an app that sends one anyway is refused (502)."""
    from starlette.responses import FileResponse

    secret = tmp_path / "plan.txt"
    secret.write_text(f"the {SECRET}")
    guard = Guard(load_text(POLICY), backends=ScriptedBackend(answers))

    async def files(scope: Any, receive: Any, send: Any) -> None:
        await FileResponse(secret, media_type="text/plain")(scope, receive, send)

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.pathsend", "path": str(secret)})

    for app, status in ((files, 403), (raw, 502)):
        sent = await _asgi_get(GuardMiddleware(app, guard=guard), "/out/x", {"http.response.pathsend": {}})
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[0]["status"] == status and SECRET.encode() not in sent[1]["body"]
    await guard.aclose()


@pytest.mark.anyio
async def test_a_utf8_label_cut_by_a_chunk_is_read_whole() -> None:
    """A streamed page whose ``<meta charset="utf-8">`` arrives in two chunks is read once the tag is whole, not
    refused as naming the charset 'utf'."""
    parts = [b'<html><head><meta charset="utf', b'-8"></head><body>hello</body></html>']

    async def chunks() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def html(request: Request) -> Response:
        return StreamingResponse(chunks(), headers={"content-type": "text/html"})

    guard, app = rules_only(RELEASED_POLICY, [Route("/out/x", html)])
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and response.content == b"".join(parts), response.text
    await guard.aclose()


@pytest.mark.anyio
async def test_an_unclosed_meta_label_is_read_before_anything_after_it_is_sent() -> None:
    """``<meta charset=iso-2022-jp`` with no ``>`` yet, then text and a pause longer than the flush delay: refused at
    once (502), not flushed as UTF-8 and cut off when the label was read later."""
    async def chunks() -> AsyncIterator[bytes]:
        yield b"<html><head><meta charset=iso-2022-jp the SE\x1b(BCRET is swordfish " + b"x" * 600
        await asyncio.sleep(0.5)
        yield b"y" * 600

    async def html(request: Request) -> Response:
        return StreamingResponse(chunks(), headers={"content-type": "text/html"})

    guard, app = rules_only(RELEASED_POLICY, [Route("/out/x", html)])
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 502 and b"swordfish" not in response.content
    await guard.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("media", "page"), [
    ("text/html", b'<html><head><meta charset="iso-2022-jp"></head><body>the SE\x1b(BCRET is swordfish</body></html>'),
    ("text/html", b"<html><head><!--" + b"x" * 1100 + b'--><meta charset="iso-2022-jp"></head>'
                  b"<body>the SE\x1b(BCRET is swordfish</body></html>"),  # the <meta> past the first 1,024 bytes
    ("text/html", b"<html><body>the SE\x1b(BCRET is swordfish</body></html>"),  # none: a browser's detection
    ("application/xml", b'<?xml version="1.0" encoding="ISO-2022-JP"?><r>the SE\x1b(BCRET is swordfish</r>'),
    (None, b"<html>the SE\x1b(BCRET is swordfish</html>"),  # untyped: a browser sniffs HTML and picks the charset
    ("text/plain", b"the SE\x1b(BCRET is swordfish"),  # no charset: a browser picks one
])  # fmt: skip
@pytest.mark.parametrize("streamed", [False, True])
async def test_an_html_response_naming_another_charset_in_a_meta_tag_cannot_be_judged(
        media: str | None, page: bytes, streamed: bool) -> None:
    """``SE\\x1b(BCRET`` under ``<meta charset="iso-2022-jp">`` (or an XML declaration naming it), or in HTML, plain
    text or an untyped body naming no charset, is SECRET in a browser that picks ISO-2022-JP: 502, never passed
    unread, whole or streamed (a stream was read as UTF-8 and passed)."""
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(page), 16):
            yield page[i:i + 16]

    async def html(request: Request) -> Response:
        headers = {"content-type": media} if media else {}  # no charset: the document or the browser decides
        if streamed:
            return StreamingResponse(chunks(), headers=headers)
        return Response(page, headers=headers)

    guard, app = rules_only(RELEASED_POLICY, [Route("/out/x", html)])
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 502 and response.json()["code"] == "response_uninspectable"
    assert b"swordfish" not in response.content  # a random decision id may hold any short digit string
    await guard.aclose()


STRADDLE_OLD = """
policies:
  - id: req-a
    version: "1"
    match: {http: {methods: [POST], paths: ["/x"]}}
    rules: [{id: never, when: "false", action: block}]
    default: allow
  - id: resp-r
    version: "1"
    match: {http: {paths: ["/x"], response: {status: [200]}}}
    rules: [{id: all, when: "true", action: block}]
    default: allow
"""
STRADDLE_NEW = """
policies:
  - id: req-a
    version: "2"
    match: {http: {methods: [POST], paths: ["/x"]}}
    rules: [{id: always, when: "true", action: block}]
    default: block
"""


@pytest.mark.anyio
async def test_a_reload_while_a_request_is_served_does_not_split_its_judges(tmp_path: Path) -> None:
    """The request was matched on the policies of its head and its response on those of its end: a reload between
    them (a slow upload, a slow app) let a response through that the old set blocks (response policy) and the new set
    never lets the request reach (attack finding). One version of the policies judges both."""
    policy = tmp_path / "p.yaml"
    policy.write_text(STRADDLE_OLD)
    guard = Guard.from_files(policy, backends=ScriptedBackend(lambda r: {}))

    async def app_answer(request: Request) -> Response:
        await request.body()
        return JSONResponse({"secret": "UPSTREAM-BODY"})

    async def slow_upload() -> Any:
        yield b"hel"
        policy.write_text(STRADDLE_NEW)  # the policies change while the body arrives
        guard.reload()
        yield b"lo"

    app = Starlette(routes=[Route("/x", app_answer, methods=["POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])
    async with client_for(app) as client:
        straddled = await client.post("/x", content=slow_upload())
        after = await client.post("/x", content=b"hello")
    assert straddled.status_code == 403 and "UPSTREAM-BODY" not in straddled.text
    assert straddled.json()["policy"] == "resp-r"  # the old set's response policy judged the response
    assert after.status_code == 403 and after.json()["policy"] == "req-a"  # the next request meets the new set
    await guard.aclose()


SPLIT_POLICY = r"""
policies:
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {status: [STATUS], content_types: [TYPES]}}}
    state: {text: body_text}
    rules:
      - {id: leak, when: 'state.text.contains("SECRET")', action: block}
"""


def _split_policy(types: str = "text/event-stream, text/plain, application/json, application/x-ndjson",
                  status: int = 200) -> str:
    return SPLIT_POLICY.replace("TYPES", types).replace("STATUS", str(status))


def _chunk(token: str, index: int = 0) -> str:
    return "data: " + json.dumps({"choices": [{"index": index, "delta": {"content": token}}]}) + "\n\n"


async def _raw(policy: str, headers: list[tuple[str, str]], chunks: list[str]) -> tuple[int, bytes, list[Any]]:
    """The status and body a client gets from an app that sends ``headers`` (as they are, repeated ones too) and
    ``chunks``, behind a middleware on ``policy``; and the decisions recorded."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in headers]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": i < len(chunks) - 1})

    guard = Guard(load_text(policy), backends=ScriptedBackend(lambda request: {}))
    sent: list[Any] = []
    middleware = GuardMiddleware(app, guard=guard)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/out/x", "raw_path": b"/out/x", "query_string": b"", "root_path": "", "headers": [(b"host", b"t")],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with contextlib.suppress(OSError):
        await middleware(scope, receive, send)
    await guard.aclose()
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), sent


SSE_CT = ("content-type", "text/event-stream")


@pytest.mark.anyio
@pytest.mark.parametrize(("headers", "chunks"), [
    ([SSE_CT, SSE_CT], [_chunk("the SECRET is")]),  # joined, the media type matched no content_types
    ([("content-type", "text/plain"), SSE_CT], [_chunk("the SECRET is")]),
    ([("content-type", "application/json"), ("content-type", "application/json"), ("content-length", "33")],
     ['{"text": "the SECRET is here!!"}']),
    ([("content-type", "text/plain"), ("content-length", "13"), ("content-length", "13")], ["the SECRET is"]),
    ([("content-type", "text/plain"), ("content-length", "13"), ("content-encoding", "identity"),
      ("content-encoding", "identity")], ["the SECRET is"]),
])  # fmt: skip
async def test_a_response_repeating_a_header_it_is_read_by_is_refused_before_any_byte(
    headers: list[tuple[str, str]], chunks: list[str]
) -> None:
    """A repeated Content-Type, Content-Length or Content-Encoding has no one reading: the copies joined named no
    media type a policy's ``content_types`` holds, and the response passed unjudged."""
    status, body, _ = await _raw(_split_policy(), headers, chunks)
    assert status == 502 and json.loads(body)["code"] == "response_uninspectable" and b"SECRET" not in body


@pytest.mark.anyio
async def test_a_repeated_header_on_a_response_no_policy_watches_passes() -> None:
    status, body, _ = await _raw(_split_policy(status=500), [SSE_CT, SSE_CT], [_chunk("the SECRET is")])
    assert status == 200 and b"SECRET" in body


@pytest.mark.anyio
@pytest.mark.parametrize("headers", [[("content-type", "text/plain")], [], [("content-type", "text/html")]])
async def test_sse_served_as_text_or_untyped_is_joined_as_its_client_joins_it(headers: list[tuple[str, str]]) -> None:
    """OpenAI's SDK parses server-sent events whatever the Content-Type says."""
    status, body, _ = await _raw(_split_policy(""), headers, [_chunk("the SEC"), _chunk("RET is")])
    assert b"RET is" not in body and status == 403, (status, body)


@pytest.mark.anyio
async def test_sse_sent_whole_as_text_is_judged_joined() -> None:
    """SSE sent whole with a Content-Length as text is judged with its events joined, as a stream of them is (a
    client's SSE parser reads it whatever the type)."""
    body = _chunk("the SEC") + _chunk("RET is")
    headers = [("content-type", "text/plain"), ("content-length", str(len(body.encode())))]
    status, sent, _ = await _raw(_split_policy(), headers, [body])
    assert status == 403 and b"RET is" not in sent, (status, sent)


@pytest.mark.anyio
@pytest.mark.parametrize(("media", "body"), [
    ("application/json", json.dumps([{"id": f"u{i}", "word": w} for i, w in enumerate(["SE", "CRET"])])),
    ("application/x-ndjson", '{"id": "u0", "word": "SE"}\n{"id": "u1", "word": "CRET"}\n'),
])  # fmt: skip
async def test_records_sent_whole_are_one_document_not_joined(media: str, body: str) -> None:
    """A list endpoint's or an export's records are not a stream's pieces: joined, neighbouring ``last4`` values made
    a card number and a redact rule blocked an ordinary response (review findings)."""
    headers = [("content-type", media), ("content-length", str(len(body.encode())))]
    status, sent, _ = await _raw(_split_policy(), headers, [body])
    assert status == 200 and sent == body.encode()


AI_SDK = [("content-type", "text/plain; charset=utf-8"), ("x-vercel-ai-data-stream", "v1")]


def _parts(kind: str, values: list[Any]) -> list[str]:
    """Vercel AI SDK data stream parts (v4): one line ``TYPE:JSON`` each."""
    return [f"{kind}:{json.dumps(value)}\n" for value in values]


def _whole(chunks: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    body = "".join(chunks)
    return [*AI_SDK, ("content-length", str(len(body.encode())))], [body]


@pytest.mark.anyio
@pytest.mark.parametrize(("headers", "chunks"), [
    (AI_SDK, ['f:{"messageId":"msg-1"}\n', *_parts("0", ["the plan is SEC", "RET, keep it"]), 'd:{"finishReason":"stop"}\n']),
    (AI_SDK, ['0:"the plan is SE', 'C"\n0:"RET"\n']),  # a part cut across chunks
    (AI_SDK, ["".join(_parts("g", ["thinking of the SE", "CRET"]))]),  # reasoning
    (AI_SDK, _parts("c", [{"toolCallId": "a", "argsTextDelta": '{"q": "SE'}, {"toolCallId": "b", "argsTextDelta": "x"},
                          {"toolCallId": "a", "argsTextDelta": 'CRET"}'}])),  # one call's deltas, another between
    _whole(_parts("0", ["the plan is SEC", "RET, keep it"])),  # sent whole with a Content-Length
])  # fmt: skip
async def test_the_ai_sdk_data_stream_is_joined_as_its_client_joins_it(
    headers: list[tuple[str, str]], chunks: list[str]
) -> None:
    """The Vercel AI SDK's data stream protocol (v4): ``text/plain`` with ``x-vercel-ai-data-stream: v1``, a part per
    line, ``TYPE:JSON``; its client joins the text parts (``0``), the reasoning (``g``) and each tool call's argument
    deltas (``c``, by ``toolCallId``)."""
    status, body, _ = await _raw(_split_policy(), headers, chunks)
    assert status == 403 and b"RET" not in body, (status, body)


@pytest.mark.anyio
@pytest.mark.parametrize("whole", [False, True])
async def test_an_ai_sdk_data_stream_that_holds_nothing_to_stop_passes_as_it_came(whole: bool) -> None:
    chunks = ['f:{"messageId":"msg-1"}\n', *_parts("0", ["the plan ", "is fine"]), 'e:{"finishReason":"stop"}\n']
    headers, chunks = _whole(chunks) if whole else (AI_SDK, chunks)
    status, body, _ = await _raw(_split_policy(), headers, chunks)
    assert status == 200 and body == "".join(chunks).encode()


async def _ai_sdk_answer(request: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        for line in _parts("0", ["Your key is ", "sk-abcd", "efgh1234", ". Done"]):
            yield line.encode()
            await asyncio.sleep(0.01)

    return StreamingResponse(parts(), media_type="text/plain", headers={"x-vercel-ai-data-stream": "v1"})


@pytest.mark.parametrize("how", ["middleware", "proxy"])
def test_a_key_the_ai_sdk_streams_token_by_token_is_never_sent(how: str) -> None:
    """Over real HTTP: the key cut across text parts cannot be masked in them, so the answer is refused whole."""
    guard, app = rules_only(ESCAPES_POLICY, [Route("/out/chat", _ai_sdk_answer)])
    if how == "middleware":
        with serve_in_thread(app) as url:
            answer = httpx.get(f"{url}/out/chat", timeout=10)
    else:
        upstream = Starlette(routes=[Route("/out/chat", _ai_sdk_answer)])
        with serve_in_thread(upstream) as url, serve_in_thread(proxy_app(guard, ProxyConfig(url))) as proxy:
            answer = httpx.get(f"{proxy}/out/chat", timeout=10)
    guard.close()
    assert answer.status_code == 403 and answer.json()["rule"] == "keys", answer.text
    assert "efgh1234" not in answer.text


async def _sse_with_length(request: Request) -> Response:
    body = {"short": "data: use sk-abcdefgh12345 now\n\n",
            "long": "data: use sk-abcdefghijklmnopqrstuvwxyz0123456789abcdefghijkl now\n\n"}[request.query_params["k"]]
    return Response(body, media_type="text/event-stream")  # Starlette sets its Content-Length


@pytest.mark.parametrize("kind", ["short", "long"])
def test_sse_sent_with_a_content_length_is_masked_and_sent_without_it(kind: str) -> None:
    """SSE is judged as a stream whatever its head says; the masked text is longer or shorter than the upstream's
    Content-Length, which was kept: uvicorn raised (content longer, or shorter, than Content-Length) and the client
    got a broken response."""
    guard, app = rules_only(ESCAPES_POLICY, [Route("/out/sse", _sse_with_length)])
    with serve_in_thread(app) as url:
        answer = httpx.get(f"{url}/out/sse", params={"k": kind}, timeout=10)
    guard.close()
    assert answer.status_code == 200 and "content-length" not in answer.headers
    assert answer.text == "data: use [REDACTED:api_key] now\n\n"


@pytest.mark.anyio
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("media", ["text/plain", "application/grpc"])
async def test_trailers_of_a_watched_response_are_dropped_and_not_announced(early: bool, media: str) -> None:
    """Trailers (``http.response.trailers``) are headers no policy reads: a watched response's scope does not offer
    them, and an app that sends them anyway has them dropped. They were passed on unjudged while the body was held
    (before the response's start), and the start kept ``trailers: True`` while the trailers after the body were
    dropped, so a server that sends trailers waited for them for ever. A binary stream judged on its head
    (``opaque_media="metadata"``), whose bytes then pass as sent, had its start announce none but its trailers
    passed on: a server raises on trailers it was not told of."""
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert "http.response.trailers" not in scope["extensions"]
        trailers = {"type": "http.response.trailers", "headers": [(b"x-plan", b"sk-abcdefgh12345")],
                    "more_trailers": False}
        await send({"type": "http.response.start", "status": 200, "trailers": True,
                    "headers": [(b"content-type", media.encode())]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        if early:
            await send(trailers)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if not early:
            await send(trailers)

    async def send(message: dict[str, Any]) -> None:
        seen.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = Guard(load_text(ESCAPES_POLICY), backends=ScriptedBackend(lambda request: {}))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/out/x", "raw_path": b"/out/x", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"x")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "extensions": {"http.response.trailers": {}}}
    await GuardMiddleware(app, guard=guard, limits=BodyLimits(opaque_media="metadata"))(scope, receive, send)
    await guard.aclose()
    assert {m["type"] for m in seen[1:]} == {"http.response.body"} and seen[0]["type"] == "http.response.start"
    assert not seen[0].get("trailers") and b"".join(m["body"] for m in seen[1:]) == b"hello"


PAIR_POLICY = r"""
policies:
  - id: pair
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: both, when: 'state.text.contains("ALPHA") && state.text.contains("OMEGA")', action: block}
"""


@pytest.mark.anyio
async def test_a_stream_overlap_of_zero_judges_each_window_alone() -> None:
    """With ``stream_overlap_bytes=0`` the tail kept for the next window was ``sent[-0:]``, everything sent so far: every
    window judged the whole stream again (its memory and judging growing with the stream), and two words eight windows
    apart stopped it. Now no sent text is judged again."""
    async def chunks() -> AsyncIterator[bytes]:
        yield b"ALPHA" + b"." * 59
        for _ in range(5):
            yield b"." * 64
        yield b"OMEGA" + b"." * 59

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), media_type="text/plain")

    limits = BodyLimits(stream_window_bytes=64, stream_overlap_bytes=0, stream_flush_s=None, stream_hold_chars=0)
    guard, app = rules_only(PAIR_POLICY, [Route("/out/x", stream)], limits=limits)
    async with client_for(app) as client:
        response = await client.get("/out/x")
    assert response.status_code == 200 and len(response.content) == 7 * 64 and "OMEGA" in response.text
    await guard.aclose()


@pytest.mark.parametrize(("limits", "reason"), [
    ({"stream_overlap_bytes": -1}, "stream_overlap_bytes is -1; it must be a non-negative integer"),
    ({"stream_window_bytes": 0, "stream_overlap_bytes": -1}, "stream_window_bytes is 0; it must be a positive"),
    ({"stream_window_bytes": True, "stream_overlap_bytes": 0}, "stream_window_bytes is True"),
])  # fmt: skip
def test_the_stream_window_limits_are_checked(limits: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        BodyLimits(**limits)
