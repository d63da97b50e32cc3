"""Shadow policies beside enforced ones: a shadow policy's questions go in a request of their own (a backend that
refuses, omits or fails them never decides an enforced verdict), and an enforced verdict never waits for a slow shadow
policy (that one finishes in the background and is recorded as a decision of its own, awaited by ``aclose``)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog, Telemetry
from guard.errors import BackendRejected, BackendUnavailable
from guard.policy import load_text
from guard.subject import HttpSubject
from guard.systemone import SystemOneRequestV1, SystemOneResponseV1
from tests._backends import ScriptedBackend

pytestmark = pytest.mark.anyio

ENFORCED = """
  - id: enforced
    version: "1"
    match: {http: {methods: [POST]}}
    state: {text: body_text}
    questions: {spam: {type: noul, instructions: "Is this spam?"}}
    rules: [{id: spam, when: spam.noul >= 0.9, action: block}]
    default: allow
"""
SHADOW = """
  - id: trial
    version: "1"
    mode: shadow
    match: {http: {methods: [POST]}}
    state: {text: body_text}
    timeout_ms: 2000
    questions: {topic: {type: noul, instructions: "Is this about topic X?"}}
    rules: [{id: topic, when: topic.noul >= 0.9, action: block}]
    default: allow
"""


def post() -> HttpSubject:
    return HttpSubject(method="POST", path="/x", body={"t": "hello"}, body_text="hello")


def refuse_topic(request: SystemOneRequestV1) -> dict[str, float]:
    if any(q.id == "topic" for q in request.questions):
        raise BackendRejected("http 400: unknown question 'topic'", backend="remote")
    return {"spam": 0.01}


def drop_topic(response: SystemOneResponseV1) -> SystemOneResponseV1:
    return dataclasses.replace(response, answers={k: v for k, v in response.answers.items() if k != "topic"})


@pytest.mark.parametrize("backend", [
    pytest.param(lambda: ScriptedBackend(refuse_topic), id="rejected"),
    pytest.param(lambda: ScriptedBackend(lambda r: {"spam": 0.01, "topic": 0.95}, answers_override=drop_topic),
                 id="answer-missing"),
])
async def test_a_shadow_policys_failing_question_never_fails_the_enforced_policy(backend: Any) -> None:
    scripted = backend()
    async with Guard(load_text("policies:" + ENFORCED + SHADOW), backends=scripted) as guard:
        verdict = await guard.aevaluate(post())
    assert verdict.action == "allow" and verdict.fail_mode in (None, "closed")
    parts = {c.policy_id: c for c in verdict.contributions}
    assert (parts["enforced"].action, parts["enforced"].rule, parts["enforced"].error) == ("allow", "default", None)
    assert (parts["trial"].action, parts["trial"].shadow_action, parts["trial"].rule) == ("allow", "block", "on_error")
    assert scripted.calls == 2  # the shadow policy's question went in a request of its own
    assert [[q.id for q in r.questions] for r in scripted.requests] == [["spam"], ["topic"]]


async def test_enforced_policies_alone_still_share_one_call() -> None:
    second = SHADOW.replace("id: trial", "id: second").replace("    mode: shadow\n", "")
    scripted = ScriptedBackend(lambda r: {"spam": 0.01, "topic": 0.01})
    async with Guard(load_text("policies:" + ENFORCED + second), backends=scripted) as guard:
        verdict = await guard.aevaluate(post())
    assert verdict.action == "allow" and scripted.calls == 1


@pytest.mark.parametrize("sync", [False, True])
async def test_a_slow_shadow_policy_does_not_delay_the_enforced_verdict(sync: bool) -> None:
    sink = io.StringIO()
    fast = ScriptedBackend(lambda r: {"spam": 0.01})
    slow = ScriptedBackend(lambda r: {"topic": 0.95}, delay=1.0)
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: slow\n    questions:")
    guard = Guard(load_text(text), backends={"default": fast, "slow": slow}, decision_log=DecisionLog(sink))
    started = time.perf_counter()
    if sync:
        verdict = await asyncio.to_thread(guard.evaluate, post())
    else:
        verdict = await guard.aevaluate(post())
    took = time.perf_counter() - started
    assert took < 0.5, f"the enforced verdict waited {took:.2f} s for the shadow policy"
    assert (verdict.action, verdict.policy_id, verdict.rule) == ("allow", "enforced", "default")
    assert [c.policy_id for c in verdict.contributions] == ["enforced"]
    await guard.aclose()  # waits for the shadow decision, which records itself
    records = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [r["policy"]["id"] for r in records] == ["enforced", "trial"]
    assert records[0]["decision_id"] == records[1]["decision_id"]
    result = records[1]["result"]
    assert (result["action"], result["shadow_action"], result["rule"]) == ("allow", "block", "topic")
    assert slow.calls == 1


async def test_a_large_late_shadow_decision_is_written_on_the_event_loop() -> None:
    """A late shadow decision on a large request builds its record on a thread and hands it to the sink on the loop's
    thread: a callable sink may use the running loop."""
    import threading

    from guard.engine.guard import INLINE_DECISION_CHARS

    threads: list[int] = []
    lines: list[str] = []

    def sink(line: str) -> None:
        threads.append(threading.get_ident())
        asyncio.get_running_loop()  # raises off the loop
        lines.append(line)

    log = DecisionLog(sink)
    fast = ScriptedBackend(lambda r: {"spam": 0.01})
    slow = ScriptedBackend(lambda r: {"topic": 0.95}, delay=0.2)
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: slow\n    questions:")
    body = {"t": "hello", **{f"k{i}": "v" for i in range(INLINE_DECISION_CHARS // 8)}}
    large = HttpSubject(method="POST", path="/x", body=body, body_text="\n".join(body.values()))
    async with Guard(load_text(text), backends={"default": fast, "slow": slow}, decision_log=log) as guard:
        await guard.aevaluate(large)
    assert [json.loads(line)["policy"]["id"] for line in lines] == ["enforced", "trial"]
    assert threads == [threading.get_ident()] * 2
    assert log.dropped == 0


def test_a_late_shadow_decision_is_recorded_before_the_server_stops() -> None:
    """GuardMiddleware: stopping the server (lifespan shutdown) waits for a late shadow decision, so the shadow trial
    loses none (it was cancelled with the event loop)."""
    from starlette.testclient import TestClient

    from tests.asgi._apps import BENIGN, guarded_app

    sink = io.StringIO()
    fast = ScriptedBackend(lambda r: {"spam": 0.01})
    slow = ScriptedBackend(lambda r: {"topic": 0.95}, delay=0.5)
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: slow\n    questions:")
    guard = Guard(load_text(text), backends={"default": fast, "slow": slow}, decision_log=DecisionLog(sink))
    with TestClient(guarded_app(guard)) as client:
        assert client.post("/v1/echo", json={"message": BENIGN}).status_code == 200
    records = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [(r["policy"]["id"], r["result"]["action"], r["result"]["shadow_action"]) for r in records] == [
        ("enforced", "allow", None), ("trial", "allow", "block")]
    guard.close()


async def test_a_shadow_policy_that_answers_in_time_is_part_of_the_verdict_but_never_decides_it() -> None:
    scripted = ScriptedBackend(lambda r: {"spam": 0.01, "topic": 0.95})
    async with Guard(load_text("policies:" + ENFORCED + SHADOW), backends=scripted) as guard:
        await guard.aevaluate(post())  # fills the cache
        verdict = await guard.aevaluate(post())
    assert (verdict.action, verdict.shadow_action, verdict.policy_id) == ("allow", None, "enforced")
    assert [(c.policy_id, c.shadow_action) for c in verdict.contributions] == [("enforced", None), ("trial", "block")]


async def test_an_enforced_policy_that_fails_open_decides_over_a_shadow_policy_that_would_block() -> None:
    """The shadow policy's would-be block ranked over the enforced fail-open: the verdict, its headers, the span and
    the decision log named the shadow policy with no fail mode, and the HTTP layer neither flagged nor counted the
    request it passed undecided (review finding)."""
    sink = io.StringIO()
    down = ScriptedBackend(fail=BackendUnavailable("down", backend="down"), name="down")
    text = "policies:" + ENFORCED.replace("    default: allow", "    default: allow\n    on_error: {mode: open}\n"
                                          "    backend: down") + SHADOW
    guard = Guard(load_text(text), backends={"default": ScriptedBackend(lambda r: {"topic": 0.95}), "down": down},
                  decision_log=DecisionLog(sink))
    async with guard:
        verdict = await guard.aevaluate(post())
    assert (verdict.policy_id, verdict.action, verdict.rule, verdict.fail_mode) == ("enforced", "allow", "on_error",
                                                                                    "open")
    assert verdict.shadow_action is None and verdict.flags.get("fail_open") is True
    assert [(c.policy_id, c.shadow_action) for c in verdict.contributions] == [("enforced", None), ("trial", "block")]
    (record,) = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert (record["policy"]["id"], record["fail_mode"]) == ("enforced", "open")


async def test_late_shadow_decisions_are_capped_so_they_cannot_take_the_enforced_calls_connections() -> None:
    """Each request returned at once while its slow shadow call held a backend connection up to the shadow timeout:
    a client could hold request rate x timeout connections and starve the enforced calls (review finding). Past
    MAX_BACKGROUND_SHADOW late shadow decisions, shadow questions are not asked."""
    from guard.engine.guard import MAX_BACKGROUND_SHADOW

    fast = ScriptedBackend(lambda r: {"spam": 0.01})
    slow = ScriptedBackend(lambda r: {"topic": 0.95}, delay=1.0)
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: slow\n    questions:")
    reader = InMemoryMetricReader()
    guard = Guard(load_text(text), backends={"default": fast, "slow": slow},
                  telemetry=Telemetry(meter_provider=MeterProvider(metric_readers=[reader])))
    bodies = [HttpSubject(method="POST", path="/x", body={"t": f"hello {i}"}, body_text=f"hello {i}")
              for i in range(MAX_BACKGROUND_SHADOW + 8)]
    verdicts = [await guard.aevaluate(subject) for subject in bodies]
    assert all(v.action == "allow" and v.policy_id == "enforced" for v in verdicts)
    assert slow.calls == MAX_BACKGROUND_SHADOW  # the last 8 shadow questions were not asked
    skipped = [(dict(point.attributes), point.value)
               for resource in reader.get_metrics_data().resource_metrics for scope in resource.scope_metrics
               for metric in scope.metrics if metric.name == "guard.shadow_skipped"
               for point in metric.data.data_points]
    assert skipped == [({"guard.policy.id": "trial"}, 8)]  # operators see what shadow mode did not measure
    await guard.aclose()


async def test_a_shadow_policy_that_fails_open_leaves_the_enforced_verdict_unflagged() -> None:
    """The shadow policy's ``fail_open`` flag was merged into the enforced verdict (counted in ``guard.fail_open``
    under the enforced policy, and reported to HTTP clients as the request's fail-open: review finding). It stays in
    the shadow policy's own verdict."""
    down = ScriptedBackend(fail=BackendUnavailable("down", backend="down"), name="down")
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: down\n    on_error: {mode: open}\n"
                                                   "    questions:")
    async with Guard(load_text(text), backends={"default": ScriptedBackend(lambda r: {"spam": 0.01}), "down": down}
                     ) as guard:
        verdict = await guard.aevaluate(post())
    assert (verdict.policy_id, verdict.action, verdict.fail_mode) == ("enforced", "allow", None)
    assert "fail_open" not in verdict.flags
    trial = next(c for c in verdict.contributions if c.policy_id == "trial")
    assert (trial.fail_mode, trial.flags.get("fail_open")) == ("open", True)


