"""Canary epochs shared through a Redis cache (:meth:`guard.engine.health.HealthMonitor._share_epoch`): a replica
never reads answers cached before a canary failure or recovery it did not see, even when the published epoch is gone
from Redis (deleted by someone with access to it, evicted under ``allkeys-lru``) or replaced by a value that is not
sealed."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from guard.engine import Guard
from guard.engine.cache import CacheConfig, MemoryCache, RedisCache
from guard.engine.health import HealthMonitor
from guard.policy import load_text
from guard.subject import HttpSubject
from tests._backends import ScriptedBackend
from tests._policies import ATTACK, CACHED_INJECTION

pytestmark = pytest.mark.anyio

POLICY = CACHED_INJECTION.replace("mode: closed", "mode: open")
SUBJECT = HttpSubject(method="POST", path="/v1/chat", body=ATTACK, body_text=ATTACK)
SCOPE = "default\nr1"  # the epoch's scope: backend name and model revision


def injection_by_word(request: Any) -> dict[str, float]:
    """A healthy model for the catalog canaries: an injection when the state says "ignore"."""
    return {"guard.prompt_injection": 0.99 if "ignore" in str(request.state).lower() else 0.01}


#: Seconds a :class:`SlowBackend` call started in this context sleeps (a canary run started with it set is slow).
DELAY: contextvars.ContextVar[float] = contextvars.ContextVar("delay", default=0.0)


class SlowBackend(ScriptedBackend):
    """A scripted backend whose calls sleep :data:`DELAY` first: overlapping canary runs end in a chosen order."""

    async def decide(self, request: Any, *, timeout: float | None = None) -> Any:
        await asyncio.sleep(DELAY.get())
        return await super().decide(request, timeout=timeout)


class Replica:
    """One guard process on the shared Redis (no local copies), with its canary monitor and a model that can break."""

    def __init__(self, redis_url: str, prefix: str, *, broken: bool = False) -> None:
        self.broken = broken
        self.backend = SlowBackend(self._answer, revision="r1")
        self.cache = RedisCache(CacheConfig(url=redis_url, prefix=prefix, local_ttl=0))
        self.guard = Guard(load_text(POLICY), backends=self.backend, cache=self.cache)
        self.monitor = HealthMonitor(self.guard, interval_s=0)

    def _answer(self, request: Any) -> dict[str, float]:
        return {"guard.prompt_injection": 0.0} if self.broken else injection_by_word(request)

    @property
    def epoch(self) -> int:
        return self.guard.canary_epochs.get("default", 0)

    async def aclose(self) -> None:
        await self.guard.aclose()


async def epoch_keys(create_redis: Any) -> list[bytes]:
    return [k async for k in create_redis().scan_iter(match=f"{create_redis.prefix}e:*")]


async def broken_answer_cached_then_recovered(redis_url: str, create_redis: Any) -> Replica:
    """Replica A: its model breaks, answers the attack "no" (cached in Redis), fails its canary and passes again."""
    a = Replica(redis_url, create_redis.prefix)
    await a.monitor.check()
    a.broken = True
    assert (await a.guard.aevaluate(SUBJECT)).action == "allow"  # the broken model's answer, now in Redis
    await a.monitor.check()  # fails
    a.broken = False
    await a.monitor.check()  # passes again: a new epoch, published
    assert (await a.guard.aevaluate(SUBJECT)).action == "block"
    return a


async def test_a_healthy_replica_does_not_read_what_a_broken_one_cached_before_its_canary_failed(
    redis_url: str, create_redis: Any
) -> None:
    """Replica A's model breaks and, before A's next canary run, answers an attack "no" (stored in Redis). A's canary
    then fails; the epoch used to move only on a recovery, so replica B, whose model is fine, served A's broken
    answer (an allow) for the rest of the TTL. A failed canary publishes the next epoch: B takes it at its next
    run and asks its own model; A's recovery moves it on again."""
    a, b = Replica(redis_url, create_redis.prefix), Replica(redis_url, create_redis.prefix)
    await a.monitor.check()
    await b.monitor.check()
    start = a.epoch
    a.broken = True
    assert (await a.guard.aevaluate(SUBJECT)).action == "allow"  # the broken model's answer, now in Redis
    await a.monitor.check()  # fails
    assert a.monitor.results["default"].code == "canary_failed"
    assert a.epoch == start + 1 and await a.cache.shared_epoch(SCOPE) == start + 1
    await b.monitor.check()
    assert b.epoch == start + 1
    calls = b.backend.calls
    verdict = await b.guard.aevaluate(SUBJECT)
    assert (verdict.action, verdict.rule, verdict.cache_hit) == ("block", "inj", False), (b.epoch, verdict.error)
    assert b.backend.calls == calls + 1  # its own model, not A's broken answer
    a.broken = False
    await a.monitor.check()  # passes again
    assert a.epoch == start + 2 and await a.cache.shared_epoch(SCOPE) == start + 2
    await a.aclose()
    await b.aclose()


