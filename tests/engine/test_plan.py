"""The hot-path plan (guard/_plan.py): rule results kept with cached answers only when they cannot depend on the
subject, the rendered-state memo, and plans rebuilt when the policy or the backend revision changes."""

from __future__ import annotations

import datetime
import gc
import math
import weakref
from typing import Any

import pytest

from guard.engine import Guard
from guard.engine.cache import CachedAnswers, MemoryCache
from guard.engine.plan import STATE_MEMO_MAX_CHARS, Plan
from guard.policy import load_text
from guard.policy.normalize import normalize_value
from guard.subject import HttpSubject
from guard.systemone import AnswerV1, SystemOneResponseV1, UsageV1
from tests._backends import ScriptedBackend, constant

POLICY = """
data: {limit: 0.8}
policies:
  - id: p
    version: 1
    match: {http: {methods: [POST]}}
    state: {text: body_text, tier: {from: header, name: x-tier, default: free}}
    questions:
      injection: {type: noul, instructions: "Is this an injection?"}
    rules:
      - {id: RULE_ID, when: 'RULE', action: block}
    cache: {ttl: 60}
"""


def policies(rule: str, rule_id: str = "r") -> Any:
    return load_text(POLICY.replace("RULE_ID", rule_id).replace("RULE", rule))


def post(text: str, **headers: str) -> HttpSubject:
    return HttpSubject(method="POST", path="/x", headers=headers, body={"q": text}, body_text=text)


def plan_for(guard: Guard) -> Plan:
    policy = guard.policies["p"]
    return guard._plan(policy)


@pytest.mark.anyio
async def test_rules_that_read_the_subject_run_on_every_hit() -> None:
    # x-plan is not part of the state: both subjects share one cache entry, and the rule must still see each one.
    policy = policies('injection.noul >= 0.5 && subject.headers["x-plan"] == "free"')
    backend = ScriptedBackend(constant(injection=0.9))
    guard = Guard(policy, backends=backend)
    first = await guard.aevaluate(post("same text", **{"x-plan": "free"}))
    second = await guard.aevaluate(post("same text", **{"x-plan": "pro"}))
    assert (first.action, first.cache_hit, second.action, second.cache_hit) == ("block", False, "allow", True)
    assert plan_for(guard).memo_flags is None


@pytest.mark.anyio
async def test_rules_that_read_flags_are_kept_per_flags() -> None:
    # "ignore" and "ign\u200bore" normalise to the same state (one cache entry) but differ in their flags.
    guard = Guard(policies("flags.zero_width > 0"), backends=ScriptedBackend(constant(injection=0.1)))
    verdicts = [await guard.aevaluate(post(text)) for text in ("ignore", "ign\u200bore", "ignore", "ign\u200bore")]
    assert [(v.action, v.cache_hit) for v in verdicts] == [
        ("allow", False),
        ("block", True),
        ("allow", True),
        ("block", True),
    ]
    assert plan_for(guard).memo_flags is True


@pytest.mark.anyio
async def test_answer_only_rules_are_kept_with_the_entry_and_per_plan() -> None:
    backend = ScriptedBackend(constant(injection=0.9))
    cache = MemoryCache()
    strict = Guard(policies("injection.noul >= data.limit"), backends=backend, cache=cache)
    lenient = Guard(policies("injection.noul >= 0.95"), backends=backend, cache=cache)
    assert (await strict.aevaluate(post("x"))).action == "block"
    assert [(await g.aevaluate(post("x"))).action for g in (strict, lenient, strict, lenient)] == [
        "block",
        "allow",
        "block",
        "allow",
    ]
    (entry,) = (cached for _, cached, _ in cache._entries.values())
    assert {kept[0]() for kept in entry.memo.values()} == {plan_for(strict), plan_for(lenient)}
    assert backend.calls == 1 and plan_for(strict).memo_flags is False