async def test_a_shadow_policys_flags_stay_in_its_own_verdict_and_its_unmaskable_body_stays_out_of_the_log() -> None:
    """A shadow policy's flags were merged into the enforced verdict: its state cut showed as the enforced decision's
    ``flags.truncated`` (review finding). They stay in its own verdict (the decision log's ``policies``); a shadow
    redact that could not mask still keeps the body and query out of the decision log."""
    sink = io.StringIO()
    text = "policies:" + ENFORCED + SHADOW.replace("state: {text: body_text}",
                                                   "state: {text: {from: body_text, max_chars: 3}}") + """
  - id: cards
    version: "1"
    mode: shadow
    match: {http: {methods: [POST]}}
    rules: [{id: card, when: "true", action: redact, redact: {patterns: {card: '\\b\\d{4}(?: ?\\d{4}){3}\\b'}}}]
"""
    subject = HttpSubject(method="POST", path="/x", query={"card": ["4111 1111 1111 1111"]}, body={"t": "hello"},
                          body_text="hello")
    async with Guard(load_text(text), backends=ScriptedBackend(lambda r: {"spam": 0.01, "topic": 0.01}),
                     decision_log=DecisionLog(sink)) as guard:
        verdict = await guard.aevaluate(subject)
    assert (verdict.policy_id, verdict.action, verdict.flags) == ("enforced", "allow", {})
    own = {c.policy_id: c for c in verdict.contributions}
    assert own["trial"].flags == {"truncated": 1} and own["cards"].flags.get("unmaskable") == 1
    (record,) = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert record["flags"] == {}
    assert {p["id"]: p["flags"] for p in record["policies"]}["trial"] == {"truncated": 1}
    assert "4111" not in json.dumps(record) and record["input"]["body"].startswith("[withheld")


