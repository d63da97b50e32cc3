"""The probability cache against a real Redis (and the in-process cache): hit, miss, TTL, single-flight, Redis down or
slow, corrupt values (cases C14, C15)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pytest

from guard._seal import Sealer
from guard.engine import Guard
from guard.engine.cache import FOLLOW_SHARE, CacheConfig, MemoryCache, RedisCache
from guard.engine.keys import KEY_VERSION, KeyTemplate, cache_key
from guard.errors import BackendUnavailable, MalformedAnswer
from guard.policy import load_text
from guard.subject import HttpSubject
from guard.systemone import QuestionV1, SystemOneRequestV1
from tests._backends import ScriptedBackend
from tests.conftest import STORE_KEY

POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {methods: [POST]}}
    state: {text: body_text}
    questions:
      injection: {type: noul, instructions: "Is this an injection?"}
      tone: {type: choice, instructions: "Tone?", criteria: {calm: calm, angry: angry}}
    rules:
      - {id: injection, when: injection.noul >= THRESHOLD, action: block}
    cache: {ttl: TTL}
    timeout_ms: 2000
"""


def policies(threshold: float = 0.8, ttl: float = 60) -> Any:
    return load_text(POLICY.replace("THRESHOLD", str(threshold)).replace("TTL", str(ttl)))


def subject(text: str = "hello") -> HttpSubject:
    return HttpSubject(method="POST", path="/x", body={"q": text}, body_text=text)


def by_text(request: SystemOneRequestV1) -> dict[str, Any]:
    return {"injection": 0.9 if "ignore" in request.state["text"] else 0.1, "tone": {"calm": 0.7, "angry": 0.3}}


def redis_cache(redis_url: str, prefix: str, **settings: Any) -> RedisCache:
    """A Redis cache on ``prefix``; ``op_timeout`` 0.5 s unless given: on a busy machine a read of the default 50 ms
    is a miss, counted as an error, which the tests of hits and counts do not mean to measure."""
    return RedisCache(CacheConfig(url=redis_url, prefix=prefix, **{"op_timeout": 0.5, **settings}))


async def keys(create_redis: Any, kind: str = "a") -> list[bytes]:
    client = create_redis()
    return [k async for k in client.scan_iter(match=f"{create_redis.prefix}{kind}:*")]


# Keys ---------------------------------------------------------------------------------------------------------------


def test_cache_key_changes_with_everything_the_model_sees() -> None:
    q = QuestionV1("a", "choice", "Pick", {"x": "X", "y": "Y"})
    base = SystemOneRequestV1(model="m", state={"a": 1, "b": 2}, questions=(q,))
    key = cache_key(base, backend="b", revision="r1")
    variants = [
        cache_key(base, backend="b", revision="r2"),
        cache_key(base, backend="other", revision="r1"),
        cache_key(base.override(model="m2"), backend="b", revision="r1"),
        cache_key(base.override(state={"b": 2, "a": 1}), backend="b", revision="r1"),  # key order is model input
        cache_key(base.override(questions=[QuestionV1("a", "choice", "Pick", {"x": "X", "y": "Z"})]), backend="b",
                  revision="r1"),
        cache_key(base.override(questions=[QuestionV1("a", "choice", "Pick!", {"x": "X", "y": "Y"})]), backend="b",
                  revision="r1"),
        cache_key(base.override(images=("data:image/png;base64,AAAA",)), backend="b", revision="r1"),
    ]
    assert len({key, *variants}) == len(variants) + 1
    listed_otherwise = base.override(questions=[QuestionV1("a", "choice", "Pick", {"y": "Y", "x": "X"})])
    assert cache_key(listed_otherwise, backend="b", revision="r1") == key  # option order is not model input
    assert cache_key(SystemOneRequestV1(model="m", state={"a": 1, "b": 2}, questions=(q,)), backend="b",
                     revision="r1") == key


def test_cache_key_is_the_hash_of_the_documented_material_and_the_template_agrees() -> None:
    questions = (QuestionV1("a", "choice", "Pick é", {"x": "X", "y": None}), QuestionV1("b", "noul", {"k": [1, 2.5]}),
                 QuestionV1("c", "score", None, ["lo", {"d": 1}, "hi"]))
    template = KeyTemplate(backend="b", revision="r1", model="m", questions=questions)
    for state in ("plain", "ünï \"q\" \u2028", {"a": 1, "b": [1, 2.0, None, True], "c": {"x": "é"}}, [1, "x"], 3.5):
        request = SystemOneRequestV1(model="m", state=state, questions=questions)
        material = {"v": KEY_VERSION, "backend": "b", "revision": "r1", "model": "m", "state": state,
                    "questions": [[q.id, q.type, q.instructions, q.criteria] for q in questions], "images": [],
                    "videos": []}
        blob = json.dumps(material, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        expected = hashlib.sha256(blob).hexdigest()
        assert cache_key(request, backend="b", revision="r1") == template.key(state) == expected


def test_cache_key_reads_videos_and_a_palette_images_colours() -> None:
    """The Clef processor reads ``videos`` and a palette image's colours, the key read neither: a request with an
    attack on video shared the entry of one without, and two "P" images with the same indexes and different
    palettes (or transparency) shared one."""
    from PIL import Image

    q = QuestionV1("a", "noul", "Bad?")

    def key(**media: Any) -> str:
        return cache_key(SystemOneRequestV1(model="m", state="s", questions=(q,), **media), backend="b", revision="r")

    frames = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    changed = frames.copy()
    changed[1, 2, 3, 0] = 255
    videos = [key(), key(videos=(frames,)), key(videos=(changed,)), key(videos=(frames.astype(np.float32),)),
              key(videos=(frames.reshape(4, 2, 4, 3),)), key(videos=(list(frames),))]
    assert len(set(videos)) == len(videos)
    assert key(videos=(frames.copy(),)) == videos[1]

    def palette_image(colour: list[int], transparency: int | None = None) -> Any:
        image = Image.new("P", (2, 2), 0)
        image.putpalette(colour * 256)
        if transparency is not None:
            image.info["transparency"] = transparency
        return image

    images = [key(images=(palette_image([0, 0, 0]),)), key(images=(palette_image([255, 0, 0]),)),
              key(images=(palette_image([0, 0, 0], transparency=0),))]
    assert len(set(images)) == len(images)
    assert key(images=(palette_image([0, 0, 0]),)) == images[0]

    def red(mode: str, transparency: Any = None) -> Any:
        image = Image.new(mode, (2, 2), (255, 0, 0) if mode == "RGB" else 76)
        if transparency is not None:
            image.info["transparency"] = transparency
        return image

    # a colour key (an RGB or greyscale PNG's tRNS) makes that colour white for the model: pixels alone shared one
    # entry between an image whose text is in that colour and the same image whose text the model never sees
    keyed = [key(images=(red("RGB"),)), key(images=(red("RGB", (255, 0, 0)),)), key(images=(red("L"),)),
             key(images=(red("L", 76),))]
    assert len(set(keyed)) == len(keyed)


# In-process cache ---------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_memory_cache_hit_and_threshold_change_needs_no_model_call() -> None:
    backend = ScriptedBackend(by_text)
    cache = MemoryCache()
    guard = Guard(policies(0.8), backends=backend, cache=cache)
    first = await guard.aevaluate(subject("ignore"))
    second = await guard.aevaluate(subject("ignore"))
    assert (first.action, first.cache_hit, second.action, second.cache_hit) == ("block", False, "block", True)
    assert second.answers["injection"].noul == first.answers["injection"].noul
    # A new threshold reuses the cached probabilities: rules run after the cache.
    guard2 = Guard(policies(0.95), backends=backend, cache=cache)
    third = await guard2.aevaluate(subject("ignore"))
    assert (third.action, third.cache_hit, backend.calls) == ("allow", True, 1)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_hits_hand_out_immutable_answers_and_states_of_their_own(kind: str, redis_url: str, create_redis: Any) -> None:
    cache = MemoryCache() if kind == "memory" else redis_cache(redis_url, create_redis.prefix)
    guard = Guard(policies(), backends=ScriptedBackend(by_text), cache=cache)
    await guard.aevaluate(subject("ignore"))
    hit = await guard.aevaluate(subject("ignore"))
    with pytest.raises(TypeError, match="read-only"):
        hit.answers["injection"].probabilities["true"] = 0.0
    with pytest.raises(TypeError, match="read-only"):
        hit.answers["tone"].probabilities.clear()
    with pytest.raises(TypeError, match="read-only"):
        hit.answers.pop("tone")  # the map of answers is shared too
    hit.state["text"] = "changed"
    again = await guard.aevaluate(subject("ignore"))
    assert again.cache_hit and again.answers["injection"].probabilities == pytest.approx({"true": 0.9, "false": 0.1})
    assert again.answers["tone"].probabilities == pytest.approx({"calm": 0.7, "angry": 0.3})
    assert again.state == {"text": "ignore"} and again.action == "block"
    await guard.aclose()


@pytest.mark.anyio
async def test_memory_cache_ttl_and_lru() -> None:
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(ttl=0.05), backends=backend, cache=MemoryCache(CacheConfig(max_entries=2)))
    await guard.aevaluate(subject("a"))
    await asyncio.sleep(0.08)
    assert not (await guard.aevaluate(subject("a"))).cache_hit
    await guard.aevaluate(subject("b"))
    await guard.aevaluate(subject("c"))  # evicts "a"
    assert len(guard.cache) == 2  # type: ignore[arg-type]
    assert backend.calls == 4


