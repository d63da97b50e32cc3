"""The part of agent enforcement that does not depend on where it runs: evaluate a subject, settle a handoff,
apply the fail mode when the guard itself raises, and record synthetic decisions (malformed calls).

Both :class:`~guard.agents.GuardAgentMiddleware` and the guarded tool node hold one :class:`Judge`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from guard.agents._reviewer import areview, review
from guard.engine import verdicts
from guard.engine.ids import new_decision_id
from guard.errors import HandoffError
from guard.subject import AgentSubject
from guard.verdict import Action, FailMode, Verdict

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from guard.engine import Guard
    from guard.policy import Policy

__all__ = ["DEFAULT_REVIEWER_TIMEOUT_S", "Judge", "Judgement", "Outcome"]

logger = logging.getLogger("guard.agents")

DEFAULT_REVIEWER_TIMEOUT_S = 30.0
"""Seconds an LLM reviewer may take (async path) before the fail mode decides."""
MAX_PARALLEL_JUDGEMENTS = 8
"""Most subjects of one model turn judged at once by the blocking path (the async path has no limit)."""
MALFORMED_RULE = "malformed_arguments"
"""``Verdict.rule`` of the decision recorded for a malformed tool call."""


Outcome = Literal["allow", "block", "escalate", "route"]


@dataclass(frozen=True)
class Judgement:
    """What the enforcement point does with one subject.

    Attributes:
        outcome: ``allow``, ``block``, ``escalate``, or ``route`` (hand to the graph node ``node``).
        verdict: the engine's verdict (or the synthetic one for a malformed call or a guard failure).
        reason: why, when it differs from the policy's message (the reviewer's reason, a handoff failure).
        node: the graph node for ``route``.
        reviewer: the LLM reviewer that settled a handoff.
    """

    outcome: Outcome
    verdict: Verdict
    reason: str | None = None
    node: str | None = None
    reviewer: str | None = None


_FAIL_ACTIONS: dict[FailMode, Action] = {"closed": "block", "open": "allow", "escalate": "escalate"}


def _fail_outcome(mode: FailMode) -> Outcome:
    return _FAIL_ACTIONS[mode]  # type: ignore[return-value]


class Judge:
    """Evaluates agent subjects with a :class:`~guard.engine.Guard` and settles ``handoff`` verdicts.

    Args:
        guard: the engine (``match``, ``evaluate``, ``aevaluate``, ``record``).
        reviewers: handoff target name -> LangChain chat model that answers allow/deny.
        handoff_nodes: handoff target names that are graph nodes (hand-built graphs only).
        fail_mode: what a handoff that cannot be settled, or a guard that raises, turns into.
        reviewer_timeout_s: seconds an async reviewer call may take.
    """

    def __init__(
        self,
        guard: Guard,
        *,
        reviewers: Mapping[str, BaseChatModel],
        handoff_nodes: Collection[str],
        fail_mode: FailMode,
        reviewer_timeout_s: float,
    ) -> None:
        self.guard = guard
        self.reviewers = dict(reviewers)
        self.handoff_nodes = frozenset(handoff_nodes)
        self.fail_mode = fail_mode
        self.reviewer_timeout_s = reviewer_timeout_s

    def matches(self, subject: AgentSubject) -> bool:
        """Whether any policy applies (no policy: the subject passes without a model call or a record)."""
        return self.guard.match(subject) is not None

    # Verdicts -------------------------------------------------------------------------------------------------

    def _guard_failed(self, subject: AgentSubject, exc: BaseException, started: float) -> Verdict:
        logger.error(
            "guard raised while judging %s %s; fail mode %s applies",
            subject.event,
            subject.tool_name or "",
            self.fail_mode,
            exc_info=exc,
        )
        policy = self.guard.match(subject)
        verdict = verdicts.guard_failed(
            policy, self.fail_mode, exc, decision_id=new_decision_id(), latency_ms=(time.perf_counter() - started) * 1000
        )
        try:
            self._record(verdict, subject, policy)
        except Exception:
            logger.exception("recording the fail-mode decision %s failed", verdict.decision_id)
        return verdict

    def evaluate(self, subject: AgentSubject) -> Verdict:
        started = time.perf_counter()
        try:
            return self.guard.evaluate(subject)
        except Exception as exc:  # noqa: BLE001 - a raising guard gets the fail mode, never a crash or an allow
            return self._guard_failed(subject, exc, started)

    async def aevaluate(self, subject: AgentSubject) -> Verdict:
        started = time.perf_counter()
        try:
            return await self.guard.aevaluate(subject)
        except Exception as exc:  # noqa: BLE001 - a raising guard gets the fail mode, never a crash or an allow
            return self._guard_failed(subject, exc, started)

    def malformed(self, subject: AgentSubject, problem: str, raw: str | None) -> Verdict:
        """Record the decision for a malformed call (block, rule ``malformed_arguments``) and return it."""
        policy = self.guard.match(subject)
        flags: dict[str, Any] = {"malformed": problem}
        if raw is not None:
            flags["raw_arguments"] = raw[:1000]
        verdict = verdicts.refused(
            policy, decision_id=new_decision_id(), rule=MALFORMED_RULE, status=400, message=problem, flags=flags
        )
        self._record(verdict, subject, policy)
        return verdict

    def _record(self, verdict: Verdict, subject: AgentSubject, policy: Policy | None) -> None:
        self.guard.record(verdict, subject, policy=policy)
        logger.info(
            "decision %s: %s %s %s (%s)",
            verdict.decision_id,
            verdict.action,
            subject.event,
            subject.tool_name or "",
            verdict.rule,
        )

    # Judgements -----------------------------------------------------------------------------------------------

    def _settle(self, subject: AgentSubject, verdict: Verdict) -> Judgement | str:
        """A judgement for anything but a reviewer handoff; for that, the reviewer's name."""
        if verdict.action in ("allow", "block", "escalate"):
            return Judgement(verdict.action, verdict)
        target = verdict.handoff or ""
        if target in self.reviewers:
            return target
        if target in self.handoff_nodes:
            return Judgement("route", verdict, node=target)
        reason = f"handoff target {target!r} is not a reviewer or graph node of this agent"
        logger.warning("policy %s: %s; fail mode %s applies", verdict.policy_id, reason, self.fail_mode)
        return self._failed_handoff(verdict, reason)

    def _failed_handoff(self, verdict: Verdict, reason: str) -> Judgement:
        outcome = _fail_outcome(self.fail_mode)
        return Judgement(outcome, verdicts.unsettled_handoff(verdict, self.fail_mode, reason), reason=reason)

    @staticmethod
    def _reviewed(target: str, verdict: Verdict, decision: str, reason: str) -> Judgement:
        outcome: Outcome = "allow" if decision == "allow" else "block"
        text = f"reviewer {target} denied it: {reason}" if outcome == "block" else reason
        return Judgement(outcome, verdict, reason=text or None, reviewer=target)

    def judge(self, subject: AgentSubject) -> Judgement:
        """Evaluate ``subject`` and settle a handoff (blocking)."""
        verdict = self.evaluate(subject)
        settled = self._settle(subject, verdict)
        if isinstance(settled, Judgement):
            return settled
        try:
            answer = review(settled, self.reviewers[settled], subject, verdict)
        except HandoffError as exc:
            return self._failed_handoff(verdict, str(exc))
        return self._reviewed(settled, verdict, answer.decision, answer.reason)

    async def ajudge(self, subject: AgentSubject) -> Judgement:
        """Async twin of :meth:`judge`."""
        verdict = await self.aevaluate(subject)
        settled = self._settle(subject, verdict)
        if isinstance(settled, Judgement):
            return settled
        try:
            answer = await areview(settled, self.reviewers[settled], subject, verdict, timeout=self.reviewer_timeout_s)
        except HandoffError as exc:
            return self._failed_handoff(verdict, str(exc))
        return self._reviewed(settled, verdict, answer.decision, answer.reason)

    def judge_all(self, subjects: list[AgentSubject]) -> list[Judgement]:
        """Judge several subjects concurrently on worker threads (blocking); one decision each."""
        if len(subjects) < 2:
            return [self.judge(s) for s in subjects]
        with ThreadPoolExecutor(max_workers=min(len(subjects), MAX_PARALLEL_JUDGEMENTS)) as pool:
            return list(pool.map(lambda s: contextvars.copy_context().run(self.judge, s), subjects))

    async def ajudge_all(self, subjects: list[AgentSubject]) -> list[Judgement]:
        """Judge several subjects concurrently (one decision each)."""
        return list(await asyncio.gather(*(self.ajudge(s) for s in subjects)))