def _counted(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    return {point.attributes["guard.policy.id"]: point.value
            for resource in reader.get_metrics_data().resource_metrics for scope in resource.scope_metrics
            for metric in scope.metrics if metric.name == name for point in metric.data.data_points}


@pytest.mark.parametrize("shadow_backend", [
    pytest.param(lambda: ScriptedBackend(fail=BackendUnavailable("down", backend="shadow"), name="shadow"),
                 id="fails-in-time"),
    pytest.param(lambda: ScriptedBackend(lambda r: {"topic": 0.01}, delay=5.0, name="shadow"), id="times-out-late"),
])
async def test_a_shadow_policys_fail_open_and_cut_state_count_under_its_own_id_early_or_late(shadow_backend: Any) -> None:
    """A shadow policy failing open in time was not counted in ``guard.fail_open``, one timing out after the enforced
    verdict (recorded in the background) was, and its cut state counted ``guard.state_cut`` under the enforced
    policy (review findings): both count under the shadow policy's own id, whenever its verdict comes in."""
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    text = "policies:" + ENFORCED + SHADOW.replace("    questions:", "    backend: shadow\n    on_error: {mode: open}\n"
                                                   "    questions:").replace(
        "timeout_ms: 2000", "timeout_ms: 200").replace("state: {text: body_text}",
                                                       "state: {text: {from: body_text, max_chars: 3}}")
    backends = {"default": ScriptedBackend(lambda r: {"spam": 0.01}), "shadow": shadow_backend()}
    async with Guard(load_text(text), backends=backends, telemetry=telemetry) as guard:
        verdict = await guard.aevaluate(post())
        await guard.drain()
    assert (verdict.policy_id, verdict.fail_mode, verdict.flags) == ("enforced", None, {})
    assert _counted(reader, "guard.fail_open") == {"trial": 1}
    assert _counted(reader, "guard.state_cut") == {"trial": 1}


async def test_an_enforced_fail_open_beside_an_enforced_redact_counts_under_the_policy_that_failed() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    text = "policies:" + ENFORCED.replace("    default: allow", "    default: allow\n    on_error: {mode: open}\n"
                                          "    backend: down") + """
  - id: cards
    version: "1"
    match: {http: {methods: [POST]}}
    rules: [{id: card, when: "true", action: redact, redact: {patterns: {card: '\\b\\d{4}(?: ?\\d{4}){3}\\b'}}}]
"""
    backends = {"default": ScriptedBackend(), "down": ScriptedBackend(fail=BackendUnavailable("down", backend="down"))}
    async with Guard(load_text(text), backends=backends, telemetry=telemetry) as guard:
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/x", body={"t": "4111 1111 1111 1111"},
                                                    body_text="4111 1111 1111 1111"))
    assert (verdict.policy_id, verdict.action, verdict.flags) == ("cards", "redact", {"fail_open": True})
    assert _counted(reader, "guard.fail_open") == {"enforced": 1}


