"""What health reports: each part's state as a short code, and the details behind it.

* :class:`FailureTracker`: the outcome of a part's recent calls (a backend's decisions, the proxy's upstream): its
  last call failed within ``window_s`` seconds. What a call carries is the client's choice (a state that runs the
  model past its timeout or that a remote model answers with a 500, a path the upstream answers slowly), so a
  failed live call must not be enough for one client to take every replica out of rotation in turn: an upstream
  forward is at worst ``degraded``; a backend's failed call is ``degraded`` and asks the monitor for a canary run,
  which decides; without a monitor (or canaries) :func:`call_severity` says which failures no request causes
  (refused, a server error, a malformed answer, a raising model, a revoked key) and those are ``failing``.
* :class:`HealthMonitor`: runs each backend's canaries (:mod:`guard.backends.selftest`), fixed states no client
  chooses, at start-up, every ``interval_s`` seconds and at the first decision after a policy reload; a backend whose canary fails is ``canary_failed`` and the
  engine refuses its answers (``BackendUnavailable``, ``reason="canary_failed"``: the policy's fail mode decides)
  until a run passes; one that cannot answer them (down, an error; not busy) is ``unreachable`` until a run or a
  live call succeeds (failing for a model in this process, degraded for a remote one every replica shares); one that answers them too late is ``canary_timed_out`` (degraded: perhaps a flood of slow
  requests, which taking replicas out would help).
* :func:`health_report`: ``{"status", "ready", "checks": {part: code}, "details": {...}}`` from the engine, the
  monitor, the policy watcher and any other parts; :func:`public_health` keeps codes only (no error text, no policy
  content) for unauthenticated callers.

Status: ``failing`` when no request can be judged (no policy; a backend that fails its canary or, in this process,
cannot answer it, whose monitor has not finished its first canary run (``starting``), that refused the deployment's key or
model, or, with no canaries to ask, whose last call failed in a way no request causes; a policy watcher not started
yet, ``starting``); ``degraded`` when requests are still judged but something needs a look (a Redis error, a forged or corrupt value read from it, a failed
reload, a dead reload watcher, a backend call a request may have failed, an upstream forward that failed lately);
else ``ok``. ``ready`` is ``status != "failing"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guard.backends.http import SystemOneClient
from guard.backends.selftest import Canary, CanaryFailed, catalog_canaries, clef_canaries, run_canaries
from guard.errors import (
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    GuardError,
    MalformedAnswer,
    StateTooLong,
    UnsupportedQuestion,
)

if TYPE_CHECKING:
    from guard.backends.base import DecisionBackend
    from guard.policy.watch import PolicyWatcher

__all__ = [
    "BUSY_REASONS",
    "CONFIG_STATUSES",
    "DEFAULT_CANARY_INTERVAL_S",
    "DEFAULT_FAILING_WINDOW_S",
    "RECHECK_INTERVAL_S",
    "Check",
    "FailureTracker",
    "HealthMonitor",
    "call_severity",
    "canaries_for",
    "error_code",
    "health_report",
    "public_health",
    "refused_config",
]

logger = logging.getLogger("guard.health")

#: Least seconds between two canary runs a failed live call asks for (:meth:`HealthMonitor.suspect`).
RECHECK_INTERVAL_S = 10.0
#: Seconds a failed call keeps its part ``failing`` when no call succeeded since.
DEFAULT_FAILING_WINDOW_S = 30.0
#: Seconds between canary runs of the gateway's backends.
DEFAULT_CANARY_INTERVAL_S = 60.0
_SEVERITY = {"ok": 0, "degraded": 1, "failing": 2}


@dataclass(frozen=True)
class Check:
    """One part's state: ``code`` (``ok`` or a snake_case failure code), ``severity`` (``ok``, ``degraded`` or
    ``failing``) and ``detail`` (for authenticated callers only: may hold error text)."""

    code: str
    severity: str = "ok"
    detail: Mapping[str, Any] | None = None


class FailureTracker:
    """The outcome of a part's recent calls.

    Args:
        window_s: seconds a failure keeps the part ``failing`` when nothing succeeded since.
    """

    __slots__ = ("calls_failed", "last_code", "last_error", "last_failure_at", "last_severity", "refused_config",
                 "window_s")

    def __init__(self, window_s: float = DEFAULT_FAILING_WINDOW_S) -> None:
        self.window_s = window_s
        self.last_failure_at: float | None = None  # None: the last call succeeded (or none was made)
        self.last_code = ""
        self.last_error = ""
        self.last_severity = "failing"
        self.refused_config = False  # the last failure was the deployment's (a key or model refused): no canary clears it
        self.calls_failed = 0

    def success(self) -> None:
        """A call succeeded (one attribute store: cheap enough for every request)."""
        self.last_failure_at = None

    def failure(self, code: str, message: str, *, severity: str = "failing", refused_config: bool = False) -> None:
        """A call failed with ``code`` (snake_case, shown to anyone) and ``message`` (shown to admins only);
        ``severity``: ``failing``, or ``degraded`` for a failure the request itself may have caused;
        ``refused_config``: the backend refused the deployment's key or model (:data:`CONFIG_STATUSES`)."""
        now = time.monotonic()
        self.calls_failed += 1
        if (severity != "failing" and self.last_severity == "failing" and self.last_failure_at is not None
                and now - self.last_failure_at < self.window_s):
            return  # a failure a request may have caused says nothing about one no request causes
        self.last_failure_at = now
        self.last_code = code
        self.last_error = message[:300]
        self.last_severity = severity
        self.refused_config = refused_config

    def check(self) -> Check:
        """While the last call failed within the window: ``failing``, or ``last_call_failed`` (degraded) for a
        failure the request may have caused; else ``ok``."""
        detail = {"calls_failed": self.calls_failed, "last_error": self.last_error or None}
        at = self.last_failure_at
        if at is not None and time.monotonic() - at < self.window_s:
            code = "failing" if self.last_severity == "failing" else "last_call_failed"
            return Check(code, self.last_severity, {**detail, "error_code": self.last_code,
                                                   "seconds_ago": round(time.monotonic() - at, 1)})  # fmt: skip
        return Check("ok", "ok", detail)


