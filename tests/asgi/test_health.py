"""On the gateway, ``/_guard/health`` tells the truth over real HTTP (backend down, upstream down,
a degenerate backend, a reload watcher hit by a reader error), and tells strangers codes only."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.asgi.admin import AdminApp, admin_app
from guard.asgi.health import HealthEndpoint
from guard.asgi.proxy import ProxyApp, ProxyConfig, proxy_app
from guard.backends.http import SystemOneClient
from guard.engine import Guard
from guard.engine.health import HealthMonitor
from guard.policy import load_files
from guard.policy.watch import PolicyWatcher
from tests._backends import ScriptedBackend
from tests._degenerate import always_no_app
from tests._policies import ATTACK, CACHED_INJECTION
from tests.asgi._apps import POLICY, scripted_answers
from tests.asgi._servers import serve_in_thread
from tests.worker._serve import serve_app_in_thread

pytestmark = pytest.mark.anyio

TOKEN = "health-admin-token-0123456789"


@pytest.fixture
def frozen_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rate limiter's clock stands still, so its buckets never refill while a test runs however slow the
    machine (the event loop's clock is left alone)."""
    from types import SimpleNamespace

    from guard.asgi import _ratelimit

    monkeypatch.setattr(_ratelimit, "time", SimpleNamespace(monotonic=lambda: 1000.0))
#: One policy asking the catalog's injection question of every HTTP request (the catalog has canaries for it).
INJECTION_POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {}}
    questions: {injection: {catalog: guard.prompt_injection}}
    rules: [{id: r, when: injection.noul >= 0.9, action: block}]
"""
AUTH = {"authorization": f"Bearer {TOKEN}"}


def admin_for(guard: Guard, app: ProxyApp, watcher: PolicyWatcher | None = None) -> AdminApp:
    """The admin listener's app for ``app``, as ``guard proxy`` builds it: health reporting the proxy's upstream and
    the watcher, details for the reviewer's token."""
    health = HealthEndpoint(guard, upstream=app.proxy.health, admin_tokens=[TOKEN], watcher=watcher)
    return admin_app(guard, review_store=app.guarded.review_store, reviewers={"alice": TOKEN},
                     metrics=app.guarded.metrics, health=health)  # fmt: skip