async def test_overlapping_canary_runs_take_turns_so_a_failure_after_a_recovery_moves_the_epoch(
    redis_url: str, create_redis: Any
) -> None:
    """A's periodic canary run and one a refused request asked for (:meth:`HealthMonitor.suspect`) overlap, both
    started while A fails its canary. The first passes (the epoch moves on); A's model breaks again and answers an
    attack "no" (stored in Redis); the second then fails. Each run compared its result with the state before *it*
    started (failing), so this failure moved no epoch and healthy replica B served A's broken answer. Runs now take
    turns: the second compares with the first's pass and moves the epoch; B asks its own model."""
    a, b = Replica(redis_url, create_redis.prefix), Replica(redis_url, create_redis.prefix)
    await a.monitor.check()
    await b.monitor.check()
    a.broken = True
    await a.monitor.check()
    assert a.monitor.results["default"].code == "canary_failed"
    failed_at = a.epoch
    a.broken = False
    DELAY.set(0.1)
    periodic = asyncio.create_task(a.monitor.check_backend("default"))
    await asyncio.sleep(0)
    DELAY.set(0.3)
    a.monitor.suspect("default")  # a refused request asks for a run: started now, on this loop
    recheck = a.monitor._rechecks["default"]
    DELAY.set(0.0)
    assert (await periodic).code == "ok" and a.epoch == failed_at + 1
    a.broken = True  # breaks again before the recheck ends
    assert (await a.guard.aevaluate(SUBJECT)).action == "allow"  # the broken model's answer, now in Redis
    assert (await recheck).code == "canary_failed"
    assert a.monitor.results["default"].code == "canary_failed"
    assert a.epoch == failed_at + 2 and await a.cache.shared_epoch(SCOPE) == a.epoch
    await b.monitor.check()
    calls = b.backend.calls
    verdict = await b.guard.aevaluate(SUBJECT)
    assert (verdict.action, verdict.rule, verdict.cache_hit) == ("block", "inj", False), (b.epoch, verdict.error)
    assert b.backend.calls == calls + 1  # its own model, not A's broken answer
    await a.aclose()
    await b.aclose()


async def test_a_replica_failing_its_first_canary_leaves_the_other_replicas_cache_alone(
    redis_url: str, create_redis: Any
) -> None:
    """A replica started on a broken model fails its first canary before it answered anything (``guard proxy`` runs
    the canaries before it takes requests), so nothing it cached needs hiding. That failure used to move the shared
    epoch: a pod restarted over and over on a bad node emptied every replica's cache at each start. Neither it nor
    its recovery moves the epoch now; the healthy replica keeps its cached answers."""
    b = Replica(redis_url, create_redis.prefix)
    await b.monitor.check()
    assert (await b.guard.aevaluate(SUBJECT)).cache_hit is False
    start = b.epoch
    for _ in range(3):  # a crash loop
        c = Replica(redis_url, create_redis.prefix, broken=True)
        await c.monitor.check()
        assert c.monitor.results["default"].code == "canary_failed" and c.epoch == start
        await c.aclose()
    c.broken = False  # the last one recovers: it has used no answer of the broken model either
    await c.monitor.check()
    assert c.monitor.results["default"].code == "ok" and c.epoch == start
    assert await b.cache.shared_epoch(SCOPE) == start
    await b.monitor.check()
    calls = b.backend.calls
    assert b.epoch == start and (await b.guard.aevaluate(SUBJECT)).cache_hit is True
    assert b.backend.calls == calls
    await b.aclose()
    await c.aclose()


async def test_answers_a_model_gave_before_its_first_canary_run_are_not_read_after_it_fails_and_recovers() -> None:
    """A library caller may serve requests before its monitor's first run: a broken model's answer is then cached.
    Its first run fails and a later one passes; the answer cached before must not be read then (the epoch moves once
    the backend's answers may have been used, however its first run ended)."""
    broken = {"now": True}
    backend = ScriptedBackend(lambda r: {"guard.prompt_injection": 0.0} if broken["now"] else injection_by_word(r),
                              revision="r1")
    guard = Guard(load_text(POLICY), backends=backend, cache=MemoryCache())
    monitor = HealthMonitor(guard, interval_s=0)
    assert (await guard.aevaluate(SUBJECT)).action == "allow"  # before any canary run: cached
    await monitor.check()
    assert monitor.results["default"].code == "canary_failed"
    broken["now"] = False  # mended
    await monitor.check()
    assert monitor.results["default"].code == "ok"
    verdict = await guard.aevaluate(SUBJECT)
    assert (verdict.action, verdict.cache_hit) == ("block", False), guard.canary_epochs
    await guard.aclose()