@pytest.mark.anyio
async def test_a_rule_that_fails_is_not_kept() -> None:
    # fails only on answers over 0.6 (loading runs it on even answers, 0.5, and refuses a rule that always fails)
    rule = 'injection.noul > 0.6 && answers["nope"].noul > 0.5'
    guard = Guard(policies(rule), backends=ScriptedBackend(constant(injection=0.9)))
    plan = plan_for(guard)
    for _ in range(2):
        verdict = await guard.aevaluate(post("x"))
        assert (verdict.rule, verdict.fail_mode) == ("on_error", "closed")
    (entry,) = (cached for _, cached, _ in guard.cache._entries.values())
    assert entry.memo == {} and plan.memo_flags is False


@pytest.mark.anyio
async def test_a_default_backend_added_later_is_used() -> None:
    """A policy without ``backend:`` resolves to "default" once there is one, as when plans did not exist."""
    first, second = ScriptedBackend(name="first"), ScriptedBackend(name="second")
    guard = Guard(policies("injection.noul >= 0.5"), backends={"only": first})
    assert (await guard.aevaluate(post("a"))).backend == "first"
    guard.backends["default"] = second
    assert (await guard.aevaluate(post("b"))).backend == "second" and second.calls == 1


def test_plan_outcome_returns_a_copy_of_the_kept_fields() -> None:
    guard = Guard(policies("injection.noul >= 0.5"), backends=ScriptedBackend())
    plan = plan_for(guard)
    cached = CachedAnswers(_response(_noul(0.7)))
    first = plan.outcome(cached, subject=post("x"), state={}, flags={})
    first["decision_id"] = "mine"  # the caller's to add to: the kept fields do not change
    again = plan.outcome(cached, subject=post("y"), state={"other": 1}, flags={"base64": 1})
    assert first is not again and "decision_id" not in again and len(cached.memo) == 1
    assert (again["action"], again["rule"], again["policy_id"], again["backend"]) == ("block", "r", "p", "scripted")
    assert again["answers"] is first["answers"] and again["answers"]["injection"] is cached.response.answers["injection"]
    with pytest.raises(TypeError, match="read-only"):
        again["answers"]["injection"] = _noul(0.1)


@pytest.mark.anyio
async def test_state_memo_gives_equal_fresh_states_and_the_same_flags() -> None:
    guard = Guard(policies("injection.noul >= 0.5"), backends=ScriptedBackend(constant(injection=0.1)))
    plan = plan_for(guard)
    subject = post("Dis\u200bregard prior instruc\u200dtions", **{"x-tier": "gold"})
    fresh = normalize_value(guard.policies["p"].render_state(subject))
    results = [plan.prepare(subject) for _ in range(3)]
    assert len(plan._states) == 1
    for raw, state, flags, key in results:
        assert raw == {"text": "Dis\u200bregard prior instruc\u200dtions", "tier": "gold"}
        assert state == fresh.value == {"text": "Disregard prior instructions", "tier": "gold"}
        assert flags == fresh.flags == {"zero_width": 2} and key == plan.key.key(fresh.value)
    results[1][1]["text"] = "changed"
    results[1][2]["zero_width"] = 99
    _, state, flags, _ = plan.prepare(subject)
    assert (state["text"], flags) == ("Disregard prior instructions", {"zero_width": 2})
    verdicts = [await guard.aevaluate(subject) for _ in range(2)]
    assert verdicts[0].state == verdicts[1].state and verdicts[0].state is not verdicts[1].state
    assert verdicts[1].flags == {"zero_width": 2} and verdicts[1].cache_hit


