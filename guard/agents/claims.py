"""Single-use approvals: a reviewer's decision releases its tool call once.

The checkpoint alone cannot make an approval single use: two resumes of one interrupt started at the same time (two
threads, ``asyncio.gather`` of two ``ainvoke``), or a resume replayed from the checkpoint saved at the interrupt, each
load a state in which the call is approved and not yet answered. So before a call released by a review decision
(approve, or an edit the policy then allowed) runs a side-effecting tool, guard claims it in a shared store; only
the first claim succeeds, and every later one raises :class:`~guard.errors.ApprovalAlreadyUsed` without running the
tool. The claim id is bound to the thread, the model turn, the ``tool_call_id`` and the digest of the call as the
model's turn held it for review, not of the call that runs: an approval and an edit of one review item (or two
different edits) make the same claim, so only one of them runs the tool.

A claim stays used when the tool raises (it may have taken effect before it failed); the claim is marked failed, so
a later claim of it (a retry of the task, a replayed resume) raises :class:`~guard.errors.ApprovalAlreadyUsed` with
``status="failed"``, which guard answers with an error tool message instead of running the tool again.

* :class:`MemoryApprovalClaims` (the default): one process. Every resume that must see the claim has to run in the
  same process and through the same store (pass one instance to every middleware that serves the thread).
* :class:`RedisApprovalClaims`: every replica sharing one Redis. ``SET key value NX PX ttl`` is the atomic claim;
  the value (the claim time) is sealed with the store key (:mod:`guard._seal`), so an entry guard did not write is
  told apart when it blocks a claim. A claim refused or unreadable for any reason, Redis down included, never runs
  the tool (fail closed).

Claims live ``ttl_s`` seconds (30 days by default): a replay later than that is not detected.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from guard._seal import Sealer
from guard.errors import ApprovalAlreadyUsed, ReviewStoreUnavailable
from guard.subject import digest_of

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis

__all__ = [
    "DEFAULT_CLAIM_PREFIX",
    "DEFAULT_CLAIM_TTL_S",
    "ApprovalClaims",
    "MemoryApprovalClaims",
    "RedisApprovalClaims",
    "claim_id",
]

DEFAULT_CLAIM_TTL_S = 30 * 24 * 3600.0
"""How long a claim is kept, seconds (30 days)."""
DEFAULT_CLAIM_PREFIX = "guard:claim:"
"""Redis key prefix of :class:`RedisApprovalClaims`."""
_FAILED = "/failed"
"""What follows the claim time in a Redis claim's sealed stamp once the claimed tool raised."""


def claim_id(*, thread_id: str | None, message_id: str | None, tool_call_id: str, digest: str) -> str:
    """The claim id of one review item's release: ``ga_`` + 24 hex digits of a digest of thread, turn, call id and
    the digest of the call held for review (whatever call a decision then runs)."""
    return "ga_" + digest_of("claim", thread_id or "", message_id or "", tool_call_id, digest)[:24]


@runtime_checkable
class ApprovalClaims(Protocol):
    """Where single-use claims are made. ``claim``/``aclaim`` return ``None`` for the first claim of ``key`` and
    raise :class:`~guard.errors.ApprovalAlreadyUsed` for any later one (:class:`~guard.errors.ReviewStoreUnavailable`
    when the store cannot answer). ``release``/``arelease`` give a claim back: the claimed tool stopped at an
    ``interrupt()`` of its own before finishing, and runs again from its start when the graph resumes.
    ``fail``/``afail`` keep it used and mark it failed (the claimed tool raised): a later claim raises
    ``ApprovalAlreadyUsed`` with ``status="failed"``."""

    def claim(self, key: str) -> None: ...

    async def aclaim(self, key: str) -> None: ...

    def release(self, key: str) -> None: ...

    async def arelease(self, key: str) -> None: ...

    def fail(self, key: str) -> None: ...

    async def afail(self, key: str) -> None: ...