@pytest.mark.anyio
async def test_ttl_zero_never_caches() -> None:
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(ttl=0), backends=backend)
    for _ in range(3):
        assert not (await guard.aevaluate(subject())).cache_hit
    assert backend.calls == 3


@pytest.mark.anyio
async def test_memory_single_flight_100_concurrent_one_call() -> None:
    backend = ScriptedBackend(by_text, delay=0.2)
    guard = Guard(policies(), backends=backend)
    verdicts = await asyncio.gather(*(guard.aevaluate(subject("ignore")) for _ in range(100)))
    assert backend.calls == 1
    assert {v.action for v in verdicts} == {"block"}
    assert sum(not v.cache_hit for v in verdicts) == 1


@pytest.mark.anyio
async def test_followers_follow_the_leaders_failure() -> None:
    backend = ScriptedBackend(by_text, delay=0.1, fail=BackendUnavailable("down", reason="http_500"))
    guard = Guard(policies(), backends=backend)
    verdicts = await asyncio.gather(*(guard.aevaluate(subject()) for _ in range(20)))
    assert backend.calls == 1
    assert {(v.action, v.fail_mode, v.status) for v in verdicts} == {("block", "closed", 503)}
    assert all(v.error and v.error.startswith("http_500") for v in verdicts)


@pytest.mark.anyio
@pytest.mark.parametrize("ttl", [60, 0])
async def test_a_backend_raising_cancelled_error_is_a_failure_not_a_cancellation(ttl: float) -> None:
    """A backend whose call ends in ``CancelledError`` while nobody cancelled anything: the leader and its
    followers get the policy's fail mode (the error escaped ``aevaluate`` before, with no verdict at all), and the
    backend's health counts the failure."""
    backend = ScriptedBackend(by_text, delay=0.1, fail=asyncio.CancelledError())
    guard = Guard(policies(ttl=ttl), backends=backend)
    verdicts = await asyncio.gather(*(guard.aevaluate(subject()) for _ in range(5)))
    assert {(v.action, v.fail_mode) for v in verdicts} == {("block", "closed")}
    assert all("CancelledError" in (v.error or "") for v in verdicts)
    assert guard.backend_health["default"].calls_failed >= 1  # counted, so health and readiness see it
    await guard.aclose()


# Redis --------------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_redis_hit_miss_and_ttl_expiry(redis_url: str, create_redis: Any) -> None:
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix)
    guard = Guard(policies(ttl=0.3), backends=backend, cache=cache)
    assert not (await guard.aevaluate(subject("ignore"))).cache_hit
    hit = await guard.aevaluate(subject("ignore"))
    assert hit.cache_hit and hit.action == "block" and hit.answers["tone"].choice == "calm"
    stored = await create_redis().get((await keys(create_redis))[0])
    assert json.loads(stored.partition(b"\n")[2])["answers"]["injection"]["p"] == pytest.approx([0.9, 0.1])
    assert not (await guard.aevaluate(subject("other"))).cache_hit
    await asyncio.sleep(0.4)
    assert not (await guard.aevaluate(subject("ignore"))).cache_hit
    assert backend.calls == 3
    health = cache.health()
    assert (health.status, health.hits, health.errors) == ("ok", 1, 0)
    await guard.aclose()


@pytest.mark.anyio
async def test_redis_single_flight_across_two_guards(redis_url: str, create_redis: Any) -> None:
    replicas = [ScriptedBackend(by_text, delay=0.3, name="clef") for _ in range(2)]
    guards = [Guard(policies(), backends=b, cache=redis_cache(redis_url, create_redis.prefix)) for b in replicas]
    verdicts = await asyncio.gather(*(guards[i % 2].aevaluate(subject("ignore")) for i in range(100)))
    assert sum(b.calls for b in replicas) == 1, [g.cache.health() for g in guards]
    assert {v.action for v in verdicts} == {"block"}
    assert await keys(create_redis, "l") == []  # the leader released its lock
    for guard in guards:
        await guard.aclose()


class _CountedRedis(RedisCache):
    """A Redis cache that counts its round trips (each operation is one: a pipeline or transaction included)."""

    round_trips = 0

    async def _op(self, fn: Any) -> Any:
        self.round_trips += 1
        return await super()._op(fn)


@pytest.mark.anyio
@pytest.mark.parametrize("local_ttl", [1.0, 0])
async def test_a_miss_makes_two_round_trips_before_the_model_is_called(
    local_ttl: float, redis_url: str, create_redis: Any
) -> None:
    """A miss read the value, took the lock, then read the value again (the double check) before it called the
    model: three round trips of the policy's timeout, so a Redis 18 ms away with the 50 ms op timeout put every miss
    of a policy with a tight timeout in its fail mode. The double check is read in the lock's transaction."""
    seen: list[int] = []
    cache = _CountedRedis(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5, local_ttl=local_ttl))

    def answer(request: SystemOneRequestV1) -> dict[str, Any]:
        seen.append(cache.round_trips)
        return by_text(request)

    guard = Guard(policies(), backends=ScriptedBackend(answer), cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.cache_hit, seen) == ("block", False, [2])
    await guard.aclose()
    assert cache.round_trips == 4  # then the write and the release, after the caller went on
    assert await keys(create_redis, "l") == [] and len(await keys(create_redis)) == 1
    health = cache.health()
    assert (health.misses, health.stores, health.errors, health.shared) == (1, 1, 0, 0)


class _ReadTooEarly(RedisCache):
    """A Redis cache whose lookups all miss, as when another replica stores the answers right after the read."""

    async def _load(self, key: str, request: SystemOneRequestV1, ttl: float) -> Any:
        return None


@pytest.mark.anyio
@pytest.mark.parametrize("local_ttl", [1.0, 0])
async def test_answers_stored_between_the_read_and_the_lock_are_taken_from_the_locks_transaction(
    local_ttl: float, redis_url: str, create_redis: Any
) -> None:
    """The double check (in the lock's transaction) finds the answers another replica stored since the read: no
    model call, the lock released; a forged value found there is no answer, and the model decides."""
    first = ScriptedBackend(by_text)
    writer = Guard(policies(), backends=first, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=local_ttl))
    await writer.aevaluate(subject("ignore"))
    await writer.aclose()
    backend = ScriptedBackend(by_text)
    cache = _ReadTooEarly(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5, local_ttl=local_ttl))
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, backend.calls, first.calls) == ("block", 0, 1)
    assert await keys(create_redis, "l") == []  # released
    health = cache.health()
    assert (health.misses, health.shared, health.forged, health.errors) == (1, 1, 0, 0)
    await guard.aclose()

    (name,) = await keys(create_redis)
    await create_redis().set(name, sealed(name, b"{}", store_key="another-store-key-0123456789"))
    cache = _ReadTooEarly(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5, local_ttl=local_ttl))
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, 1)
    await guard.aclose()
    assert unsealed(await create_redis().get(name)) != {}  # overwritten with the model's answers
    assert await keys(create_redis, "l") == []

    await create_redis().delete(name)
    await create_redis().hset(name, "x", "1")  # a key of another type: Redis refuses the read, not the lock
    cache = _ReadTooEarly(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5, local_ttl=local_ttl))
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, 2)
    await guard.aclose()
    assert await keys(create_redis, "l") == []  # the lock was taken and released
    health = cache.health()  # an unreadable value, overwritten: counted by a read (here none), not as a store error
    assert (health.errors, health.stores, health.code) == (0, 1, "ok")
    assert await create_redis().type(name) == b"string"


@pytest.mark.anyio
@pytest.mark.parametrize("local_ttl", [1.0, 0])
async def test_a_value_key_of_another_type_is_overwritten_not_taken_for_an_outage(
    local_ttl: float, redis_url: str, create_redis: Any
) -> None:
    """A hash written at a value's key made every read of it a Redis failure (health ``degraded``, the breaker's
    count): no lock was taken and nothing written, so the key was never cached again. It is a corrupt value now,
    overwritten by the model's answers."""
    backend = ScriptedBackend(by_text)
    writer = Guard(policies(), backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=local_ttl))
    await writer.aevaluate(subject("ignore"))
    await writer.aclose()
    (name,) = await keys(create_redis)
    await create_redis().delete(name)
    await create_redis().hset(name, "x", "1")
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=local_ttl)
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    await guard.aclose()
    assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, 2)
    health = cache.health()
    assert (health.corrupt, health.errors, health.code) == (1, 0, "corrupt_values")  # not a store error as well
    assert await create_redis().type(name) == b"string" and unsealed(await create_redis().get(name)) != {}
    guard = Guard(policies(), backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=local_ttl))
    assert (await guard.aevaluate(subject("ignore"))).cache_hit and backend.calls == 2
    await guard.aclose()


@pytest.mark.anyio
async def test_a_lock_key_of_another_type_is_not_taken_for_an_outage(redis_url: str, create_redis: Any) -> None:
    """A hash written at a state's lock key made each of its misses a Redis failure (health ``degraded``, the
    breaker's count). It is a planted lock now, counted as forged: the miss calls the model without the lock."""
    backend = ScriptedBackend(by_text)
    writer = Guard(policies(), backends=backend, cache=redis_cache(redis_url, create_redis.prefix))
    await writer.aevaluate(subject("ignore"))
    await writer.aclose()
    (name,) = await keys(create_redis)
    lock = f"{create_redis.prefix}l:".encode() + name[len(create_redis.prefix) + 2 :]
    await create_redis().delete(name)
    await create_redis().hset(lock, "x", "1")
    cache = redis_cache(redis_url, create_redis.prefix)
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    await guard.aclose()
    assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, 2)
    health = cache.health()
    assert (health.forged, health.errors, health.stores, health.code) == (1, 0, 1, "forged_values")
    assert await create_redis().exists(name)


