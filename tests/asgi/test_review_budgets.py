"""Byte budgets of held review items, through the middleware and both stores (memory and a real Redis): one client
cannot pin more than its budget of large bodies (429, others unaffected), the store as a whole fails closed past its
budget (503, also for requests without a client address), and a decision, an expiry or a replica racing another
frees or counts bytes exactly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from guard.asgi.review_store import (
    DEFAULT_MAX_BYTES_PER_CLIENT,
    MemoryReviewStore,
    RedisReviewStore,
    ReviewStore,
)
from guard.engine import Guard
from guard.errors import ReviewQuotaExceeded, ReviewStoreUnavailable
from guard.verdict import Verdict
from tests.asgi._apps import guarded_app

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
JSON = {"content-type": "application/json"}


def _unsure(size: int) -> bytes:
    """An escalated body of about ``size`` bytes (the test policy escalates "maybe")."""
    return json.dumps({"message": "maybe show me the settings", "pad": "x" * size}).encode()


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest, create_redis: Any) -> Any:
    def factory(**options: Any) -> ReviewStore:
        if request.param == "memory":
            return MemoryReviewStore(**options)
        return RedisReviewStore(create_redis(), prefix=create_redis.prefix, **options)

    return factory


def _client(app: Any, address: str | None) -> httpx.AsyncClient:
    async def peer(scope: Any, receive: Any, send: Any) -> None:  # None: behind a Unix socket, no peer address
        await app({**scope, "client": (address, 1000) if address else None}, receive, send)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=peer), base_url="http://testserver")


async def test_one_client_holds_at_most_its_byte_budget_of_large_bodies(
    make_guard: GuardFactory, make_store: Callable[..., ReviewStore]
) -> None:
    """With the defaults, one address escalating 1 MB bodies is refused (429 with Retry-After) once its items hold
    16 MiB, long before its 100 pending items; another address still escalates, and a rejection frees the bytes."""
    store = make_store()
    app = guarded_app(make_guard(), review_store=store)
    body = _unsure(1_000_000)
    try:
        async with _client(app, "198.51.100.1") as one, _client(app, "198.51.100.2") as two:
            answers = [await one.post("/v1/echo", content=body, headers=JSON) for _ in range(14)]
            other = await two.post("/v1/echo", content=body, headers=JSON)
            held = [a.json()["review_id"] for a in answers if a.status_code == 202]
            await store.reject(held[0], by="alice")
            after = await one.post("/v1/echo", content=body, headers=JSON)
    finally:
        await store.aclose()
    codes = [a.status_code for a in answers]
    kept = codes.count(202)
    assert codes == [202] * kept + [429] * (14 - kept) and 5 <= kept < 14, codes
    refused = answers[-1]
    assert refused.json()["code"] == "review_quota_exceeded" and int(refused.headers["retry-after"]) > 0
    assert f"its limit {DEFAULT_MAX_BYTES_PER_CLIENT}" in refused.json()["message"]
    assert other.status_code == 202 and after.status_code == 202


async def test_the_store_byte_budget_fails_closed_for_every_client_and_without_an_address(
    make_guard: GuardFactory, make_store: Callable[..., ReviewStore]
) -> None:
    """Past the store's budget every new hold is a 503 ``review_unavailable`` with Retry-After (never an allow), for
    a request without a client address too; a release frees the held request's bytes (two free room for one more
    item: its view of the body stays until it expires)."""
    store = make_store(max_bytes=400_000)  # each item holds the request and the reviewer's view of its body
    app = guarded_app(make_guard(), review_store=store)
    body = _unsure(30_000)
    try:
        async with _client(app, None) as socket, _client(app, "198.51.100.7") as tcp:
            codes = [(await socket.post("/v1/echo", content=body, headers=JSON)).status_code for _ in range(8)]
            full = await tcp.post("/v1/echo", content=body, headers=JSON)
            assert store.health.last_code == "review_store_full"  # type: ignore[attr-defined]
            for item in (await store.list_items())[:2]:  # a release frees the request, not the view decided items keep
                await store.approve(item.id, by="alice")
                await store.release(item.id, item.digest)
            freed = await tcp.post("/v1/echo", content=body, headers=JSON)
    finally:
        await store.aclose()
    kept = codes.count(202)
    assert codes == [202] * kept + [503] * (8 - kept) and 3 <= kept < 8, codes
    assert full.status_code == 503 and full.json()["code"] == "review_unavailable" and full.headers["retry-after"]
    assert freed.status_code == 202


async def _create(store: ReviewStore, client: str | None, size: int) -> str:
    verdict = Verdict(action="escalate", decision_id="d")
    request = {"body_b64": "x" * size}
    try:
        await store.create(verdict, subject={}, digest="0" * 64, request=request, client=client)
    except ReviewStoreUnavailable:
        return "full"
    except ReviewQuotaExceeded:
        return "quota"
    return "held"


async def test_redis_byte_budgets_hold_across_replicas_creating_at_once_and_free_on_expiry(create_redis: Any) -> None:
    """Two replicas creating 40 items at once against a budget of about 10 hold 10 between them (one held before by
    a replica with a longer TTL among them); once the short-lived items expire, their bytes are free again (the next
    create sweeps them from the budget, which the long-lived item keeps)."""
    calibration = RedisReviewStore(create_redis(), prefix=f"{create_redis.prefix}calibration:")
    await _create(calibration, None, 10_000)
    await calibration.aclose()
    sizes = await create_redis().hgetall(f"{create_redis.prefix}calibration:bytes:sizes")
    item = int(sizes[b"total"])  # one item's bytes: its view and its encrypted request (a few bytes vary)
    replicas = [RedisReviewStore(create_redis(), prefix=create_redis.prefix, ttl_s=ttl_s, max_bytes=int(10.5 * item),
                                 max_bytes_per_client=int(6.5 * item)) for ttl_s in (5, 5, 60)]
    try:
        assert await _create(replicas[2], None, 10_000) == "held"
        results = await asyncio.gather(*(_create(replicas[i % 2], None, 10_000) for i in range(40)))
        assert results.count("held") == 9 and results.count("full") == 31
        mine = await asyncio.gather(*(_create(replicas[i % 2], "203.0.113.9", 10_000) for i in range(2)))
        assert mine == ["full", "full"]  # the store's budget comes first
        await asyncio.sleep(5.1)
        clients = await asyncio.gather(*(_create(replicas[i % 2], "203.0.113.9", 10_000) for i in range(12)))
        assert clients.count("held") == 6 and clients.count("quota") == 6
        sizes = await create_redis().hgetall(f"{create_redis.prefix}bytes:sizes")
        assert len(sizes) == 8 and int(sizes[b"total"]) == sum(int(v) for k, v in sizes.items() if k != b"total")
    finally:
        for store in replicas:
            await store.aclose()


async def test_a_clients_decided_items_leave_its_budget_and_stay_in_the_stores(
    make_store: Callable[..., ReviewStore]
) -> None:
    """A decided item keeps its view for reviewers until it expires, which its client cannot hasten: that view
    counted against the client, so a client whose escalations were all decided was refused for 24 h once their
    views filled its budget. Now a rejected or released item leaves its client's budget; the store's keeps the
    view."""
    store = make_store(max_bytes_per_client=60_000)
    shown = {"body": {"text": "y" * 5_000}}
    try:
        for n in range(30):  # ~10 KB each (view and request): 300 KB decided against a client budget of 60 KB
            item = await store.create(Verdict(action="escalate", decision_id=f"d{n}"), subject=shown,
                                      digest="0" * 64, request={"body_b64": "x" * 5_000}, client="203.0.113.9")
            if n % 2:
                await store.reject(item.id, by="alice")
            else:
                await store.approve(item.id, by="alice")
                await store.release(item.id, item.digest)
        if isinstance(store, MemoryReviewStore):
            assert store.held_bytes >= 30 * 5_000  # the views stay in the store's budget
        outcomes = [await _create(store, "203.0.113.9", 10_000) for _ in range(8)]  # undecided ones still count
        held = outcomes.count("held")
        assert 3 <= held < 8 and outcomes == ["held"] * held + ["quota"] * (8 - held), outcomes
    finally:
        await store.aclose()
