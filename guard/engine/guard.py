"""``Guard.evaluate(subject) -> Verdict``.

For one subject: find every policy that matches (never reads the body); take each one's plan
(:mod:`guard.engine.plan`: render the state, normalise it, apply the fields' caps, hash the cache key); read the
probability cache or ask the backend within the policy's timeout; apply the rules; make the verdict and record it
(:mod:`guard.engine.verdicts`). When several policies match, policies that share a backend, model and state are asked
in one request (each distinct question once, :func:`~guard.engine.plan.group_plans`), each policy's rules make its
own verdict, and :func:`~guard.engine.verdicts.combined` picks the one that decides (the most severe,
:data:`~guard.verdict.ACTIONS`); the others stay in ``Verdict.contributions``. A policy without questions
(rules only) is decided without a model call.

``aevaluate`` never raises for backend, cache or rule trouble: each policy's fail mode decides for that policy, and
its verdict says so (``fail_mode``, ``error``, ``rule="on_error"``). Shadow policies compute and record the verdict
but allow. A field with ``truncate: error`` over its cap is blocked without a model call (status 413, rule
``state_too_long``), as is a request that sends a value the policy reads as one more than once (status 400, rule
``state_ambiguous``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from guard.backends import start_backend
from guard.backends.base import DecisionBackend
from guard.engine import verdicts
from guard.engine.cache import (
    CacheConfig,
    CachedAnswers,
    Lookup,
    MemoryCache,
    ProbabilityCache,
    RedisCache,
    Unstored,
)
from guard.engine.health import (
    FailureTracker,
    HealthMonitor,
    call_severity,
    error_code,
    health_report,
    refused_config,
)
from guard.engine.ids import new_decision_id
from guard.engine.keys import scoped_key
from guard.engine.plan import Group, Plan, group_plans
from guard.engine.telemetry import DecisionLog, Telemetry
from guard.engine.verdicts import STATE_TOO_LONG_RULE, STATE_TOO_LONG_STATUS
from guard.errors import BackendError, BackendUnavailable, PolicyError, StateAmbiguous, StateTooLong
from guard.policy import Policy, PolicySet, load_files
from guard.policy.model import MAX_TIMEOUT_MS
from guard.subject import HttpSubject, Subject, carries_over
from guard.systemone import SystemOneRequestV1
from guard.systemone.answers import encode_checked
from guard.verdict import Verdict

__all__ = ["DEFAULT_BACKEND", "MAX_BACKGROUND_SHADOW", "STATE_TOO_LONG_RULE", "STATE_TOO_LONG_STATUS", "Guard"]

logger = logging.getLogger("guard.engine")

#: Backend name used when ``Guard`` is given a single backend, and by policies that name none.
DEFAULT_BACKEND = "default"
#: Per-policy plans kept before the table starts over (plans of policies no longer loaded are dropped as new plans
#: are made).
MAX_PLANS = 256
#: Most shadow decisions finishing in the background at once (:meth:`Guard._compose`): past it, a request an enforced
#: policy also matches does not ask its shadow policies' questions, so slow shadow calls cannot take the backends'
#: connections from enforced ones (a backend's pool is 100 connections by default).
MAX_BACKGROUND_SHADOW = 32
#: Characters of request data (:func:`~guard.subject.carries_over`) past which a decision renders its state and runs
#: rules that read request data on a thread: on the event loop, a policy whose rules read a 1 MB body with the
#: payload detectors held every other request for about a second (``bench/decision_off_loop.py``).
INLINE_DECISION_CHARS = 64 * 1024
#: Seconds :meth:`Guard.aclose` waits, per loop, for model calls whose callers went at their deadline (each ends
#: within its policy's ``timeout_ms``, at most ``MAX_TIMEOUT_MS``) before closing without them.
CLOSE_WAIT_S = MAX_TIMEOUT_MS / 1000 + 1
#: Seconds the sync facade's loop waits for the tasks it cancels as it closes.
CANCEL_WAIT_S = 1.0

T = TypeVar("T")

class _Portal:
    """A private event loop in a daemon thread, so the sync facade works from any thread (with or without a loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="guard-portal", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Cancel the tasks still running on the loop and wait for them, then stop and close it."""
        self.call(_cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Guard:
    """Evaluates subjects against policies with a decision backend.

    Args:
        policies: a :class:`PolicySet` (or a sequence of policies), in match order.
        backends: one backend, or a mapping name -> backend that policies select with ``backend:``. A policy that
            names none uses ``"default"``, or the only backend when there is one.
        cache: a probability cache; ``None`` = an in-process :class:`MemoryCache`.
        telemetry: spans and counters; ``None`` = the global OpenTelemetry providers.
        decision_log: where decision records go; ``None`` = nowhere.

    Raises:
        PolicyError: when a policy names a backend that is not in ``backends`` (names the file and line).

    The Guard owns the backends and cache it is given: :meth:`aclose` closes them.

    Example:
        >>> async with Guard.from_files("policies/api_abuse.yaml", backends=backend) as guard:  # doctest: +SKIP
        ...     verdict = await guard.aevaluate(HttpSubject(method="POST", path="/v1/chat", body={"prompt": "hi"}))
    """

    def __init__(
        self,
        policies: PolicySet | Sequence[Policy],
        *,
        backends: DecisionBackend | Mapping[str, DecisionBackend],
        cache: ProbabilityCache | None = None,
        telemetry: Telemetry | None = None,
        decision_log: DecisionLog | None = None,
    ) -> None:
        self.backends: dict[str, DecisionBackend] = (
            dict(backends) if isinstance(backends, Mapping) else {DEFAULT_BACKEND: backends}
        )
        if not self.backends:
            raise ValueError("Guard needs at least one backend")
        self.policies = policies if isinstance(policies, PolicySet) else PolicySet(policies)
        self._check_backends(self.policies.policies)
        self.policies.validator = self._check_backends
        self.cache = cache if cache is not None else MemoryCache()
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.decision_log = decision_log
        self._portal: _Portal | None = None
        self._portal_lock = threading.Lock()
        self._closed = False
        #: Shadow policies' decisions finishing in the background (:meth:`_compose`), on whichever loop started them.
        self._background: set[asyncio.Future[Any]] = set()
        self._background_lock = threading.Lock()
        #: Group calls of :meth:`_compose` still running, on whichever loop started them (close waits for them).
        self._calls: set[asyncio.Future[Any]] = set()
        self._plans: dict[int, tuple[Plan, str]] = {}  # id(policy) -> (plan, backend name)
        self._groups: dict[tuple[int, ...], tuple[tuple[Plan, ...], tuple[Group, ...]]] = {}  # id(plan)s -> groups
        #: Each backend's recent model calls (:meth:`health`); a call is counted on a cache miss only.
        self.backend_health: dict[str, FailureTracker] = {name: FailureTracker() for name in self.backends}
        #: The canary monitor, once a :class:`~guard.engine.health.HealthMonitor` is made for this Guard: a backend
        #: failing its canary gets no model calls (the policy's fail mode decides) until it passes again.
        self.monitor: HealthMonitor | None = None
        #: backend name -> its canary epoch, moved on by each canary failure and recovery (:class:`Plan`'s
        #: ``epoch``; :meth:`HealthMonitor._share_epoch`)
        self.canary_epochs: dict[str, int] = {}

    @classmethod
    def from_files(
        cls,
        *paths: str | Path,
        backends: DecisionBackend | Mapping[str, DecisionBackend],
        redis_url: str | None = None,
        cache_config: CacheConfig | None = None,
        telemetry: Telemetry | None = None,
        decision_log: DecisionLog | None = None,
    ) -> Guard:
        """Load policy files and build a Guard with a Redis cache when ``redis_url`` is given, else in-process.

        Raises:
            PolicyError: for the first invalid file (file, line, key) or a policy naming an unknown backend.
        """
        config = cache_config or CacheConfig()
        if redis_url is not None:
            config = CacheConfig(**{**config.__dict__, "url": redis_url})
        cache: ProbabilityCache = RedisCache(config) if config.url else MemoryCache(config)
        return cls(load_files(*paths), backends=backends, cache=cache, telemetry=telemetry, decision_log=decision_log)

    # Backends ---------------------------------------------------------------------------------------------------

    def _backend_name(self, policy: Policy) -> str | None:
        if policy.backend is not None:
            return policy.backend if policy.backend in self.backends else None
        if DEFAULT_BACKEND in self.backends:
            return DEFAULT_BACKEND
        return next(iter(self.backends)) if len(self.backends) == 1 else None

    def _check_backends(self, policies: Sequence[Policy]) -> None:
        """Every policy names a known backend, and that backend can answer its questions (checked now, not on the
        first request, for backends that can tell: the compact model's ``explain(question)``; a local Clef model's
        ``explain`` and ``explain_questions``, whether the questions fit its prompt limit)."""
        for policy in policies:
            name = self._backend_name(policy)
            if name is None:
                wanted = policy.backend or DEFAULT_BACKEND
                raise PolicyError(
                    policy.file,
                    policy.line,
                    "backend",
                    f"policy {policy.id!r} uses backend {wanted!r}, which is not one of {sorted(self.backends)}",
                )
            explain = getattr(self.backends[name], "explain", None)
            if not callable(explain):
                continue
            for question in policy.questions:
                reason = explain(question.wire)
                if reason is not None:
                    raise PolicyError(
                        policy.file,
                        question.line,
                        question.path,
                        f"backend {name!r} cannot answer question {question.key!r} ({question.wire.id}): {reason}",
                    )
            together = getattr(self.backends[name], "explain_questions", None)
            if callable(together) and len(policy.questions) > 1:  # they all go out in one request
                reason = together([q.wire for q in policy.questions])
                if reason is not None:
                    raise PolicyError(
                        policy.file, policy.line, policy.questions[0].path.rpartition(".")[0],  # the questions key
                        f"backend {name!r} cannot answer policy {policy.id!r}'s questions in one request: {reason}",
                    )  # fmt: skip

    def backend_for(self, policy: Policy) -> DecisionBackend:
        """The backend that answers ``policy``'s questions."""
        name = self._backend_name(policy)
        if name is None:  # pragma: no cover - prevented by _check_backends
            raise KeyError(policy.backend)
        return self.backends[name]

    def _plan(self, policy: Policy) -> Plan:
        """``policy``'s plan, made again when the policy object, its backend or the backend's revision changed. A
        rules-only policy's plan never reads the backend's revision (or anything else of it): no model answers it."""
        known = self._plans.get(id(policy))
        if known is not None:
            plan, name = known
            backend = plan.backend
            if (
                plan.policy is policy
                and self._backend_name(policy) == name  # the name resolves as when the plan was made ...
                and self.backends[name] is backend  # ... to the same backend, at the same revision
                and (plan.no_answers is not None or plan.revision == backend.model_revision)
                and plan.epoch == self.canary_epochs.get(name, 0)
            ):
                return plan
        backend = self.backend_for(policy)
        chosen = self._backend_name(policy)
        assert chosen is not None  # backend_for found it
        live = self.policies.policies  # plans of policies a reload replaced go (with their state memos)
        for key, (old, _) in list(self._plans.items()):
            if not any(old.policy is p for p in live):
                self._plans.pop(key, None)
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        revision = backend.model_revision if policy.questions else ""
        plan = Plan(policy, backend, revision, self.canary_epochs.get(chosen, 0))
        self._plans[id(policy)] = (plan, chosen)
        return plan

    # Evaluation ---------------------------------------------------------------------------------------------------

    def match(self, subject: Subject) -> Policy | None:
        """The first policy whose ``match`` accepts ``subject`` (method/path/host/headers or event/tool), or None
        (:meth:`matching` gives every one)."""
        return self.policies.match(subject)

    def watching(self, request: HttpSubject) -> tuple[Policy, ...]:
        """The response policies that judge ``request``'s response (``match.http.response``), in match order."""
        return self.policies.watching(request)

    def matching(self, subject: Subject) -> tuple[Policy, ...]:
        """Every policy whose ``match`` accepts ``subject``, in match order; empty when none does."""
        return self.policies.matching(subject)

    async def aevaluate(self, subject: Subject, *, policies: Sequence[Policy] | None = None,
                        cache_scope: str | None = None, views: Mapping[str, Subject] | None = None) -> Verdict:
        """Decide one subject. Never raises for backend, cache or rule trouble: each policy's fail mode decides.

        Args:
            subject: what to decide.
            policies: the policies :meth:`matching` already returned for this subject (an enforcement point that
                matched before reading the body passes them, so matching is not done twice); ``None`` = match now.
            cache_scope: keeps this decision's cache entries (and in-flight model calls) apart from those of other
                scopes (:func:`~guard.engine.keys.scoped_key`): the request's tenant, so that one tenant cannot time
                whether another sent the same text; ``None``: the entries every unscoped decision shares.
            views: policy id to the subject that policy judges where it is not ``subject``: a request matched on
                several views of its path judges each policy on the first view it matched
                (:meth:`~guard.policy.PolicyView.matching_views`, :func:`~guard.policy.loader.policy_subjects`). The
                decision is recorded with the subject the deciding policy judged.

        Returns:
            The :class:`Verdict`; ``allow`` with ``policy_id=None`` (and no model call) when no policy matches; when
            several match, the one :func:`~guard.engine.verdicts.combined` picks, with every policy's own verdict
            in ``contributions``.
        """
        started = time.perf_counter()
        decision_id = new_decision_id()
        if policies is None:
            policies = self.policies.matching(subject)
        views = views or {}
        if not self.telemetry.tracing:  # no span to start: no context manager either (part of every cache hit)
            return await self._decided(None, policies, subject, decision_id, started, cache_scope, views)
        with self.telemetry.span(subject) as span:
            return await self._decided(span, policies, subject, decision_id, started, cache_scope, views)

    async def _decided(
        self, span: Any, policies: Sequence[Policy], subject: Subject, decision_id: str, started: float,
        cache_scope: str | None, views: Mapping[str, Subject],
    ) -> Verdict:
        """Decide (:meth:`_decide_all`) and record the decision (:meth:`_conclude`; on a worker thread where
        :meth:`_logs_off_loop`)."""
        verdict, lookup = await self._decide_all(policies, subject, decision_id, started, cache_scope, views)
        if self._logs_off_loop(verdict, subject):
            return await asyncio.to_thread(self._conclude, span, policies, subject, verdict, lookup, views=views,
                                           decision_log=self._loop_writes())  # fmt: skip
        return self._conclude(span, policies, subject, verdict, lookup, views=views)

    def _logs_off_loop(self, verdict: Verdict, subject: Subject) -> bool:
        """Whether the decision is recorded on a thread: its decision-log record copies and redacts every key and
        string of the request (seconds for a body of tens of thousands of keys), so past
        :data:`INLINE_DECISION_CHARS` of request data it is built off the event loop (:meth:`_loop_writes`); the
        record is still written on the loop, before :meth:`aevaluate` returns and the decision is acted on."""
        return (self.decision_log is not None and verdict.policy_id is not None
                and carries_over(subject, INLINE_DECISION_CHARS))

    def _loop_writes(self) -> _LoopWrites:
        """The decision log for a decision recorded on a worker thread (called on the event loop)."""
        assert self.decision_log is not None
        return _LoopWrites(self.decision_log, asyncio.get_running_loop())

    def _conclude(
        self, span: Any, policies: Sequence[Policy], subject: Subject, verdict: Verdict, lookup: Lookup | None, *,
        views: Mapping[str, Subject] | None = None, decision_log: DecisionLog | _LoopWrites | None = None,
    ) -> Verdict:
        """Record the decision (``span`` ``None``: none was started) under the policy that decided, with the subject
        it judged (``views``: :meth:`aevaluate`'s), to ``decision_log`` (``None``: the guard's own)."""
        policy = next((p for p in policies if p.id == verdict.policy_id), None)
        if views and policy is not None:
            subject = views.get(policy.id, subject)
        return verdicts.record(
            self.telemetry, decision_log if decision_log is not None else self.decision_log, verdict, subject,
            policy=policy, cache=lookup, span=span, matched=policies,
        )

    def record(self, verdict: Verdict, subject: Subject, *, policy: Policy | None) -> Verdict:
        """Record a verdict an enforcement point made without :meth:`aevaluate` (a refused body, a malformed tool
        call, a guard that raised) the way every decision is recorded: counters, a span, the decision log."""
        with self.telemetry.span(subject) as span:
            return self._conclude(span, (policy,) if policy is not None else (), subject, verdict, None)

    async def _decide_all(
        self, policies: Sequence[Policy], subject: Subject, decision_id: str, started: float, cache_scope: str | None,
        views: Mapping[str, Subject],
    ) -> tuple[Verdict, Lookup | None]:
        if not policies:
            return verdicts.no_match(decision_id, _since(started)), None
        if len(policies) == 1:
            return await self._decide(policies[0], views.get(policies[0].id, subject), decision_id, started,
                                      cache_scope)  # fmt: skip
        return await self._compose(tuple(policies), subject, decision_id, started, cache_scope, views)

    async def _decide(
        self, policy: Policy, subject: Subject, decision_id: str, started: float, cache_scope: str | None
    ) -> tuple[Verdict, Lookup | None]:
        """One matching policy (the hot path)."""
        state: Any = None
        flags: dict[str, Any] = {}
        lookup: Lookup | None = None
        response = None
        try:
            policy.check_repeated(subject)
            plan = self._plan(policy)  # reads the backend's revision (a policy with questions), which may fail
            large = carries_over(subject, INLINE_DECISION_CHARS)
            # rules read ``raw``; the model and the cache ``state``
            raw, state, flags, key = await _run(large, plan.prepare, subject, cache_scope)
            key = scoped_key(key, cache_scope)
            if plan.no_answers is not None:  # rules only: no model call, no cache
                cached = plan.no_answers
            else:
                self._refuse_failed_canary(self._backend_name(policy) or DEFAULT_BACKEND, plan.backend)
                # An in-process hit is answered inline: no timeout, no flight, no await.
                cached = self.cache.peek(key) if policy.cache_ttl > 0 else None
                if cached is not None:
                    lookup = "hit"
                else:
                    request = policy.build_request(state)
                    cached, lookup = await self._fetch(
                        request, plan.backend, key, name=self._backend_name(policy) or DEFAULT_BACKEND,
                        timeout=policy.timeout, ttl=policy.cache_ttl, revision=plan.revision,
                    )
            response = cached.response
            outcome = await _run(large and plan.memo_flags is None, plan.outcome, cached, subject=subject, state=raw,
                                 flags=flags)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every failure goes to the fail mode; none escapes as a 500
            model = getattr(response, "model", None)  # None when no model answered
            return self._failed(policy, subject, exc, decision_id, started, state, flags, model), lookup
        # a redact outcome looks for its spans in every string of the body: on a thread for a large one
        verdict = await _run(
            large and outcome["redact"] is not None, verdicts.answered, policy, outcome, decision_id=decision_id,
            cache_hit=lookup in ("hit", "shared"), latency_ms=_since(started), state=state, flags=flags,
            subject=subject,
        )  # fmt: skip
        return verdict, lookup

    async def _compose(
        self, policies: tuple[Policy, ...], subject: Subject, decision_id: str, started: float,
        cache_scope: str | None, views: Mapping[str, Subject],
    ) -> tuple[Verdict, Lookup | None]:
        """Several matching policies: one request per :class:`~guard.engine.plan.Group` (started together), each
        policy waiting for its group's answers within its own timeout, then its own rules; then
        :func:`~guard.engine.verdicts.combined`. When an enforced policy matches, a shadow policy whose answers are not
        in once the enforced ones have decided is left out of the verdict and finishes in the background
        (:meth:`_finish_shadow`, recorded apart under the same decision id; :meth:`drain` waits for it). Each policy
        judges its own subject (``views``, :meth:`aevaluate`'s): policies are grouped among those that judge the same
        one."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        own: dict[int, Verdict] = {}  # id(policy) -> its verdict
        lookups: list[Lookup] = []
        by_subject: dict[int, tuple[Subject, list[Plan]]] = {}  # id(subject) -> the plans of the policies judging it
        for policy in policies:
            judged = views.get(policy.id, subject)
            try:
                policy.check_repeated(judged)  # per policy: policies asked together may read different headers
                by_subject.setdefault(id(judged), (judged, []))[1].append(self._plan(policy))
            except Exception as exc:  # noqa: BLE001 - this policy's fail mode decides for it
                own[id(policy)] = self._failed(policy, judged, exc, decision_id, started, None, {}, None)
        asks: list[tuple[Group, Subject, Any, Any, dict[str, Any], CachedAnswers | asyncio.Future[Any] | None]] = []
        enforcing = any(policy.mode != "shadow" for policy in policies)
        large = carries_over(subject, INLINE_DECISION_CHARS)
        with self._background_lock:
            crowded = enforcing and len(self._background) >= MAX_BACKGROUND_SHADOW
        grouped = [(judged, group) for judged, plans in by_subject.values() for group in self._grouped(tuple(plans))]
        for judged, group in grouped:
            if crowded and group.questions and group.plans[0].policy.mode == "shadow":
                # as many late shadow decisions as the cap are running: this one is not asked (groups split by mode)
                logger.debug("shadow policies %s not asked: %d late shadow decisions running",
                             [plan.policy.id for plan in group.plans], MAX_BACKGROUND_SHADOW)
                for plan in group.plans:
                    self.telemetry.shadow_skipped.add(1, {"guard.policy.id": plan.policy.id})
                continue
            try:
                raw, state, flags, key = await _run(large, group.prepare, judged, cache_scope)
                key = scoped_key(key, cache_scope)
            except Exception as exc:  # noqa: BLE001 - a state too long (or a failing render) for every member
                for plan in group.plans:
                    own[id(plan.policy)] = self._failed(plan.policy, judged, exc, decision_id, started, None, {}, None)
                continue
            source: CachedAnswers | asyncio.Future[Any] | None = None  # None: rules only
            if group.questions:
                try:
                    self._refuse_failed_canary(self._backend_name(group.plans[0].policy) or DEFAULT_BACKEND,
                                               group.plans[0].backend)  # fmt: skip
                except BackendUnavailable as exc:
                    for plan in group.plans:
                        own[id(plan.policy)] = self._failed(plan.policy, judged, exc, decision_id, started, None, {},
                                                            None)  # fmt: skip
                    continue
                source = self.cache.peek(key) if group.ttl > 0 else None
                if source is None:
                    request = group.request(state)
                    source = asyncio.ensure_future(
                        self._fetch(
                            request, group.plans[0].backend, key,
                            name=self._backend_name(group.plans[0].policy) or DEFAULT_BACKEND,
                            timeout=group.timeout, ttl=group.ttl, revision=group.plans[0].revision,
                        )
                    )
                    source.add_done_callback(_retrieve)
                    with self._background_lock:
                        self._calls.add(source)
                    source.add_done_callback(self._forget_call)
            asks.append((group, judged, raw, state, flags, source))
        # Enforced policies first; a shadow policy never holds up the verdict of an enforced one: when any enforced
        # policy matched, a shadow policy whose answers are not in yet finishes in the background and is recorded
        # as a decision of its own when it does (same decision id).
        late: list[tuple[Plan, Subject, Any, Any, dict[str, Any], asyncio.Future[Any]]] = []
        for shadow_pass in (False, True):
            for group, judged, raw, state, flags, source in asks:
                for plan in group.plans:
                    if (plan.policy.mode == "shadow") != shadow_pass:
                        continue
                    if (shadow_pass and enforcing and isinstance(source, asyncio.Future) and not source.done()):
                        late.append((plan, judged, raw, state, flags, source))
                        continue
                    verdict, lookup = await self._own(plan, judged, raw, state, flags, source, decision_id, started,
                                                      began)  # fmt: skip
                    own[id(plan.policy)] = verdict
                    if lookup is not None:
                        lookups.append(lookup)
        for plan, judged, raw, state, flags, source in late:
            self._later(self._finish_shadow(plan, judged, raw, state, flags, source, decision_id, started, began))
        decided = tuple(policy for policy in policies if id(policy) in own)
        contributions = [own[id(policy)] for policy in decided]
        verdict = verdicts.combined(decided, contributions, decision_id=decision_id, latency_ms=_since(started))
        return verdict, _combined_lookup(lookups)

    async def _own(
        self, plan: Plan, subject: Subject, raw: Any, state: Any, flags: dict[str, Any],
        source: CachedAnswers | asyncio.Future[Any] | None, decision_id: str, started: float, began: float,
    ) -> tuple[Verdict, Lookup | None]:
        """One policy's own verdict in :meth:`_compose`: its group's answers (``source``: cached, a call in flight,
        or ``None`` for rules only) within its own timeout (counted from ``began``, a loop time), then its rules."""
        policy, policy_flags = plan.policy, dict(flags)
        lookup: Lookup | None = None
        response = None
        try:
            if source is None:
                cached = plan.no_answers
                assert cached is not None  # a group without questions holds one rules-only plan
            elif isinstance(source, CachedAnswers):
                cached, lookup = source, "hit"
            else:
                loop = asyncio.get_running_loop()
                left = max(began + policy.timeout - loop.time(), 0.0)
                cached, lookup = await asyncio.wait_for(asyncio.shield(source), left)
            response = cached.response
            off_loop = plan.memo_flags is None and carries_over(subject, INLINE_DECISION_CHARS)
            outcome = await _run(off_loop, plan.outcome, cached, subject=subject, state=raw, flags=policy_flags)
        except Exception as exc:  # noqa: BLE001 - this policy's fail mode decides for it
            model = getattr(response, "model", None)
            return self._failed(policy, subject, exc, decision_id, started, state, policy_flags, model), None
        # a redact outcome looks for its spans in every string of the body: on a thread for a large one
        verdict = await _run(
            outcome["redact"] is not None and carries_over(subject, INLINE_DECISION_CHARS), verdicts.answered, policy,
            outcome, decision_id=decision_id, cache_hit=lookup in ("hit", "shared"), latency_ms=_since(started),
            state=state, flags=policy_flags, subject=subject,
        )  # fmt: skip
        return verdict, lookup

    async def _finish_shadow(
        self, plan: Plan, subject: Subject, raw: Any, state: Any, flags: dict[str, Any], source: asyncio.Future[Any],
        decision_id: str, started: float, began: float,
    ) -> None:
        """A shadow policy whose answers came after the enforced verdict was returned: its verdict, recorded as a
        decision of its own (counters, span, decision log) under the same decision id."""
        try:
            verdict, lookup = await self._own(plan, subject, raw, state, flags, source, decision_id, started, began)
            off_loop = self._logs_off_loop(verdict, subject)
            decision_log = self._loop_writes() if off_loop else self.decision_log
            if not self.telemetry.tracing:
                await _run(off_loop, verdicts.record, self.telemetry, decision_log, verdict, subject,
                           policy=plan.policy, cache=lookup)  # fmt: skip
                return
            with self.telemetry.span(subject) as span:
                await _run(off_loop, verdicts.record, self.telemetry, decision_log, verdict, subject,
                           policy=plan.policy, cache=lookup, span=span)  # fmt: skip
        except Exception:
            logger.exception("recording shadow policy %s of decision %s failed", plan.policy.id, decision_id)

    def _later(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background on the running loop, tracked so :meth:`aclose` / :meth:`close` wait for it."""
        task = asyncio.ensure_future(coro)
        with self._background_lock:
            self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        with self._background_lock:
            self._background.discard(task)

    def _forget_call(self, task: asyncio.Future[Any]) -> None:
        with self._background_lock:
            self._calls.discard(task)

    async def _drain(self) -> None:
        """Wait for the background shadow decisions running on this loop (each is bounded by its policy's
        ``timeout_ms``)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._background_lock:
                mine = [task for task in self._background if task.get_loop() is loop]
            if not mine:
                return
            await asyncio.gather(*mine, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until every shadow policy's decision still running in the background (:meth:`aevaluate` returns an
        enforced verdict without waiting for a slow shadow policy) is recorded: those on this loop and on the sync
        facade's. :meth:`aclose` and :meth:`close` do this first."""
        await self._drain()
        with self._portal_lock:
            portal = self._portal
        if portal is not None:
            await asyncio.to_thread(portal.call, self._drain())

    def _grouped(self, plans: tuple[Plan, ...]) -> tuple[Group, ...]:
        """:func:`~guard.engine.plan.group_plans` of ``plans``, worked out once per set of plans."""
        token = tuple(id(plan) for plan in plans)
        known = self._groups.get(token)
        if known is not None and all(a is b for a, b in zip(known[0], plans, strict=True)):
            return known[1]
        if len(self._groups) >= MAX_PLANS:
            self._groups.clear()
        groups = group_plans(plans)
        self._groups[token] = (plans, groups)
        return groups

    def _failed(
        self, policy: Policy, subject: Subject, exc: Exception, decision_id: str, started: float, state: Any,
        flags: dict[str, Any], model: str | None,
    ) -> Verdict:
        """``policy``'s verdict when deciding it failed: the block for a state it will not judge (too long, or a
        value sent twice), else its fail mode."""
        backend = self.backend_for(policy)
        if isinstance(exc, (StateTooLong, StateAmbiguous)):
            return verdicts.state_refused(
                policy, exc, decision_id=decision_id, backend=backend.name, model_revision=_revision(backend),
                latency_ms=_since(started), flags=flags,
            )  # fmt: skip
        return verdicts.fail_mode(
            policy, subject, exc, decision_id=decision_id, backend=backend.name, model=model,
            model_revision=_revision(backend), latency_ms=_since(started), state=state, flags=flags,
        )  # fmt: skip

    async def _fetch(
        self, request: SystemOneRequestV1, backend: DecisionBackend, key: str, *, name: str, timeout: float,
        ttl: float, revision: str,
    ) -> tuple[CachedAnswers, Lookup]:
        """The answers on a miss of the in-process peek: from the cache's store, a flight in progress or the backend
        (registered as ``name``: its calls count in :attr:`backend_health`), within ``timeout`` seconds (the backend
        is told what is left of it). ``revision`` is the model revision ``key`` names: answers the backend gave as
        another one (it learns its revision from each answer, as a System One client behind a rolling update does)
        are used for this call and not stored under ``key``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        tracker = self.backend_health.get(name) or self.backend_health.setdefault(name, FailureTracker())

        async def compute() -> Any:
            self._refuse_failed_canary(name, backend)  # it may have failed while this request waited
            try:
                try:
                    answer = await backend.decide(request, timeout=max(deadline - loop.time(), 0.001))
                except asyncio.CancelledError as exc:
                    task = asyncio.current_task()
                    if task is not None and not task.cancelling():  # the backend's own, nobody cancelled the call
                        raise BackendError("the backend call ended in CancelledError though nobody cancelled it",
                                           backend=name, reason="cancelled") from exc
                    if loop.time() >= deadline - 0.001:  # the policy's timeout, not a caller that went away
                        tracker.failure("backend_timeout", f"no answer within {timeout * 1000:g} ms",
                                        severity="degraded")
                        self._suspect(name)
                    raise
                encode_checked(answer, request)  # an answer the cache refuses counts against the backend too
            except Exception as exc:
                tracker.failure(error_code(exc), f"{type(exc).__name__}: {exc}", severity=call_severity(exc),
                                refused_config=refused_config(exc))
                self._suspect(name)
                raise
            tracker.success()
            if self.monitor is not None:
                self.monitor.answered(name)
            return answer if backend.model_revision == revision else Unstored(answer)

        self._refuse_failed_canary(name, backend)  # not even a stored answer: it may be the broken model's
        async with asyncio.timeout(timeout):
            return await self.cache.fetch(key, request, compute, ttl=ttl, wait=timeout)

    def _suspect(self, name: str) -> None:
        """A live call to backend ``name`` failed: the health monitor, when one is attached, runs its canaries."""
        if self.monitor is not None:
            self.monitor.suspect(name)

    def _refuse_failed_canary(self, name: str, backend: DecisionBackend) -> None:
        """While backend ``name`` fails its canary (:class:`~guard.engine.health.HealthMonitor`), none of its answers
        are used, cached ones included (they may be the broken model's): the policy's fail mode decides, and the
        monitor runs the canaries again (at most every ``RECHECK_INTERVAL_S``), so a recovered backend is used again
        without waiting for the next periodic run.

        Raises:
            BackendUnavailable: reason ``canary_failed``.
        """
        monitor = self.monitor
        if monitor is not None:
            monitor.follow_policies(name)  # a reload since its last canary run: run them for the new questions
        if monitor is not None and name in monitor.canary_failed:
            monitor.suspect(name)  # run the canaries again soon: a backend that recovered is used again
            raise BackendUnavailable(
                f"backend {name!r} failed its canary self-test; its answers are not used",
                backend=backend.name,
                reason="canary_failed",
            )

    def evaluate(self, subject: Subject) -> Verdict:
        """Sync twin of :meth:`aevaluate`: runs it on the Guard's private event-loop thread, so it is safe from any
        thread, with or without a running loop (the calling thread blocks until the verdict is ready).

        Raises:
            RuntimeError: when the Guard is closed.
        """
        return self._portal_call(self.aevaluate(subject))

    def _portal_call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("this Guard is closed; create a new one")
        with self._portal_lock:
            if self._portal is None:
                self._portal = _Portal()
            portal = self._portal
        return portal.call(coro)

    def health(self) -> dict[str, Any]:
        """The full health report (:func:`guard.engine.health.health_report`): ``{"status": "ok" | "degraded" |
        "failing", "ready", "checks": {part: code}, "details": {...}}``. ``failing`` while no policy is loaded, a
        backend's last model call failed (within 30 s) or its canary fails; ``degraded`` for a Redis error, a forged
        or corrupt value read from Redis, or a failed reload. ``details`` holds error text: show it to admins only
        (:func:`guard.engine.health.public_health` keeps the codes)."""
        return health_report(self)

    def reload(self) -> None:
        """Reload the policy files; a failure keeps the last good policies and raises :class:`PolicyError`."""
        self.policies.reload()

    # Lifecycle --------------------------------------------------------------------------------------------------

    async def _close_loop(self) -> None:
        """Wait for the model calls still running on this loop (their callers may have gone at their deadline; each
        call is bounded by its policy's ``timeout_ms``), then close the cache's part on this loop; at most
        :data:`CLOSE_WAIT_S` in all (a backend that ignores cancellation cannot hold closing up for ever)."""
        closing = asyncio.ensure_future(self._finish_calls())
        done, _ = await asyncio.wait([closing], timeout=CLOSE_WAIT_S)
        if not done:
            logger.warning("model calls still running %.0f s after closing began; closing without them", CLOSE_WAIT_S)

    async def _finish_calls(self) -> None:
        loop = asyncio.get_running_loop()
        with self._background_lock:
            calls = [task for task in self._calls if task.get_loop() is loop]
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)
        await self.cache.aclose()

    async def _close_resources(self) -> None:
        await self._close_loop()
        for backend in self.backends.values():
            await backend.aclose()

    async def aclose(self) -> None:
        """Stop the health monitor's runs and close the cache, the backends and the sync portal, once the model calls
        still running (a caller gone at its deadline leaves its call to end within its ``timeout_ms``) have ended.
        Idempotent."""
        if self._closed:
            return
        await self.drain()  # shadow decisions still running record before the backends close
        self._closed = True
        if self.monitor is not None:  # its runs ask the backends closed below
            await self.monitor.aclose()
        with self._portal_lock:
            portal, self._portal = self._portal, None
        if portal is not None:
            await asyncio.to_thread(portal.call, self._close_loop())
            await asyncio.to_thread(portal.stop)
        await self._close_resources()
        if self.decision_log is not None:  # waits for its queued lines, within a bound
            await asyncio.to_thread(self.decision_log.close)

    def close(self) -> None:
        """Sync twin of :meth:`aclose`.

        Raises:
            RuntimeError: when called from a thread whose event loop is running (use ``await aclose()``).
        """
        if self._closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Guard.close() called inside a running event loop; use 'await guard.aclose()'")
        with self._portal_lock:
            portal = self._portal
        if portal is not None:
            portal.call(self._drain())  # shadow decisions still running record before the backends close
            self._closed = True
            self._portal = None
            if self.monitor is not None:
                portal.call(self.monitor.aclose())
            portal.call(self._close_resources())
            portal.stop()
            if self.decision_log is not None:
                self.decision_log.close()
        else:
            asyncio.run(self.aclose())

    async def astart(self) -> None:
        """Start every backend (:func:`~guard.backends.start_backend`: a :class:`~guard.backends.local.LocalBackend`
        starts its batcher and runs its self-test, the compact model reads a warm-up text), so the first decision's
        deadline is not spent warming a model up. ``async with guard`` calls it, and ``with guard`` runs it on the
        loop the sync :meth:`evaluate` uses; idempotent. Call it on the event loop that calls :meth:`aevaluate`.

        Raises:
            BackendUnavailable: a backend failed its startup self-test.
        """
        for backend in {id(backend): backend for backend in self.backends.values()}.values():
            await start_backend(backend)

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Self:
        self._portal_call(self.astart())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _LoopWrites:
    """A decision log as a worker thread recording a decision sees it: :meth:`record` builds the record there
    (:meth:`DecisionLog.build`) and has ``loop`` write it (:meth:`DecisionLog.append`), so a sink is only ever called
    where the record is made without a thread: a callable may use the loop, a stream shared with the loop's own
    writes gets whole lines. The write is scheduled before the thread returns, so it runs before the thread's result
    reaches the loop (and still runs when the awaiting task is cancelled); where the loop has closed meanwhile, the
    thread writes it."""

    def __init__(self, log: DecisionLog, loop: asyncio.AbstractEventLoop) -> None:
        self._log = log
        self._loop = loop

    def record(self, verdict: Verdict, subject: Subject | None, **kwargs: Any) -> dict[str, Any]:
        event, line = self._log.build(verdict, subject, **kwargs)
        if line is not None:
            try:
                self._loop.call_soon_threadsafe(self._log.append, line)
            except RuntimeError:  # the loop closed while the record was built: nothing would run the write
                self._log.append(line)
        return event


async def _cancel_the_rest() -> None:
    """Cancel every other task of the running loop and wait for them to end, at most :data:`CANCEL_WAIT_S` (a task
    that ignores cancellation is left to the loop's closing)."""
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    for task in rest:
        task.cancel()
    if rest:
        _, running = await asyncio.wait(rest, timeout=CANCEL_WAIT_S)
        if running:
            logger.warning("%d task(s) ignored cancellation while the sync facade's loop closed", len(running))


async def _run(off_loop: bool, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``: on a thread when ``off_loop`` (the event loop serves other requests while it
    runs), else inline. Exceptions propagate as raised."""
    if off_loop:
        return await asyncio.to_thread(function, *args, **kwargs)
    return function(*args, **kwargs)


def _since(started: float) -> float:
    """Milliseconds since ``started`` (a ``time.perf_counter()`` reading)."""
    return (time.perf_counter() - started) * 1000


def _revision(backend: DecisionBackend) -> str | None:
    try:
        return backend.model_revision
    except Exception:  # noqa: BLE001 - a broken backend must not break the fail-mode verdict
        return None


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a group call's outcome so an error no policy waited for (all timed out first) is not reported as never
    retrieved; each waiting policy gets it through its own await."""
    if not task.cancelled():
        task.exception()


def _combined_lookup(lookups: Sequence[Lookup]) -> Lookup | None:
    """How the answers of several groups were found, as one word: ``miss`` when any call was made, else ``shared``
    when any joined another's, else ``hit``; ``None`` without a lookup (rules only, or every decision failed)."""
    for word in ("miss", "shared", "hit"):
        if word in lookups:
            return word  # type: ignore[return-value]
    return None
