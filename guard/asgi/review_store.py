"""The review store: escalated decisions waiting for a person or a tool, with single-use release.

An **escalate** verdict becomes a :class:`ReviewItem` (``pending``). A reviewer approves or rejects it; an approved
item can be **released** once, and only for the content it was created for (its ``digest``): the HTTP middleware
replays the held request, the agent middleware resumes the held tool call. Lifecycle::

    pending ──approve──► approved ──release(digest)──► released
       └────reject────► rejected

Every transition is atomic (a Lua script in Redis, a plain check-and-set in memory), so two concurrent releases of
the same item give one success and one :class:`~guard.errors.ReviewConflict`. Items expire after their TTL.

Two stores share the :class:`ReviewStore` protocol: :class:`RedisReviewStore` (shared across replicas, Redis TTL)
and :class:`MemoryReviewStore` (one process, the fallback when no Redis is configured). Redis items are sealed
(HMAC-SHA256 keyed by the store key, :mod:`guard._seal`) over every field, status included, and each transition is
a compare-and-set on the seal: an item edited in Redis by someone without the key (``HSET ... status approved``)
is refused as ``tampered`` (409), never approved or released. The in-memory store needs no seal: only this process
writes it. A Redis that cannot be
reached raises :class:`~guard.errors.ReviewStoreUnavailable`; callers fail closed on it, never open.

Example:
    >>> store = MemoryReviewStore()
    >>> item = await store.create(verdict, subject={"method": "POST", "path": "/v1/chat"}, digest=digest_of(body))
    >>> await store.approve(item.id, by="alice")
    >>> await store.release(item.id, digest_of(body))   # a second call raises ReviewConflict
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from redis.client import NEVER_DECODE
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from guard._seal import Sealer
from guard.engine.health import FailureTracker
from guard.errors import (
    ReviewConflict,
    ReviewError,
    ReviewNotFound,
    ReviewOutcomeUnknown,
    ReviewQuotaExceeded,
    ReviewStoreUnavailable,
)
from guard.subject import digest_of
from guard.verdict import Verdict

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_BYTES_PER_CLIENT",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MAX_PENDING_PER_CLIENT",
    "DEFAULT_REVIEW_PREFIX",
    "DEFAULT_REVIEW_TTL_S",
    "MAX_SETTLED",
    "NEW_ITEM",
    "MemoryReviewStore",
    "RedisReviewStore",
    "ReviewItem",
    "ReviewStatus",
    "ReviewStore",
    "digest_of",
]

ReviewStatus = Literal["pending", "approved", "rejected", "released"]
STATUSES: tuple[ReviewStatus, ...] = ("pending", "approved", "rejected", "released")

DEFAULT_REVIEW_TTL_S = 24 * 3600.0
"""How long an item lives, seconds, whatever its status."""
DEFAULT_REVIEW_PREFIX = "guard:review:"
"""Redis key prefix: items at ``<prefix><id>``, the per-status indexes at ``<prefix>index:<status>``."""
DEFAULT_MAX_ITEMS = 10_000
"""Most items the in-memory store holds; creating one more fails closed."""
MAX_SETTLED = 100_000
"""Most settled (rejected or released) item ids one :class:`RedisReviewStore` remembers, to refuse an item put back
to an earlier state in Redis (about 140 bytes each)."""
#: The ``review_id`` of a :class:`~guard.errors.ReviewError` raised before an item had an id (creating one).
NEW_ITEM = "(new)"
DEFAULT_MAX_PENDING_PER_CLIENT = 100
"""Most pending items one client may have at once (both stores); one more is a 429 for that client only, so a
client filling the store cannot turn every other client's escalation into a 503."""
DEFAULT_MAX_BYTES = 256 * 2**20
"""Most bytes the items of one store may hold together (both stores; the Redis store's across every replica):
creating one that would pass it fails closed. An item's bytes are its view and its held request as the store keeps
them (:func:`_item_bytes`); the request's share is freed when the item is rejected or released, the rest when it
expires."""
DEFAULT_MAX_BYTES_PER_CLIENT = 16 * 2**20
"""Most bytes one client's items may hold (both stores, counted as for :data:`DEFAULT_MAX_BYTES`); one more is a 429
for that client only. A held request of the largest body (``BodyLimits.max_body_bytes``, 1 MiB by default) is about
1.33 times the body in memory and 1.8 times in Redis (encrypted): about 12 or 9 of them."""
DEFAULT_LIST_LIMIT = 100
_REVIEW_ID = re.compile(r"rv_[0-9a-f]{24}")
LOST_REPLY_WAITS = (0.05, 0.25, 0.5)
"""Seconds waited before each read of an item whose transition's reply was lost (:meth:`RedisReviewStore._move`)."""
_AS_BYTES: dict[str, Any] = {NEVER_DECODE: []}
"""redis-py's per-command option for a reply as bytes whatever the client's ``decode_responses``, so a value that is
not UTF-8 reaches :meth:`RedisReviewStore._checked` rather than failing inside the client."""

logger = logging.getLogger("guard.review")


@dataclass(frozen=True)
class ReviewItem:
    """One escalated decision.

    Attributes:
        id: the item's id (``rv_`` + 24 hex digits).
        status: ``pending``, ``approved``, ``rejected`` or ``released``.
        created_at: Unix time, seconds.
        expires_at: Unix time, seconds; the item is gone after it.
        decision_id: the escalating verdict's decision id.
        policy_id: the policy that escalated.
        policy_version: its version.
        rule: the rule that fired (``on_error`` when a fail mode escalated).
        message: the rule's message.
        subject: a redacted summary of what is held (HTTP: method, path, query, host, client, headers, and the
            body as text with secrets masked, cut at ``guard.asgi._body_view.MAX_SHOWN_BODY_BYTES`` bytes; agent:
            tool, thread).
        state: the decision state the model judged, with secret-named fields removed as the decision log's
            ``redacted`` mode removes them (``guard.engine.telemetry.redact_secrets``).
        tenant: the tenant the held request belongs to (``GuardMiddleware(tenant_header=...)``), or ``None``;
            reviewers scoped to tenants see only their tenants' items.
        client: who sent it (the subject's client), counted against the per-client caps; with a tenant, each
            tenant at a client is counted apart (:func:`_counted_as`).
        answers: each question's answer (``AnswerV1.to_json()`` plus every option's probability).
        digest: SHA-256 of the held content; a release must present the same digest.
        request: what is needed to replay the held content (HTTP: method, path, query, headers, body); ``None``
            in listings.
        decided_by: who approved or rejected.
        decided_at: when, Unix seconds.
        note: the reviewer's note.
        released_at: when the item was released, Unix seconds.
    """

    id: str
    status: ReviewStatus
    created_at: float
    expires_at: float
    decision_id: str
    digest: str
    policy_id: str | None = None
    policy_version: str | None = None
    rule: str | None = None
    message: str | None = None
    subject: dict[str, Any] = field(default_factory=dict)
    state: Any = None
    answers: dict[str, Any] = field(default_factory=dict)
    request: dict[str, Any] | None = None
    decided_by: str | None = None
    decided_at: float | None = None
    note: str | None = None
    released_at: float | None = None
    tenant: str | None = None
    client: str | None = None

    def to_json(self, *, include_request: bool = False) -> dict[str, Any]:
        """Everything a reviewer needs; the held ``request`` only when asked for (it can carry a body)."""
        out = asdict(self)
        if not include_request:
            out.pop("request")
        return out

    def public_json(self) -> dict[str, Any]:
        """What the client whose request is held may see: no state, answers or request."""
        return {
            "id": self.id,
            "status": self.status,
            "decision_id": self.decision_id,
            "policy": self.policy_id,
            "rule": self.rule,
            "message": self.message,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }


def _quota_key(tenant: str | None, client: str | None) -> str | None:
    """Whom an item counts against (the per-client caps): ``client``, and with a tenant the pair
    ``["tenant", "client"]`` as JSON, so tenants behind one address (a gateway, a NAT) have caps of their own;
    ``None`` without a client."""
    if client is None or tenant is None:
        return client
    return json.dumps([tenant, client], ensure_ascii=False)


def _counted_as(item: ReviewItem) -> str | None:
    """Whom ``item`` counts against (:func:`_quota_key`)."""
    return _quota_key(item.tenant, item.client)


def _redacted_state(state: Any) -> Any:
    from guard.engine.telemetry import redact_secrets

    return redact_secrets(state)


def _new_item(
    verdict: Verdict, *, subject: dict[str, Any], digest: str, request: dict[str, Any] | None, ttl_s: float,
    tenant: str | None, client: str | None,
) -> ReviewItem:
    now = time.time()
    return ReviewItem(
        id="rv_" + secrets.token_hex(12),
        status="pending",
        created_at=now,
        expires_at=now + ttl_s,
        decision_id=verdict.decision_id,
        digest=digest,
        policy_id=verdict.policy_id,
        policy_version=verdict.policy_version,
        rule=verdict.rule,
        message=verdict.message,
        subject=dict(subject),
        state=_redacted_state(verdict.state),
        answers={
            qid: {**answer.to_json(), "probabilities": {k: round(v, 6) for k, v in answer.probabilities.items()}}
            for qid, answer in verdict.answers.items()
        },
        request=request,
        tenant=tenant,
        client=client,
    )


async def _built_item(verdict: Verdict, **kwargs: Any) -> tuple[ReviewItem, str]:
    """A new item for ``verdict`` (:func:`_new_item`) and its view as JSON (:func:`_view_json`), built on a thread:
    redacting the state and writing the view walk every key and string of the body (about a second for one of 30,000
    keys), which on the event loop would hold every other request."""

    def build() -> tuple[ReviewItem, str]:
        item = _new_item(verdict, **kwargs)
        return item, _view_json(item)

    return await asyncio.to_thread(build)


#: The longest item lifetime, seconds (ten years): a longer one (1e300) is past the expiry Redis can set, and every
#: escalation to a Redis store would fail.
_MAX_TTL_S = 10 * 365 * 24 * 3600.0


def _check_ttl(ttl_s: float) -> float:
    if not 0 < ttl_s <= _MAX_TTL_S:
        raise ValueError(f"ttl_s is {ttl_s}; it must be a positive number of seconds, at most {_MAX_TTL_S:.0f} "
                         "(ten years)")
    return float(ttl_s)


def _check_budgets(max_bytes: int, max_bytes_per_client: int) -> None:
    if max_bytes < 1 or max_bytes_per_client < 1:
        raise ValueError(f"max_bytes ({max_bytes}) and max_bytes_per_client ({max_bytes_per_client}) must be at "
                         "least 1")


_CORE_FIELDS = ("id", "created_at", "expires_at", "decision_id", "policy_id", "policy_version", "rule", "message",
                "subject", "state", "answers", "tenant", "client")