def dead_url() -> str:
    """A loopback URL nothing listens on (the port was bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_health_reports_a_dead_backend_and_upstream_and_leaks_nothing() -> None:
    guard = Guard(load_files(POLICY), backends=SystemOneClient(dead_url(), timeout=2))
    app = proxy_app(guard, ProxyConfig(dead_url(), connect_timeout=1), on_shutdown=guard.aclose)
    # the guard's HTTP client lives on the proxy server's loop; health is on the admin listener
    with serve_in_thread(app, lifespan="on") as proxy, serve_in_thread(admin_for(guard, app)) as admin_url:
        async with httpx.AsyncClient(base_url=proxy, timeout=30) as client, \
                httpx.AsyncClient(base_url=admin_url, timeout=30) as ops:
            before = await ops.get("/_guard/health")
            judged = await client.post("/v1/echo", json={"message": "hello"})  # fails closed: backend down
            after_backend = await ops.get("/_guard/health")
            unjudged = await client.get("/public/echo")  # no policy: forwarded, and the upstream is down
            after_upstream = await ops.get("/_guard/health")
            admin = await ops.get("/_guard/health", headers=AUTH)
            wrong = await ops.get("/_guard/health", headers={"authorization": "Bearer " + "x" * 29})
    assert before.status_code == 200 and before.json()["status"] == "ok"
    assert judged.status_code == 503 and unjudged.status_code == 502
    # A refused backend is failing (no request causes that); a failed forward is degraded: every replica shares
    # the upstream, and a client chooses the path it answers slowly.
    body = after_backend.json()
    assert after_backend.status_code == 503 and body["status"] == "failing" and body["ready"] is False
    assert body["checks"]["backends"] == {"default": "failing"} and body["checks"]["upstream"] == "ok"
    assert after_upstream.status_code == 503 and after_upstream.json()["checks"]["upstream"] == "last_call_failed"
    for public in (before, after_backend, after_upstream, wrong):
        text = public.text
        assert "details" not in public.json() and "Connect" not in text and "api_guard" not in text
        assert set(public.json()) == {"status", "ready", "checks"}
    details = admin.json()["details"]
    assert details["backends"]["default"]["error_code"].startswith("backend_unavailable")
    assert "ConnectError" in details["backends"]["default"]["last_error"]
    assert details["upstream"]["error_code"] == "upstream_unavailable" and details["upstream"]["calls_failed"] == 1


async def test_a_backend_that_always_says_no_is_failing_and_gets_no_model_calls() -> None:
    calls: list[int] = []
    no = always_no_app(calls)
    with serve_app_in_thread(no, ready_path=None) as backend_url:
        guard = Guard(load_files(POLICY), backends=SystemOneClient(backend_url, timeout=10))
        monitor = HealthMonitor(guard, interval_s=0)
        app = proxy_app(guard, ProxyConfig(dead_url()), on_startup=monitor.start, on_shutdown=guard.aclose)
        with serve_in_thread(app, lifespan="on") as proxy, serve_in_thread(admin_for(guard, app)) as admin_url:
            async with httpx.AsyncClient(base_url=proxy, timeout=30) as client, \
                    httpx.AsyncClient(base_url=admin_url, timeout=30) as ops:
                canary_calls = len(calls)
                health = await ops.get("/_guard/health")
                judged = await client.post("/v1/echo", json={"message": "hello"})
                admin = await ops.get("/_guard/health", headers=AUTH)
    assert canary_calls == 4  # two canaries, a benign and an attack state each
    assert health.status_code == 503 and health.json()["checks"]["backends"] == {"default": "canary_failed"}
    assert judged.status_code == 503 and judged.headers["x-guard-rule"] == "on_error"  # its fail mode decided
    # the degenerate backend was never asked to decide: the refused request only asked for one more canary run
    assert len(calls) in (canary_calls, 2 * canary_calls)
    canaries = admin.json()["details"]["backends"]["default"]["canary"]["canaries"]
    assert [c["spread"] for c in canaries] == [0.0, 0.0] and canaries[0]["question"] == "guard.prompt_injection"


async def test_health_is_not_ready_until_the_first_canary_run_has_finished() -> None:
    """The admin listener can answer before the proxy's start-up has run the canaries: until then the backend is
    ``starting`` and health is not ready; a passing run makes it ``ok``."""
    guard = Guard(load_files(POLICY), backends=ScriptedBackend())
    monitor = HealthMonitor(guard, interval_s=0)
    app = proxy_app(guard, ProxyConfig(dead_url()))
    with serve_in_thread(admin_for(guard, app)) as admin_url:
        async with httpx.AsyncClient(base_url=admin_url, timeout=30) as ops:
            before = await ops.get("/_guard/health")
            await monitor.start()
            after = await ops.get("/_guard/health")
    assert before.status_code == 503 and before.json()["checks"]["backends"] == {"default": "starting"}
    assert after.status_code == 200 and after.json()["checks"]["backends"] == {"default": "ok"}


async def test_a_control_character_does_not_kill_the_watcher_and_health_says_so(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.read_text())
    guard = Guard.from_files(policy, backends=SystemOneClient(dead_url(), timeout=1))
    watcher = PolicyWatcher(guard.policies, interval_s=0.05)
    app = proxy_app(guard, ProxyConfig(dead_url()), on_shutdown=guard.aclose)
    with serve_in_thread(app, lifespan="on"), serve_in_thread(admin_for(guard, app, watcher)) as admin_url:
        async with httpx.AsyncClient(base_url=admin_url, timeout=30) as client:
            watcher.start()
            ok = await client.get("/_guard/health")
            policy.write_text(POLICY.read_text() + "\x01\n")  # a control character: yaml's ReaderError
            while watcher.failures == 0:
                await _sleep()
            bad = await client.get("/_guard/health")
            admin = await client.get("/_guard/health", headers=AUTH)
            policy.write_text(POLICY.read_text().replace("version: 3", "version: 4", 1))
            while watcher.reloads == 0:
                await _sleep()
            fixed = await client.get("/_guard/health")
            await watcher.aclose()
            dead = await client.get("/_guard/health")
    assert ok.json()["checks"]["policy_watcher"] == "ok"
    assert bad.status_code == 200 and bad.json()["status"] == "degraded"
    assert bad.json()["checks"]["policy_watcher"] == "reload_failed" and watcher.failures == 1
    assert "control character" in admin.json()["details"]["policy_watcher"]["last_error"]
    assert "control character" not in bad.text and "policy.yaml" not in bad.text
    assert fixed.json()["checks"]["policy_watcher"] == "ok"  # the later valid change was applied
    assert guard.policies.policies[0].version == "4"
    assert dead.json()["checks"]["policy_watcher"] == "watcher_dead" and dead.json()["status"] == "degraded"


async def _sleep() -> None:
    await asyncio.sleep(0.02)


async def test_a_backend_whose_canary_answer_is_malformed_is_failing() -> None:
    """NaN probabilities (a model with broken weights) are a failed canary, not a run "not completed": the
    backend's answers are refused until it answers well again."""
    from guard.errors import MalformedAnswer

    for error in (MalformedAnswer("question 'injection' has a non-finite probability: [nan, nan]"),
                  RuntimeError("the ONNX session failed")):  # any error the model raises: a broken model
        await _canary_fails_with(error)


