"""The review store: lifecycle, single-use release bound to the digest, TTL, concurrency, Redis down (real Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from guard.asgi.review_store import MemoryReviewStore, RedisReviewStore, ReviewStore, digest_of
from guard.errors import ReviewConflict, ReviewNotFound, ReviewQuotaExceeded, ReviewStoreUnavailable
from guard.systemone import AnswerV1
from guard.verdict import Verdict

pytestmark = pytest.mark.anyio


def _verdict() -> Verdict:
    answer = AnswerV1(question_id="injection", type="noul", probabilities={"true": 0.55, "false": 0.45}, noul=0.55)
    return Verdict(
        action="escalate",
        decision_id=uuid.uuid4().hex,
        policy_id="api_abuse",
        policy_version="3",
        rule="unsure_injection",
        message="held for review",
        answers={"injection": answer},
        state={"body": {"prompt": "maybe"}},
    )


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, create_redis: Any) -> AsyncIterator[Callable[..., ReviewStore]]:
    stores: list[ReviewStore] = []

    def factory(ttl_s: float = 60.0) -> ReviewStore:
        store: ReviewStore
        if request.param == "memory":
            store = MemoryReviewStore(ttl_s=ttl_s)
        else:
            store = RedisReviewStore(create_redis(), prefix=create_redis.prefix, ttl_s=ttl_s)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        await store.aclose()


async def test_lifecycle_approve_then_release_exactly_once(make_store: Callable[..., ReviewStore]) -> None:
    store = make_store()
    digest = digest_of("POST", "/v1/chat", b'{"prompt":"maybe"}')
    request = {"method": "POST", "path": "/v1/chat", "body_b64": "e30="}
    item = await store.create(_verdict(), subject={"method": "POST", "path": "/v1/chat"}, digest=digest, request=request)
    assert item.status == "pending" and item.id.startswith("rv_")
    assert item.expires_at - item.created_at == pytest.approx(60.0)

    got = await store.get(item.id)
    assert got.request == request and got.answers["injection"]["probabilities"]["true"] == pytest.approx(0.55)
    assert got.rule == "unsure_injection" and got.state == {"body": {"prompt": "maybe"}}
    listed = await store.list_items("pending")
    assert [i.id for i in listed] == [item.id] and listed[0].request is None

    with pytest.raises(ReviewConflict, match="pending; this change needs it to be approved"):
        await store.release(item.id, digest)
    approved = await store.approve(item.id, by="alice", note="looks fine")
    assert (approved.status, approved.decided_by, approved.note) == ("approved", "alice", "looks fine")
    assert await store.list_items("pending") == []
    assert [i.id for i in await store.list_items("approved")] == [item.id]

    with pytest.raises(ReviewConflict, match="digest mismatch"):
        await store.release(item.id, digest_of("POST", "/v1/chat", b'{"prompt":"other"}'))
    released = await store.release(item.id, digest)
    assert released.status == "released" and released.released_at is not None
    with pytest.raises(ReviewConflict, match="already released"):
        await store.release(item.id, digest)
    assert (await store.get(item.id)).status == "released"


async def test_reject_is_final(make_store: Callable[..., ReviewStore]) -> None:
    store = make_store()
    item = await store.create(_verdict(), subject={}, digest="d")
    rejected = await store.reject(item.id, by="bob")
    assert rejected.status == "rejected" and rejected.decided_by == "bob"
    for change in (store.approve(item.id), store.reject(item.id), store.release(item.id, "d")):
        with pytest.raises(ReviewConflict) as info:
            await change
        assert info.value.status == "rejected"


async def test_concurrent_releases_give_one_success(make_store: Callable[..., ReviewStore]) -> None:
    store = make_store()
    item = await store.create(_verdict(), subject={}, digest="abc")
    await store.approve(item.id)
    results = await asyncio.gather(*(store.release(item.id, "abc") for _ in range(20)), return_exceptions=True)
    assert sum(1 for r in results if not isinstance(r, Exception)) == 1
    assert all(isinstance(r, ReviewConflict) for r in results if isinstance(r, Exception))


async def test_unknown_and_expired_items(make_store: Callable[..., ReviewStore]) -> None:
    store = make_store(ttl_s=0.3)
    with pytest.raises(ReviewNotFound):
        await store.get("rv_nope")
    with pytest.raises(ReviewNotFound):
        await store.approve("rv_nope")
    item = await store.create(_verdict(), subject={}, digest="d")
    assert [i.id for i in await store.list_items(None)] == [item.id]
    await asyncio.sleep(0.45)
    with pytest.raises(ReviewNotFound):
        await store.get(item.id)
    with pytest.raises(ReviewNotFound):
        await store.approve(item.id)
    assert await store.list_items(None) == []


async def test_redis_store_is_shared_between_instances(create_redis: Any) -> None:
    one = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    two = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    item = await one.create(_verdict(), subject={"path": "/x"}, digest="d")
    await two.approve(item.id, by="carol")
    assert (await one.get(item.id)).decided_by == "carol"
    await one.release(item.id, "d")
    with pytest.raises(ReviewConflict):
        await two.release(item.id, "d")


async def test_a_redis_item_put_back_after_its_expiry_is_not_found(create_redis: Any) -> None:
    """Someone who can write to Redis (but has no store key) copies an approved item and puts it back, without a TTL,
    after it expired: the expiry is sealed in the item, so it is gone for good, not approved and releasable forever."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix, ttl_s=0.3)
    item = await store.create(_verdict(), subject={"path": "/x"}, digest="d")
    await store.approve(item.id, by="carol")
    client = create_redis()
    key = f"{create_redis.prefix}{item.id}"
    assert await client.exists(key)
    snapshot = await client.hgetall(key)
    await asyncio.sleep(0.45)
    assert not await client.exists(key)  # Redis expired it
    await client.hset(key, mapping=snapshot)  # put back, with no expiry
    with pytest.raises(ReviewNotFound):
        await store.get(item.id)
    with pytest.raises(ReviewNotFound):
        await store.release(item.id, "d")
    await store.aclose()