async def test_a_shadow_policys_short_timeout_never_times_out_the_enforced_policy_asking_the_same() -> None:
    """A shadow candidate listed first, asking what the enforced policy asks about the same state with a shorter
    timeout: both groups have one cache key, so the enforced one joins the shadow's call. That call timed out at the
    shadow's 100 ms and the enforced policy took the timeout (its fail mode: an allow under on_error open) though the
    model answered in 300 ms, well within its own 2 s; it now calls again in what is left of its own budget."""
    text = """
policies:
  - id: candidate
    version: "2"
    mode: shadow
    match: {http: {methods: [POST]}}
    state: {text: body_text}
    questions: {spam: {type: noul, instructions: "Is this spam?"}}
    timeout_ms: 100
    rules: [{id: spam, when: spam.noul >= 0.3, action: block}]
    default: allow
  - id: live
    version: "1"
    on_error: {mode: open}
    match: {http: {methods: [POST]}}
    state: {text: body_text}
    questions: {spam: {type: noul, instructions: "Is this spam?"}}
    timeout_ms: 2000
    rules: [{id: spam, when: spam.noul >= 0.5, action: block}]
    default: allow
"""
    backend = ScriptedBackend(lambda r: {"spam": 0.99}, delay=0.3)
    async with Guard(load_text(text), backends=backend) as guard:
        verdict = await guard.aevaluate(post())
    parts = {c.policy_id: c for c in verdict.contributions}
    assert (verdict.action, verdict.fail_mode, parts["live"].rule) == ("block", None, "spam"), parts["live"].error
    assert parts["candidate"].rule == "on_error" and backend.calls == 2