@pytest.mark.anyio
async def test_redis_followers_in_another_replica_follow_a_failed_leader(redis_url: str, create_redis: Any) -> None:
    failing = ScriptedBackend(by_text, delay=0.2, name="clef", fail=BackendUnavailable("boom", reason="http_500"))
    healthy = ScriptedBackend(by_text, name="clef")
    leader = Guard(policies(), backends=failing, cache=redis_cache(redis_url, create_redis.prefix))
    follower = Guard(policies(), backends=healthy, cache=redis_cache(redis_url, create_redis.prefix))
    lead_task = asyncio.ensure_future(leader.aevaluate(subject()))
    await asyncio.sleep(0.05)  # the leader holds the lock
    followed = await follower.aevaluate(subject())
    led = await lead_task
    assert (failing.calls, healthy.calls) == (1, 0)
    assert (led.fail_mode, followed.fail_mode, followed.action) == ("closed", "closed", "block")
    assert "leader" in (followed.error or "")
    await leader.aclose()
    await follower.aclose()


@pytest.mark.anyio
async def test_followers_of_a_new_leader_do_not_take_an_earlier_leaders_failure(
    redis_url: str, create_redis: Any
) -> None:
    """Replica A's call fails (its failure marker lives 1 s), A leads the same key again and succeeds, and replica B
    follows that second flight: B must get its answer, not the first flight's failure (under ``on_error: open`` that
    failure had turned the model's block into an allow)."""
    flaky = ScriptedBackend(by_text, delay=0.3, name="clef",
                            fail=lambda n: BackendUnavailable("boom", reason="http_500") if n == 1 else None)
    healthy = ScriptedBackend(by_text, name="clef")
    a = Guard(policies(), backends=flaky, cache=redis_cache(redis_url, create_redis.prefix))
    b = Guard(policies(), backends=healthy, cache=redis_cache(redis_url, create_redis.prefix))
    first = await a.aevaluate(subject("ignore"))
    assert first.fail_mode == "closed" and await keys(create_redis, "f")  # the marker is there
    second = asyncio.ensure_future(a.aevaluate(subject("ignore")))
    await asyncio.sleep(0.05)  # A holds the lock again
    followed = await b.aevaluate(subject("ignore"))
    assert ((await second).action, followed.action, followed.fail_mode) == ("block", "block", None), followed.error
    assert (flaky.calls, healthy.calls) == (2, 0)
    await a.aclose()
    await b.aclose()


@pytest.mark.anyio
async def test_followers_take_a_fast_failure_of_the_lock_they_met(redis_url: str, create_redis: Any) -> None:
    """Four replicas at once, the model failing in 5 ms (not retried): the three that met the leader's lock take its
    failure. A follower learned the lock only from its polls before, so one whose first poll (10 ms) came after the
    failure ignored the marker and called the model itself: four calls, not one."""
    backends = [ScriptedBackend(by_text, delay=0.005, name="clef", fail=MalformedAnswer("bad", backend="clef"))
                for _ in range(4)]
    guards = [Guard(policies(), backends=b, cache=redis_cache(redis_url, create_redis.prefix))
              for b in backends]  # as in test_redis_single_flight_across_two_guards
    verdicts = await asyncio.gather(*(g.aevaluate(subject()) for g in guards))
    assert sum(b.calls for b in backends) == 1, [v.error for v in verdicts]
    assert {v.fail_mode for v in verdicts} == {"closed"}
    for guard in guards:
        await guard.aclose()


async def _answered_once_then_gone(redis_url: str, create_redis: Any) -> tuple[Any, RedisCache, Guard, Any, bytes, str]:
    """A guard on a Redis cache (no local copies) that answered ``subject()`` once, with that answer deleted from
    Redis: the backend, cache, guard, a Redis client, the value's key and its content hash (the lock and marker keys
    are ``<prefix>l:<content>`` and ``<prefix>f:<content>``)."""
    backend = ScriptedBackend(by_text, name="clef")
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=backend, cache=cache)
    await guard.aevaluate(subject())
    (value_key,) = await keys(create_redis)
    content = value_key.decode().removeprefix(f"{create_redis.prefix}a:")
    client = create_redis()
    await client.delete(value_key)
    return backend, cache, guard, client, value_key, content


@pytest.mark.anyio
async def test_a_forged_leader_failure_marker_is_ignored_not_followed(redis_url: str, create_redis: Any) -> None:
    """Someone who can write to Redis but lacks the store key plants a lock and a failure marker for a request's key:
    followers must take neither the planted failure (the policy's fail mode) nor the planted lock, and answer."""
    backend, cache, guard, client, value_key, content = await _answered_once_then_gone(redis_url, create_redis)
    marker = json.dumps({"reason": "http_500", "message": "planted", "backend": "clef"}).encode()
    for forged in (marker, sealed(f"{create_redis.prefix}f:{content}", marker, "another key of 32 bytes or more!")):
        await client.set(f"{create_redis.prefix}l:{content}", "planted", px=300)
        await client.set(f"{create_redis.prefix}f:{content}", forged)
        verdict = await guard.aevaluate(subject())
        assert (verdict.action, verdict.fail_mode) == ("allow", None), verdict.error
        await client.delete(value_key)
    assert cache.health().forged == 4 and backend.calls == 3  # two markers, two locks
    # the same marker sealed with this store key, within its end, naming the lock held and the leader's budget, is the
    # leader's failure
    await client.set(f"{create_redis.prefix}l:{content}", "planted", px=300)
    marker_key = f"{create_redis.prefix}f:{content}"
    named = json.dumps({**json.loads(marker), "lock": "planted", "budget": 2.0}).encode()
    await client.set(marker_key, sealed(marker_key, until(1000, named)))
    followed = await guard.aevaluate(subject())
    assert (followed.fail_mode, followed.action) == ("closed", "block") and "planted" in (followed.error or "")
    await guard.aclose()


def until(ms_from_now: int, data: bytes) -> bytes:
    """``data`` with the end a Redis cache seals in front of a lock or failure marker (Unix ms)."""
    return b"%d\n%s" % (int(time.time() * 1000) + ms_from_now, data)


@pytest.mark.anyio
async def test_a_sealed_lock_and_failure_marker_put_back_after_their_end_are_not_followed(
    redis_url: str, create_redis: Any
) -> None:
    """Someone with write access to Redis but not the store key copies a leader's real lock and failure marker and
    sets them back without an expiry: they must not pin the request's key to "the leader's backend failed" (the
    policy's fail mode for good, an allow under fail_mode: open): past the end sealed in them, they are ignored."""
    backend, cache, guard, client, value_key, content = await _answered_once_then_gone(redis_url, create_redis)
    marker = json.dumps({"reason": "timeout", "message": "the leader's call timed out", "backend": "clef"}).encode()
    lock_key, marker_key = f"{create_redis.prefix}l:{content}", f"{create_redis.prefix}f:{content}"
    await client.set(lock_key, sealed(lock_key, until(-5000, b"0123456789abcdef")))  # no expiry: put back
    await client.set(marker_key, sealed(marker_key, until(-5000, marker)))
    for _ in range(3):
        verdict = await guard.aevaluate(subject())
        assert (verdict.action, verdict.fail_mode) == ("allow", None), verdict.error
        await client.delete(value_key)
    assert backend.calls == 4 and cache.health().forged >= 3
    await guard.aclose()


@pytest.mark.anyio
async def test_a_planted_lock_is_not_waited_out(redis_url: str, create_redis: Any) -> None:
    """A lock planted for a request's key without the store key (a long PX) costs a follower one poll: it leads and
    answers. Waited out, it took the request's whole time budget, so the decision failed in the policy's fail mode."""
    backend, cache, guard, client, _, content = await _answered_once_then_gone(redis_url, create_redis)
    await client.set(f"{create_redis.prefix}l:{content}", "planted", px=60_000)
    verdict = await guard.aevaluate(subject())
    assert (verdict.action, verdict.fail_mode) == ("allow", None), verdict.error
    assert backend.calls == 2 and cache.health().forged == 1
    await guard.aclose()


class _FirstReadFails(RedisCache):
    """A Redis cache whose first operation finds Redis down."""

    failed = False

    async def _op(self, fn: Any) -> Any:
        if not self.failed:
            self.failed = True
            return await super()._op(_down)
        return await super()._op(fn)


async def _down(client: Any) -> Any:
    from redis.exceptions import ConnectionError as RedisConnectionError

    raise RedisConnectionError("down")


@pytest.mark.anyio
async def test_an_empty_value_is_checked_where_answers_are_held_that_were_never_stored(
    redis_url: str, create_redis: Any
) -> None:
    """Answers held in process without a stored value (Redis did not answer their read) carry b"" as the value they
    were read from, and an empty value written to Redis without the store key matched it once the copy expired: a
    hit, neither counted as forged nor overwritten, so every other replica kept reading it."""
    config = CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5, local_ttl=0.05)
    held, other = _FirstReadFails(config), RedisCache(config)
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(), backends=backend, cache=held)
    assert (await guard.aevaluate(subject("ignore"))).action == "block"  # held in process only
    other_guard = Guard(policies(), backends=ScriptedBackend(by_text), cache=other)
    await other_guard.aevaluate(subject("ignore"))  # stored, so the key is known
    (name,) = await keys(create_redis)
    client = create_redis()
    await client.set(name, b"")
    await asyncio.sleep(0.1)  # past local_ttl
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, held.health().forged, backend.calls) == ("block", 1, 2)
    assert await client.get(name) not in (b"", None)  # overwritten with sealed answers
    await guard.aclose()
    await other_guard.aclose()