async def _put_back(client: Any, key: str, snapshot: dict[bytes, bytes]) -> None:
    """What someone who can write to Redis (without the store key) does to roll an item back to a copied state."""
    left = await client.pttl(key)
    await client.delete(key)
    await client.hset(key, mapping=snapshot)
    await client.pexpire(key, left)


async def test_a_redis_item_put_back_to_an_earlier_state_is_refused_by_a_store_that_saw_it_settled(
    create_redis: Any
) -> None:
    """A copy of an approved item put back after its release released it again (the held request replayed once per
    put-back), and a copy of a pending item put back after its rejection could be approved: each seal checks, so only
    the store's memory of the settled item tells; a store that never saw it settled cannot (documented)."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    client = create_redis()
    released = await store.create(_verdict(), subject={"path": "/x"}, digest="d")
    await store.approve(released.id, by="carol")
    approved_copy = await client.hgetall(f"{create_redis.prefix}{released.id}")
    await store.release(released.id, "d")
    await _put_back(client, f"{create_redis.prefix}{released.id}", approved_copy)
    with pytest.raises(ReviewConflict) as caught:
        await store.release(released.id, "d")
    assert caught.value.status == "tampered"

    rejected = await store.create(_verdict(), subject={"path": "/y"}, digest="e")
    pending_copy = await client.hgetall(f"{create_redis.prefix}{rejected.id}")
    await store.reject(rejected.id, by="alice")
    await _put_back(client, f"{create_redis.prefix}{rejected.id}", pending_copy)
    with pytest.raises(ReviewConflict):
        await store.approve(rejected.id, by="bob")
    assert store.tampered == 2

    assert rejected.id not in [i.id for i in await store.list_items("pending")]  # not offered for approval either
    assert store.tampered == 2  # a listing leaves it out quietly: one racing a settle here would look the same

    other = RedisReviewStore(create_redis(), prefix=create_redis.prefix)  # a replica that saw neither settle
    assert (await other.approve(rejected.id, by="bob")).status == "approved"
    await other.get(released.id)  # it still reads the put-back copy: the documented limit
    await other.aclose()

    lister = RedisReviewStore(create_redis(), prefix=create_redis.prefix)  # one that saw it settled in a listing
    listed = await store.create(_verdict(), subject={"path": "/z"}, digest="f")
    await store.approve(listed.id, by="carol")
    copy = await client.hgetall(f"{create_redis.prefix}{listed.id}")
    await store.release(listed.id, "f")
    assert listed.id in [i.id for i in await lister.list_items("released")]
    await _put_back(client, f"{create_redis.prefix}{listed.id}", copy)
    with pytest.raises(ReviewConflict):
        await lister.release(listed.id, "f")
    await lister.aclose()
    await store.aclose()


@pytest.mark.parametrize("decode_responses", [False, True])
async def test_a_redis_field_or_index_entry_that_is_not_utf8_is_tampered_not_a_crash(
    create_redis: Any, decode_responses: bool
) -> None:
    """One byte that is not UTF-8 in an item's field (``HSET <id> status "pend\\xffing"``) or in an index raised
    UnicodeDecodeError: every listing and the item's own reads answered 500. The item is now tampered (counted, left
    out of listings and its index, refused on read); the index entries are dropped."""
    store = RedisReviewStore(create_redis(decode_responses=decode_responses), prefix=create_redis.prefix)
    client = create_redis()
    good = await store.create(_verdict(), subject={}, digest="d")
    bad = await store.create(_verdict(), subject={}, digest="d")
    await client.hset(f"{create_redis.prefix}{bad.id}", "status", b"pend\xffing")
    index = f"{create_redis.prefix}index:pending"
    soon = time.time() + 30  # more than a page of them, before the live item (and not yet expired)
    await client.zadd(index, {b"rv_\xff%d" % n: soon for n in range(20)})
    assert [i.id for i in await store.list_items("pending", limit=2)] == [good.id]  # pages of 16
    assert store.tampered == 1
    assert await client.zrange(index, 0, -1) == [good.id.encode()]
    for change in (store.get(bad.id), store.approve(bad.id), store.release(bad.id, "d")):
        with pytest.raises(ReviewConflict) as caught:
            await change
        assert caught.value.status == "tampered"
    assert store.tampered == 4
    await store.aclose()


@pytest.mark.parametrize("decode_responses", [False, True])
async def test_a_clients_pending_slot_that_is_not_an_item_id_is_tampered_not_a_crash_nor_held(
    create_redis: Any, decode_responses: bool
) -> None:
    """A member that is not UTF-8 in ``<prefix>pending:<client>`` made every create for that client raise a bare
    UnicodeDecodeError with ``decode_responses=True`` (after its slot was added), and junk counted against the
    client's cap. Junk is now dropped and counted as tampered; the cap holds for the client's real items."""
    store = RedisReviewStore(create_redis(decode_responses=decode_responses), prefix=create_redis.prefix,
                             max_pending_per_client=2)
    client = create_redis()
    first = await store.create(_verdict(), subject={}, digest="d", client="alice")
    slots = f"{create_redis.prefix}pending:" + hashlib.sha256(b"alice").hexdigest()[:32]
    await client.zadd(slots, {b"rv_\xff": time.time() + 5, b"not-an-id": time.time() + 6})
    second = await store.create(_verdict(), subject={}, digest="d", client="alice")
    assert store.tampered == 2
    assert sorted(await client.zrange(slots, 0, -1)) == sorted([first.id.encode(), second.id.encode()])
    with pytest.raises(ReviewQuotaExceeded, match="already has 2 pending review items"):
        await store.create(_verdict(), subject={}, digest="d", client="alice")
    assert await client.zcard(slots) == 2
    await store.aclose()


@pytest.mark.parametrize("decode_responses", [False, True])
async def test_a_status_edited_to_junk_between_the_read_and_the_transition_is_tampered(
    create_redis: Any, decode_responses: bool
) -> None:
    """The transition script names the status it found; one that is not UTF-8 raised UnicodeDecodeError inside
    redis-py with ``decode_responses=True``. Its reply is read as bytes, and a status no store writes is tampered."""
    store = RedisReviewStore(create_redis(decode_responses=decode_responses), prefix=create_redis.prefix)
    client = create_redis()
    item = await store.create(_verdict(), subject={}, digest="d")
    read = store._read

    async def read_then_edit(review_id: str) -> list[str | None]:
        texts = await read(review_id)
        await client.hset(f"{create_redis.prefix}{review_id}", "status", b"pend\xffing")  # after the seal checked
        return texts

    store._read = read_then_edit  # type: ignore[method-assign]
    with pytest.raises(ReviewConflict) as caught:
        await store.approve(item.id)
    assert caught.value.status == "tampered" and store.tampered == 1
    await store.aclose()


async def test_redis_down_is_unavailable_not_an_allow(private_redis: Any) -> None:
    store = RedisReviewStore.from_url(private_redis.url, timeout_s=0.2)
    item = await store.create(_verdict(), subject={}, digest="d")
    private_redis.stop()
    with pytest.raises(ReviewStoreUnavailable, match="Redis failed"):
        await store.create(_verdict(), subject={}, digest="d")
    with pytest.raises(ReviewStoreUnavailable):
        await store.release(item.id, "d")
    with pytest.raises(ReviewStoreUnavailable):
        await store.list_items()
    await store.aclose()
    await store.aclose()


async def test_memory_store_full_fails_closed() -> None:
    store = MemoryReviewStore(max_items=2)
    await store.create(_verdict(), subject={}, digest="d")
    await store.create(_verdict(), subject={}, digest="d")
    with pytest.raises(ReviewStoreUnavailable, match="its limit 2"):
        await store.create(_verdict(), subject={}, digest="d")


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="ttl_s is 0"):
        MemoryReviewStore(ttl_s=0)
    # inf was taken: the first 429 over a client's cap then raised; 1e300 failed every escalation to a Redis store
    for endless in (float("inf"), float("nan"), 1e300):
        with pytest.raises(ValueError, match="at most 315360000"):
            MemoryReviewStore(ttl_s=endless)
        with pytest.raises(ValueError, match="at most 315360000"):
            RedisReviewStore(None, ttl_s=endless)  # type: ignore[arg-type]
    assert MemoryReviewStore(ttl_s=315360000).ttl_s == 315360000.0
    with pytest.raises(ValueError, match=r"max_items \(0\)"):
        MemoryReviewStore(max_items=0)


def test_digest_is_length_prefixed() -> None:
    assert digest_of("ab", "c") != digest_of("a", "bc")
    assert digest_of(b"x") == digest_of("x") and len(digest_of()) == 64


def test_public_json_hides_state_and_request() -> None:
    item = asyncio.run(MemoryReviewStore().create(_verdict(), subject={}, digest="d", request={"body_b64": ""}))
    assert set(item.public_json()) == {"id", "status", "decision_id", "policy", "rule", "message", "created_at",
                                       "expires_at"}
    assert "request" not in item.to_json() and item.to_json(include_request=True)["request"] == {"body_b64": ""}


@pytest.mark.anyio
async def test_concurrent_escalations_of_one_client_stay_within_its_redis_quota(create_redis: Any) -> None:
    """The pending slot is taken and counted in one transaction: 60 concurrent creates from one client leave exactly
    its cap of items (every one could pass a separate check-then-add before)."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix, max_pending_per_client=10)
    verdict = _verdict()
    results = await asyncio.gather(*(store.create(verdict, subject={}, digest="x", client="10.0.0.66")
                                     for _ in range(60)), return_exceptions=True)  # fmt: skip
    created = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, ReviewQuotaExceeded)]
    assert len(created) == 10 and len(refused) == 50
    assert len(await store.list_items(limit=100)) == 10
    other = await store.create(verdict, subject={}, digest="x", client="10.0.1.1")  # another client is not limited
    assert other.status == "pending"
    await store.aclose()