def canaries_for(backend: DecisionBackend, question_ids: Sequence[str]) -> list[Canary]:
    """The canaries that ``backend`` is checked with: its own (a :class:`~guard.backends.local.LocalBackend`'s
    ``canaries``); the catalog canaries of ``question_ids`` it can answer, at their margins, for a backend that says
    what it answers (the compact model's ``explain``); else (a remote System One server) the catalog states with
    :func:`~guard.backends.selftest.clef_canaries`' default: the answers must depend on the state."""
    own = getattr(backend, "canaries", None)
    if own is not None:
        return list(own)
    explain = getattr(backend, "explain", None)
    if callable(explain):
        return [c for c in catalog_canaries(question_ids) if explain(c.question) is None]
    return clef_canaries()


class HealthMonitor:
    """Runs every backend's canaries now and every ``interval_s`` seconds, and keeps the results.

    Args:
        guard: the :class:`~guard.engine.Guard` whose backends are checked (it reads :attr:`canary_failed` before
            each model call).
        interval_s: seconds between runs (0: only when :meth:`check` is called, e.g. at start-up, and after
            a policy reload, :meth:`follow_policies`).
        timeout_s: seconds one backend's canaries may take.

    Example:
        >>> monitor = HealthMonitor(guard)   # doctest: +SKIP
        >>> await monitor.start()            # first run, then every minute
    """

    def __init__(
        self, guard: Any, *, interval_s: float = DEFAULT_CANARY_INTERVAL_S, timeout_s: float = 30.0
    ) -> None:
        if interval_s < 0 or timeout_s <= 0:
            raise ValueError("interval_s must be >= 0 and timeout_s > 0 seconds")
        self.guard = guard
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.results: dict[str, Check] = {}
        self.canary_failed: set[str] = set()
        self.unreachable: set[str] = set()  # backends whose last canary run raised (logged once until they answer)
        self._task: asyncio.Task[None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # where the monitor runs: every run starts there
        self._rechecks: dict[str, asyncio.Task[Check]] = {}
        self._rechecked_at: dict[str, float] = {}
        self._runs: dict[str, asyncio.Lock] = {}  # one canary run of a backend at a time (check_backend)
        # backends whose answers this process may have used (stored in a shared cache): one that passed a canary, or
        # finished a run the engine does not refuse it after, or answered a live call
        self._served: set[str] = set()
        self._views: dict[str, Any] = {}  # the policy version each backend's last run took its canaries from
        guard.monitor = self

    async def check(self) -> dict[str, Check]:
        """One run over every backend; returns (and keeps) each backend's canary check."""
        if self._event_loop is None:
            self._event_loop = asyncio.get_running_loop()
        for name in self.guard.backends:
            await self.check_backend(name)
        return dict(self.results)

    async def check_backend(self, name: str) -> Check:
        """Run backend ``name``'s canaries now; returns (and keeps) its check.

        Runs of one backend take turns (the periodic run, one a refused or failed request asked for,
        :meth:`suspect`, and a caller's): each compares its result with the one before it, so every change between
        failing and passing moves the epoch (:meth:`_share_epoch`), and a run that started earlier never overwrites
        a later one's result. A change moves it only once this process may have used the backend's answers: a
        first run that fails before the backend answered anything (a replica that starts on a broken model, ``guard
        proxy`` runs the canaries before it takes requests) and its later recovery leave the other replicas'
        cached answers alone."""
        lock = self._runs.get(name) or self._runs.setdefault(name, asyncio.Lock())
        async with lock:
            backend = self.guard.backends[name]
            view = self._views[name] = self.guard.policies.view()
            policies = [p for p in view.policies if self.guard.backend_for(p) is backend]
            canaries = canaries_for(backend, [q.wire.id for p in policies for q in p.questions])
            model = policies[0].model if policies else "canary"  # a System One server answers the models it serves
            failed_before = name in self.canary_failed
            self.results[name] = result = await self._run(name, backend, canaries, model)
            failed = name in self.canary_failed
            await self._share_epoch(name, backend, move_on=failed != failed_before and name in self._served)
            if not failed:  # the engine calls the backend again: its answers may be stored from now on
                self._served.add(name)
            return result

    async def _share_epoch(self, name: str, backend: DecisionBackend, *, move_on: bool = False) -> None:
        """Agree on backend ``name``'s epoch with the processes sharing the guard's cache (the cache keys name it:
        :func:`~guard.engine.plan.keyed_revision`): a higher one published by another replica (its canary saw this
        model fail, or pass again) is taken, so answers cached before are not read here either, nor by a replica
        started later; a higher one of this process is published. An in-process cache shares nothing.

        ``move_on``: this run's canary failed where the last one passed, or passed where it failed, and the backend's
        answers may have been used in this process (:meth:`check_backend`): the epoch moves one past the higher of
        this process's and the published one, and is published. On a failure, the answers the broken model gave (and
        stored) since the last run are read by no replica, the healthy ones included; on a recovery, neither are any
        stored meanwhile by replicas that had not yet seen the failure.

        A process still at epoch 0 that finds none published (the first replica on an empty store; or the key was
        deleted by someone with access to Redis, or evicted under ``allkeys-lru``, or holds a value without the
        store key's seal or another type than a string) publishes a fresh one, only if none is there (of replicas
        starting together, one does), and takes what it then reads: the wall-clock time in milliseconds, higher than every epoch published before
        (a recovery adds 1) and than the 0 of every answer cached before, so an epoch lost from the store does not
        bring back the answers cached under it. A sealed epoch copied earlier and put back is genuine: a process
        started after it takes it, and a process holding a newer one republishes that at its next canary run."""
        scope = f"{name}\n{backend.model_revision}"
        cache = self.guard.cache
        local = self.guard.canary_epochs.get(name, 0)
        shared = await cache.shared_epoch(scope)
        if shared is None and local == 0:
            await cache.publish_epoch(scope, time.time_ns() // 1_000_000, if_absent=True)
            shared = await cache.shared_epoch(scope)
        epoch = max(local, shared or 0) + (1 if move_on else 0)
        if epoch > local:
            if local and not move_on:
                logger.info("backend %r failed or recovered in another replica; answers cached before are not read",
                            name)
            self.guard.canary_epochs[name] = epoch
        if epoch > (shared or 0):
            await cache.publish_epoch(scope, epoch)

    def covers(self, name: str) -> bool:
        """Whether backend ``name`` has canaries (a run found some), so they, not live calls, say it is failing."""
        result = self.results.get(name)
        return result is not None and result.code != "no_canary"

    def suspect(self, name: str) -> None:
        """A live call to backend ``name`` failed: run its canaries soon (at most once per
        :data:`RECHECK_INTERVAL_S`), so whether it is broken is decided on fixed states, not on what a client
        sent. Safe from any thread (the sync ``Guard.evaluate`` decides on a thread of its own): the run starts on
        the monitor's loop; nothing happens before the monitor has run once."""
        self._on_loop(self._recheck, name)

    def follow_policies(self, name: str) -> None:
        """Run backend ``name``'s canaries now when the active policies are not those its last run took them from:
        a reload may have added a question with a canary, which the broken model would otherwise answer until the
        next periodic run (never with ``interval_s=0``). Safe from any thread; nothing before the first run. The run
        records the version it reads (:meth:`check_backend`): a decision while one with the older version's canaries
        still goes on starts none, the first after it does."""
        seen = self._views.get(name)
        if seen is not None and seen is not self.guard.policies.view():
            self._on_loop(self._recheck_now, name)

    def _recheck_now(self, name: str) -> None:
        self._rechecked_at.pop(name, None)
        self._recheck(name)

    def _recheck(self, name: str) -> None:
        running = self._rechecks.get(name)
        now = time.monotonic()
        if (running is not None and not running.done()) or now < self._rechecked_at.get(name, -1e9) + RECHECK_INTERVAL_S:
            return
        self._rechecked_at[name] = now
        self._rechecks[name] = asyncio.get_running_loop().create_task(self.check_backend(name),
                                                                      name=f"guard-canary-{name}")

    def _on_loop(self, call: Callable[[str], None], name: str) -> None:
        """``call(name)`` on the monitor's loop: now when this is it, else soon (when it still runs)."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            call(name)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(call, name)

    async def _run(self, name: str, backend: DecisionBackend, canaries: Sequence[Canary], model: str) -> Check:
        if not canaries:
            return Check("no_canary", "ok", {"canaries": 0})
        try:
            results = await run_canaries(backend, canaries, timeout=self.timeout_s, model=model)
        except CanaryFailed as exc:
            if name not in self.canary_failed:
                logger.error("backend %r failed its canary; its answers are refused: %s", name, exc)
            self.canary_failed.add(name)
            return Check("canary_failed", "failing", {"canaries": [r.to_json() for r in exc.results]})
        except MalformedAnswer as exc:  # the backend answered, but not with probabilities (NaN): a failed canary
            return self._failing(name, exc)
        except (TimeoutError, BackendTimeout) as exc:  # slow, perhaps flooded: taking replicas out would finish
            return Check("canary_timed_out", "degraded", {"error": f"{type(exc).__name__}: {exc}"[:300]})  # the flood
        except GuardError as exc:
            if getattr(exc, "reason", None) not in BUSY_REASONS:  # down, not busy: report it
                refused = refused_config(exc)  # its key or model refused: no request can be judged
                self.guard.backend_health[name].failure(error_code(exc), f"canary: {type(exc).__name__}: {exc}",
                                                        refused_config=refused)
                if name not in self.unreachable:
                    logger.warning("backend %r could not answer its canary; requests that need it follow their "
                                   "policy's fail mode until it can: %s: %s", name, type(exc).__name__, exc)
                self.unreachable.add(name)
                # a remote model (a System One server) that cannot be reached is every replica's, as the upstream is:
                # taking them all out of rotation would not route around it, and would turn the policies' fail modes
                # (a 503 with Retry-After, or fail-open) and every path no policy judges into connection errors. One
                # that refuses the deployment's key or model is this deployment's fault: failing.
                if refused:
                    return Check("refused", "failing", {"error": f"{type(exc).__name__}: {exc}"[:300]})
                severity = "degraded" if isinstance(backend, SystemOneClient) else "failing"
                return Check("unreachable", severity, {"error": f"{type(exc).__name__}: {exc}"[:300]})
            return Check("canary_not_run", "ok", {"error": f"{type(exc).__name__}: {exc}"[:300]})
        except Exception as exc:  # noqa: BLE001 - any other error the model raised (a broken ONNX session)
            return self._failing(name, exc)
        if name in self.unreachable:
            logger.info("backend %r answers its canary again", name)
            self.unreachable.discard(name)
        if name in self.canary_failed:  # check_backend moves the epoch on: answers cached before are not read
            logger.info("backend %r passed its canary again; answers cached before are not read", name)
        self.canary_failed.discard(name)
        return Check("ok", "ok", {"canaries": [r.to_json() for r in results]})

    def answered(self, name: str) -> None:
        """Backend ``name`` answered a live call: its answers may be in the cache now (a canary failure moves the
        epoch past them, :meth:`check_backend`); one the last canary run could not reach is reachable again (its
        canaries' verdict waits for the next run). Safe from any thread, as :meth:`suspect`."""
        if name not in self._served:  # usually there: set lookups on the hot path
            self._served.add(name)
        if name in self.unreachable:
            self._on_loop(self._reachable, name)

    def _reachable(self, name: str) -> None:
        if name in self.unreachable:
            self.unreachable.discard(name)
            logger.info("backend %r answers again", name)
            self.results[name] = Check("canary_not_run", "ok", {"error": "answered a live call since the canary "
                                                                         "run that could not reach it"})

    def _failing(self, name: str, exc: Exception) -> Check:
        """The check of a backend whose canary answer was malformed or raised: failing, its answers refused."""
        if name not in self.canary_failed:
            logger.error("backend %r answered its canary malformed or raised; its answers are refused: %s: %s", name,
                         type(exc).__name__, exc)
        self.canary_failed.add(name)
        return Check("canary_failed", "failing", {"error": f"{type(exc).__name__}: {exc}"[:300]})

    async def start(self) -> None:
        """Run once now, then every ``interval_s`` in the running loop (when > 0). Idempotent."""
        if self._task is not None:
            return
        await self.check()
        if self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="guard-health-monitor")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # the monitor must outlive any one bad run
                logger.exception("health monitor run failed")

    async def aclose(self) -> None:
        """Stop the periodic runs and any run a failed call asked for (awaited when this is the monitor's loop).
        Idempotent."""
        tasks = [t for t in (self._task, *self._rechecks.values()) if t is not None]
        self._task = None
        self._rechecks.clear()
        loop = self._event_loop
        if loop is not None and loop is not asyncio.get_running_loop():
            for task in tasks:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: its tasks are gone
                    loop.call_soon_threadsafe(task.cancel)
            return
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


#: ``reason`` of a backend error that says the backend is busy or slow, not broken (a 429, a full queue, a
#: gateway timeout).
BUSY_REASONS = ("overloaded", "http_429", "http_504")
#: HTTP statuses of a refusal that is the deployment's, not the request's: a revoked key, a model no longer served.
CONFIG_STATUSES = (401, 403, 404)


def refused_config(exc: BaseException) -> bool:
    """Whether the backend refused what the deployment sends every call (its key, a model it does not serve:
    :data:`CONFIG_STATUSES`), which the canaries may not ask about (they ask for one model)."""
    return isinstance(exc, BackendRejected) and exc.status_code in CONFIG_STATUSES


def call_severity(exc: BaseException) -> str:
    """How much a live call's failure says about its backend when no canary can be run: ``degraded`` when the
    request may have caused it (no answer in time, a request the backend rejects or cannot read, a busy backend:
    a 429, a 503 with ``Retry-After``, a 504), else ``failing`` (refused, a server error, a malformed answer, a model
    that raised, a key or model the backend refuses: 401/403/404)."""
    if isinstance(exc, BackendRejected):
        return "failing" if refused_config(exc) else "degraded"
    if isinstance(exc, (TimeoutError, BackendTimeout, StateTooLong, UnsupportedQuestion)):
        return "degraded"
    if isinstance(exc, BackendUnavailable) and exc.retry_after is not None:
        return "degraded"
    return "degraded" if getattr(exc, "reason", None) in BUSY_REASONS else "failing"


def error_code(exc: BaseException) -> str:
    """The code :class:`FailureTracker` records for ``exc``: its class name in snake_case, plus the ``reason`` of a
    ``BackendUnavailable`` (``backend_unavailable:connection``); never its text."""
    name = "".join("_" + c.lower() if c.isupper() else c for c in type(exc).__name__).lstrip("_")
    reason = getattr(exc, "reason", None)
    return name + (f":{reason}" if isinstance(reason, str) and reason else "")


def _watcher_check(watcher: PolicyWatcher | None) -> Check:
    if watcher is None:
        return Check("off", "ok")
    detail = {"reloads": watcher.reloads, "failures": watcher.failures, "last_error": watcher.last_error}
    if not watcher.started:  # as a backend whose first canary run has not finished: not ready yet
        return Check("starting", "failing", detail)
    if not watcher.alive:
        return Check("watcher_dead", "degraded", detail)
    if watcher.last_error is not None:  # the last change was refused; the last good policies serve
        return Check("reload_failed", "degraded", detail)
    return Check("ok", "ok", detail)


def health_report(
    guard: Any, *, watcher: PolicyWatcher | None = None, parts: Mapping[str, Check] | None = None
) -> dict[str, Any]:
    """The full report (for the library caller and authenticated admins).

    Args:
        guard: the :class:`~guard.engine.Guard` (policies, cache, backends and, when one is attached, its
            :class:`HealthMonitor`).
        watcher: the policy watcher, when one runs.
        parts: other checks by name (the proxy's ``upstream``).

    Returns:
        ``{"status": "ok" | "degraded" | "failing", "ready": bool, "checks": {name: code or {backend: code}},
        "details": {name: ...}}``.
    """
    checks: dict[str, Check] = {}
    policies = guard.policies
    checks["policies"] = Check("ok", "ok", {"loaded": len(policies)}) if len(policies) else Check("none", "failing")
    reload_detail = {"reload_failures": policies.reload_failures,
                     "last_reload_error": str(policies.last_error) if policies.last_error else None,
                     "policies_removed": policies.policies_removed,
                     "last_removed": list(policies.last_removed)}  # fmt: skip
    checks["policy_reload"] = (
        Check("reload_failed", "degraded", reload_detail) if policies.last_error else Check("ok", "ok", reload_detail)
    )
    checks["policy_watcher"] = _watcher_check(watcher)
    cache = guard.cache.health()
    checks["cache"] = Check(cache.code, cache.status, cache.to_json())
    backends: dict[str, Check] = {}
    monitor: HealthMonitor | None = getattr(guard, "monitor", None)
    for name in guard.backends:
        tracker = guard.backend_health[name]
        check = tracker.check()
        canary = monitor.results.get(name) if monitor is not None else None
        if check.severity == "failing" and monitor is not None and monitor.covers(name) and not tracker.refused_config:
            check = Check("last_call_failed", "degraded", check.detail)  # the canary run the failure asked for decides
        if canary is not None and canary.severity != "ok" and _SEVERITY[canary.severity] >= _SEVERITY[check.severity]:
            check = canary  # the canaries' word (unreachable, canary_timed_out) over a live call's as bad
        if monitor is not None and canary is None:  # its first run is under way
            check = Check("starting", "failing", {"error": "the canaries have not run yet"})
        detail = {**(check.detail or {}), "canary": dict(canary.detail or {}, code=canary.code) if canary else None}
        backends[name] = Check(check.code, check.severity, detail)
    for name, check in (parts or {}).items():
        checks[name] = check
    worst = max([*(c.severity for c in checks.values()), *(c.severity for c in backends.values())],
                key=_SEVERITY.__getitem__)  # fmt: skip
    codes: dict[str, Any] = {n: c.code for n, c in checks.items()}
    details: dict[str, Any] = {n: dict(c.detail or {}) for n, c in checks.items()}
    codes["backends"] = {n: c.code for n, c in backends.items()}
    details["backends"] = {n: dict(c.detail or {}) for n, c in backends.items()}
    return {"status": worst, "ready": worst != "failing", "checks": codes, "details": details}


def public_health(report: Mapping[str, Any]) -> dict[str, Any]:
    """``report`` without its details: status, readiness and one code per check (nothing a caller could learn the
    policies or error text from)."""
    return {"status": report["status"], "ready": report["ready"], "checks": report["checks"]}