def _used(key: str, detail: str, failed: bool = False) -> ApprovalAlreadyUsed:
    if failed:
        return ApprovalAlreadyUsed(
            key,
            f"this approval was already used {detail} by a run whose tool raised; the tool did not run again",
            status="failed",
        )
    return ApprovalAlreadyUsed(
        key,
        f"this approval was already used {detail}; the tool did not run again (a second resume of the same "
        f"interrupt, concurrent or replayed from its checkpoint)",
    )


class MemoryApprovalClaims:
    """Claims in this process's memory, thread-safe.

    Args:
        ttl_s: how long a claim is kept, seconds.
        max_entries: claims kept at most; past it the oldest claim is forgotten first.

    Raises:
        ValueError: a non-positive ``ttl_s`` or ``max_entries``.
    """

    def __init__(self, *, ttl_s: float = DEFAULT_CLAIM_TTL_S, max_entries: int = 100_000) -> None:
        if not ttl_s > 0 or max_entries < 1:
            raise ValueError(f"ttl_s and max_entries must be positive; got {ttl_s!r}, {max_entries!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = int(max_entries)
        self._claims: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()  # key -> (at, expires, failed)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryApprovalClaims(claims={len(self._claims)}, ttl_s={self.ttl_s})"

    def claim(self, key: str) -> None:
        now = time.monotonic()
        with self._lock:
            held = self._claims.get(key)
            if held is not None and held[1] > now:
                raise _used(key, f"{now - held[0]:.3f} s ago", held[2])
            self._claims[key] = (now, now + self.ttl_s, False)
            self._claims.move_to_end(key)
            while len(self._claims) > self.max_entries:
                self._claims.popitem(last=False)

    async def aclaim(self, key: str) -> None:
        self.claim(key)

    def release(self, key: str) -> None:
        with self._lock:
            self._claims.pop(key, None)

    async def arelease(self, key: str) -> None:
        self.release(key)

    def fail(self, key: str) -> None:
        with self._lock:
            held = self._claims.get(key)
            if held is not None:
                self._claims[key] = (held[0], held[1], True)

    async def afail(self, key: str) -> None:
        self.fail(key)


class RedisApprovalClaims:
    """Claims in Redis (``SET NX PX``), shared by every replica and process that uses the same Redis and store key.

    Args:
        client: a ``redis.Redis`` client for sync runs (``invoke``/``stream``).
        aclient: a ``redis.asyncio.Redis`` client for async runs (``ainvoke``/``astream``).
        store_key: the secret claim values are sealed with (at least 16 bytes); ``None`` = ``$GUARD_STORE_KEY``.
        prefix: key prefix.
        ttl_s: how long a claim is kept, seconds.

    Attributes:
        forged: claims refused so far because an entry whose seal did not check held the key.

    Raises:
        ValueError: no store key, or a short one; neither client given.
    """

    def __init__(
        self,
        client: redis.Redis | None = None,
        *,
        aclient: aioredis.Redis | None = None,
        store_key: bytes | str | None = None,
        prefix: str = DEFAULT_CLAIM_PREFIX,
        ttl_s: float = DEFAULT_CLAIM_TTL_S,
    ) -> None:
        if client is None and aclient is None:
            raise ValueError("RedisApprovalClaims needs client= (sync runs), aclient= (async runs) or both")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive; got {ttl_s!r}")
        self._client = client
        self._aclient = aclient
        self._sealer = Sealer.resolve(store_key, "RedisApprovalClaims")
        self.prefix = prefix
        self.ttl_s = float(ttl_s)
        self.forged = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        store_key: bytes | str | None = None,
        prefix: str = DEFAULT_CLAIM_PREFIX,
        ttl_s: float = DEFAULT_CLAIM_TTL_S,
        timeout_s: float = 0.5,
    ) -> RedisApprovalClaims:
        """Claims with a sync and an async client for ``url`` (``redis://:PASSWORD@host``, ``rediss://`` for TLS);
        socket connect/read timeouts of ``timeout_s`` seconds.

        Raises:
            ValueError: ``url`` is not one redis-py can connect with, checked as the cache's
                (:func:`~guard.engine.cache.redis_options`: a password with a ``/``, ``?`` or ``#`` not
                percent-encoded, a database path that is not a number); the message names the URL without its
                credentials.
        """
        import redis
        import redis.asyncio as aioredis

        from guard.engine.cache import redis_options

        redis_options(url, timeout_s, role="approval claim store")  # checked only: refuses what redis-py misreads
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        return cls(
            redis.Redis.from_url(url, **options),
            aclient=aioredis.Redis.from_url(url, **options),
            store_key=store_key,
            prefix=prefix,
            ttl_s=ttl_s,
        )

    def __repr__(self) -> str:
        return f"RedisApprovalClaims(prefix={self.prefix!r}, ttl_s={self.ttl_s})"

    def _value(self, redis_key: str, failed: bool = False) -> str:
        stamp = f"{time.time():.6f}{_FAILED if failed else ''}"
        return f"{stamp}:{self._sealer.seal(redis_key, stamp.encode())}"

    def _refusal(self, key: str, redis_key: str, held: Any) -> ApprovalAlreadyUsed:
        text = held.decode("utf-8", "replace") if isinstance(held, bytes) else str(held or "")
        stamp, _, seal = text.partition(":")
        if held is not None and seal and self._sealer.check(redis_key, stamp.encode(), seal):
            at, failed, _ = stamp.partition(_FAILED)
            return _used(key, f"at {at} (Unix time)", bool(failed))
        self.forged += 1
        return _used(key, "(an entry guard did not write holds the claim: its seal does not check)")

    def _unavailable(self, key: str, exc: BaseException) -> ReviewStoreUnavailable:
        return ReviewStoreUnavailable(key, f"the approval claim store failed: {type(exc).__name__}: {exc}")

    def claim(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._client is None:
            raise TypeError("RedisApprovalClaims has no sync client (client=) for invoke/stream")
        redis_key = self.prefix + key
        try:
            if self._client.set(redis_key, self._value(redis_key), nx=True, px=int(self.ttl_s * 1000)):
                return
            held = self._client.get(redis_key)
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc
        raise self._refusal(key, redis_key, held)

    async def aclaim(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._aclient is None:
            raise TypeError("RedisApprovalClaims has no async client (aclient=) for ainvoke/astream")
        redis_key = self.prefix + key
        try:
            if await self._aclient.set(redis_key, self._value(redis_key), nx=True, px=int(self.ttl_s * 1000)):
                return
            held = await self._aclient.get(redis_key)
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc
        raise self._refusal(key, redis_key, held)

    def release(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._client is None:
            raise TypeError("RedisApprovalClaims has no sync client (client=) for invoke/stream")
        try:
            self._client.delete(self.prefix + key)
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc

    async def arelease(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._aclient is None:
            raise TypeError("RedisApprovalClaims has no async client (aclient=) for ainvoke/astream")
        try:
            await self._aclient.delete(self.prefix + key)
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc

    def fail(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._client is None:
            raise TypeError("RedisApprovalClaims has no sync client (client=) for invoke/stream")
        redis_key = self.prefix + key
        try:
            self._client.set(redis_key, self._value(redis_key, failed=True), px=int(self.ttl_s * 1000))
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc

    async def afail(self, key: str) -> None:
        from redis.exceptions import RedisError

        if self._aclient is None:
            raise TypeError("RedisApprovalClaims has no async client (aclient=) for ainvoke/astream")
        redis_key = self.prefix + key
        try:
            await self._aclient.set(redis_key, self._value(redis_key, failed=True), px=int(self.ttl_s * 1000))
        except (RedisError, OSError) as exc:
            raise self._unavailable(key, exc) from exc

    def close(self) -> None:
        """Close the sync client's connections."""
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        """Close the async client's connections."""
        if self._aclient is not None:
            await self._aclient.aclose()