async def test_a_redis_decision_frees_the_clients_pending_slot_in_the_same_step(create_redis: Any) -> None:
    """Approving or rejecting moves the item out of its client's pending set inside the transition: a failure after
    it cannot report an applied decision as failed (a reviewer then believes a releasable request was not approved),
    nor leave the slot counted against the client's quota."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    client = create_redis()
    store = RedisReviewStore(client, prefix=create_redis.prefix, max_pending_per_client=2)
    first, second = [await store.create(_verdict(), subject={}, digest="x", client="10.0.0.7") for _ in range(2)]

    async def cut(*args: Any, **kwargs: Any) -> Any:
        raise RedisConnectionError("connection cut after the transition")

    client.zrem = cut  # any separate clean-up call after the transition fails
    assert (await store.approve(first.id, by="alice")).status == "approved"
    assert (await store.reject(second.id, by="alice")).status == "rejected"
    assert await client.zcard(f"{create_redis.prefix}pending:" + hashlib.sha256(b"10.0.0.7").hexdigest()[:32]) == 0
    assert (await store.create(_verdict(), subject={}, digest="x", client="10.0.0.7")).status == "pending"
    await store.aclose()


async def _hmget_calls(client: Any) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_hmget", {}).get("calls", 0))


async def test_redis_lists_the_oldest_pending_items_behind_any_number_of_decided_ones(create_redis: Any) -> None:
    """A listing reads the index of the status it lists: the pending items behind 60 decided ones are found, and
    reading them touches a few items, not every item in the store."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    items = [await store.create(_verdict(), subject={}, digest="d") for _ in range(66)]
    for item in items[:60]:
        await store.approve(item.id)
    probe = create_redis()
    before = await _hmget_calls(probe)
    listed = await store.list_items("pending", limit=4)
    assert [i.id for i in listed] == [i.id for i in items[60:64]]
    assert await _hmget_calls(probe) - before <= 16  # one chunk of the pending index; it was all 66 items
    assert [i.id for i in await store.list_items("approved", limit=2)] == [i.id for i in items[:2]]
    everything = await store.list_items(None, limit=100)
    assert [i.id for i in everything] == [i.id for i in items]
    await store.release(items[0].id, "d")
    assert [i.id for i in await store.list_items("released")] == [items[0].id]
    assert items[0].id not in [i.id for i in await store.list_items("approved")]
    await store.aclose()