async def _code_after(monitor: HealthMonitor, code: str) -> str:
    """The default backend's canary result once it is no longer ``code`` (or ``code``, after a second)."""
    for _ in range(100):
        if monitor.results["default"].code != code:
            break
        await asyncio.sleep(0.01)
    return monitor.results["default"].code


async def _canary_fails_with(error: Exception) -> None:
    from guard.policy import load_text

    broken = ScriptedBackend(fail=error)
    policy = load_text(INJECTION_POLICY)
    guard = Guard(policy, backends=broken)
    monitor = HealthMonitor(guard, interval_s=0)
    checks = await monitor.check()
    assert checks["default"].code == "canary_failed" and checks["default"].severity == "failing"
    assert monitor.canary_failed == {"default"}
    await guard.aclose()


async def test_wrong_admin_tokens_are_rate_limited_like_the_review_apis(frozen_buckets: None) -> None:
    """The details answer tells whether a token is right, so guessing is limited per address (30 wrong, then 429);
    a probe without a token and the right token are never limited."""
    from tests.asgi._apps import client_for

    guard = Guard(load_files(POLICY), backends=ScriptedBackend())
    health = HealthEndpoint(guard, admin_tokens=[TOKEN])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await health(scope, send)

    async with client_for(app) as client:
        wrong = [(await client.get("/", headers={"authorization": f"Bearer guess-{i:04d}"})).status_code
                 for i in range(40)]  # fmt: skip
        probe = await client.get("/")
        admin = await client.get("/", headers=AUTH)
    assert set(wrong[:30]) <= {200, 503} and set(wrong[30:]) == {429}
    assert probe.status_code in (200, 503) and "details" not in probe.json()
    assert admin.status_code in (200, 503) and "details" in admin.json()
    await guard.aclose()


