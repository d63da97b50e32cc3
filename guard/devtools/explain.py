"""``guard policy explain``: everything the engine does for one subject, step by step, as a JSON-safe report.

The report holds the policy that decided, the state the model reads (normalised, with flags) and the one the rules
read (``rule_state``: as received), the cache key, each answer, the ``call`` / ``result`` features its rules read
(argument provenance, instructions found in a tool result), every rule's ``when`` value in order, the verdict, and the
verdict each fail mode would give if the backend failed; and ``matched``: the same for every policy that matched (all
of them decide; the most severe verdict wins). The
steps run through the real engine (:class:`~guard.engine.Guard`), so the report is what production would do. When
the decision itself failed (backend error or timeout), ``error`` says why, the verdict is the policy's fail mode, and
the rules are not traced: without answers there is nothing to run them on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guard.backends import start_backend
from guard.backends.base import DecisionBackend
from guard.backends.fixture import FixtureBackend
from guard.devtools.testing import judged_subject, late_shadow_verdicts, wire_answers, with_timeout
from guard.engine.cache import MemoryCache
from guard.engine.keys import cache_key
from guard.errors import GuardError, StateAmbiguous, StateTooLong
from guard.policy._yaml import read_policy_file
from guard.policy.loader import PolicySet, load_text
from guard.policy.policy import FailPolicy, Policy
from guard.policy.provenance import rule_features
from guard.policy.rules import FEATURE_NAMES, rule_inputs, trace_rules
from guard.verdict import Verdict

if TYPE_CHECKING:
    from guard.engine import Guard

__all__ = ["explain"]


def _guard(policies: list[Policy], backend: DecisionBackend) -> Guard:
    from guard.engine import Guard

    names = {p.backend or "default" for p in policies} | {"default"}
    return Guard(policies, backends=dict.fromkeys(names, backend), cache=MemoryCache())


async def _verdict(policies: list[Policy], backend: DecisionBackend, subject: Any) -> Verdict:
    guard = _guard(policies, backend)
    try:
        return await guard.aevaluate(subject, policies=policies)
    finally:
        await guard.aclose()


async def explain(
    file: str | Path,
    subject_data: Any,
    *,
    answers: Mapping[str, Any] | None = None,
    backend_factory: Callable[[], DecisionBackend] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Explain the decision for one subject.

    Args:
        file: the policy file.
        subject_data: ``{"http": {...}}`` (with ``response`` for a response policy) or ``{"agent": {...}}``, matched
            as :func:`~guard.devtools.testing.judged_subject` says.
        answers: hand-written answers by question key (see ``guard/backends/fixture.py``); default: even splits.
        backend_factory: builds a real backend instead of ``answers``; it is started (warmed up) before the decision.
        timeout_s: replaces the policies' ``timeout`` (seconds) when given.

    Returns:
        The report; ``error`` is the verdict's error text (``None`` when the decision succeeded) and ``rules`` is
        empty when the decision failed before any answer.

    Raises:
        PolicyError: the file does not load. ValueError: the subject or the answers do not fit.
    """
    policies = with_timeout(load_text(read_policy_file(file), str(file)), timeout_s)
    subject, matched, views = judged_subject(PolicySet(policies), subject_data)
    if not matched:
        return {"policy": None, "matched": [], "verdict": {"action": "allow", "policy": None}, "error": None}
    if backend_factory is not None:
        backend = backend_factory()
        await start_backend(backend)
    else:
        backend = FixtureBackend(wire_answers(matched, answers or {}))
    guard = _guard(policies, backend)
    try:  # the backend stays open until the reports are built: a rule error asks it again
        verdict = await guard.aevaluate(subject, policies=matched, views=views)
        late = await late_shadow_verdicts(guard, subject, matched, verdict, views)
        own = {v.policy_id: v for v in (*(verdict.contributions or (verdict,)), *late)}
        reports = [await _policy_report(policy, own[policy.id], views.get(policy.id, subject), backend)
                   for policy in matched]
    finally:
        await guard.aclose()
    decisive = next(r for r in reports if r["policy"]["id"] == verdict.policy_id)
    policy = next(p for p in matched if p.id == verdict.policy_id)
    subject = views.get(policy.id, subject)  # the view the deciding policy judged
    fail_modes = {}
    engine_logger = logging.getLogger("guard.engine")
    level = engine_logger.level
    engine_logger.setLevel(logging.ERROR)  # the simulated fail-open below is not a real one worth a warning
    try:
        for mode in ("closed", "open", "escalate"):
            forced = dataclasses.replace(policy, on_error=FailPolicy(mode))
            failed = await _verdict([forced], FixtureBackend(error="unavailable"), subject)
            fail_modes[mode] = {"action": failed.action, "status": failed.status, "retry_after": failed.retry_after}
    finally:
        engine_logger.setLevel(level)
    return {
        **decisive,
        "verdict": verdict.to_json() | {"status": verdict.status},
        "error": verdict.error,
        "fail_mode": policy.fail_policy(subject).mode,
        "fail_modes": fail_modes,
        "matched": reports,
    }