async def test_redis_tenant_listing_skips_stale_and_foreign_entries(create_redis: Any) -> None:
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    ours = [await store.create(_verdict(), subject={}, digest="d", tenant="acme") for _ in range(3)]
    for _ in range(40):
        await store.create(_verdict(), subject={}, digest="d", tenant="globex")
    client = create_redis()
    index = f"{create_redis.prefix}index:pending:" + hashlib.sha256(b"acme").hexdigest()[:32]
    await client.zadd(index, {"rv_" + "0" * 24: 1e12, "not-an-id": 0})  # a gone item, a hand-written entry
    await store.approve(ours[0].id)
    before = await _hmget_calls(client)
    assert [i.id for i in await store.list_items("pending", tenants={"acme"})] == [i.id for i in ours[1:]]
    assert await _hmget_calls(client) - before <= 4
    assert [i.id for i in await store.list_items("approved", tenants={"acme", "initech"})] == [ours[0].id]
    assert await store.list_items("pending", tenants=set()) == []
    await store.aclose()


async def test_redis_listing_pages_by_score_so_a_removal_elsewhere_skips_no_live_item(create_redis: Any) -> None:
    """Another replica approving an item between two pages of one listing shifted the next page by one (paged by
    offset), so a pending item was left out and a newer one listed instead."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    other = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    items = [await store.create(_verdict(), subject={}, digest="d") for _ in range(40)]
    fetch, fired = store._fetch, []

    async def approving_elsewhere(ids: list[str]) -> Any:
        if not fired:
            fired.append(True)
            await other.approve(items[0].id)
        return await fetch(ids)

    store._fetch = approving_elsewhere  # type: ignore[method-assign]
    listed = await store.list_items("pending", limit=20)
    assert [i.id for i in listed] == [i.id for i in items[1:21]]
    await store.aclose()
    await other.aclose()


def _lose_the_next_transition_reply(client: Any, *, runs: bool = True, meanwhile: Any = None) -> list[str]:
    """The next transition script sent on ``client`` runs in Redis (unless not ``runs``) but its reply is lost: the
    call raises redis-py's TimeoutError, as a read past the socket timeout does. ``meanwhile()`` is awaited before the
    reply is lost (after the script ran, or in its place). Later commands pass. Returns the list the lost call is
    noted in."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    send, lost = client.execute_command, []

    async def execute(*args: Any, **kwargs: Any) -> Any:
        if args[:2] == ("EVAL", RedisReviewStore.TRANSITION_SCRIPT) and not lost:
            lost.append(args[4 + int(args[2])])  # the new status (ARGV[2])
            if runs:
                await send(*args, **kwargs)
            if meanwhile is not None:
                await meanwhile()
            raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
        return await send(*args, **kwargs)

    client.execute_command = execute
    return lost


