"""Canary epochs shared through a Redis cache (:meth:`guard.engine.health.HealthMonitor._share_epoch`): a replica
never reads answers cached before a canary failure or recovery it did not see, even when the published epoch is gone
from Redis (deleted by someone with access to it, evicted under ``allkeys-lru``) or replaced by a value that is not
sealed."""

from __future__ import annotations

import asyncio
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


class Replica:
    """One guard process on the shared Redis (no local copies), with its canary monitor and a model that can break."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.broken = False
        self.backend = ScriptedBackend(self._answer, revision="r1")
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


@pytest.mark.parametrize("how", ["deleted", "forged"])
async def test_a_replica_started_after_the_epoch_is_lost_does_not_read_answers_cached_before_a_recovery(
    redis_url: str, create_redis: Any, how: str
) -> None:
    """The recovery epoch A published is deleted from Redis (someone with access to it; ``allkeys-lru`` eviction) or
    replaced by a value without the store key's seal. Replica C, started then, used to stay at epoch 0 and read the
    broken model's cached "no" (an allow of the attack): it must take a fresh epoch, miss, and ask its model."""
    a = await broken_answer_cached_then_recovered(redis_url, create_redis)
    (key,) = await epoch_keys(create_redis)
    if how == "deleted":
        await create_redis().delete(key)
    else:
        await create_redis().set(key, b"not sealed\n999999999999999")
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