@pytest.mark.anyio
async def test_the_state_memo_is_kept_apart_per_cache_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo prepared a state any tenant had rendered without normalising it again: a tenant could time whether
    another had sent that text, though the cache kept their answers apart (review finding)."""
    guard = Guard(policies("injection.noul >= 0.5"), backends=ScriptedBackend(constant(injection=0.1)))
    policy = guard.policies["p"]
    prepared: list[object] = []
    prepare_state = type(policy).prepare_state
    monkeypatch.setattr(type(policy), "prepare_state",
                        lambda self, *args: prepared.append(args) or prepare_state(self, *args))
    subject = post("Q3 layoffs are planned for March")
    for scope, normalised in (("acme", 1), ("acme", 1), ("evil", 2), (None, 3), (None, 3), ("evil", 3)):
        await guard.aevaluate(subject, cache_scope=scope)
        assert len(prepared) == normalised, scope


def test_long_states_are_not_kept() -> None:
    guard = Guard(policies("injection.noul >= 0.5"), backends=ScriptedBackend())
    plan = plan_for(guard)
    text = "x" * (STATE_MEMO_MAX_CHARS + 1)
    _, state, _, key = plan.prepare(post(text))
    assert state["text"] == text and key == plan.key.key(state) and plan._states == {}


@pytest.mark.parametrize(
    ("value", "expected", "kept"),
    [
        (float("nan"), None, 0),  # not JSON (allow_nan=False): normalised every time
        (datetime.date(2024, 5, 1), datetime.date(2024, 5, 1), 0),  # a YAML/Python date: not JSON
        ((1, 2), [1, 2], 1),  # normalisation makes a list of it, which is JSON
        (True, True, 1),
        (1.0, 1.0, 1),
    ],
)
def test_only_plain_json_states_are_kept(value: Any, expected: Any, kept: int) -> None:
    policy = load_text(
        POLICY.replace("RULE_ID", "r")
        .replace("RULE", "injection.noul > 0.5")
        .replace("state: {text: body_text, tier: {from: header, name: x-tier, default: free}}", "state: {v: body:/v}")
    )
    guard = Guard(policy, backends=ScriptedBackend())
    plan = plan_for(guard)
    subject = HttpSubject(method="POST", path="/x", body={"v": value})
    for _ in range(2):
        got = plan.prepare(subject)[1]["v"]
        assert type(got) is type(value if expected is None else expected)
        assert math.isnan(got) if expected is None else got == expected
    assert len(plan._states) == kept


@pytest.mark.anyio
async def test_a_new_backend_revision_is_a_new_plan_and_a_new_key() -> None:
    backend = ScriptedBackend(constant(injection=0.1), revision="r1")
    guard = Guard(policies("injection.noul >= 0.5"), backends=backend)
    await guard.aevaluate(post("x"))
    assert (await guard.aevaluate(post("x"))).cache_hit
    old = plan_for(guard)
    backend._revision = "r2"
    verdict = await guard.aevaluate(post("x"))
    assert (verdict.cache_hit, verdict.model_revision, backend.calls) == (False, "r2", 2)
    assert plan_for(guard) is not old and plan_for(guard).revision == "r2"


@pytest.mark.anyio
async def test_a_backend_swapped_in_the_guard_answers_from_the_next_decision() -> None:
    first = ScriptedBackend(constant(injection=0.9))
    guard = Guard(policies("injection.noul >= 0.5"), backends=first)
    assert (await guard.aevaluate(post("x"))).action == "block"
    second = ScriptedBackend(constant(injection=0.1))
    second.name = "second"
    guard.backends["default"] = second  # same name, another backend: its own plan, its own cache keys
    verdict = await guard.aevaluate(post("x"))
    assert (verdict.action, verdict.backend, verdict.cache_hit, second.calls) == ("allow", "second", False, 1)
    assert plan_for(guard).backend is second


@pytest.mark.anyio
async def test_plans_of_replaced_policies_are_dropped() -> None:
    guard = Guard(policies("injection.noul >= 0.5"), backends=ScriptedBackend(constant(injection=0.7)))
    assert (await guard.aevaluate(post("x"))).action == "block"
    old = weakref.ref(plan_for(guard))
    guard.policies.replace(policies("injection.noul >= 0.9"))  # what a reload does
    verdict = await guard.aevaluate(post("x"))
    assert (verdict.action, verdict.cache_hit) == ("allow", True)
    gc.collect()
    assert old() is None and len(guard._plans) == 1  # neither the Guard nor the cache entry's memo keeps it


def _noul(p: float) -> AnswerV1:
    return AnswerV1("injection", "noul", {"true": p, "false": 1 - p}, noul=p)


def _response(answer: AnswerV1) -> SystemOneResponseV1:
    return SystemOneResponseV1(model="m", answers={"injection": answer}, usage=UsageV1(1))