async def test_a_redis_change_whose_reply_is_lost_is_returned_as_made_once_read_again(create_redis: Any) -> None:
    """Redis ran the transition but its reply was lost: the change was taken as not made (503 "try again"), though
    the item was approved (or released, its request deleted), and a retry was a 409. The item is read again, and a
    change found made with this call's own seal and nonce is returned as made; a second one is still refused."""
    client = create_redis()
    store = RedisReviewStore(client, prefix=create_redis.prefix)
    item = await store.create(_verdict(), subject={}, digest="d", request={"body_b64": "e30="})
    lost = _lose_the_next_transition_reply(client)
    approved = await store.approve(item.id, by="alice", note="ok")
    assert lost == ["approved"]
    assert (approved.status, approved.decided_by, approved.note) == ("approved", "alice", "ok")
    assert (await store.get(item.id)).status == "approved"
    with pytest.raises(ReviewConflict):
        await store.approve(item.id, by="alice")
    lost = _lose_the_next_transition_reply(client)
    released = await store.release(item.id, "d")
    assert lost == ["released"]
    assert released.status == "released" and released.decided_by == "alice" and released.request is None
    with pytest.raises(ReviewConflict) as again:
        await store.release(item.id, "d")
    assert again.value.status == "released"
    await store.aclose()


