"""Cache-hit evaluation latency against a local Redis, side by side with the Redis GET round trip alone.

What it measures (one process, one event loop, sequential calls, after a warm-up):

* ``redis GET``: ``redis.asyncio`` GET of the stored answers value (the floor any Redis cache hit pays), back to back,
  and timed alone right after an in-process evaluation (so redis-server and the scheduler see the same gaps between
  round trips as in a real hit: on a busy host waking redis-server costs more than the GET itself);
* ``evaluate, redis hit``: ``Guard.aevaluate`` on a subject whose answers are in Redis: match, render the state,
  normalise it, hash the cache key, GET, decode and check the answers, run the CEL rules, build the verdict, and the
  (no-op) span;
* ``evaluate, redis hit + OTel SDK``: the same with a real SDK tracer and an in-memory exporter;
* ``evaluate, memory hit``: the same with the in-process cache (no network);
* ``evaluate, redis cache, local copy hit``: the Redis cache as configured by default, answering from the copy it
  holds in process for ``CacheConfig.local_ttl`` (the Redis-hit rows above set ``local_ttl=0``: one GET per hit);
* ``evaluate, no cache``: ttl 0 with an instant in-process backend (the engine's own overhead around a model call).

Usage::

    python bench/cache_hit.py [--redis-url redis://127.0.0.1:6379/0] [--iterations 3000]

Policy: ``policies/api_abuse.yaml`` (its ``api-abuse`` policy: 3 questions, 9 rules). Numbers depend on the machine; run it where you quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis

from guard.backends.fixture import FixtureBackend
from guard.engine import Guard
from guard.engine.cache import CacheConfig, MemoryCache, RedisCache
from guard.engine.telemetry import Telemetry
from guard.policy import load_files
from guard.subject import HttpSubject

# Settings -------------------------------------------------------------------------------------------------------
REDIS_URL = "redis://127.0.0.1:6379/0"
ITERATIONS = 3000
WARMUP = 300
CHUNK = 100
POLICY = ROOT / "policies" / "api_abuse.yaml"
PREFIX = "guard-bench:"
KEY = os.urandom(32)  # this run seals and reads its own cache entries
PROMPT = "Hi! My card was charged twice for the same order last week; can you refund one of the charges? " * 3
ANSWERS = {"guard.prompt_injection": 0.02, "guard.harmful_request": 0.01, "spam": 0.03}


def subject() -> HttpSubject:
    return HttpSubject(method="POST", path="/v1/chat", content_type="application/json",
                       body={"prompt": PROMPT}, body_text=PROMPT)  # fmt: skip


Variant = tuple[str, Callable[[], Awaitable[Any]]]


@dataclasses.dataclass
class SelfTimed:
    """A variant that timed only part of its work returns this."""

    us: float


async def timed(variants: list[Variant], iterations: int) -> list[tuple[str, list[float]]]:
    """Warm up each variant, then time them round-robin in chunks so machine noise hits all of them alike."""
    for _, fn in variants:
        for _ in range(WARMUP):
            await fn()
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(iterations // CHUNK):
        for name, fn in variants:
            for _ in range(CHUNK):
                started = time.perf_counter()
                result = await fn()
                elapsed = (time.perf_counter() - started) * 1e6
                samples[name].append(result.us if isinstance(result, SelfTimed) else elapsed)
    return [(name, samples[name]) for name, _ in variants]


def summary(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=100)
    return statistics.median(samples), q[94], q[98]


async def main(redis_url: str, iterations: int) -> None:
    policies = load_files(POLICY)
    redis_cache = RedisCache(CacheConfig(url=redis_url, prefix=PREFIX, local_ttl=0, store_key=KEY))  # every hit a GET
    # The baseline client: same library and connection settings, but no 50 ms op timeout (a bench must not crash).
    client = aioredis.Redis.from_url(redis_url, lib_name=None, lib_version=None)
    async for stale in client.scan_iter(match=f"{PREFIX}*"):
        await client.delete(stale)
    guard = Guard(policies, backends=FixtureBackend(ANSWERS), cache=redis_cache)
    first = await guard.aevaluate(subject())
    assert first.error is None and not first.cache_hit, first
    hit = await guard.aevaluate(subject())
    assert hit.cache_hit and hit.action == "allow", hit
    (key,) = [k async for k in client.scan_iter(match=f"{PREFIX}a:*")]

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = Guard(policies, backends=FixtureBackend(ANSWERS), cache=redis_cache,
                   telemetry=Telemetry(tracer_provider=provider))  # fmt: skip

    async def traced_eval() -> Any:
        verdict = await traced.aevaluate(subject())
        exporter.clear()
        return verdict

    memory = Guard(policies, backends=FixtureBackend(ANSWERS), cache=MemoryCache())
    local = Guard(policies, backends=FixtureBackend(ANSWERS), cache=RedisCache(CacheConfig(url=redis_url, prefix=PREFIX, store_key=KEY)))

    async def get_after_work() -> SelfTimed:
        # Back-to-back GETs keep redis-server hot; a real hit does ~0.2 ms of work first. Time only the GET.
        await memory.aevaluate(subject())
        started = time.perf_counter()
        await client.get(key)
        return SelfTimed((time.perf_counter() - started) * 1e6)

    no_cache = Guard([dataclasses.replace(p, cache_ttl=0.0) for p in policies], backends=FixtureBackend(ANSWERS))
    rows = await timed(
        [
            ("redis GET (round trip alone)", lambda: client.get(key)),
            ("redis GET after engine-sized CPU work", get_after_work),
            ("evaluate, redis hit", lambda: guard.aevaluate(subject())),
            ("evaluate, redis hit + OTel SDK", traced_eval),
            ("evaluate, memory hit", lambda: memory.aevaluate(subject())),
            ("evaluate, redis cache, local copy hit", lambda: local.aevaluate(subject())),
            ("evaluate, no cache (instant backend)", lambda: no_cache.aevaluate(subject())),
        ],
        iterations,
    )

    base = summary(rows[0][1])[0]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"policy {POLICY.name}; {iterations} sequential calls per variant (round-robin chunks of {CHUNK}) after "
          f"{WARMUP} warm-up; redis {redis_url}; {os.cpu_count()} CPUs, load average {load}")
    print(f"{'variant':<38} {'p50 us':>9} {'p95 us':>9} {'p99 us':>9} {'p50 / GET':>10}")
    for name, samples in rows:
        p50, p95, p99 = summary(samples)
        print(f"{name:<38} {p50:>9.1f} {p95:>9.1f} {p99:>9.1f} {p50 / base:>9.2f}x")
    health = redis_cache.health()
    print(f"redis cache: {health.hits} hits, {health.misses} misses, {health.errors} errors, {health.skipped} skipped "
          "(a miss calls the instant backend, so errors only lower the redis-hit numbers)")
    async for stale in client.scan_iter(match=f"{PREFIX}*"):
        await client.delete(stale)
    await guard.aclose()
    await local.aclose()
    await client.aclose()
    provider.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    args = parser.parse_args()
    asyncio.run(main(args.redis_url, args.iterations))