async def test_only_reviewers_not_scoped_to_tenants_read_the_details() -> None:
    """The details are the whole gateway's (cache counts, reload and backend errors): a reviewer scoped to one tenant
    read them too. Its token now gets the codes only, as a caller without one; an unscoped reviewer's the details."""
    from guard.asgi.review_api import Reviewer
    from guard.asgi.review_store import MemoryReviewStore
    from tests.asgi._apps import client_for

    scoped = "acme-secret-0123456789"
    guard = Guard(load_files(POLICY), backends=ScriptedBackend())
    app = admin_app(guard, review_store=MemoryReviewStore(),
                    reviewers={"alice": TOKEN, "acme": Reviewer(scoped, frozenset({"acme"}))})
    async with client_for(app) as client:
        acme = await client.get("/_guard/health", headers={"authorization": f"Bearer {scoped}"})
        alice = await client.get("/_guard/health", headers=AUTH)
        listed = await client.get("/_guard/admin/reviews", headers={"authorization": f"Bearer {scoped}"})
    assert acme.status_code in (200, 503) and set(acme.json()) == {"status", "ready", "checks"}
    assert alice.status_code in (200, 503) and "details" in alice.json()
    assert listed.status_code == 200  # still a reviewer of its tenant's items
    await guard.aclose()


async def test_authorization_sent_twice_is_refused_whichever_copy_is_the_admin_token() -> None:
    """The token was read from the first ``Authorization`` copy (review finding): a front proxy checking or
    stripping the last one let a request it took for a stranger's read the details with an admin token. Sent twice,
    the admin token first or last, it is a 400 ``repeated_header`` with no report; sent once it reads the details."""
    from tests.asgi._apps import client_for

    guard = Guard(load_files(POLICY), backends=ScriptedBackend())
    health = HealthEndpoint(guard, admin_tokens=[TOKEN])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await health(scope, send)

    admin, other = AUTH["authorization"], "Bearer " + "x" * len(TOKEN)
    async with client_for(app) as client:
        twice = [await client.get("/", headers=[("authorization", a), ("authorization", b)])
                 for a, b in ((admin, other), (other, admin), (admin, admin))]
        once = await client.get("/", headers=AUTH)
    for response in twice:
        assert response.status_code == 400, response.text
        assert response.json() == {"code": "repeated_header", "message": "the authorization header is sent more than "
                                   "once; send it once", "field": "authorization"}
    assert once.status_code in (200, 503) and "details" in once.json()
    await guard.aclose()