async def test_a_redis_change_whose_reply_is_lost_and_not_seen_made_is_of_unknown_outcome(create_redis: Any) -> None:
    """Not found made when read again, the item still as it was read: the change may still be on its way, so the
    answer says its outcome is unknown (a ReviewStoreUnavailable: callers fail closed), not that nothing changed.
    Changed by another change meanwhile, this one can no longer be made: a conflict naming the status."""
    from guard.errors import ReviewOutcomeUnknown

    client = create_redis()
    store = RedisReviewStore(client, prefix=create_redis.prefix)
    other = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    item = await store.create(_verdict(), subject={}, digest="d")
    _lose_the_next_transition_reply(client, runs=False)
    with pytest.raises(ReviewOutcomeUnknown, match="unknown|lost") as caught:
        await store.approve(item.id, by="alice")
    assert isinstance(caught.value, ReviewStoreUnavailable)
    assert (await store.get(item.id)).status == "pending"

    async def rejected_elsewhere() -> None:
        await other.reject(item.id, by="bob")

    _lose_the_next_transition_reply(client, runs=False, meanwhile=rejected_elsewhere)
    with pytest.raises(ReviewConflict) as conflict:
        await store.approve(item.id, by="alice")
    assert conflict.value.status == "rejected"
    assert (await store.get(item.id)).decided_by == "bob"
    await store.aclose()
    await other.aclose()