@pytest.mark.parametrize("how", ["deleted", "forged", "another type"])
async def test_a_replica_started_after_the_epoch_is_lost_does_not_read_answers_cached_before_a_recovery(
    redis_url: str, create_redis: Any, how: str
) -> None:
    """The recovery epoch A published is deleted from Redis (someone with access to it; ``allkeys-lru`` eviction) or
    replaced by a value without the store key's seal, or by a key of another type. Replica C, started then, used to
    stay at epoch 0 and read the broken model's cached "no" (an allow of the attack): it must take a fresh epoch,
    miss, and ask its model."""
    a = await broken_answer_cached_then_recovered(redis_url, create_redis)
    (key,) = await epoch_keys(create_redis)
    if how == "deleted":
        await create_redis().delete(key)
    elif how == "forged":
        await create_redis().set(key, b"not sealed\n999999999999999")
    else:  # a hash: Redis refuses GET on it, and SET NX does not take its place
        await create_redis().delete(key)
        await create_redis().hset(key, "epoch", "1")
    await asyncio.sleep(0.01)  # a later millisecond than A's epoch
    c = Replica(redis_url, create_redis.prefix)
    await c.monitor.check()
    calls = c.backend.calls
    verdict = await c.guard.aevaluate(SUBJECT)
    assert (verdict.action, verdict.rule, verdict.cache_hit) == ("block", "inj", False), (c.epoch, verdict.error)
    assert c.backend.calls == calls + 1  # a fresh model call, not the answer cached before
    assert c.epoch > a.epoch and await c.cache.shared_epoch(SCOPE) == c.epoch
    await a.monitor.check()  # A takes C's (higher) epoch at its next run: one epoch again
    assert a.epoch == c.epoch
    await a.aclose()
    await c.aclose()


async def test_replicas_starting_on_an_empty_store_agree_on_one_epoch(redis_url: str, create_redis: Any) -> None:
    """Two replicas whose first canary runs meet on an empty store: one publishes (only if absent), both take it."""
    a, b = Replica(redis_url, create_redis.prefix), Replica(redis_url, create_redis.prefix)
    await asyncio.gather(a.monitor.check(), b.monitor.check())
    shared = await a.cache.shared_epoch(SCOPE)
    assert shared is not None and shared > 0 and a.epoch == b.epoch == shared
    assert len(await epoch_keys(create_redis)) == 1
    # a replica started later takes it too, and answers cached under it are shared
    assert (await a.guard.aevaluate(SUBJECT)).cache_hit is False
    c = Replica(redis_url, create_redis.prefix)
    await c.monitor.check()
    assert c.epoch == shared and (await c.guard.aevaluate(SUBJECT)).cache_hit is True
    for replica in (a, b, c):
        await replica.aclose()


async def test_a_replayed_older_epoch_is_undone_at_the_next_canary_run_of_a_replica_holding_the_newer(
    redis_url: str, create_redis: Any
) -> None:
    """Someone copies the sealed epoch before a recovery and puts it back after. A replica started after that takes
    it (its value is genuine); the replica that holds the newer one republishes it at its next canary run, and the
    later replica takes it back at its own."""
    a = Replica(redis_url, create_redis.prefix)
    await a.monitor.check()
    (key,) = await epoch_keys(create_redis)
    old = await create_redis().get(key)
    a.broken = True
    await a.monitor.check()
    a.broken = False
    await a.monitor.check()  # recovered: a newer epoch
    newer = a.epoch
    await create_redis().set(key, old)  # replayed
    c = Replica(redis_url, create_redis.prefix)
    await c.monitor.check()
    assert c.epoch < newer
    await a.monitor.check()
    assert await c.cache.shared_epoch(SCOPE) == newer
    await c.monitor.check()
    assert c.epoch == newer
    await a.aclose()
    await c.aclose()


async def test_an_in_process_cache_publishes_nothing_and_keeps_epoch_zero() -> None:
    guard = Guard(load_text(POLICY), backends=ScriptedBackend(injection_by_word, revision="r1"), cache=MemoryCache())
    await HealthMonitor(guard, interval_s=0).check()
    assert guard.canary_epochs.get("default", 0) == 0
    await guard.aclose()


async def test_an_in_process_cache_moves_the_epoch_on_a_canary_failure_and_on_the_recovery() -> None:
    broken = {"now": False}
    backend = ScriptedBackend(lambda r: {"guard.prompt_injection": 0.0} if broken["now"] else injection_by_word(r),
                              revision="r1")
    guard = Guard(load_text(POLICY), backends=backend, cache=MemoryCache())
    monitor = HealthMonitor(guard, interval_s=0)
    await monitor.check()
    broken["now"] = True
    assert (await guard.aevaluate(SUBJECT)).action == "allow"  # the broken model's answer, cached
    await monitor.check()  # fails: the keys move on
    assert guard.canary_epochs["default"] == 1
    broken["now"] = False
    await monitor.check()  # passes: they move on again, and the broken answer is not read
    assert guard.canary_epochs["default"] == 2
    verdict = await guard.aevaluate(SUBJECT)
    assert (verdict.action, verdict.cache_hit) == ("block", False)
    await guard.aclose()