async def _policy_report(
    policy: Policy, verdict: Verdict, subject: Any, backend: DecisionBackend
) -> dict[str, Any]:
    """One matching policy's part: its states (the model's, and the rules' as received), questions, answers,
    features, traced rules and own verdict. When a rule failed (``rule_error``), the backend had answered: its
    answers are asked for again so the report shows them and every rule's value or error. A state the policy will
    not judge (too long, a value sent twice) has no state, questions' answers or rules: only its block."""
    questions = [{"key": q.key, **q.wire.to_json(), "id": q.wire.id} for q in policy.questions]
    try:
        raw = policy.render_state(subject)
        normalized = policy.prepare_state(raw, subject)
    except (StateTooLong, StateAmbiguous) as exc:
        return {"policy": _policy_identity(policy), "state": None, "rule_state": None, "flags": {},
                "refused_state": str(exc), "questions": questions, "cache_key": None, "backend": None,
                "revision": None, "answers": {}, "features": {}, "rules": [], "own_verdict": _own_verdict(verdict)}
    request = policy.build_request(normalized.value)
    named = dict(verdict.answers)  # keyed by question key
    rule_error = verdict.error is not None and verdict.error.startswith("rule_error")
    if rule_error and policy.questions:
        try:
            response = await asyncio.wait_for(backend.decide(request), policy.timeout)
            named = {q.key: response.answers[q.wire.id] for q in policy.questions}
        except (GuardError, TimeoutError):  # the second ask failed: the report shows no answers, as for a failure
            rule_error = False
    features = rule_features(
        subject, rule_inputs(policy.rules) & FEATURE_NAMES, tools=policy.tools, trusted=policy.trusted,
        detector=policy.detector,
    )  # fmt: skip
    traced: list[tuple[str, bool | str]] = []
    if verdict.error is None or rule_error:  # else: no answers to run the rules on
        traced = trace_rules(
            policy.id, policy.rules, named, subject=subject, state=raw, flags=normalized.flags,
            data=policy.data, features=features,
        )  # fmt: skip
    return {
        "policy": _policy_identity(policy),
        "state": normalized.value,
        "rule_state": raw,
        "flags": normalized.flags,
        "questions": questions,
        "cache_key": cache_key(request, backend=backend.name, revision=backend.model_revision) if policy.questions
        else None,
        "backend": backend.name if policy.questions else None,
        "revision": backend.model_revision if policy.questions else None,
        "answers": {key: answer.to_json() for key, answer in named.items()},
        "features": features,
        "rules": traced,
        "own_verdict": _own_verdict(verdict),
    }  # fmt: skip


def _policy_identity(policy: Policy) -> dict[str, Any]:
    return {"id": policy.id, "version": policy.version, "digest": policy.digest, "file": policy.file,
            "line": policy.line, "mode": policy.mode, "priority": policy.priority}


def _own_verdict(verdict: Verdict) -> dict[str, Any]:
    return {"action": verdict.action, "rule": verdict.rule, "status": verdict.status,
            "shadow_action": verdict.shadow_action, "fail_mode": verdict.fail_mode, "error": verdict.error}