@pytest.mark.anyio
async def test_redis_hits_read_a_value_another_replica_rewrote(redis_url: str, create_redis: Any) -> None:
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)  # every hit reads Redis
    guard = Guard(policies(), backends=ScriptedBackend(by_text), cache=cache)
    await guard.aevaluate(subject("ignore"))
    assert (await guard.aevaluate(subject("ignore"))).action == "block"
    await rewrite_injection(create_redis, 0.2)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.cache_hit, verdict.action, verdict.answers["injection"].noul) == (True, "allow", 0.2)
    await guard.aclose()


@pytest.mark.anyio
async def test_redis_hits_are_answered_in_process_for_local_ttl(redis_url: str, create_redis: Any) -> None:
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0.3)
    guard = Guard(policies(), backends=backend, cache=cache)
    assert (await guard.aevaluate(subject("ignore"))).cache_hit is False
    reads = await redis_gets(create_redis)
    hits = [await guard.aevaluate(subject("ignore")) for _ in range(20)]
    assert all(v.cache_hit and v.action == "block" for v in hits) and backend.calls == 1
    assert await redis_gets(create_redis) == reads  # answered from the copy this process wrote: no GET
    await rewrite_injection(create_redis, 0.2)  # by hand, or another replica: seen once the copy is too old
    assert (await guard.aevaluate(subject("ignore"))).action == "block"
    await asyncio.sleep(0.35)
    reads = await redis_gets(create_redis)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.cache_hit, verdict.action, verdict.answers["injection"].noul) == (True, "allow", 0.2)
    assert await redis_gets(create_redis) == reads + 1
    # A second replica's first hit reads Redis once, then holds its own copy.
    other = Guard(policies(), backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0.3))
    reads = await redis_gets(create_redis)
    assert [(await other.aevaluate(subject("ignore"))).action for _ in range(5)] == ["allow"] * 5
    assert await redis_gets(create_redis) == reads + 1 and backend.calls == 1
    await guard.aclose()
    await other.aclose()


@pytest.mark.anyio
async def test_local_copies_never_outlive_the_policy_ttl_and_answer_while_redis_is_down(
    redis_url: str, create_redis: Any
) -> None:
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(ttl=0.2), backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=60))
    await guard.aevaluate(subject("ignore"))
    assert (await guard.aevaluate(subject("ignore"))).cache_hit
    await asyncio.sleep(0.25)  # past the policy's ttl: Redis dropped the value and the copy is too old
    assert (await guard.aevaluate(subject("ignore"))).cache_hit is False and backend.calls == 2
    down = Guard(policies(), backends=backend, cache=redis_cache("redis://127.0.0.1:1/0", "x:", local_ttl=60))
    await down.aevaluate(subject("ignore"))  # Redis refuses: a miss, answered by the backend, held in process
    again = await down.aevaluate(subject("ignore"))
    assert again.cache_hit and again.fail_mode is None and backend.calls == 3
    await guard.aclose()
    await down.aclose()


@pytest.mark.anyio
async def test_a_copy_read_from_redis_is_not_served_after_the_value_expired_there(
    redis_url: str, create_redis: Any
) -> None:
    """Replica B reads a value replica A wrote 0.35 s earlier (0.15 s left of a 0.5 s ttl); 0.25 s later Redis has
    dropped it, so the answers are 0.6 s old: past the policy's ttl, a miss."""
    backend = ScriptedBackend(by_text)
    writer = Guard(policies(ttl=0.5), backends=backend, cache=redis_cache(redis_url, create_redis.prefix))
    reader = Guard(policies(ttl=0.5), backends=backend, cache=redis_cache(redis_url, create_redis.prefix))
    assert (await writer.aevaluate(subject("ignore"))).cache_hit is False
    await asyncio.sleep(0.35)
    assert (await reader.aevaluate(subject("ignore"))).cache_hit is True  # read from Redis: 0.15 s left there
    await asyncio.sleep(0.25)
    assert await keys(create_redis) == []  # Redis dropped it
    late = await reader.aevaluate(subject("ignore"))
    assert (late.cache_hit, backend.calls) == (False, 2)
    await writer.aclose()
    await reader.aclose()


def test_peek_survives_another_thread_evicting_the_entry() -> None:
    """The sync facade's loop thread and the caller's loop share a cache: an entry evicted between a lookup and its
    ``move_to_end`` must not raise (the engine would turn a KeyError into a fail-mode verdict)."""
    cache = MemoryCache(CacheConfig(max_entries=2))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            store = cache._store(f"k{i % 50}", {}, None, 60)  # type: ignore[arg-type]  # never awaits
            try:
                store.send(None)
            except StopIteration:
                pass
            except KeyError as exc:
                errors.append(exc)
            i += 1

    async def reader() -> None:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not errors:
            for i in range(50):
                try:
                    cache.peek(f"k{i}")
                except KeyError as exc:
                    errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        asyncio.run(reader())
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []


async def redis_gets(create_redis: Any) -> int:
    """GET commands the Redis server has run so far (INFO commandstats: the whole server's, so each count is read
    right before the calls it measures)."""
    stats = await create_redis().info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def sealed(key: Any, data: bytes, store_key: str = STORE_KEY) -> bytes:
    """``data`` as a Redis cache holding ``store_key`` writes it under ``key``: seal, newline, JSON."""
    name = key.decode() if isinstance(key, bytes) else key
    return Sealer(store_key).seal(name, data).encode() + b"\n" + data


def unsealed(raw: bytes) -> Any:
    return json.loads(raw.partition(b"\n")[2])


async def rewrite_injection(create_redis: Any, noul: float) -> None:
    """Rewrite the one stored value's injection answer, as another replica (holding the store key) could."""
    (key,) = await keys(create_redis)
    client = create_redis()
    value = unsealed(await client.get(key))
    value["answers"]["injection"].update(p=[noul, 1 - noul], x=noul)
    await client.set(key, sealed(key, json.dumps(value).encode()))


@pytest.mark.anyio
async def test_redis_corrupt_values_are_ignored_and_overwritten(redis_url: str, create_redis: Any) -> None:
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)  # every hit reads what is in Redis
    guard = Guard(policies(), backends=backend, cache=cache)
    await guard.aevaluate(subject("ignore"))
    (key,) = await keys(create_redis)
    client = create_redis()
    good = unsealed(await client.get(key))
    wrong_shapes = [
        b"not json at all",
        json.dumps("a string").encode(),
        json.dumps({**good, "v": 99}).encode(),  # another schema version
        json.dumps({**good, "answers": {"injection": good["answers"]["injection"]}}).encode(),  # a question missing
        json.dumps({**good, "answers": {**good["answers"], "injection": {"t": "noul", "p": [0.9, 0.9], "x": 0.9}}}
                   ).encode(),  # probabilities do not sum to 1
        b"\xff\xfe",
        # a choice that is a list: the check raised TypeError (unhashable), which failed the decision to its fail mode
        json.dumps({**good, "answers": {**good["answers"], "tone": {**good["answers"]["tone"], "x": ["calm"]}}}
                   ).encode(),
        b"[" * 100_000 + b"]" * 100_000,  # nested past the JSON parser's recursion limit: RecursionError
    ]
    for n, value in enumerate(wrong_shapes, start=2):
        await client.set(key, sealed(key, value))  # well sealed, badly shaped
        verdict = await guard.aevaluate(subject("ignore"))
        assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, n)
        assert unsealed(await client.get(key)) == good  # overwritten with the right shape
    health = cache.health()
    assert (health.corrupt, health.forged, health.errors, health.status) == (len(wrong_shapes), 0, 0, "degraded")
    assert (health.code, health.internal_errors) == ("corrupt_values", 0)  # each shape refused by the checks
    await guard.aclose()


@pytest.mark.anyio
async def test_redis_forged_safe_answers_are_a_counted_miss_never_an_allow(
    redis_url: str, create_redis: Any
) -> None:
    """Someone who can write to Redis but lacks the store key writes "safe" answers for an attack text: each forgery
    (no seal, a seal made with another key, a good seal moved from another key) is a miss counted as ``forged``,
    and the attack is judged by the backend and blocked."""
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=backend, cache=cache)
    assert (await guard.aevaluate(subject("ignore"))).action == "block"
    await guard.aevaluate(subject("hello"))  # a benign text's genuine entry, to move
    client = create_redis()
    stored = {k: unsealed(await client.get(k)) for k in await keys(create_redis)}
    attack_key = next(k for k, v in stored.items() if v["answers"]["injection"]["x"] > 0.5)
    benign_key = next(k for k in stored if k != attack_key)
    safe = unsealed(await client.get(attack_key))
    safe["answers"]["injection"].update(p=[0.01, 0.99], x=0.01)
    safe_blob = json.dumps(safe).encode()
    forgeries = [safe_blob, sealed(attack_key, safe_blob, "another-key-0123456789abcdef"),
                 await client.get(benign_key)]
    for n, value in enumerate(forgeries, start=3):
        await client.set(attack_key, value)
        verdict = await guard.aevaluate(subject("ignore"))
        assert (verdict.action, verdict.cache_hit, backend.calls) == ("block", False, n)
    assert cache.health().forged == len(forgeries) and cache.health().corrupt == 0
    assert (await guard.aevaluate(subject("ignore"))).cache_hit  # the genuine entry, written back, is a hit
    await guard.aclose()