#: A surrogate code point (a lone one, from an agent's tool arguments or ``os.fsdecode``), which UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _view_json(item: ReviewItem) -> str:
    """The item's view (:data:`_CORE_FIELDS`) as JSON: what a Redis item keeps in clear as ``core``. Text is kept as
    it is (UTF-8 in Redis: a ``\\u`` escape for each character would make a view of non-Latin text up to six times
    its size), but for surrogate code points, written as ``\\uXXXX`` escapes (they can only stand inside a string,
    where the escape means the same), so the view always encodes."""
    text = json.dumps({k: getattr(item, k) for k in _CORE_FIELDS}, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _request_json(request: dict[str, Any]) -> str:
    """The held request as JSON (ASCII: one character a byte): what a Redis item keeps encrypted."""
    return json.dumps(request, separators=(",", ":"))


def _item_bytes(view: str, request: str | None) -> tuple[int, int]:
    """What an item counts against the byte budgets: its view's bytes (UTF-8) and its held request's (0 without one),
    as the store keeps them (JSON; in Redis the request encrypted)."""
    return len(view.encode("utf-8")), len(request or "")


def _bytes_quota(used: int, cap: int, size: int, retry_after: float) -> ReviewQuotaExceeded:
    return ReviewQuotaExceeded(NEW_ITEM, f"this client's review items already hold {used} bytes, its limit {cap}; "
                               f"this one needs {size}; wait for a decision on them", retry_after=max(1.0, retry_after))


def _store_full(used: int, cap: int, size: int) -> str:
    return f"the review store's items hold {used} bytes, its limit {cap}; this one needs {size}"


@runtime_checkable
class ReviewStore(Protocol):
    """Where review items live. Every method is atomic per item.

    Raises (all methods): ReviewStoreUnavailable when the store cannot be reached.

    Attributes:
        ttl_s: item lifetime, seconds.

    A store may also have ``health``, a :class:`~guard.engine.health.FailureTracker` of its recent operations
    (``ReviewStoreUnavailable`` a degraded failure), reported as health check ``review_store``; both stores here do.
    """

    ttl_s: float

    async def create(
        self, verdict: Verdict, *, subject: dict[str, Any], digest: str, request: dict[str, Any] | None = None,
        tenant: str | None = None, client: str | None = None,
    ) -> ReviewItem:
        """Store a new ``pending`` item for ``verdict`` and return it. Raises ReviewQuotaExceeded when ``client``
        (with a ``tenant``, that tenant at ``client``) already has ``max_pending_per_client`` pending items."""
        ...

    async def get(self, review_id: str) -> ReviewItem:
        """The item, with its held request. Raises ReviewNotFound."""
        ...

    async def list_items(
        self, status: ReviewStatus | None = "pending", *, limit: int = DEFAULT_LIST_LIMIT,
        tenants: Collection[str] | None = None,
    ) -> list[ReviewItem]:
        """Live items with that status (all when ``None``) and, given ``tenants``, one of those tenants; oldest
        first, without their held requests."""
        ...

    async def approve(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        """pending -> approved. Raises ReviewNotFound, ReviewConflict (not pending)."""
        ...

    async def reject(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        """pending -> rejected. Raises ReviewNotFound, ReviewConflict (not pending)."""
        ...

    async def release(self, review_id: str, digest: str) -> ReviewItem:
        """approved -> released, once, for the same content. Raises ReviewNotFound, ReviewConflict (not approved,
        already released, or ``digest`` differs from the item's)."""
        ...

    async def aclose(self) -> None:
        """Close connections the store owns. Idempotent."""
        ...


def _conflict(item_id: str, status: str, wanted: str) -> ReviewConflict:
    if wanted == "approved" and status == "released":
        return ReviewConflict(item_id, status, "the item was already released; a release is single-use")
    return ReviewConflict(item_id, status, f"the item is {status}; this change needs it to be {wanted}")


def _digest_conflict(item_id: str, status: str) -> ReviewConflict:
    return ReviewConflict(item_id, status, "the content or the client differs from what was reviewed (digest mismatch)")


def _quota(client: str, count: int, cap: int, retry_after: float) -> ReviewQuotaExceeded:
    return ReviewQuotaExceeded(NEW_ITEM, f"this client already has {count} pending review items, its limit {cap}; "
                               "wait for a decision on them", retry_after=max(1.0, retry_after))


def _wrong_type(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Redis's WRONGTYPE reply (a command on a key that holds another type), alone or as the
    error redis-py raises for one command of a pipeline."""
    from redis.exceptions import ResponseError

    return isinstance(exc, ResponseError) and (str(exc).startswith("WRONGTYPE")
                                               or " of pipeline caused error: WRONGTYPE" in str(exc))


def _kind_of(key: str) -> str:
    """The Redis type the store keeps at one of its own keys beside the items (:class:`RedisReviewStore`): a hash
    for a byte budget's sizes (``...:sizes``), a sorted set for the rest (indexes, pending slots, budget expiries)."""
    return "hash" if key.endswith(":sizes") else "zset"


def _in_scope(item: ReviewItem, tenants: Collection[str] | None) -> bool:
    return tenants is None or (item.tenant is not None and item.tenant in tenants)


class MemoryReviewStore:
    """A review store in this process's memory: for one process, tests, and when no Redis is configured.

    Args:
        ttl_s: item lifetime, seconds.
        max_items: most live items held; creating another raises ReviewStoreUnavailable (fail closed).
        max_pending_per_client: most pending items one client may have; another raises ReviewQuotaExceeded.
        max_bytes: most bytes the live items hold together (see :data:`DEFAULT_MAX_BYTES`); creating one that would
            pass it raises ReviewStoreUnavailable (fail closed).
        max_bytes_per_client: most bytes one client's live items hold; one more raises ReviewQuotaExceeded.

    Attributes:
        held_bytes: the bytes the items hold together (:data:`DEFAULT_MAX_BYTES`; expired ones until purged).
    """

    def __init__(self, *, ttl_s: float = DEFAULT_REVIEW_TTL_S, max_items: int = DEFAULT_MAX_ITEMS,
                 max_pending_per_client: int = DEFAULT_MAX_PENDING_PER_CLIENT, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_bytes_per_client: int = DEFAULT_MAX_BYTES_PER_CLIENT) -> None:
        self.ttl_s = _check_ttl(ttl_s)
        if max_items < 1 or max_pending_per_client < 1:
            raise ValueError(f"max_items ({max_items}) and max_pending_per_client ({max_pending_per_client}) must "
                             "be at least 1")
        _check_budgets(max_bytes, max_bytes_per_client)
        self.max_items = max_items
        self.max_pending_per_client = max_pending_per_client
        self.max_bytes = max_bytes
        self.max_bytes_per_client = max_bytes_per_client
        self.health = FailureTracker()
        self._items: dict[str, ReviewItem] = {}
        self._pending: dict[str, list[ReviewItem]] = {}  # client -> its pending items, oldest first
        self._sizes: dict[str, tuple[int, int]] = {}  # id -> the bytes its view and its held request count
        self._decided: set[str] = set()  # ids rejected or released: their bytes no longer count against their client
        self.held_bytes = 0
        self._client_bytes: dict[str, int] = {}  # client -> its live items' bytes

    def __repr__(self) -> str:
        return f"MemoryReviewStore(ttl_s={self.ttl_s}, max_items={self.max_items}, items={len(self._items)})"

    def _unpend(self, item: ReviewItem) -> None:
        """Forget ``item`` in its client's pending list (decided or expired)."""
        quota = _counted_as(item)
        if quota is None or item.status != "pending":
            return
        mine = self._pending.get(quota, [])
        self._pending[quota] = [i for i in mine if i.id != item.id]
        if not self._pending[quota]:
            del self._pending[quota]

    def _count(self, item: ReviewItem, delta: int, *, store: bool = True) -> None:
        """Add ``delta`` bytes (negative: freed) to the store's (unless not ``store``) and, unless ``item`` was
        decided (rejected or released), its client's held bytes."""
        if store:
            self.held_bytes += delta
        quota = _counted_as(item)
        if quota is not None and item.id not in self._decided:
            left = self._client_bytes.get(quota, 0) + delta
            if left:
                self._client_bytes[quota] = left
            else:
                self._client_bytes.pop(quota, None)

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._unpend(item)
            self._count(item, -sum(self._sizes.pop(key, (0, 0))))
            self._decided.discard(key)

    def _purge(self) -> None:
        now = time.time()
        for key in [k for k, item in self._items.items() if item.expires_at <= now]:
            self._drop(key)

    def _live(self, review_id: str) -> ReviewItem:
        item = self._items.get(review_id)
        if item is None or item.expires_at <= time.time():
            self._drop(review_id)
            raise ReviewNotFound(review_id)
        return item

    def _check_quota(self, client: str | None) -> None:
        if client is None:
            return
        now = time.time()
        mine = [i for i in self._pending.get(client, []) if i.expires_at > now]
        if len(mine) >= self.max_pending_per_client:
            raise _quota(client, len(mine), self.max_pending_per_client, mine[0].expires_at - now)

    def _client_bytes_over(self, client: str | None, size: int) -> bool:
        return client is not None and self._client_bytes.get(client, 0) + size > self.max_bytes_per_client

    async def create(
        self, verdict: Verdict, *, subject: dict[str, Any], digest: str, request: dict[str, Any] | None = None,
        tenant: str | None = None, client: str | None = None,
    ) -> ReviewItem:
        item, view = await _built_item(verdict, subject=subject, digest=digest, request=request, ttl_s=self.ttl_s,
                                       tenant=tenant, client=client)
        # checked once built, with no await before the item is kept: concurrent creates cannot both pass the quota
        quota = _quota_key(tenant, client)
        self._check_quota(quota)
        sizes = _item_bytes(view, _request_json(request) if request is not None else None)
        size = sum(sizes)
        if (len(self._items) >= self.max_items or self.held_bytes + size > self.max_bytes
                or self._client_bytes_over(quota, size)):
            self._purge()
        if quota is not None and self._client_bytes_over(quota, size):
            now = time.time()
            first = min((i.expires_at for i in self._items.values() if (i.client, i.tenant) == (client, tenant)),
                        default=now + self.ttl_s)
            raise _bytes_quota(self._client_bytes.get(quota, 0), self.max_bytes_per_client, size, first - now)
        if len(self._items) >= self.max_items or self.held_bytes + size > self.max_bytes:
            full = (f"the in-memory review store holds {len(self._items)} items, its limit {self.max_items}"
                    if len(self._items) >= self.max_items else _store_full(self.held_bytes, self.max_bytes, size))
            self.health.failure("review_store_full", full, severity="degraded")
            raise ReviewStoreUnavailable(NEW_ITEM, full)
        self.health.success()
        self._items[item.id] = item
        self._sizes[item.id] = sizes
        self._count(item, size)
        if quota is not None:
            self._pending.setdefault(quota, []).append(item)
        return item

    async def get(self, review_id: str) -> ReviewItem:
        return self._live(review_id)

    async def list_items(
        self, status: ReviewStatus | None = "pending", *, limit: int = DEFAULT_LIST_LIMIT,
        tenants: Collection[str] | None = None,
    ) -> list[ReviewItem]:
        self._purge()
        items = [i for i in self._items.values()
                 if (status is None or i.status == status) and _in_scope(i, tenants)]
        items.sort(key=lambda i: i.created_at)
        return [replace(i, request=None) for i in items[:limit]]

    def _decide(self, review_id: str, to: ReviewStatus, by: str | None, note: str | None) -> ReviewItem:
        item = self._live(review_id)
        if item.status != "pending":
            raise _conflict(review_id, item.status, "pending")
        self._unpend(item)
        item = replace(item, status=to, decided_by=by, decided_at=time.time(), note=note,
                       request=item.request if to == "approved" else None)
        self._items[review_id] = item
        if to == "rejected":
            self._free_request(item)
        return item

    def _free_request(self, item: ReviewItem) -> None:
        """``item`` no longer holds its request (rejected or released): its request's bytes are freed, and the item
        leaves its client's budget (a decided item is kept for reviewers until it expires: its client could not free
        it); its view's bytes stay in the store's."""
        view, request = self._sizes.get(item.id, (0, 0))
        self._sizes[item.id] = (view, 0)
        self._count(item, -request)
        self._count(item, -view, store=False)
        self._decided.add(item.id)

    async def approve(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        return self._decide(review_id, "approved", by, note)

    async def reject(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        return self._decide(review_id, "rejected", by, note)

    async def release(self, review_id: str, digest: str) -> ReviewItem:
        item = self._live(review_id)
        if item.status != "approved":
            raise _conflict(review_id, item.status, "approved")
        if not secrets.compare_digest(item.digest, digest):
            raise _digest_conflict(review_id, item.status)
        item = replace(item, status="released", released_at=time.time(), request=None)
        self._items[review_id] = item
        self._free_request(item)
        return item

    async def aclose(self) -> None:
        return None


def _hashed(name: str) -> str:
    """A client or tenant name as a fixed-size key part (no name a client sends reaches the store's key syntax)."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _sealed(fields: list[str | None]) -> bytes:
    """What a Redis item's seal covers: status, core, digest, decided, released_at and request, as stored."""
    return json.dumps([f or "" for f in fields[:6]], separators=(",", ":")).encode()


class RedisReviewStore:
    """A review store in Redis, shared by every replica: one hash per item with a TTL; per status an index of its
    items by expiry (``<prefix>index:<status>``, and ``<prefix>index:<status>:<sha256 of the tenant>`` for an item
    with a tenant), moved with the status in the transition script, so a listing reads only the items it returns;
    and per client (per tenant and client with a tenant) the ids of its pending items
    (``<prefix>pending:<sha256 of the client>``, for the per-client cap).
    The byte budgets are kept beside them, the store's and each client's: the live items by expiry
    (``<prefix>bytes``, ``<prefix>bytes:<sha256 of the client>``) and their bytes with the total (the same key with
    ``:sizes``). A Lua script sweeps the expired entries, checks and counts a new item in one step, so replicas
    creating at once cannot pass a budget together; a rejection or release frees the request's bytes in the
    transition script; expiry frees the rest when the next create sweeps it.

    What Redis holds of an item in clear is its redacted view (summary, redacted state, answers, status); the held
    request (headers, query and body, which a release replays) is encrypted with AES-256-GCM under a key derived
    from the store key, bound to the item's Redis key, and deleted when the item is rejected or released.

    Args:
        client: a ``redis.asyncio.Redis`` client (any ``decode_responses`` setting).
        prefix: key prefix (see :data:`DEFAULT_REVIEW_PREFIX`).
        ttl_s: item lifetime, seconds (Redis expires the key).
        owns_client: close ``client`` in :meth:`aclose` (set by :meth:`from_url`).
        store_key: the secret items are sealed and their requests encrypted with (at least 16 bytes); ``None`` =
            ``$GUARD_STORE_KEY``. Every replica sharing the store needs the same one.
        max_pending_per_client: most pending items one client may have; another raises ReviewQuotaExceeded.
        max_bytes: most bytes the live items of the store hold together, every replica's (see
            :data:`DEFAULT_MAX_BYTES`); creating one that would pass it raises ReviewStoreUnavailable (fail closed).
        max_bytes_per_client: most bytes one client's live items hold; one more raises ReviewQuotaExceeded.

    A seal proves who wrote a state, not that it is the latest: someone who can write to Redis can put back a copy of
    an item's earlier sealed state (approved after its release, pending after its rejection). Each store therefore
    remembers, until they expire, the items it saw rejected or released (at most :data:`MAX_SETTLED`), and refuses
    an earlier state of one as ``tampered``. Another replica that never saw the item settled cannot tell; limit who
    can write the review prefix in Redis (ACLs) to close that.

    A key the store keeps beside the items (an index, a client's pending slots, a byte budget) that holds another
    type than the store writes there is deleted when a command meets it (logged, and named in ``health``), and the
    command runs again, so one hand-written key cannot take every listing and escalation down. The transition
    script checks every key it writes before its first write (Redis does not undo a script's writes when a later
    command fails): a change that meets such a key is refused as ``tampered`` with nothing written.

    A transition whose reply is lost (a read timeout or a connection cut after the script was sent: Redis may have
    run it) is not taken as failed: each carries a nonce of its own (an approval or rejection in its sealed
    ``decided``, which the release that may follow keeps; a release, an item's last change, in the item's ``change``
    field beside its seal), and the item is read again (:data:`LOST_REPLY_WAITS`), its seal checked. Holding this
    change's ``decided``, or this release's seal and nonce, the change was made and is returned as made (an approval
    also when the item was released since); changed otherwise, it was not (a conflict: the script needs the seal it
    read); still as it was read, or not readable, the change may yet be made, and
    :class:`~guard.errors.ReviewOutcomeUnknown` says so. A change is made at most once either way.

    Attributes:
        tampered: items refused so far because their seal did not check or they were put back to an earlier state.

    Raises:
        ValueError: no store key, or a short one.
    """

    # KEYS[1] = item hash, KEYS[2] = the sending client's pending set the item leaves (KEYS[1] again when none),
    # KEYS[3..6] = the store's and the item's client's byte budget keys (the store's again when none), then pairs of
    # index keys (the one the item leaves, the one it joins). ARGV[1] = required status, ARGV[2] = new status,
    # ARGV[3] = required digest or "", ARGV[4] = required seal (the one just read and checked), ARGV[5] = item id,
    # ARGV[6] = its expiry (the index score), ARGV[7] = the bytes of its request freed (deleted; "0" when kept: else
    # the store's budget frees them and the item leaves its client's budget whole, as a decided item is kept for
    # reviewers until it expires and its client could not free it),
    # ARGV[8..] = field/value pairs to set (the new seal among them; a release's nonce too). Returns {code, current
    # status}: 0 missing, 1 wrong status, 2 digest mismatch, 3 changed, 4 the item changed since it was read; 5 (then
    # the keys) keys beside the item hold another type than the store writes there (sizes hashes at KEYS[4] and
    # KEYS[6], sorted sets elsewhere): checked before any write, as Redis does not undo a script's writes when a later
    # command fails, so nothing is written then. HSET keeps the key's TTL.
    TRANSITION_SCRIPT = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
if cur ~= ARGV[1] then return {1, cur} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'digest') ~= ARGV[3] then return {2, cur} end
if redis.call('HGET', KEYS[1], 'seal') ~= ARGV[4] then return {4, cur} end
local wrong = {5, cur}
for i = 2, #KEYS do
  local kind = (i == 4 or i == 6) and 'hash' or 'zset'
  local found = redis.call('TYPE', KEYS[i]).ok
  if KEYS[i] ~= KEYS[1] and found ~= 'none' and found ~= kind then wrong[#wrong + 1] = KEYS[i] end
end
if #wrong > 2 then return wrong end
if ARGV[7] ~= '0' then
  if redis.call('ZSCORE', KEYS[3], ARGV[5]) then
    redis.call('HINCRBY', KEYS[4], ARGV[5], -ARGV[7])
    redis.call('HINCRBY', KEYS[4], 'total', -ARGV[7])
  end
  if KEYS[5] ~= KEYS[3] and redis.call('ZREM', KEYS[5], ARGV[5]) == 1 then
    redis.call('HINCRBY', KEYS[6], 'total', -(tonumber(redis.call('HGET', KEYS[6], ARGV[5])) or 0))
    redis.call('HDEL', KEYS[6], ARGV[5])
  end
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 8))
if KEYS[2] ~= KEYS[1] then redis.call('ZREM', KEYS[2], ARGV[5]) end
for i = 7, #KEYS, 2 do
  redis.call('ZREM', KEYS[i], ARGV[5])
  redis.call('ZADD', KEYS[i + 1], ARGV[6], ARGV[5])
end
return {3, ARGV[2]}
"""
    # drop(index, sizes, id): item ``id`` leaves one byte budget (its expiry index and sizes hash), its bytes freed.
    _DROP_LUA = """
local function drop(index, sizes, id)
  if redis.call('ZREM', index, id) == 1 then
    redis.call('HINCRBY', sizes, 'total', -(tonumber(redis.call('HGET', sizes, id)) or 0))
    redis.call('HDEL', sizes, id)
  end
end
"""
    # Each key of KEYS holding another type than ARGV (the same position: zset or hash) and not absent is deleted.
    # Returns the deleted keys, each followed by the type it held.
    REPAIR_SCRIPT = """
local found = {}
for i = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= 'none' and kind ~= ARGV[i] then
    redis.call('DEL', KEYS[i])
    found[#found + 1] = KEYS[i]
    found[#found + 1] = kind
  end
end
return found
"""
    # Item ARGV[1] leaves each byte budget of KEYS (pairs: expiry index, sizes hash).
    GIVE_BACK_SCRIPT = _DROP_LUA + """
for p = 1, #KEYS, 2 do drop(KEYS[p], KEYS[p + 1], ARGV[1]) end
"""
    # KEYS = pairs (expiry index, sizes hash) of the byte budgets: the store's, then the client's when there is one.
    # ARGV[1] = now (Unix seconds), ARGV[2] = item id, ARGV[3] = its bytes, ARGV[4] = its expiry (Unix seconds),
    # ARGV[5], ARGV[6] = the budgets, in the pairs' order. Sweeps each budget's expired entries (at most 1000 a call:
    # one not swept yet still counts, so a budget is never passed), then counts the item in every budget if it fits
    # in all. Returns {0} counted, or {n, bytes held, earliest expiry} when it does not fit budget n (1: the store,
    # 2: the client). A key lives until its latest entry expires.
    HOLD_SCRIPT = _DROP_LUA + """
local now, size = tonumber(ARGV[1]), tonumber(ARGV[3])
for p = 1, #KEYS / 2 do
  local index, sizes = KEYS[2 * p - 1], KEYS[2 * p]
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, 1000)) do
    drop(index, sizes, id)
  end
  local held = tonumber(redis.call('HGET', sizes, 'total')) or 0
  if held + size > tonumber(ARGV[4 + p]) then
    local first = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
    return {p, held, first[2] or ARGV[4]}
  end
end
local at = math.floor(tonumber(ARGV[4]) * 1000)
for p = 1, #KEYS / 2 do
  local index, sizes = KEYS[2 * p - 1], KEYS[2 * p]
  redis.call('ZADD', index, ARGV[4], ARGV[2])
  redis.call('HSET', sizes, ARGV[2], ARGV[3])
  redis.call('HINCRBY', sizes, 'total', ARGV[3])
  for _, key in ipairs({index, sizes}) do
    local ttl = redis.call('PTTL', key)
    if ttl < 0 or now * 1000 + ttl < at then redis.call('PEXPIREAT', key, at) end
  end
end
return {0}
"""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_REVIEW_PREFIX,
        ttl_s: float = DEFAULT_REVIEW_TTL_S,
        owns_client: bool = False,
        store_key: bytes | str | None = None,
        max_pending_per_client: int = DEFAULT_MAX_PENDING_PER_CLIENT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_bytes_per_client: int = DEFAULT_MAX_BYTES_PER_CLIENT,
    ) -> None:
        self.ttl_s = _check_ttl(ttl_s)
        if max_pending_per_client < 1:
            raise ValueError(f"max_pending_per_client is {max_pending_per_client}; it must be at least 1")
        _check_budgets(max_bytes, max_bytes_per_client)
        self.max_pending_per_client = max_pending_per_client
        self.max_bytes = max_bytes
        self.max_bytes_per_client = max_bytes_per_client
        self._sealer = Sealer.resolve(store_key, "RedisReviewStore")
        self.tampered = 0
        self.health = FailureTracker()
        self.prefix = prefix
        self._client = client
        self._owns_client = owns_client
        self._settled: dict[str, float] = {}  # id -> expiry of the items seen rejected or released

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str = DEFAULT_REVIEW_PREFIX, ttl_s: float = DEFAULT_REVIEW_TTL_S,
        timeout_s: float = 0.5, store_key: bytes | str | None = None,
        max_pending_per_client: int = DEFAULT_MAX_PENDING_PER_CLIENT, max_bytes: int = DEFAULT_MAX_BYTES,
        max_bytes_per_client: int = DEFAULT_MAX_BYTES_PER_CLIENT,
    ) -> RedisReviewStore:
        """A store with its own client for ``url`` (``redis://:PASSWORD@host`` or ``rediss://`` for TLS); socket
        connect/read timeouts of ``timeout_s`` seconds (unless the URL sets them).

        Raises:
            ValueError: ``url`` is not one redis-py can connect with, checked as the cache's
                (:func:`~guard.engine.cache.redis_options`: a database path that is not a number, ``/nine``, is
                refused, not read as database 0).
        """
        import redis.asyncio as aioredis

        from guard.engine.cache import redis_options

        options = redis_options(url, timeout_s, role="review store")
        client = aioredis.Redis.from_pool(aioredis.ConnectionPool(**options))  # closes its pool
        return cls(client, prefix=prefix, ttl_s=ttl_s, owns_client=True, store_key=store_key,
                   max_pending_per_client=max_pending_per_client, max_bytes=max_bytes,
                   max_bytes_per_client=max_bytes_per_client)

    def __repr__(self) -> str:
        return f"RedisReviewStore(prefix={self.prefix!r}, ttl_s={self.ttl_s})"

    def _key(self, review_id: str) -> str:
        """The item's Redis key.

        Raises:
            ReviewNotFound: ``review_id`` is not of an item's shape (``rv_`` + 24 hex digits), so no id a client
                sends reaches the store's own keys (its expiry index, its per-client counters).
        """
        if not _REVIEW_ID.fullmatch(review_id):
            raise ReviewNotFound(review_id)
        return f"{self.prefix}{review_id}"

    def _pending_key(self, client: str) -> str:
        return f"{self.prefix}pending:{_hashed(client)}"

    def _budget_keys(self, client: str | None) -> list[str]:
        """The byte budgets' keys (expiry index, sizes hash): the store's, then ``client``'s when there is one."""
        names = [f"{self.prefix}bytes"] + ([f"{self.prefix}bytes:{_hashed(client)}"] if client is not None else [])
        return [key for name in names for key in (name, f"{name}:sizes")]

    def _index(self, status: str, tenant: str | None = None) -> str:
        """The index of the items with ``status``: of every tenant, or of ``tenant``'s only."""
        return f"{self.prefix}index:{status}" + (f":{_hashed(tenant)}" if tenant is not None else "")

    def _indexes(self, status: str, tenant: str | None) -> list[str]:
        """The indexes an item of ``status`` and ``tenant`` is in."""
        return [self._index(status)] + ([self._index(status, tenant)] if tenant is not None else [])

    async def _call(self, review_id: str, coro: Any, *, one_item: bool = False) -> Any:
        """``coro``'s result. Raises ReviewStoreUnavailable for a Redis or socket error (counted in ``health``);
        with ``one_item`` (a command on item ``review_id``'s key alone), ReviewConflict ``tampered`` for Redis's
        WRONGTYPE reply: that key holds another type, written by hand, and the store itself answered."""
        from redis.exceptions import RedisError

        try:
            result = await coro
        except (RedisError, OSError) as exc:
            if one_item and _wrong_type(exc):
                self.health.success()
                raise self._tampered(review_id) from None
            raise self._unavailable(review_id, exc) from exc
        self.health.success()
        return result

    async def _owned(self, review_id: str, keys: Collection[str], command: Callable[[], Awaitable[Any]]) -> Any:
        """``command()``'s result (through :meth:`_call`), ``command`` writing the store's own ``keys`` beside the
        items (indexes, pending slots, byte budgets). On Redis's WRONGTYPE reply, those of ``keys`` that hold another
        type are reset (:meth:`_repair`) and ``command()`` runs once more; when none was, the failure is raised.

        Raises:
            ReviewStoreUnavailable: Redis failed (again).
        """
        try:
            return await self._call(review_id, command())
        except ReviewStoreUnavailable as exc:
            if not _wrong_type(exc.__cause__) or not await self._repair(review_id, keys):
                raise
        return await self._call(review_id, command())

    async def _repair(self, review_id: str, keys: Collection[str]) -> bool:
        """Delete each of ``keys`` (the store's own beside the items, never an item) that holds another type than the
        store keeps there (:func:`_kind_of`): written outside guard, it holds nothing the store wrote, and every
        command the store runs on it fails. Each one is logged and reported in ``health`` by name. Returns whether
        any was deleted.

        Raises:
            ReviewStoreUnavailable: Redis failed.
        """
        keys = list(dict.fromkeys(keys))
        found = await self._call(review_id, self._client.execute_command(
            "EVAL", self.REPAIR_SCRIPT, len(keys), *keys, *map(_kind_of, keys), **_AS_BYTES))
        for raw_key, raw_kind in zip(found[::2], found[1::2], strict=True):
            key, kind = self._text(raw_key, "replace"), self._text(raw_kind, "replace")
            logger.warning("review store key %s held a %s, not the %s the store keeps there (written outside guard); "
                           "deleted", key, kind, _kind_of(key or ""))
            self.health.failure("review_key_wrong_type", f"{key} held a {kind}, not a {_kind_of(key or '')} "
                                "(written outside guard): deleted, so the store works again", severity="degraded")
        return bool(found)

    def _unavailable(self, review_id: str, exc: BaseException) -> ReviewStoreUnavailable:
        """Count ``exc`` as a store failure in ``health``; the ReviewStoreUnavailable to raise."""
        self.health.failure("review_store_unavailable", f"{type(exc).__name__}: {exc}", severity="degraded")
        return ReviewStoreUnavailable(review_id, f"Redis failed: {type(exc).__name__}: {exc}")

    @staticmethod
    def _text(value: Any, errors: str = "strict") -> str | None:
        """A reply value as text (``None`` stays ``None``). Raises UnicodeDecodeError for bytes that are not UTF-8
        when ``errors`` is ``strict``."""
        if value is None:
            return None
        return value.decode("utf-8", errors) if isinstance(value, bytes) else str(value)

    def _hmget(self, target: Any, review_id: str) -> Any:
        """HMGET of the item's :attr:`_FIELDS` on ``target`` (the client or a pipeline), replied as bytes."""
        return target.execute_command("HMGET", self._key(review_id), *self._FIELDS, **_AS_BYTES)

    def _checked(self, review_id: str, raw: list[Any]) -> list[str | None] | None:
        """The item's fields as text (:attr:`_FIELDS` order), ``None`` when it is absent.

        Raises:
            ReviewConflict: status ``tampered``: the seal does not check, or a field is not UTF-8 (a store writes
                only UTF-8).
        """
        if raw[0] is None:
            return None
        try:
            texts: list[str | None] | None = [self._text(v) for v in raw]
        except UnicodeDecodeError:
            texts = None
        seal = texts[-1] if texts is not None else None
        if texts is None or seal is None or not self._sealer.check(self._key(review_id), _sealed(texts), seal):
            raise self._tampered(review_id)
        return texts

    def _tampered(self, review_id: str) -> ReviewConflict:
        """Count and log an item edited in Redis without the store key; the ``tampered`` conflict to raise."""
        self.tampered += 1
        logger.warning("review item %s fails its integrity check (edited in Redis); refusing it", review_id)
        return ReviewConflict(review_id, "tampered", "the item fails its integrity check (edited in the store without "
                              "the store key); it cannot be approved or released")

    def _decode(self, texts: list[str | None], *, with_request: bool) -> ReviewItem:
        status, core, digest, decided, released_at, request, _ = texts
        data = json.loads(core or "{}")
        extra = json.loads(decided) if decided else {}
        return ReviewItem(
            **{k: data.get(k) for k in _CORE_FIELDS},
            status=status,  # type: ignore[arg-type]
            digest=digest or "",
            decided_by=extra.get("by"),
            decided_at=extra.get("at"),
            note=extra.get("note"),
            released_at=float(released_at) if released_at else None,
            request=json.loads(self._sealer.decrypt(self._key(data["id"]), request)) if (with_request and request)
            else None,
        )

    _FIELDS = ("status", "core", "digest", "decided", "released_at", "request", "seal")

    async def _reserve(self, client: str, item: ReviewItem) -> None:
        """Take one of ``client``'s pending slots for ``item``: added and counted in one transaction, so concurrent
        creates cannot all pass the cap (each sees the count with its own item in it); one over the cap gives its
        slot back and raises ReviewQuotaExceeded. Over the cap, the slots are read (as bytes): an entry that is not an
        item id (a store writes only ids) is tampered, counted, dropped and not held against the client."""
        key, now = self._pending_key(client), time.time()

        def take() -> Awaitable[list[Any]]:
            pipe = self._client.pipeline(transaction=True)
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {item.id: item.expires_at})
            pipe.pexpireat(key, int(item.expires_at * 1000))
            pipe.zcard(key)
            return pipe.execute()

        *_, count = await self._owned(NEW_ITEM, [key], take)
        if int(count) <= self.max_pending_per_client:
            return
        rows = await self._call(NEW_ITEM, self._client.execute_command(
            "ZRANGE", key, 0, -1, "WITHSCORES", withscores=True, score_cast_func=float, **_AS_BYTES))
        junk = [raw for raw, _ in rows if not _REVIEW_ID.fullmatch(raw.decode("utf-8", "replace"))]
        if junk:
            self.tampered += len(junk)
            logger.warning("%d entries of a client's pending slots are not item ids (edited in Redis); dropping them",
                           len(junk))
            await self._call(NEW_ITEM, self._client.zrem(key, *junk))
        held = [score for raw, score in rows if raw not in junk]
        if len(held) > self.max_pending_per_client:
            await self._call(NEW_ITEM, self._client.zrem(key, item.id))
            raise _quota(client, len(held) - 1, self.max_pending_per_client, held[0] - now)

    async def create(
        self, verdict: Verdict, *, subject: dict[str, Any], digest: str, request: dict[str, Any] | None = None,
        tenant: str | None = None, client: str | None = None,
    ) -> ReviewItem:
        item, core = await _built_item(verdict, subject=subject, digest=digest, request=request, ttl_s=self.ttl_s,
                                       tenant=tenant, client=client)
        quota = _quota_key(tenant, client)
        if quota is not None:
            await self._reserve(quota, item)
        key = self._key(item.id)
        held = self._sealer.encrypt(key, _request_json(request).encode()) if request is not None else None
        try:
            await self._hold(item, sum(_item_bytes(core, held)))
        except ReviewError:
            await self._give_back(item, [])
            raise
        seal = self._sealer.seal(key, _sealed([item.status, core, digest, None, None, held]))
        mapping: dict[Any, Any] = {"status": item.status, "core": core, "digest": digest, "seal": seal}
        if held is not None:
            mapping["request"] = held
        indexes = self._indexes(item.status, tenant)

        def write() -> Awaitable[list[Any]]:
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(key, mapping=mapping)
            pipe.pexpireat(key, int(item.expires_at * 1000))
            for index in indexes:
                pipe.zadd(index, {item.id: item.expires_at})
                pipe.zremrangebyscore(index, "-inf", time.time())
            return pipe.execute()

        try:  # a failure names no id (NEW_ITEM): the item was not stored, or not whole, so no answer may name it
            await self._owned(NEW_ITEM, indexes, write)
        except ReviewStoreUnavailable:
            await self._give_back(item, self._budget_keys(quota))
            raise
        return item

    async def _hold(self, item: ReviewItem, size: int) -> None:
        """Count ``item``'s ``size`` bytes in the store's and its client's byte budgets (:attr:`HOLD_SCRIPT`).

        Raises:
            ReviewQuotaExceeded: the client's budget has no room for it.
            ReviewStoreUnavailable: the store's budget has no room for it (fail closed), or Redis failed.
        """
        keys, now = self._budget_keys(_counted_as(item)), time.time()
        reply = await self._owned(NEW_ITEM, keys, lambda: self._client.execute_command(
            "EVAL", self.HOLD_SCRIPT, len(keys), *keys, repr(now), item.id, size, repr(item.expires_at),
            self.max_bytes, self.max_bytes_per_client, **_AS_BYTES))
        if int(reply[0]) == 1:
            full = _store_full(int(reply[1]), self.max_bytes, size)
            self.health.failure("review_store_full", full, severity="degraded")
            raise ReviewStoreUnavailable(NEW_ITEM, full)
        if int(reply[0]) == 2:
            raise _bytes_quota(int(reply[1]), self.max_bytes_per_client, size, float(reply[2]) - now)

    async def _give_back(self, item: ReviewItem, budgets: list[str]) -> None:
        """Give back what creating ``item`` took for an item that was not stored: its client's pending slot and its
        bytes in ``budgets`` (:meth:`_budget_keys`). When Redis cannot take them back now, they are freed when
        their entries expire."""
        pipe = self._client.pipeline(transaction=False)
        if (quota := _counted_as(item)) is not None:
            pipe.zrem(self._pending_key(quota), item.id)
        if budgets:
            pipe.execute_command("EVAL", self.GIVE_BACK_SCRIPT, len(budgets), *budgets, item.id)
        if len(pipe):
            with contextlib.suppress(ReviewStoreUnavailable):
                await self._call(item.id, pipe.execute())

    async def _read(self, review_id: str) -> list[str | None]:
        """The item's checked fields (:meth:`_checked`).

        Raises:
            ReviewNotFound: absent, or past the expiry sealed in it: Redis drops an item by then, so one still there
                was put back by someone who can write to Redis (without the store key it cannot extend the expiry).
            ReviewConflict: status ``tampered`` (also for a key of another type than an item's hash).
        """
        raw = await self._call(review_id, self._hmget(self._client, review_id), one_item=True)
        texts = self._checked(review_id, raw)
        if texts is None or json.loads(texts[1] or "{}").get("expires_at", 0) <= time.time():
            raise ReviewNotFound(review_id)
        if self._put_back(review_id, texts):
            self.tampered += 1
            logger.warning("review item %s is back in an earlier state (%s) after it was settled (put back in Redis); "
                           "refusing it", review_id, texts[0])
            raise ReviewConflict(review_id, "tampered", "the item was rejected or released and is back in an earlier "
                                 "state (put back in the store); it cannot be approved or released")
        return texts

    def _put_back(self, review_id: str, texts: list[str | None]) -> bool:
        """Remember an item read rejected or released; whether it is one this store saw settled that is back in an
        earlier state (a copy put back in Redis, or a row read before this store settled it)."""
        if texts[0] in ("rejected", "released"):
            self._settle(review_id, json.loads(texts[1] or "{}").get("expires_at", 0))
            return False
        return self._settled.get(review_id, 0) > time.time()

    def _settle(self, review_id: str, expires_at: float) -> None:
        """Remember that ``review_id`` was rejected or released, until ``expires_at``. At :data:`MAX_SETTLED` entries
        the expired ones go, and if that frees too little the oldest tenth, so the cost per settle stays constant."""
        if review_id not in self._settled and len(self._settled) >= MAX_SETTLED:
            now = time.time()
            self._settled = {k: v for k, v in self._settled.items() if v > now}
            if len(self._settled) > MAX_SETTLED * 9 // 10:
                for key in list(itertools.islice(self._settled, len(self._settled) - MAX_SETTLED * 9 // 10)):
                    del self._settled[key]
        self._settled[review_id] = expires_at

    async def get(self, review_id: str) -> ReviewItem:
        return self._decode(await self._read(review_id), with_request=True)

    async def list_items(
        self, status: ReviewStatus | None = "pending", *, limit: int = DEFAULT_LIST_LIMIT,
        tenants: Collection[str] | None = None,
    ) -> list[ReviewItem]:
        """Read in expiry order (oldest first where replicas share a TTL) from the indexes of ``status`` (every
        status when ``None``), of every tenant or of each of ``tenants``, merged; an entry whose item is gone,
        tampered or (for one status) of another status is skipped and dropped from that index, and the next read in
        its place, so the items returned are the oldest that match however many others exist. Each index is paged
        by score, so an entry another replica removes meanwhile cannot shift the next page past a live item."""
        keys = [self._index(s, t) for s in ((status,) if status else STATUSES)
                for t in ((None,) if tenants is None else sorted(tenants))]
        now = time.time()

        def sweep() -> Awaitable[list[Any]]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.zremrangebyscore(key, "-inf", now)
            return pipe.execute()

        await self._owned("(list)", keys, sweep)
        chunk = max(limit, 16)
        queued: dict[str, list[tuple[float, str]]] = {key: [] for key in keys}
        after: dict[str, tuple[float, set[str]]] = {key: (float("-inf"), set()) for key in keys}
        exhausted: set[str] = set()
        items: list[ReviewItem] = []
        seen: set[str] = set()
        while len(items) < limit:
            for key in keys:
                if not queued[key] and key not in exhausted:
                    queued[key] = await self._page(key, after, chunk)
                    if len(queued[key]) < chunk:
                        exhausted.add(key)
            picked: list[tuple[str, str]] = []  # (index, id) in expiry order across the indexes
            # the smallest expiry of all queued entries is next in order while every index that may hold more
            # entries still has one queued (an unread entry of it cannot come earlier)
            while len(picked) < chunk:
                ready = [key for key in keys if queued[key]]
                if not ready:
                    break
                key = min(ready, key=lambda k: queued[k][0])
                picked.append((key, queued[key].pop(0)[1]))
                if not queued[key] and key not in exhausted:
                    break
            if not picked:
                break
            fresh = [(key, review_id) for key, review_id in picked if review_id not in seen]
            seen.update(review_id for _, review_id in fresh)
            found = await self._fetch([review_id for _, review_id in fresh])
            stale = [(key, review_id) for key, review_id in fresh
                     if review_id not in found or (status is not None and found[review_id].status != status)]
            if stale:
                pipe = self._client.pipeline(transaction=False)
                for key, review_id in stale:
                    pipe.zrem(key, review_id)
                await self._call("(list)", pipe.execute())
            items += [found[review_id] for _, review_id in fresh if review_id in found
                      and (status is None or found[review_id].status == status) and _in_scope(found[review_id], tenants)]
        return items[:limit]

    async def _page(self, key: str, after: dict[str, tuple[float, set[str]]], count: int) -> list[tuple[float, str]]:
        """The next ``count`` entries of index ``key`` by score, from the last score read on (entries of that score
        read already are left out); ``after[key]`` is updated. An entry that is not UTF-8 (no item id; a store writes
        only ASCII) is dropped from the index and the page read again."""
        score, read = after[key]
        while True:
            rows = await self._call("(list)", self._client.execute_command(
                "ZRANGEBYSCORE", key, score, "+inf", "LIMIT", 0, count + len(read), "WITHSCORES", withscores=True,
                score_cast_func=float, **_AS_BYTES))
            entries: list[tuple[float, str]] = []
            junk = []
            for raw, value in rows:
                try:
                    entries.append((float(value), self._text(raw) or ""))
                except UnicodeDecodeError:
                    junk.append(raw)
            if not junk:
                break
            await self._call("(list)", self._client.zrem(key, *junk))
        entries = [(value, review_id) for value, review_id in entries if not (value == score and review_id in read)]
        entries = entries[:count]
        if entries:
            last = entries[-1][0]
            after[key] = (last, {review_id for value, review_id in entries if value == last}
                          | (read if last == score else set()))
        return entries

    async def _fetch(self, ids: list[str]) -> dict[str, ReviewItem]:
        """The listed view of each item of ``ids`` that exists and whose seal checks, by id (an entry that is not
        an item id, written into an index by hand, is left out; so is an item whose key holds another type than a
        hash, counted as tampered).

        Raises:
            ReviewStoreUnavailable: Redis failed, or refused a read for another reason than the key's type.
        """
        ids = [review_id for review_id in ids if _REVIEW_ID.fullmatch(review_id)]
        if not ids:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for review_id in ids:
            self._hmget(pipe, review_id)
        rows = await self._call("(list)", pipe.execute(raise_on_error=False))  # a command's error is in its row
        items = {}
        for review_id, row in zip(ids, rows, strict=True):
            if isinstance(row, Exception):
                if not _wrong_type(row):
                    raise self._unavailable("(list)", row) from row
                self._tampered(review_id)  # counted and logged, as an item whose seal fails
                continue
            try:
                texts = self._checked(review_id, row)
            except ReviewConflict:  # tampered: counted and logged, never listed for approval
                continue
            if texts is None:
                continue
            if self._put_back(review_id, texts):
                continue  # settled here since (or put back): left out; reading it for a change refuses a put-back
            items[review_id] = self._decode(texts, with_request=False)
        return items

    async def _move(self, review_id: str, need: ReviewStatus, to: ReviewStatus, digest: str,
                    changes: dict[str, str]) -> ReviewItem:
        """Check the item (seal, status, digest), then set ``to`` and ``changes`` with a new seal, atomically if the
        item is still what was read."""
        texts = await self._read(review_id)
        if texts[0] != need:
            raise _conflict(review_id, texts[0] or "", need)
        if digest and not secrets.compare_digest(texts[2] or "", digest):
            raise _digest_conflict(review_id, need)
        fields = {**dict(zip(self._FIELDS, texts)), "status": to, **changes}
        key = self._key(review_id)
        seal = self._sealer.seal(key, _sealed([fields[f] for f in self._FIELDS]))
        # to tell this change from another after a lost reply: an approval or rejection holds a nonce of its own in
        # its ``decided`` (sealed); a release, an item's last change, writes one beside its seal (``change``)
        nonce = None if "decided" in changes else secrets.token_hex(16)
        written = {**changes, "seal": seal, **({"change": nonce} if nonce is not None else {})}
        pairs = [x for name, value in written.items() for x in (name, value)]
        held = self._decode(texts, with_request=False)
        indexes = [x for old, new in zip(self._indexes(need, held.tenant), self._indexes(to, held.tenant), strict=True)
                   for x in (old, new)]
        # the client's pending slot is freed in the same step (KEYS[2]; the item's own key when there is none), and
        # so are the request's bytes when it is deleted
        quota = _counted_as(held)
        pending = self._pending_key(quota) if need == "pending" and quota is not None else key
        budgets = self._budget_keys(quota)
        if quota is None:
            budgets += budgets  # the script's client budget: the store's again, counted once
        freed = len(texts[5] or "") if changes.get("request") == "" else 0
        keys = [key, pending, *budgets, *indexes]
        args = [need, to, digest, texts[-1] or "", review_id, repr(held.expires_at), str(freed), *pairs]
        try:  # replied as bytes: a status edited in Redis since it was read may not be UTF-8
            code, current, *wrong = await self._call(review_id, self._client.execute_command(
                "EVAL", self.TRANSITION_SCRIPT, len(keys), *keys, *args, **_AS_BYTES))
        except ReviewStoreUnavailable as exc:
            if not isinstance(exc.__cause__, (RedisConnectionError, RedisTimeoutError, OSError)):
                raise  # Redis answered (an error reply): the script did not run
            await self._made(review_id, need, to, texts[-1] or "", seal, changes.get("decided"), nonce)
            code, current, wrong = 3, to, []
        current = self._text(current, "replace") or ""  # a status named in a conflict only
        if int(code) == 0:
            raise ReviewNotFound(review_id)
        if int(code) == 1 and current not in STATUSES:  # edited since it was read
            raise self._tampered(review_id)
        if int(code) == 1:
            raise _conflict(review_id, current, need)
        if int(code) == 2:
            raise _digest_conflict(review_id, current)
        if int(code) == 4:
            raise ReviewConflict(review_id, current, "the item changed while this change was made; read it again")
        if int(code) == 5:  # nothing was written: the item keeps its status
            await self._repair(review_id, [self._text(k, "replace") or "" for k in wrong])
            raise ReviewConflict(review_id, "tampered", "a key the review store keeps beside the item (an index, a "
                                 "pending slot or a byte budget) held another type (edited in the store); nothing "
                                 "was changed and the key was reset: try again")
        item = self._decode([fields[f] for f in self._FIELDS], with_request=True)
        if to in ("rejected", "released"):
            self._settle(review_id, item.expires_at)
        return item

    async def _made(self, review_id: str, need: ReviewStatus, to: ReviewStatus, read_seal: str, seal: str,
                    decided: str | None, nonce: str | None) -> None:
        """After the reply to the transition to ``to`` was lost: read the item again (after each wait of
        :data:`LOST_REPLY_WAITS`), its seal checked, and return once it shows the change made: for an approval or a
        rejection, it holds the change's own ``decided`` (sealed, with the change's nonce in it, and kept by the
        release that may follow an approval before the item is read); for a release (no later change), it holds
        ``seal`` and the release's ``nonce`` beside it.

        Raises:
            ReviewNotFound: the item is gone.
            ReviewConflict: the item changed otherwise (another change was made; this one no longer can be: the script
                needs ``read_seal``), or fails its seal check (``tampered``).
            ReviewOutcomeUnknown: the item is still as it was read (the change may be on its way still), or Redis did
                not answer: whether the change was made is unknown.
        """
        for wait in LOST_REPLY_WAITS:
            await asyncio.sleep(wait)
            try:
                raw = await self._call(review_id, self._client.execute_command(
                    "HMGET", self._key(review_id), *self._FIELDS, "change", **_AS_BYTES), one_item=True)
            except ReviewStoreUnavailable:
                continue
            texts = self._checked(review_id, raw[:-1])
            if texts is None:
                raise ReviewNotFound(review_id)
            if decided is not None:
                made = texts[3] == decided
            else:
                made = texts[-1] == seal and self._text(raw[-1], "replace") == nonce
            if made:
                logger.warning("review item %s: the reply to its change to %s was lost; read again, the change was "
                               "made", review_id, to)
                return
            if texts[-1] != read_seal:
                raise _conflict(review_id, texts[0] or "", need)
        logger.warning("review item %s: the reply to its change to %s was lost and reading it again did not tell "
                       "whether the change was made", review_id, to)
        raise ReviewOutcomeUnknown(review_id, f"the change to {to} was sent to Redis but its reply was lost, and "
                                   "reading the item again did not tell whether it was made: read its status before "
                                   "trying again")

    async def _decide(self, review_id: str, to: ReviewStatus, by: str | None, note: str | None) -> ReviewItem:
        # the nonce tells this change from another after a lost reply (:meth:`_made`)
        decided = json.dumps({"by": by, "at": time.time(), "note": note, "change": secrets.token_hex(16)})
        changes = {"decided": decided} if to == "approved" else {"decided": decided, "request": ""}
        return await self._move(review_id, "pending", to, "", changes)

    async def approve(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        return await self._decide(review_id, "approved", by, note)

    async def reject(self, review_id: str, *, by: str | None = None, note: str | None = None) -> ReviewItem:
        return await self._decide(review_id, "rejected", by, note)

    async def release(self, review_id: str, digest: str) -> ReviewItem:
        digest = digest or "-"  # no digest matches nothing (after the status check, which names a second release)
        return await self._move(review_id, "approved", "released", digest,
                                {"released_at": repr(time.time()), "request": ""})

    async def aclose(self) -> None:
        if self._owns_client:
            self._owns_client = False
            await self._client.aclose()