async def test_an_approval_whose_reply_is_lost_is_made_though_the_item_was_released_before_it_was_read_again(
        create_redis: Any) -> None:
    """Redis ran the approval, its reply was lost, and the item was released before it was read again: the release
    had replaced the approval's seal and nonce, so the approval was answered as a conflict (the item released) though
    it was made. The approval's sealed ``decided`` (its own, kept by the release) tells it made, and it is returned
    as made. An approval that another reviewer made in its place is still a conflict."""
    client = create_redis()
    store = RedisReviewStore(client, prefix=create_redis.prefix)
    other = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    item = await store.create(_verdict(), subject={}, digest="d", request={"body_b64": "e30="})

    async def released_elsewhere() -> None:
        await other.release(item.id, "d")

    lost = _lose_the_next_transition_reply(client, meanwhile=released_elsewhere)
    approved = await store.approve(item.id, by="alice", note="ok")
    assert lost == ["approved"]
    assert (approved.status, approved.decided_by, approved.note) == ("approved", "alice", "ok")
    assert (await store.get(item.id)).status == "released"
    with pytest.raises(ReviewConflict):
        await store.approve(item.id, by="alice")

    second = await store.create(_verdict(), subject={}, digest="d")

    async def approved_and_released_elsewhere() -> None:
        await other.approve(second.id, by="bob", note="ok")
        await other.release(second.id, "d")

    _lose_the_next_transition_reply(client, runs=False, meanwhile=approved_and_released_elsewhere)
    with pytest.raises(ReviewConflict) as conflict:
        await store.approve(second.id, by="bob", note="ok")
    assert conflict.value.status == "released"
    assert (await store.get(second.id)).decided_by == "bob"
    await store.aclose()
    await other.aclose()


async def test_a_new_items_state_is_redacted_off_the_event_loop(
    make_store: Callable[..., ReviewStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building an item redacts its state and writes its view, which walk every key of a large body: both run on a
    worker thread, so one large escalated body does not hold every other request; the item is still redacted."""
    from guard.asgi import review_store

    where: list[bool] = []
    real = review_store._redacted_state

    def redacted(state: Any) -> Any:
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return real(state)

    monkeypatch.setattr(review_store, "_redacted_state", redacted)
    store = make_store()
    verdict = dataclasses.replace(_verdict(), state={"body": {"password": "hunter2-correct", "prompt": "maybe"}})
    item = await store.create(verdict, subject={"method": "POST", "path": "/v1/chat"}, digest=digest_of(b"x"))
    assert where == [False]
    assert "hunter2-correct" not in str((await store.get(item.id)).state)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_each_tenant_at_one_client_has_caps_of_its_own_and_the_item_keeps_the_client(
    kind: str, create_redis: Any
) -> None:
    """Tenants behind one address (a gateway) are counted apart against the per-client caps, a decision frees the
    slot of its tenant, and the item's ``client`` stays the address reviewers read."""
    store: ReviewStore = (MemoryReviewStore(max_pending_per_client=1) if kind == "memory" else
                          RedisReviewStore(create_redis(), prefix=create_redis.prefix, max_pending_per_client=1))

    async def hold(tenant: str | None) -> Any:
        return await store.create(_verdict(), subject={}, digest="x", tenant=tenant, client="10.0.0.7")

    acme, globex, untenanted = await hold("acme"), await hold("globex"), await hold(None)
    with pytest.raises(ReviewQuotaExceeded):
        await hold("acme")
    await store.reject(acme.id, by="alice")
    assert (await hold("acme")).status == "pending"
    assert {item.client for item in (acme, globex, untenanted)} == {"10.0.0.7"}
    assert {item.client for item in await store.list_items()} == {"10.0.0.7"}
    await store.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_each_tenant_at_one_client_has_a_byte_budget_of_its_own(kind: str, create_redis: Any) -> None:
    probe = MemoryReviewStore()
    await probe.create(_verdict(), subject={}, digest="x", client="10.0.0.7")
    room = probe.held_bytes * 3 // 2  # one item fits, two do not
    store: ReviewStore = (
        MemoryReviewStore(max_bytes_per_client=room) if kind == "memory" else
        RedisReviewStore(create_redis(), prefix=create_redis.prefix, max_bytes_per_client=room))

    async def hold(tenant: str | None) -> Any:
        return await store.create(_verdict(), subject={}, digest="x", tenant=tenant, client="10.0.0.7")

    await hold("acme")
    with pytest.raises(ReviewQuotaExceeded, match="bytes") as refused:
        await hold("acme")
    assert refused.value.retry_after > 1
    await hold("globex")
    await hold(None)
    await store.aclose()