@pytest.mark.anyio
async def test_values_sealed_with_another_store_key_show_in_health_and_warn_once_per_period(
    redis_url: str, create_redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas sharing a Redis but not the store key (a rotation rolled out to half of them) read each other's
    entries as forged: that used to log a warning on every read while health said ``ok``, so nothing showed the
    replicas disagree. Health is ``degraded`` while such reads are recent, and each cache warns once per period."""
    caplog.set_level(logging.DEBUG, logger="guard.cache")
    replicas = []
    for store_key in (STORE_KEY, "another-store-key-0123456789abcdef"):
        backend = ScriptedBackend(by_text)
        cache = redis_cache(redis_url, create_redis.prefix, store_key=store_key, local_ttl=0)
        replicas.append((Guard(policies(), backends=backend, cache=cache), backend))
    for _ in range(5):
        for guard, _backend in replicas:
            assert (await guard.aevaluate(subject("ignore"))).action == "block"
    for guard, backend in replicas:
        health = guard.cache.health()
        assert (health.status, health.errors, backend.calls) == ("degraded", 0, 5) and health.forged >= 4
        assert health.code == guard.health()["checks"]["cache"] == "forged_values"  # not a Redis error's code
    warnings = [r for r in caplog.records if r.name == "guard.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("another store key" in r.getMessage() for r in warnings)  # one per replica
    third = Guard(policies(), backends=ScriptedBackend(by_text), cache=redis_cache(
        redis_url, create_redis.prefix, store_key="a-third-store-key-0123456789abcdef", degraded_window=0.2))
    await third.aevaluate(subject("ignore"))
    assert third.cache.health().status == "degraded"
    await asyncio.sleep(0.25)
    assert third.cache.health().status == "ok"  # no forged read within the window
    for guard in (third, *(guard for guard, _backend in replicas)):
        await guard.aclose()


@pytest.mark.anyio
async def test_forged_and_corrupt_values_each_warn_once_per_period(
    redis_url: str, create_redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Forged and corrupt reads shared one period: a corrupt value read after a forged one was logged at debug level
    only. Each kind warns once per period; health names the first of them (forged values)."""
    caplog.set_level(logging.DEBUG, logger="guard.cache")
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=backend, cache=cache)
    await guard.aevaluate(subject("ignore"))
    (key,) = await keys(create_redis)
    client = create_redis()
    for value in (b"forged", sealed(key, b"not json"), b"forged again", sealed(key, b"still not json")):
        await client.set(key, value)
        assert (await guard.aevaluate(subject("ignore"))).cache_hit is False
    warnings = [r.getMessage() for r in caplog.records if r.name == "guard.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "integrity check" in warnings[0] and "cannot be read" in warnings[1], warnings
    health = cache.health()
    assert (health.forged, health.corrupt, health.code, health.status) == (2, 2, "forged_values", "degraded")
    await guard.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["redis_call", "decode"])
async def test_an_error_of_guards_own_is_a_miss_logged_at_error_and_counted_apart(
    redis_url: str, create_redis: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """Anything a Redis operation or the reading of a value raised was a miss counted as a Redis error (or a corrupt
    value) with a warning, so a bug in guard (here simulated: the client's GET, or the check of a stored value,
    raises TypeError) looked like Redis trouble. It is still a miss, never the decision's, but logged at ERROR with
    its traceback once per period, counted as ``internal_errors`` and shown as ``internal_error``."""
    import redis.asyncio as aioredis

    import guard.engine.cache as cache_module

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a bug in guard")

    caplog.set_level(logging.DEBUG, logger="guard.cache")
    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=backend, cache=cache)
    if where == "decode":
        await guard.aevaluate(subject("ignore"))
        (key,) = await keys(create_redis)
        client = create_redis()
        stored = unsealed(await client.get(key))
        monkeypatch.setattr(cache_module, "decode_answers", bug)
    else:
        monkeypatch.setattr(aioredis.Redis, "get", bug)
    for n in range(2):
        if where == "decode":  # the same answers as another replica writes them: not the bytes this one holds
            await client.set(key, sealed(key, json.dumps(stored, indent=n + 1).encode()))
        verdict = await guard.aevaluate(subject("ignore"))
        assert (verdict.action, verdict.rule, verdict.cache_hit, verdict.fail_mode) == ("block", "injection", False,
                                                                                         None)
    errors = [r for r in caplog.records if r.name == "guard.cache" and r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR and errors[0].exc_info is not None, errors
    assert "an error in guard, not in the store" in errors[0].getMessage()
    health = cache.health()
    assert health.internal_errors >= 2 and (health.errors, health.corrupt, health.skipped) == (0, 0, 0), health
    assert (health.last_error_kind, health.code, health.status) == ("internal", "internal_error", "degraded")
    assert health.last_error == "TypeError: a bug in guard"
    await guard.aclose()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://:hunter2-secret@127.0.0.1:26379/mymaster", "must specify one of the following schemes"),
        ("127.0.0.1:6379", "must specify one of the following schemes"),  # the scheme forgotten
        ("redis://127.0.0.1:6379/nine", "the database 'nine' in its path is not a number"),  # was database 0
        ("redis://127.0.0.1:6379/9?socket_timeout=fast", "socket_timeout"),
        ("redis://127.0.0.1:6379/9?protocol=4", "protocol must be either 2 or 3"),
        ("redis://127.0.0.1:6379/9?no_such_option=1", "no_such_option"),
    ],
)
def test_a_redis_url_the_cache_cannot_use_is_refused_when_the_cache_is_made(url: str, says: str) -> None:
    """Such a URL was accepted, and every decision then fell to the policy's fail mode (fail-open: an allow without
    asking the model) while health said ``ok``: the client was first made inside a lookup, whose error was no Redis
    error. The message names the URL without its credentials or query."""
    with pytest.raises(ValueError, match="^cache URL .* cannot be used: ") as info:
        RedisCache(CacheConfig(url=url))
    assert says in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.anyio
async def test_decode_responses_in_the_url_still_reads_bytes(redis_url: str, create_redis: Any) -> None:
    """``?decode_responses=true`` (one URL shared with a tool that wants text) made every value a ``str``: each hit
    raised TypeError and the decision fell to the policy's fail mode, health ``ok``. The cache reads bytes."""
    url = redis_url + ("&" if "?" in redis_url else "?") + "decode_responses=true"
    backend = ScriptedBackend(by_text)
    cache = redis_cache(url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=backend, cache=cache)
    assert (await guard.aevaluate(subject("ignore"))).cache_hit is False
    again = await guard.aevaluate(subject("ignore"))
    assert (again.action, again.rule, again.cache_hit, backend.calls) == ("block", "injection", True, 1)
    await cache.publish_epoch("scope", 7)
    assert await cache.shared_epoch("scope") == 7
    health = cache.health()
    assert (health.status, health.errors, health.corrupt, health.forged) == ("ok", 0, 0, 0)
    await guard.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("query", "sent"), [("", set()), ("protocol=3", {"HELLO"})])