async def test_wrong_tokens_from_one_ipv6_network_share_one_limit(frozen_buckets: None) -> None:
    """Each address of a /64 had its own bucket, so rotating them guessed without limit (attack finding)."""
    import httpx

    guard = Guard(load_files(POLICY), backends=ScriptedBackend())
    health = HealthEndpoint(guard, admin_tokens=[TOKEN])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await health(scope, send)

    codes = []
    for i in range(40):
        transport = httpx.ASGITransport(app=app, client=(f"2001:db8::{i + 1:x}", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
            codes.append((await client.get("/", headers={"authorization": f"Bearer guess-{i:04d}"})).status_code)
    assert set(codes[:30]) <= {200, 503} and set(codes[30:]) == {429}
    await guard.aclose()




def injection_by_word(request: Any) -> dict[str, float]:
    """A healthy model for the catalog canaries: an injection when the state says "ignore"."""
    return {"guard.prompt_injection": 0.99 if "ignore" in str(request.state).lower() else 0.01}


async def test_no_answer_a_broken_model_may_have_given_is_used_during_or_after_its_canary_failure() -> None:
    """A model that breaks between two canary runs answers (and its answers are cached) until the next run. While it
    fails, no answer of it is used, cached ones included; after it passes again, answers cached before are not read
    (the cache keys move on): the same attack is judged afresh."""
    from guard.policy import load_text
    from guard.subject import HttpSubject

    broken = False

    def answer(request: Any) -> dict[str, float]:
        return {"guard.prompt_injection": 0.0} if broken else injection_by_word(request)  # broken: "no" to all

    guard = Guard(load_text(CACHED_INJECTION), backends=ScriptedBackend(answer))
    monitor = HealthMonitor(guard, interval_s=0)
    subject = HttpSubject(method="POST", path="/v1/chat", body=ATTACK, body_text=ATTACK)
    await monitor.check()
    broken = True
    assert (await guard.aevaluate(subject)).action == "allow"  # before the next canary run: cached
    await monitor.check()
    during = await guard.aevaluate(subject)
    broken = False
    await monitor.check()
    after = await guard.aevaluate(subject)
    assert (during.action, during.rule, during.cache_hit) == ("block", "on_error", False)
    assert (after.action, after.rule, after.cache_hit) == ("block", "inj", False)
    await guard.aclose()


async def test_a_backend_that_cannot_answer_its_canary_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """``guard proxy`` before a backend it cannot reach (or one that refuses its requests) says why in its log, once,
    not only in the decision log."""
    guard = Guard(load_files(POLICY), backends=SystemOneClient(dead_url(), timeout=1))
    monitor = HealthMonitor(guard, interval_s=0)
    with caplog.at_level("WARNING", logger="guard.health"):
        for _ in range(2):
            assert (await monitor.check())["default"].code == "unreachable"
    warnings = [r.getMessage() for r in caplog.records if r.name == "guard.health"]
    assert len(warnings) == 1 and "could not answer its canary" in warnings[0] and "ConnectError" in warnings[0]
    await guard.aclose()


async def test_live_failures_ask_the_canaries_which_decide_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed live call made the backend ``failing`` (503 readiness for 30 s): a state that timed the model out,
    or one a remote model answers with a 500 or NaN, took replicas out of rotation, one client sufficing. With a
    health monitor a live failure is degraded and asks for a canary run (fixed states no client chooses), which
    decides: a backend broken for every input fails it; one that recovered is used again after the next run."""
    from guard.engine import health
    from guard.errors import BackendTimeout, BackendUnavailable
    from guard.policy import load_text
    from guard.subject import HttpSubject

    monkeypatch.setattr(health, "RECHECK_INTERVAL_S", 0.0)
    failure: dict[str, Exception | None] = {"live": None, "canary": None}

    def answers(request: Any) -> dict[str, Any]:
        live = "hello" in str(request.state)  # the canaries' states are the catalog's own
        error = failure["live"] if live else failure["canary"]
        if error is not None:
            raise error
        injection = scripted_answers(request)["injection"]
        return {question.id: injection for question in request.questions}

    backend = ScriptedBackend(answers)
    policy = load_text(INJECTION_POLICY)
    guard = Guard(policy, backends=backend)
    monitor = HealthMonitor(guard, interval_s=0)
    calls = iter(range(1000))

    async def call(live: Exception | None = None) -> None:
        """One request whose state is its own (never a cached answer), failing with ``live``; then the canary run
        it asked for."""
        failure["live"] = live
        text = f"hello {next(calls)}"
        await guard.aevaluate(HttpSubject(method="POST", path="/x", body=text, body_text=text))
        await asyncio.gather(*monitor._rechecks.values(), return_exceptions=True)

    def backend_check() -> tuple[str, bool]:
        report = guard.health()
        return report["checks"]["backends"]["default"], report["ready"]

    assert backend_check() == ("starting", False)
    await monitor.check()
    assert backend_check() == ("ok", True)
    for live in (BackendTimeout("no answer in time"), BackendUnavailable("500 for this state", reason="http_500"),
                 RuntimeError("the model raised on this state")):
        await call(live)
        assert backend_check() == ("last_call_failed", True), live  # the canaries passed: still ready
    failure["canary"] = broken = RuntimeError("the ONNX session is broken")  # for every input
    await call(broken)
    assert backend_check() == ("canary_failed", False)
    failure["canary"] = None  # recovered: a refused call asks for another run, which passes
    await call()
    assert backend_check()[1] is True and monitor.results["default"].code == "ok"
    await call()
    assert backend_check() == ("ok", True)
    failure["canary"] = down = BackendUnavailable("refused", reason="connection")
    await call(down)
    assert backend_check() == ("unreachable", False)
    failure["canary"] = None
    await call()  # a live answer clears it at once
    assert backend_check() == ("ok", True)
    await call(BackendTimeout("no answer in time"))
    assert backend_check() == ("last_call_failed", True)  # not the stale "unreachable" again
    await monitor.aclose()
    await guard.aclose()


def test_without_canaries_a_live_failure_no_request_causes_fails_and_the_rest_degrade() -> None:
    """The severity a live failure gets where no canary can decide (no monitor, or questions without canaries)."""
    from guard.engine.health import FailureTracker, call_severity
    from guard.errors import BackendRejected, BackendTimeout, BackendUnavailable, MalformedAnswer

    for exc, severity in (
        (BackendTimeout("slow"), "degraded"),
        (BackendRejected("bad state", status_code=422), "degraded"),
        (BackendRejected("key revoked", status_code=401), "failing"),
        (BackendRejected("no such model", status_code=404), "failing"),
        (BackendUnavailable("busy", reason="http_503", retry_after=2.0), "degraded"),
        (BackendUnavailable("gateway timeout", reason="http_504"), "degraded"),
        (BackendUnavailable("refused", reason="connection"), "failing"),
        (MalformedAnswer("nan"), "failing"),
        (RuntimeError("raised"), "failing"),
    ):
        assert call_severity(exc) == severity, exc
    tracker = FailureTracker()
    tracker.failure("inference_failed", "x")
    tracker.failure("backend_rejected", "y", severity="degraded")  # does not hide the failure no request causes
    assert tracker.check().severity == "failing"


async def test_a_canary_that_times_out_degrades_and_a_refused_model_still_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of slow requests made the canary run they asked for time out too, and ``unreachable`` took the
    replica out: now a canary timeout is ``canary_timed_out`` (degraded). A backend that refuses a policy's model
    (404, a model it no longer serves) is failing even with canaries, which ask for one model only."""
    from guard.engine import health
    from guard.errors import BackendRejected, BackendTimeout
    from guard.policy import load_text
    from guard.subject import HttpSubject

    monkeypatch.setattr(health, "RECHECK_INTERVAL_S", 0.0)
    slow = {"canary": False}

    def answers(request: Any) -> dict[str, Any]:
        if request.model == "gone":
            raise BackendRejected("no such model", status_code=404)
        if slow["canary"] and "hello" not in str(request.state):
            raise BackendTimeout("queued behind the flood")
        injection = scripted_answers(request)["injection"]
        return {question.id: injection for question in request.questions}

    policy = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {paths: ["/a"]}}
    questions: {injection: {catalog: guard.prompt_injection}}
    rules: [{id: r, when: injection.noul >= 0.9, action: block}]
  - id: q
    version: 1
    model: gone
    match: {http: {paths: ["/b"]}}
    questions: {injection: {catalog: guard.prompt_injection}}
    rules: [{id: r, when: injection.noul >= 0.9, action: block}]
""")
    guard = Guard(policy, backends=ScriptedBackend(answers))
    monitor = HealthMonitor(guard, interval_s=0)
    await monitor.check()
    slow["canary"] = True
    monitor.suspect("default")
    await asyncio.gather(*monitor._rechecks.values())
    report = guard.health()
    assert report["checks"]["backends"]["default"] == "canary_timed_out" and report["ready"] is True
    slow["canary"] = False
    verdict = await guard.aevaluate(HttpSubject(method="POST", path="/b", body="hello", body_text="hello"))
    assert verdict.fail_mode == "closed"
    report = guard.health()
    assert report["checks"]["backends"]["default"] == "failing" and report["ready"] is False
    await guard.aclose()
    assert not [t for t in monitor._rechecks.values() if not t.done()]  # aclose stopped the monitor's runs


def test_a_failure_in_the_sync_api_starts_the_canary_run_on_the_monitors_loop() -> None:
    """``Guard.evaluate`` decides on a thread of its own loop: the run it asks for was started there, where the
    monitor's own ``aclose`` could not stop it ("Task was destroyed but it is pending")."""
    from guard.errors import BackendUnavailable
    from guard.policy import load_text
    from guard.subject import HttpSubject

    def answers(request: Any) -> dict[str, Any]:
        if "hello" in str(request.state):
            raise BackendUnavailable("500 for this state", reason="http_500")
        return {question.id: scripted_answers(request)["injection"] for question in request.questions}

    policy = load_text(INJECTION_POLICY)
    guard = Guard(policy, backends=ScriptedBackend(answers))
    monitor = HealthMonitor(guard, interval_s=0)

    async def main() -> None:
        await monitor.check()
        loop = asyncio.get_running_loop()
        verdict = await asyncio.to_thread(guard.evaluate, HttpSubject(method="POST", path="/x", body="hello",
                                                                      body_text="hello"))
        assert verdict.fail_mode == "closed"
        for _ in range(100):  # the request to start it crosses threads
            if monitor._rechecks:
                break
            await asyncio.sleep(0.01)
        (run,) = monitor._rechecks.values()
        assert run.get_loop() is loop
        assert (await run).code == "ok"
        await guard.aclose()

    asyncio.run(main())


async def test_a_recovery_seen_by_one_replica_moves_every_replicas_cache_keys_on(
    redis_url: str, create_redis: Any
) -> None:
    """Replicas sharing a Redis: the model of replica A breaks, its answers are cached, its canary fails and passes
    again. Replica B (running) and replica C (started later) take A's recovery epoch at their next canary run, so
    neither decides the attack on the broken model's cached "no"."""
    from guard.engine.cache import CacheConfig, RedisCache
    from guard.policy import load_text
    from guard.subject import HttpSubject

    broken = False

    def answer(request: Any) -> dict[str, float]:
        return {"guard.prompt_injection": 0.0} if broken else injection_by_word(request)

    def replica(model: Any) -> tuple[Guard, HealthMonitor]:
        cache = RedisCache(CacheConfig(url=redis_url, prefix=create_redis.prefix, local_ttl=0))
        guard = Guard(load_text(CACHED_INJECTION), backends=ScriptedBackend(model, revision="r1"), cache=cache)
        return guard, HealthMonitor(guard, interval_s=0)

    subject = HttpSubject(method="POST", path="/v1/chat", body=ATTACK, body_text=ATTACK)
    (a, monitor_a), (b, monitor_b) = replica(answer), replica(injection_by_word)
    await monitor_a.check()
    await monitor_b.check()
    broken = True
    assert (await a.aevaluate(subject)).action == "allow"  # the broken model's answer, now in Redis
    await monitor_a.check()  # fails
    broken = False
    await monitor_a.check()  # passes again: epoch 1, published
    await monitor_b.check()
    c, monitor_c = replica(answer)
    await monitor_c.check()
    for guard in (a, b, c):
        verdict = await guard.aevaluate(subject)
        assert (verdict.action, verdict.rule) == ("block", "inj"), (guard.canary_epochs, verdict.error)
        await guard.aclose()


@pytest.mark.parametrize(("status", "code", "ready"), [(None, "unreachable", True), (401, "refused", False),
                                                       (404, "refused", False)])
async def test_a_remote_backend_is_degraded_when_down_and_failing_when_it_refuses_the_deployment(
    status: int | None, code: str, ready: bool
) -> None:
    """Every gateway replica shares a remote worker: when it cannot be reached, taking every replica out of rotation
    turned fail modes (503 with Retry-After, fail-open) and unjudged paths into connection errors (new-user trial),
    so it is degraded. A revoked key or a model it does not serve is the deployment's fault: failing (review
    finding: the canary made those ready too)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def refuse(request: Any) -> JSONResponse:
        return JSONResponse({"code": "refused", "message": "no", "field": None}, status_code=status or 500)

    stub = Starlette(routes=[Route("/v1/systemone", refuse, methods=["POST"])])
    with serve_app_in_thread(stub, ready_path=None) as live_url:
        guard = Guard(load_files(POLICY), backends=SystemOneClient(dead_url() if status is None else live_url,
                                                                   timeout=2))
        monitor = HealthMonitor(guard, interval_s=0)
        await monitor.start()
        report = guard.health()
        await monitor.aclose()
        await guard.aclose()
    assert report["checks"]["backends"] == {"default": code} and report["ready"] is ready, report


@pytest.mark.parametrize(("root_path", "path"), [("", "/_guard/live"), ("/ops", "/ops/_guard/live"),
                                                 ("/ops", "/_guard/live"), ("/ops/", "/ops//_guard/live")])
async def test_the_admin_paths_are_read_below_a_root_path(root_path: str, path: str) -> None:
    """Under a root path the admin endpoints are where the application's routes would be: below it, whether the
    server puts the root path in ``scope["path"]`` (uvicorn) or leaves it out (hypercorn); the middleware puts it in
    front of a path that lacks it."""
    guard = Guard.from_files(POLICY, backends=ScriptedBackend(scripted_answers))
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": root_path,
             "query_string": b"", "headers": [], "client": ("127.0.0.1", 5000), "server": ("admin", 9901)}
    await admin_app(guard)(scope, receive, send)
    assert sent[0]["status"] == 200 and sent[1]["body"] == b'{"status":"alive"}'
    await guard.aclose()


async def test_a_reload_that_adds_a_question_with_a_canary_runs_it_before_the_next_periodic_run(
    tmp_path: Path,
) -> None:
    """A broken model (it says "no" to everything) behind a policy whose question has no canary passes the start-up
    run; a reload to the injection question ran no canary until the next periodic run (never with interval 0), so
    the broken model judged attacks and the gateway stayed ready. The first decision after the reload runs them."""
    from guard.policy import load_files
    from guard.subject import HttpSubject

    path = tmp_path / "p.yaml"
    path.write_text(INJECTION_POLICY.replace("guard.prompt_injection", "guard.refusal"))
    guard = Guard(load_files(path), backends=ScriptedBackend(lambda request: {}, refuse=["none"]))
    monitor = HealthMonitor(guard, interval_s=0)
    await monitor.start()
    assert monitor.results["default"].code == "no_canary"
    path.write_text(INJECTION_POLICY)
    guard.reload()
    await guard.aevaluate(HttpSubject(method="POST", path="/v1/chat", body=ATTACK, body_text=ATTACK))
    assert await _code_after(monitor, "no_canary") == "canary_failed"
    assert guard.health()["ready"] is False
    await monitor.aclose()
    await guard.aclose()


async def test_a_reload_during_a_canary_run_of_the_policies_before_runs_the_new_ones_after_it(tmp_path: Path) -> None:
    """A run the older policies' canaries were read for (a failed live call asked for it) was still going on when
    the reload landed: the first decision after it marked the new version as run and started none, so the model,
    broken on the question the reload added, was used until the next periodic run (never with interval 0)."""
    from guard.policy import load_files
    from guard.subject import HttpSubject

    def injection_only(request: Any) -> dict[str, Any]:  # right on the injection canary, 0.5 on every other
        return {"guard.prompt_injection": 0.97 if "ignore" in json.dumps(request.state).lower() else 0.03}

    path = tmp_path / "p.yaml"
    path.write_text(INJECTION_POLICY)
    guard = Guard(load_files(path), backends=ScriptedBackend(injection_only, delay=0.2))
    monitor = HealthMonitor(guard, interval_s=0)
    await monitor.start()
    monitor.suspect("default")
    await asyncio.sleep(0.05)  # the run has read the policies before the reload
    path.write_text(INJECTION_POLICY.replace("{injection: {catalog: guard.prompt_injection}}",
                                             "{injection: {catalog: guard.prompt_injection}, "
                                             "harm: {catalog: guard.harmful_request}}"))
    guard.reload()
    subject = HttpSubject(method="POST", path="/v1/chat", body="hello", body_text="hello")
    await guard.aevaluate(subject)  # while that run goes on
    await asyncio.sleep(0.3)
    await guard.aevaluate(subject)  # the first after it
    assert await _code_after(monitor, "ok") == "canary_failed"
    assert guard.health()["ready"] is False
    await monitor.aclose()
    await guard.aclose()