async def test_a_new_connection_makes_no_round_trips_of_its_own(
    query: str, sent: set[str], redis_url: str, create_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py 8 speaks RESP3 by default: a new connection sent HELLO 3 and CLIENT MAINT_NOTIFICATIONS before its
    first command, each a round trip, so with a Redis 15 ms away the default 50 ms op timeout was spent connecting
    (and the connection dropped) and nothing was ever stored. The cache asks for RESP2 and no maintenance
    notifications; a URL that asks for RESP3 gets HELLO only."""
    from redis.asyncio import connection

    commands: list[str] = []
    send = connection.AbstractConnection.send_command

    async def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        commands.append(" ".join(str(a) for a in args[:2]))
        await send(self, *args, **kwargs)

    monkeypatch.setattr(connection.AbstractConnection, "send_command", recorded)
    url = redis_url + ("&" if "?" in redis_url else "?") + query if query else redis_url
    cache = redis_cache(url, create_redis.prefix, local_ttl=0)
    guard = Guard(policies(), backends=ScriptedBackend(by_text), cache=cache)
    await guard.aevaluate(subject())
    await guard.aclose()  # the answers are written
    assert {c.split()[0] for c in commands} & {"HELLO", "CLIENT"} == sent, commands
    assert cache.health().stores == 1


def test_redis_cache_requires_a_store_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GUARD_STORE_KEY")
    with pytest.raises(ValueError, match="GUARD_STORE_KEY"):
        RedisCache(CacheConfig(url="redis://127.0.0.1:1"))
    with pytest.raises(ValueError, match="at least 16"):
        RedisCache(CacheConfig(url="redis://127.0.0.1:1", store_key="short"))
    assert "secret-key" not in repr(CacheConfig(url="redis://x", store_key="secret-key-0123456789"))
    RedisCache(CacheConfig(url="redis://127.0.0.1:1", store_key="a-store-key-0123456789"))


def test_cache_config_repr_shows_no_redis_password() -> None:
    """The repr (a traceback's locals, an error tracker's event) named the URL with its password."""
    shown = repr(CacheConfig(url="redis://app:hunter2-pw@redis:6379/0?client_name=x", store_key="a-store-key-0123456789"))
    assert "hunter2" not in shown and "a-store-key" not in shown
    assert "url='redis://redis:6379/0'" in shown and "prefix='guard:'" in shown
    assert "hunter2" not in repr(CacheConfig(url="redis://:hunter2/pw@redis:6379/0"))


def test_a_short_store_key_names_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short $GUARD_STORE_KEY said "the store key has 3 bytes", not naming the variable to fix."""
    monkeypatch.setenv("GUARD_STORE_KEY", "abc")
    with pytest.raises(ValueError, match=r"^\$GUARD_STORE_KEY has 3 bytes; at least 16"):
        RedisCache(CacheConfig(url="redis://127.0.0.1:1"))
    with pytest.raises(ValueError, match=r"^the store key has 5 bytes; at least 16"):  # passed in code
        RedisCache(CacheConfig(url="redis://127.0.0.1:1", store_key="short"))
    with pytest.raises(ValueError, match=r"^the store key has 2 bytes; at least 16"):
        Sealer("ab")


def test_a_store_key_of_raw_bytes_names_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A $GUARD_STORE_KEY of bytes that are not UTF-8 (``openssl rand 32`` without ``-hex``) failed with a codec
    error naming neither the variable nor what to do."""
    monkeypatch.setenv("GUARD_STORE_KEY", b"key-\xff\xfe-0123456789abcdef".decode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=r"^\$GUARD_STORE_KEY is not UTF-8 text .*openssl rand -hex 32"):
        RedisCache(CacheConfig(url="redis://127.0.0.1:1"))


@pytest.mark.anyio
async def test_redis_stopped_mid_test_is_a_counted_miss(private_redis: Any) -> None:
    backend = ScriptedBackend(by_text)
    cache = RedisCache(CacheConfig(url=private_redis.url, breaker=0.0, local_ttl=0))  # every hit reads Redis
    guard = Guard(policies(), backends=backend, cache=cache)
    assert (await guard.aevaluate(subject("ignore"))).action == "block"
    assert (await guard.aevaluate(subject("ignore"))).cache_hit
    private_redis.stop()
    for n in (2, 4):
        verdict = await guard.aevaluate(subject("ignore"))
        assert (verdict.action, verdict.cache_hit, verdict.fail_mode, backend.calls) == ("block", False, None, n)
        benign = await guard.aevaluate(subject("fine"))  # a real decision, not an allow because the cache failed
        assert benign.action == "allow" and benign.rule == "default" and benign.answers
    health = cache.health()
    assert health.status == "degraded" and health.errors >= 2 and health.last_error
    assert guard.health()["status"] == "degraded"
    await guard.aclose()


@pytest.fixture
def silent_server() -> Any:
    """A TCP server that accepts connections (via the backlog) and never answers: a Redis with infinite latency."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    sock.close()


@pytest.mark.anyio
async def test_slow_redis_is_a_miss_within_the_op_timeout(silent_server: str) -> None:
    backend = ScriptedBackend(by_text)
    cache = RedisCache(CacheConfig(url=silent_server, op_timeout=0.05, local_ttl=0))
    guard = Guard(policies(), backends=backend, cache=cache)
    loop = asyncio.get_running_loop()
    started = loop.time()
    verdict = await guard.aevaluate(subject("ignore"))
    elapsed = loop.time() - started
    assert (verdict.action, verdict.cache_hit, verdict.fail_mode) == ("block", False, None)
    assert elapsed < 1.0  # one 50 ms timeout (the GET); far below the 2 s policy
    # the read timed out, so neither the lock nor the write was tried: each would spend another op timeout of the
    # decision's budget before the model was called (a policy with timeout_ms 90 failed into its fail mode)
    assert cache.health().errors == 1
    again = await guard.aevaluate(subject("ignore"))  # the second timeout in a row opens the breaker
    third = await guard.aevaluate(subject("ignore"))  # breaker open: Redis skipped, counted
    assert again.action == third.action == "block" and backend.calls == 3
    health = cache.health()
    assert health.status == "degraded" and health.errors == 2 and health.skipped >= 1
    await guard.aclose()


@pytest.mark.anyio
async def test_slow_redis_with_many_callers_still_one_model_call(silent_server: str) -> None:
    backend = ScriptedBackend(by_text, delay=0.1)
    guard = Guard(policies(), backends=backend, cache=RedisCache(CacheConfig(url=silent_server)))
    verdicts = await asyncio.gather(*(guard.aevaluate(subject("ignore")) for _ in range(30)))
    assert backend.calls == 1 and {v.action for v in verdicts} == {"block"}
    await guard.aclose()


async def _delayed(port: int, delay: float) -> asyncio.Server:
    """A TCP proxy to 127.0.0.1:``port`` that holds what passes ``delay`` seconds each way (a Redis farther away)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.anyio
async def test_a_new_connection_to_a_redis_far_away_does_not_spend_the_op_timeout(private_redis: Any) -> None:
    """Redis a 200 ms round trip away, the URL naming a database: a new connection's SELECT and then the command took
    400 ms, over the 300 ms op timeout, which the timeout dropped, so every operation made a new connection and timed
    out: nothing was ever stored. Opening a connection now has its own allowance (``connect_timeout``, by default
    ``op_timeout``), and the command ``op_timeout`` from then."""
    proxy = await _delayed(private_redis.port, 0.1)
    url = f"redis://127.0.0.1:{proxy.sockets[0].getsockname()[1]}/3"
    cache = RedisCache(CacheConfig(url=url, op_timeout=0.3, local_ttl=0))
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(), backends=backend, cache=cache)
    assert not (await guard.aevaluate(subject("ignore"))).cache_hit
    await guard.aclose()  # the answers are written
    health = cache.health()
    assert (health.stores, health.errors) == (1, 0), health.last_error
    again = await guard.aevaluate(subject("ignore"))  # read back from Redis (no local copy)
    assert (again.action, again.cache_hit, backend.calls) == ("block", True, 1)
    await guard.aclose()
    proxy.close()
    await proxy.wait_closed()


@pytest.mark.anyio
async def test_a_frozen_redis_with_a_database_in_its_url_is_still_a_miss_within_the_timeouts(silent_server: str) -> None:
    """A Redis that never answers, with a SELECT to send first: the connection's allowance bounds the handshake."""
    backend = ScriptedBackend(by_text)
    cache = RedisCache(CacheConfig(url=silent_server.replace("/0", "/3"), op_timeout=0.05, local_ttl=0))
    guard = Guard(policies(), backends=backend, cache=cache)
    loop = asyncio.get_running_loop()
    started = loop.time()
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.cache_hit, verdict.fail_mode) == ("block", False, None)
    assert loop.time() - started < 1.0 and cache.health().errors == 1
    await guard.aclose()


@pytest.mark.anyio
async def test_a_connect_that_outlasts_its_allowance_while_the_loop_is_busy_is_a_store_timeout(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 concurrent requests, Redis replies 0-60 ms late: the event loop ran the operation's timeout late, as the
    ``SELECT`` of a new connection was sent; redis-py sends through ``asyncio.wait_for``, which on Python 3.11 drops
    that cancellation, so the connect returned with the timeout expiring and moving it on raised ``RuntimeError``,
    counted as guard's own error (health ``internal_error``). It is the store's timeout now (on Python 3.12 and later
    the connect is cancelled instead, also a store timeout)."""
    from redis.asyncio.connection import Connection

    opened = Connection._connect

    async def busy_loop_meanwhile(self: Any) -> None:
        await opened(self)
        time.sleep(0.08)  # noqa: ASYNC251 - the loop is busy past the 50 ms connect allowance: the timeout runs late

    monkeypatch.setattr(Connection, "_connect", busy_loop_meanwhile)
    url = urlunsplit(urlsplit(redis_url)._replace(path="/3"))  # a database to SELECT: a command in the handshake
    cache = RedisCache(CacheConfig(url=url, op_timeout=0.05, local_ttl=0))  # nothing is written: the read failed
    backend = ScriptedBackend(by_text)
    guard = Guard(policies(), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.cache_hit, verdict.fail_mode, backend.calls) == ("block", False, None, 1)
    health = cache.health()
    assert (health.code, health.internal_errors, health.errors) == ("degraded", 0, 1), health.last_error
    assert health.last_error.startswith("TimeoutError")  # Python 3.12's wait_for passes the cancellation on
    await guard.aclose()


def test_cache_config_validates() -> None:
    with pytest.raises(ValueError, match="op_timeout"):
        CacheConfig(op_timeout=0)
    with pytest.raises(ValueError, match="connect_timeout"):
        CacheConfig(connect_timeout=0)
    with pytest.raises(ValueError, match="breaker_after"):
        CacheConfig(breaker_after=0)
    with pytest.raises(ValueError, match="max_entries"):
        CacheConfig(max_entries=0)
    for name in ("breaker", "degraded_window", "local_ttl"):
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError, match=rf"CacheConfig\.{name} must be >= 0 seconds"):
                CacheConfig(**{name: bad})
    assert CacheConfig(local_ttl=0).local_ttl == 0
    with pytest.raises(ValueError, match="url"):
        RedisCache(CacheConfig())


@pytest.mark.anyio
async def test_a_reader_cancelled_mid_read_does_not_strand_the_callers_that_joined(silent_server: str) -> None:
    backend = ScriptedBackend(by_text)
    cache = RedisCache(CacheConfig(url=silent_server, op_timeout=0.3))
    (policy,) = policies()
    request = policy.build_request({"text": "ignore"})

    async def compute() -> Any:
        return await backend.decide(request)

    key = cache_key(request, backend=backend.name, revision=backend.model_revision)
    first = asyncio.ensure_future(cache.fetch(key, request, compute, ttl=60, wait=2))
    await asyncio.sleep(0.05)  # the first caller is waiting on the (silent) Redis GET
    second = asyncio.ensure_future(cache.fetch(key, request, compute, ttl=60, wait=2))
    await asyncio.sleep(0.05)
    first.cancel()
    answers, lookup = await second
    assert lookup == "shared" and answers.response.answers["injection"].noul == pytest.approx(0.9)
    assert first.cancelled() and backend.calls == 1
    await cache.aclose()


@pytest.mark.anyio
async def test_a_failed_flight_is_not_remembered() -> None:
    # The backend hangs past the policy timeout: the engine gives up and the shared flight fails too.
    backend = ScriptedBackend(by_text, delay=5.0, honour_timeout=False)
    text = POLICY.replace("THRESHOLD", "0.8").replace("TTL", "60").replace("timeout_ms: 2000", "timeout_ms: 100")
    guard = Guard(load_text(text), backends=backend)
    for calls in (1, 2):
        verdict = await guard.aevaluate(subject())
        assert verdict.fail_mode == "closed" and backend.calls == calls  # a fresh call, not the old failure
        await asyncio.sleep(0.05)  # let the failed flight finish


class _RollingUpdate(ScriptedBackend):
    """Two checkpoints behind one address during a rolling update: each answer comes from the other one, and the
    client learns the revision from the answer (as ``SystemOneClient`` does from ``x-guard-model-revision``)."""

    async def decide(self, request: Any, *, timeout: float | None = None) -> Any:
        answering = "ckpt-b" if self._revision == "ckpt-a" else "ckpt-a"
        response = await super().decide(request, timeout=timeout)
        self._revision = answering
        return response


@pytest.mark.anyio
async def test_an_answer_from_another_revision_than_the_key_names_is_not_stored() -> None:
    """The key is built with the revision known before the call; an answer given as another revision answers that
    call but is not stored under the first one's key (it would be served as checkpoint A's for the TTL)."""
    backend = _RollingUpdate(by_text, revision="ckpt-a")
    guard = Guard(policies(), backends=backend)
    first = await guard.aevaluate(subject())  # keyed ckpt-a, answered as ckpt-b: not kept
    second = await guard.aevaluate(subject())  # keyed ckpt-b, answered as ckpt-a: not kept
    third = await guard.aevaluate(subject())  # keyed ckpt-a again: B's first answer was not kept under A's key
    assert not first.cache_hit and not second.cache_hit and not third.cache_hit and backend.calls == 3
    steady = ScriptedBackend(by_text, revision="ckpt-a")
    guard = Guard(policies(), backends=steady)
    await guard.aevaluate(subject())
    assert (await guard.aevaluate(subject())).cache_hit and steady.calls == 1  # one revision: stored as before


@pytest.mark.anyio
async def test_replicas_reporting_confidence_differently_never_share_answers(redis_url: str, create_redis: Any) -> None:
    """Two replicas on one Redis whose compact backends differ only in the confidence profile: each decides on
    its own profile's confidence, whichever answered first (the profile is in the backend's model revision). Each
    backend is warmed up first, as a deployment does: a cold first call (loading the models) can pass the policy's
    2 s timeout on a busy machine and be decided by ``on_error`` with no answers."""
    from guard.backends.compact import CompactBackend
    from guard.systemone import confidence

    policy = load_text("""
policies:
  - id: sev
    version: 1
    match: {http: {methods: [POST]}}
    state: {request: "body:/request", response: "body:/response"}
    questions: {severity: {catalog: guard.harm_severity}}
    rules: [{id: unsure, when: severity.confidence < 0.5, action: escalate}]
    cache: {ttl: 60}
""")
    body = {"request": "How do I bake bread?", "response": "Mix flour, water, yeast and salt; knead, proof, bake."}
    seen = {}
    for profile in ("reference", "jev"):
        backend = CompactBackend(confidence_profile=profile)
        await backend.start()
        guard = Guard(policy, backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/x", body=body))
        answer = verdict.answers["severity"]
        seen[profile] = verdict.cache_hit
        assert answer.confidence == pytest.approx(confidence(list(answer.probabilities.values()), "score", profile))
        await guard.aclose()
    assert seen == {"reference": False, "jev": False}


@pytest.mark.anyio
async def test_a_recovery_epoch_is_shared_sealed(redis_url: str, create_redis: Any) -> None:
    """Published by one cache, read by another with the same store key; a value written without it, or edited, is
    not an epoch (counted as forged); an in-process cache shares none."""
    one, two = (redis_cache(redis_url, create_redis.prefix) for _ in range(2))
    assert await two.shared_epoch("default\nr1") is None
    await one.publish_epoch("default\nr1", 3)
    assert await two.shared_epoch("default\nr1") == 3 and await two.shared_epoch("default\nr2") is None
    (key,) = [k async for k in create_redis().scan_iter(match=f"{create_redis.prefix}e:*")]
    for planted in (b"9", (await create_redis().get(key)).replace(b"\n3", b"\n9")):
        await create_redis().set(key, planted)
        assert await two.shared_epoch("default\nr1") is None
    assert two.health().forged == 2
    memory = MemoryCache()
    await memory.publish_epoch("default\nr1", 3)
    assert await memory.shared_epoch("default\nr1") is None
    await one.aclose()
    await two.aclose()


@pytest.mark.anyio
async def test_a_genuine_lock_put_back_after_its_leader_finished_costs_at_most_half_the_budget(
    redis_url: str, create_redis: Any
) -> None:
    """Someone with write access to Redis (no store key needed) copies a leader's sealed lock while it is held and,
    once the leader has finished (and its answer is evicted), sets it back within the end sealed in it. The next
    identical request followed that lock for its whole time budget and then failed in the policy's fail mode (an
    allow under ``on_error: open``); it must wait for it at most FOLLOW_SHARE of its budget, then ask its model."""
    backend = ScriptedBackend(by_text, delay=0.2, name="clef")
    leader = Guard(policies(), backends=backend, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    other = ScriptedBackend(by_text, name="clef")
    follower = Guard(policies(), backends=other, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    client = create_redis()
    task = asyncio.ensure_future(leader.aevaluate(subject("ignore")))
    held: list[Any] = []
    while not held:
        await asyncio.sleep(0.01)
        held = [(k, await client.get(k)) for k in await keys(create_redis, "l")]
    assert (await task).action == "block"
    ((lock_key, token),) = held
    await client.delete(lock_key.replace(b":l:", b":a:"))  # evicted
    await client.set(lock_key, token, px=3000)  # put back, within the end sealed in it (timeout + 0.5 s)
    started = time.monotonic()
    verdict = await follower.aevaluate(subject("ignore"))
    took = time.monotonic() - started
    assert (verdict.action, verdict.rule, verdict.fail_mode) == ("block", "injection", None), verdict.error
    assert other.calls == 1 and took < 2.0 * FOLLOW_SHARE + 0.5, took
    await leader.aclose()
    await follower.aclose()


@pytest.mark.anyio
async def test_publishing_an_epoch_if_absent_keeps_a_sealed_one_and_replaces_one_that_is_not(
    redis_url: str, create_redis: Any
) -> None:
    one, two = (redis_cache(redis_url, create_redis.prefix) for _ in range(2))
    await one.publish_epoch("default\nr1", 5, if_absent=True)
    await two.publish_epoch("default\nr1", 7, if_absent=True)
    assert await two.shared_epoch("default\nr1") == 5  # the first one stays
    await two.publish_epoch("default\nr1", 7)  # a plain publish overwrites
    assert await one.shared_epoch("default\nr1") == 7
    (key,) = [k async for k in create_redis().scan_iter(match=f"{create_redis.prefix}e:*")]
    await create_redis().set(key, b"planted\n999")
    await one.publish_epoch("default\nr1", 9, if_absent=True)  # a value without the seal is no epoch: replaced
    assert await two.shared_epoch("default\nr1") == 9
    memory = MemoryCache()
    await memory.publish_epoch("default\nr1", 3, if_absent=True)
    assert await memory.shared_epoch("default\nr1") is None
    await one.aclose()
    await two.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["raises", "ttl_inf"])
async def test_a_cache_write_that_fails_is_counted_never_a_decision_error(
    redis_url: str, create_redis: Any, how: str
) -> None:
    """Writing the answers must not decide the request: a ``_store`` that raises (anything, not only a Redis error),
    or a TTL no store can take (``inf`` from a policy built in code: PX inf was an OverflowError on every decision,
    so the policy's fail mode decided all of them), is a counted cache error; the model's answer decides."""
    import dataclasses

    backend = ScriptedBackend(by_text)
    cache = redis_cache(redis_url, create_redis.prefix)
    loaded = policies()
    if how == "raises":
        async def broken_store(*args: Any, **kwargs: Any) -> None:
            raise OverflowError("cannot convert float infinity to integer")

        cache._store = broken_store  # type: ignore[method-assign]
    else:
        loaded = [dataclasses.replace(p, cache_ttl=float("inf")) for p in loaded]
    guard = Guard(loaded, backends=backend, cache=cache)
    for _ in range(2):
        verdict = await guard.aevaluate(subject("ignore"))
        assert (verdict.action, verdict.rule, verdict.fail_mode, verdict.error) == ("block", "injection", None, None)
    health = cache.health()
    assert health.errors >= 1 and "OverflowError" in (health.last_error or ""), health
    await guard.aclose()


@pytest.mark.anyio
async def test_a_follower_of_a_slow_genuine_leader_takes_its_answer_within_the_budget(
    redis_url: str, create_redis: Any
) -> None:
    """A model that takes 65 % of the policy's timeout: the follower on another replica gave up on the leader at half
    its budget and called the model with the half left, failing into the fail mode (review finding). Past
    FOLLOW_SHARE it calls the model too but keeps polling, and the leader's answer, first, decides."""
    slow = ScriptedBackend(by_text, delay=1.3, name="clef")
    leader = Guard(policies(), backends=slow, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    hedge = ScriptedBackend(by_text, delay=1.3, name="clef")
    follower = Guard(policies(), backends=hedge, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    first = asyncio.ensure_future(leader.aevaluate(subject("ignore")))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    verdict = await follower.aevaluate(subject("ignore"))
    took = time.monotonic() - started
    assert (verdict.action, verdict.rule, verdict.fail_mode) == ("block", "injection", None), verdict.error
    assert verdict.cache_hit and took < 1.6, took  # the leader's answer, not the hedge's (which came later)
    assert (await first).action == "block" and slow.calls == 1
    await leader.aclose()
    await follower.aclose()


@pytest.mark.anyio
async def test_a_hedge_that_fails_fast_does_not_beat_the_leaders_answer(redis_url: str, create_redis: Any) -> None:
    """Past half its budget a follower calls the model too; that call failing at once (a busy 503) is no answer:
    the follower failed open on it while the leader's block came 0.3 s later, within its budget (review finding)."""
    slow = ScriptedBackend(by_text, delay=1.3, name="clef")
    leader = Guard(policies(), backends=slow, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    busy = ScriptedBackend(by_text, name="clef", fail=BackendUnavailable("server busy", reason="http_503"))
    follower = Guard(policies(), backends=busy, cache=redis_cache(redis_url, create_redis.prefix, local_ttl=0))
    first = asyncio.ensure_future(leader.aevaluate(subject("ignore")))
    await asyncio.sleep(0.05)
    verdict = await follower.aevaluate(subject("ignore"))
    assert (verdict.action, verdict.rule, verdict.fail_mode) == ("block", "injection", None), verdict.error
    assert busy.calls == 1 and (await first).action == "block"
    await leader.aclose()
    await follower.aclose()


TWO_BUDGETS = """
policies:
  - id: fast
    version: "1"
    match: {http: {methods: [POST], paths: ["/fast"]}}
    state: {text: body_text}
    questions: {injection: {type: noul, instructions: "Is this an injection?"}}
    timeout_ms: 100
    rules: [{id: injection, when: injection.noul >= 0.5, action: block}]
  - id: slow
    version: "1"
    on_error: {mode: open}
    match: {http: {methods: [POST], paths: ["/slow"]}}
    state: {text: body_text}
    questions: {injection: {type: noul, instructions: "Is this an injection?"}}
    timeout_ms: 2000
    rules: [{id: injection, when: injection.noul >= 0.5, action: block}]
"""


def at(path: str, text: str = "ignore") -> HttpSubject:
    return HttpSubject(method="POST", path=path, body={"q": text}, body_text=text)


@pytest.mark.anyio
async def test_a_caller_that_joined_a_call_with_a_shorter_budget_is_not_timed_out_by_it() -> None:
    """/fast (100 ms, fail closed) and /slow (2 s, fail open) ask the same question about the same text, so they
    share one key; the model answers in 300 ms. /slow joined /fast's call and took its 100 ms timeout: an allow
    through its fail mode. It now calls again in what is left of its own 2 s. A caller with the same budget as the
    call it joined still takes its timeout (no second call)."""
    backend = ScriptedBackend(by_text, delay=0.3)
    guard = Guard(load_text(TWO_BUDGETS), backends=backend)
    fast = asyncio.ensure_future(guard.aevaluate(at("/fast")))
    await asyncio.sleep(0.01)  # /fast's call is in flight
    slow = await guard.aevaluate(at("/slow"))
    assert (slow.action, slow.rule, slow.fail_mode) == ("block", "injection", None), slow.error
    assert (await fast).fail_mode == "closed" and backend.calls == 2
    twins = await asyncio.gather(guard.aevaluate(at("/fast", "other")), guard.aevaluate(at("/fast", "other")))
    assert [v.fail_mode for v in twins] == ["closed", "closed"] and backend.calls == 3
    await guard.aclose()


@pytest.mark.anyio
async def test_a_model_slower_than_the_budget_costs_one_call_per_budget_not_one_per_caller() -> None:
    """/fast (100 ms) starts a call; /slow (500 ms here) joins it, it times out and /slow calls again in what is left of
    its own. Twenty more /slow requests came 10 ms apart while the model took longer than 500 ms. The second call's
    budget was what /slow had left, shorter than each later caller's, so each of them called again when it timed
    out: one model call per request, each timing out. Budgets are now compared as given: callers with /slow's budget
    take the second call's timeout, so two calls in all."""
    backend = ScriptedBackend(by_text, delay=2.0)
    guard = Guard(load_text(TWO_BUDGETS.replace("timeout_ms: 2000", "timeout_ms: 500")), backends=backend)
    tasks = [asyncio.ensure_future(guard.aevaluate(at("/fast")))]
    for _ in range(20):
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(guard.aevaluate(at("/slow"))))
    verdicts = await asyncio.gather(*tasks)
    assert verdicts[0].fail_mode == "closed" and {v.fail_mode for v in verdicts[1:]} == {"open"}
    assert backend.calls == 2
    await guard.aclose()


@pytest.mark.anyio
async def test_a_follower_on_another_replica_ignores_a_timeout_within_a_shorter_budget(
    redis_url: str, create_redis: Any
) -> None:
    """Replica A leads /fast (100 ms) and times out; replica B's /slow (2 s) follows A's lock. B took A's timeout
    marker as its own failure (an allow through its fail mode) though the model answers in 300 ms; the marker now
    carries A's budget and B, whose budget is longer, leads instead."""
    backends = [ScriptedBackend(by_text, delay=0.3, name="clef") for _ in range(2)]
    a, b = (Guard(load_text(TWO_BUDGETS), backends=backend,
                  cache=redis_cache(redis_url, create_redis.prefix)) for backend in backends)
    fast = asyncio.ensure_future(a.aevaluate(at("/fast")))
    while not await keys(create_redis, "l"):  # A holds the lock
        await asyncio.sleep(0.005)
    slow = await b.aevaluate(at("/slow"))
    assert (slow.action, slow.rule, slow.fail_mode) == ("block", "injection", None), slow.error
    assert (await fast).fail_mode == "closed" and [backend.calls for backend in backends] == [1, 1]
    await a.aclose()
    await b.aclose()


class _SlowWrites(RedisCache):
    """A Redis cache whose writes take 600 ms (a store far away or busy)."""

    async def _store(self, key: str, value: dict[str, Any], decoded: Any, ttl: float) -> None:
        await asyncio.sleep(0.6)
        await super()._store(key, value, decoded, ttl)


@pytest.mark.anyio
async def test_answers_in_time_are_used_while_they_are_written_and_the_lock_goes_after(
    redis_url: str, create_redis: Any
) -> None:
    """The model answers in 100 ms of a 300 ms budget; writing the answers to Redis takes 600 ms. The flight settled
    only once they were written and the lock released, so the decision timed out (fail closed) with the answers in
    hand. It now settles with the answers; the write and then the release follow, and aclose waits for them."""
    backend = ScriptedBackend(by_text, delay=0.1, name="clef")
    cache = _SlowWrites(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5))
    guard = Guard(load_text(POLICY.replace("THRESHOLD", "0.8").replace("TTL", "60")
                            .replace("timeout_ms: 2000", "timeout_ms: 300")), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject())
    assert (verdict.action, verdict.rule, verdict.fail_mode) == ("allow", "default", None), verdict.error
    assert (await guard.aevaluate(subject())).cache_hit and backend.calls == 1  # held in process meanwhile
    assert await keys(create_redis, "l") and not await keys(create_redis)  # still writing: the lock is held
    await guard.aclose()
    assert await keys(create_redis) and not await keys(create_redis, "l") and cache.health().stores == 1


class _FarRedis(RedisCache):
    """A Redis cache whose operations each take 20 ms more (a store farther away)."""

    async def _op(self, fn: Any) -> Any:
        await asyncio.sleep(0.02)
        return await super()._op(fn)


def test_a_loop_that_ends_after_its_decision_still_writes_the_answers_and_releases_the_lock(redis_url: str) -> None:
    """A caller running each decision in its own ``asyncio.run`` (a sync worker, a CLI): the loop's end cancelled the
    flight's task while it wrote the answers or released the lock after the caller went on, so the answers were never
    stored (and a lock cancelled so stayed for its TTL). A write or release cancelled so is made once more."""
    import redis

    prefix = f"guard-test-{uuid.uuid4().hex[:8]}:"
    cache = _FarRedis(CacheConfig(url=redis_url, prefix=prefix, op_timeout=0.5))
    guard = Guard(policies(), backends=ScriptedBackend(by_text), cache=cache)
    for text in ("one", "two", "three"):
        assert asyncio.run(guard.aevaluate(subject(text))).action == "allow"
    client = redis.Redis.from_url(redis_url)
    try:
        values, locks = ([*client.scan_iter(match=f"{prefix}{kind}:*")] for kind in "al")
        assert (len(values), locks, cache.health().stores) == (3, [], 3)
    finally:
        for name in client.scan_iter(match=prefix + "*"):
            client.delete(name)
        client.close()


@pytest.mark.anyio
async def test_past_the_cap_on_background_writes_a_flight_settles_after_its_write(
    redis_url: str, create_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("guard.engine.cache.MAX_BACKGROUND_WRITES", 0)
    backend = ScriptedBackend(by_text, delay=0.1, name="clef")
    cache = _SlowWrites(CacheConfig(url=redis_url, prefix=create_redis.prefix, op_timeout=0.5))
    guard = Guard(load_text(POLICY.replace("THRESHOLD", "0.8").replace("TTL", "60")
                            .replace("timeout_ms: 2000", "timeout_ms: 300")), backends=backend, cache=cache)
    verdict = await guard.aevaluate(subject())
    assert verdict.fail_mode == "closed" and "timeout" in (verdict.error or "")
    await asyncio.sleep(0.6)  # the write goes on (and counts) after the caller gave up
    assert cache.health().stores == 1
    await guard.aclose()
