"""The probability cache: stores *answers* (probabilities, model, usage), never verdicts, so rules and thresholds can
change without a model call.

Keys are :func:`~guard.engine.keys.cache_key` hashes of everything the model sees. Two implementations share one
interface and one single-flight core:

* :class:`MemoryCache`: in-process LRU + TTL; a single process needs nothing else.
* :class:`RedisCache`: ``redis.asyncio`` with small timeouts. Every value it writes is sealed (HMAC-SHA256 keyed by
  ``CacheConfig.store_key`` or ``$GUARD_STORE_KEY``, :mod:`guard._seal`) under its Redis key; a value whose seal does
  not check (forged or edited in Redis, or written under another key) is a miss counted as ``forged``, never an
  answer. Redis slow, down or holding a value of the wrong shape (or one that cannot be read at all) is a counted
  miss, and so is a forged value: :meth:`~ProbabilityCache.health` reports ``"degraded"`` while any of these is
  recent, with a code saying which (:class:`CacheHealth`), and each kind is logged as a warning once per such
  period; never an error of the decision and never an allow. An exception of guard's own (a bug, not the store's
  failure) is a miss too, counted apart and logged at ERROR with its traceback once per period. Across replicas
  a short lock (``SET NX PX`` of a sealed token, token-checked release in Lua) elects one leader per key (a lock whose
  seal does not check is counted as ``forged`` and not waited on); followers poll for the value (past
  :data:`FOLLOW_SHARE` of their budget they also call the model, and the first answer wins) and, when the leader
  fails, raise the leader's error (from a failure marker, sealed like the values, naming the leader's lock: an
  unsealed one is counted as ``forged`` and ignored, one of an earlier leader is ignored) so the policy's fail mode
  decides for them too.

In one process, concurrent misses on one key share one task (one backend call); callers that time out leave the
task running for the others. A call is made within the budget (``wait``) of the caller that started it, so no caller
fails for a shorter budget than its own: one that joined a call which timed out calls again (or joins the next call)
in what is left of its own budget when its budget is longer than that of the caller that started the call, and a
follower on another replica ignores a leader's timeout marker (it carries the leader's budget) when its own budget is
longer and leads instead. Budgets are compared as given to :meth:`~ProbabilityCache.fetch` (a policy's timeout), not
as what is left of them, so callers with the same budget take the call's timeout: one model call per budget, not one
per caller. A shadow policy's short call thus never times out an enforced policy asking the same questions with a
longer timeout.

A flight settles as soon as its answers pass their checks; its task then writes them to the store and releases the
lock, in that order (a follower on another replica never sees neither), while the callers go on (at most
:data:`MAX_BACKGROUND_WRITES` such writes per event loop; past that the callers wait for the write as well).
:meth:`~ProbabilityCache.aclose` waits for them; a loop that ends without it (``asyncio.run`` around each decision)
cancels the task, and a write or release so cancelled is made once more, within the store's timeouts.

A Redis cache also carries each backend's canary epoch (:meth:`~ProbabilityCache.shared_epoch`, sealed like the
values), so a model one replica saw fail its canary, or pass again, moves every replica's keys on, not only its own;
a replica that finds none published publishes a fresh one if still absent (:meth:`~ProbabilityCache.publish_epoch`
``if_absent``), so an epoch deleted or evicted from Redis does not bring back the answers cached before it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.exceptions import RedisError, ResponseError

from guard._seal import Sealer
from guard._urls import password_unclear, shown_url, split_url
from guard.engine.keys import cache_key
from guard.errors import BackendError, BackendTimeout, BackendUnavailable, MalformedAnswer
from guard.systemone import SystemOneRequestV1, SystemOneResponseV1
from guard.systemone.answers import decode_answers, encode_checked

__all__ = [
    "CacheConfig",
    "CacheHealth",
    "CachedAnswers",
    "ForgedEntry",
    "Lookup",
    "MemoryCache",
    "ProbabilityCache",
    "RedisCache",
    "Unstored",
    "cache_key",
    "redis_options",
]

logger = logging.getLogger("guard.cache")

DEFAULT_PREFIX = "guard:"
DEFAULT_OP_TIMEOUT_S = 0.05
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_POLL_INTERVAL_S = 0.01
DEFAULT_BREAKER_S = 1.0
DEFAULT_BREAKER_AFTER = 2
DEFAULT_DEGRADED_WINDOW_S = 30.0
FAILURE_MARKER_MS = 1000
#: Milliseconds a sealed lock or failure marker is still read after the end it carries: the clocks of the replica
#: that wrote it and of the one reading it may differ by this much.
CLOCK_SKEW_MS = 2000
#: The share of its time budget (``wait``) a follower waits for another replica's leader alone; past it, it also
#: calls the model itself (without the lock) and keeps polling: the first answer wins. A leader's lock is sealed with
#: its end, but a copy put back in Redis within that end (by someone who can write to Redis) is genuine: waited out,
#: it spent the whole budget and the policy's fail mode decided. A leader slower than this share costs a second
#: model call (a hedge), never its followers' answers.
FOLLOW_SHARE = 0.5
#: Seconds a Redis cache answers from its in-process copy of an entry it read or wrote before reading Redis again.
DEFAULT_LOCAL_TTL_S = 1.0
#: Derived values one entry keeps in :attr:`CachedAnswers.memo` before it starts over.
MEMO_ENTRIES = 16
#: Answers one event loop writes to the store after their callers went on (each write is bounded by the store's
#: operation timeouts); past this many, a flight settles only once its answers are written.
MAX_BACKGROUND_WRITES = 1000

Lookup = Literal["hit", "miss", "shared"]
"""``hit``: read from the cache; ``miss``: this caller's backend call; ``shared``: another caller's call (in this
process or, through the Redis lock, another replica)."""



@dataclass(frozen=True)
class Unstored:
    """What a ``compute`` returns for answers that must not be kept under its key: the backend answered as another
    model revision than the key names (a rolling update behind one address). They answer this call, and the calls
    waiting on it, and are not stored."""

    response: SystemOneResponseV1


Compute = Callable[[], Awaitable[SystemOneResponseV1 | Unstored]]


@dataclass(frozen=True)
class CacheConfig:
    """Cache settings.

    Attributes:
        url: Redis URL (redis-py's syntax: ``redis://``, ``rediss://`` for TLS, ``unix://``; checked by
            :class:`RedisCache`); ``None`` = in-process cache.
        prefix: prefix of every key (``<prefix>a:<sha256>`` values, ``l:`` locks, ``f:`` leader failures).
        op_timeout: seconds per Redis operation before it counts as a miss (~50 ms), not counting the time it takes
            to open a connection (``connect_timeout``).
        connect_timeout: seconds an operation may take to open a connection before its ``op_timeout`` starts: the
            TCP (and TLS) handshake and the ``AUTH`` and ``SELECT`` the URL asks for, each reply within ``op_timeout``;
            ``None`` = ``op_timeout``. So an operation on a new connection takes at most ``connect_timeout +
            op_timeout``.
        poll_interval: seconds between a follower's polls for the leader's value.
        breaker: seconds Redis is skipped once ``breaker_after`` operations in a row failed (each skipped lookup is
            a counted miss), so a dead or black-holed Redis costs one timeout per period, not one per request.
        breaker_after: consecutive failed operations that open the breaker (one slow reply alone does not).
        degraded_window: seconds after the last error, or forged or corrupt value read, that health stays
            ``"degraded"`` (and further ones of that kind are logged at debug level, not as warnings).
        max_entries: entries held in process (LRU): the in-process cache's size; a Redis cache's local copies.
        store_key: the secret a Redis cache seals its values with (at least 16 bytes); ``None`` = ``$GUARD_STORE_KEY``.
            Required for Redis (every replica sharing it needs the same one); unused in process.
        local_ttl: seconds a Redis cache answers a key from the copy it holds in process (of a value it read from
            Redis or wrote there, never longer than the value has left in Redis: a read takes its PTTL in the same
            round trip) before it reads Redis again; ``0`` = every hit reads Redis (one GET, no PTTL). Answers are
            a pure function of the key (the state, questions and model revision), so a copy is never wrong, only up
            to this much older than a change made to Redis by hand (a flush, a deleted key).
    """

    url: str | None = None
    prefix: str = DEFAULT_PREFIX
    op_timeout: float = DEFAULT_OP_TIMEOUT_S
    connect_timeout: float | None = None
    poll_interval: float = DEFAULT_POLL_INTERVAL_S
    breaker: float = DEFAULT_BREAKER_S
    breaker_after: int = DEFAULT_BREAKER_AFTER
    degraded_window: float = DEFAULT_DEGRADED_WINDOW_S
    max_entries: int = DEFAULT_MAX_ENTRIES
    local_ttl: float = DEFAULT_LOCAL_TTL_S
    store_key: bytes | str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        """Every field but ``store_key``, the URL as :func:`~guard._urls.shown_url` shows it (no password)."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        if self.url is not None:
            shown["url"] = shown_url(self.url)
        return f"CacheConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    def __post_init__(self) -> None:
        for name in ("op_timeout", "poll_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CacheConfig.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.connect_timeout is not None and not self.connect_timeout > 0:
            raise ValueError(f"CacheConfig.connect_timeout must be > 0 seconds or None, got {self.connect_timeout!r}")
        for name in ("breaker", "degraded_window", "local_ttl"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if self.breaker_after < 1:
            raise ValueError(f"CacheConfig.breaker_after must be >= 1, got {self.breaker_after}")
        if self.max_entries < 1:
            raise ValueError(f"CacheConfig.max_entries must be >= 1, got {self.max_entries}")


@dataclass
class CacheHealth:
    """Counters and status. ``status`` is ``"degraded"`` while any trouble is recent (within
    ``CacheConfig.degraded_window``), else ``"ok"``; ``code`` (the health check's) says which, the first recent of:
    ``internal_error`` (guard's own code raised while using the store: a bug, logged at ERROR), ``forged_values``
    (a value, lock, failure marker or epoch read fails its seal: written without the store key, or by replicas
    sealing with another; or a lock's or epoch's key holds another type), ``corrupt_values`` (a sealed value cannot
    be read, or a value's key holds another type), ``degraded`` (Redis failed or refused an operation: lookups are
    misses); else ``ok``.

    ``errors`` counts the store's failures and ``internal_errors`` guard's own; ``last_error`` is the latest of
    either (``"TypeName: message"``) and ``last_error_kind`` says which (``"store"`` or ``"internal"``)."""

    status: Literal["ok", "degraded"] = "ok"
    code: str = "ok"
    backend: str = "memory"
    hits: int = 0
    misses: int = 0
    shared: int = 0
    corrupt: int = 0
    forged: int = 0
    errors: int = 0
    internal_errors: int = 0
    skipped: int = 0
    stores: int = 0
    last_error: str | None = None
    last_error_kind: Literal["store", "internal"] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class CachedAnswers:
    """Checked answers as the cache hands them out: one object per stored entry (or per backend call), shared by every
    caller served from it, so treat it as read-only.

    Attributes:
        response: the answers; not copied per caller (an :class:`~guard.systemone.AnswerV1` is immutable, its
            probabilities included).
        memo: values derived purely from ``response`` by a caller (the engine keeps rule results here, so rules that
            read only the answers run once per entry, not once per hit); cleared past :data:`MEMO_ENTRIES`.

    Threading: any thread may read and write :attr:`memo` without a lock: each dict operation is atomic, and a
    value lost to a concurrent clear is derived again.
    """

    __slots__ = ("memo", "response")

    def __init__(self, response: SystemOneResponseV1) -> None:
        self.response = response
        self.memo: dict[Any, Any] = {}

    def remember(self, key: Any, value: Any) -> None:
        """Store ``value`` in :attr:`memo` under ``key`` (bounded)."""
        if len(self.memo) >= MEMO_ENTRIES:
            self.memo.clear()
        self.memo[key] = value


#: The health code of each kind of recent trouble (:class:`CacheHealth`), the first recent one naming it.
_TROUBLE_CODES = {"internal": "internal_error", "forged": "forged_values", "corrupt": "corrupt_values",
                  "store": "degraded"}
#: What a Redis client raises when the store fails (down, slow, refusing a command); anything else is guard's bug.
_STORE_ERRORS = (RedisError, OSError, TimeoutError)


class _Failed:
    """Sentinel: a Redis operation failed (already counted)."""


_FAILED = _Failed()


class _Flight(asyncio.Future[Any]):
    """A call in flight for one key: a future of ``(answers, lookup)`` that carries ``budget``, the time budget in
    seconds of the caller that started it, as that caller gave it to :meth:`ProbabilityCache.fetch` (its call may
    have less: a caller calling again after a shorter call timed out calls in what is left of its budget)."""

    __slots__ = ("budget",)

    def __init__(self, *, loop: asyncio.AbstractEventLoop, budget: float) -> None:
        super().__init__(loop=loop)
        self.budget = budget


class ProbabilityCache:
    """The interface and the in-process single-flight core. Use :class:`MemoryCache` or :class:`RedisCache`.

    Threading: one cache serves every event loop of its Guard (the caller's and the sync facade's portal thread).
    The answers held in process (``_entries``) are read and written only under ``_lock``; calls in flight are kept
    per event loop and touched only from their loop.
    """

    kind = "base"

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self._stats = CacheHealth(backend=self.kind)
        self._trouble_at: dict[str, float] = {}  # a kind of _TROUBLE_CODES -> when it was last seen (monotonic s)
        self._inflight: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Flight]] = (
            weakref.WeakKeyDictionary()
        )
        self._last_flights: tuple[weakref.ref[asyncio.AbstractEventLoop], dict[str, _Flight]] | None = None
        # per loop, the tasks running flights' miss paths (aclose waits for them)
        self._leads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[asyncio.Task[Any]]] = (
            weakref.WeakKeyDictionary()
        )
        # per loop, the tasks writing answers whose flight already settled (aclose waits for them)
        self._writes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[asyncio.Task[Any]]] = (
            weakref.WeakKeyDictionary()
        )
        # Answers this process holds, decoded and checked: key -> (answered from here until (monotonic s), answers,
        # the raw value they were decoded from: b"" in the in-process cache, and for answers not (yet) stored). LRU,
        # at most config.max_entries.
        self._entries: OrderedDict[str, tuple[float, CachedAnswers, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def _flights(self, loop: asyncio.AbstractEventLoop) -> dict[str, _Flight]:
        """``loop``'s calls in flight, key -> future. The last loop's table is remembered (by a weak reference):
        a ``WeakKeyDictionary`` lookup makes a new weak reference every time, a noticeable part of a cache hit."""
        last = self._last_flights
        if last is not None and last[0]() is loop:
            return last[1]
        flights = self._inflight.setdefault(loop, {})
        self._last_flights = (weakref.ref(loop), flights)
        return flights

    def health(self) -> CacheHealth:
        """A snapshot of the counters and the status."""
        snapshot = CacheHealth(**asdict(self._stats))
        recent = [code for kind, code in _TROUBLE_CODES.items() if self._recent(self._trouble_at.get(kind))]
        snapshot.status, snapshot.code = ("degraded", recent[0]) if recent else ("ok", "ok")
        return snapshot

    def _recent(self, at: float | None) -> bool:
        """Whether ``at`` (a ``time.monotonic()`` reading, ``None``: never) is within ``degraded_window``."""
        return at is not None and time.monotonic() - at < self.config.degraded_window

    def peek(self, key: str) -> CachedAnswers | None:
        """The answers for ``key`` when they can be had without waiting (this process holds them: the in-process
        cache's entry, or a Redis cache's local copy within ``local_ttl``; and no call for ``key`` is in flight),
        counted as a hit; else ``None``, and :meth:`fetch` decides.

        The caller must honour the policy's ``ttl``: peek only when it is above 0.
        """
        flights = self._flights(asyncio.get_running_loop())
        if key in flights and not flights[key].done():
            return None  # a call for this key is in flight: fetch() joins it, as before the value was stored
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or time.monotonic() >= entry[0]:
                return None  # absent or expired: fetch() misses (and drops the expired entry)
            self._entries.move_to_end(key)
            self._stats.hits += 1
        return entry[1]

    def _local_until(self, ttl: float) -> float:
        """When a copy held in process now stops answering: ``local_ttl`` from now, at most ``ttl``."""
        return time.monotonic() + min(self.config.local_ttl, ttl)

    def _keep(self, key: str, answers: CachedAnswers, until: float, raw: bytes = b"") -> None:
        """Hold ``answers`` in process until ``until`` (monotonic seconds), dropping the least recently used past
        ``max_entries``."""
        with self._lock:
            entries = self._entries
            entries[key] = (until, answers, raw)
            entries.move_to_end(key)
            while len(entries) > self.config.max_entries:
                entries.popitem(last=False)

    async def fetch(
        self, key: str, request: SystemOneRequestV1, compute: Compute, *, ttl: float, wait: float
    ) -> tuple[CachedAnswers, Lookup]:
        """The answers for ``key``: from the cache, from a call already in flight, or from ``compute()``.

        Args:
            key: :func:`cache_key` of ``request``.
            request: the request (to check a stored value's shape and rebuild the answers).
            compute: makes the backend call; its result is checked and stored for ``ttl`` seconds.
            ttl: seconds to keep the answers; ``0`` = do not read or write the cache (single-flight still applies).
            wait: the caller's time budget in seconds (a policy's timeout, the same for each of its calls): the
                backend call's limit; a follower waits :data:`FOLLOW_SHARE` of it for another replica's leader
                alone, then calls the model too. A caller that joined a call started with a shorter budget, which
                timed out, calls again in what is left of its own; one whose budget is not longer takes the timeout.

        Returns:
            ``(answers, lookup)``; ``answers`` is shared by every caller served from the same entry or flight.

        Raises:
            Whatever ``compute`` raises (``BackendError`` and subclasses, ``UnsupportedQuestion``, ...), also in
            followers of a failed leader. Never raises for cache trouble.
        """
        loop = asyncio.get_running_loop()
        flights = self._flights(loop)
        budget, deadline = wait, loop.time() + wait
        joined = flights.get(key)
        while joined is not None and not joined.done():  # a finished flight (even one not yet removed) is never joined
            try:
                answers, _ = await asyncio.shield(joined)
            except BackendTimeout:
                # budgets as given, not what is left of them: a call started later for a caller with our budget is
                # no shorter than ours (one call per budget, not one per caller)
                if budget <= joined.budget or loop.time() >= deadline:
                    raise  # a call of our own would have had no longer a budget: its timeout is ours
                # started by a caller with a shorter budget than ours: call again (or join the next call) in what is
                # left of ours
                wait = deadline - loop.time()
                joined = flights.get(key)
                continue
            self._stats.shared += 1
            return answers, "shared"
        flight = _Flight(loop=loop, budget=budget)
        flights[key] = flight
        flight.add_done_callback(functools.partial(_end_flight, flights, key))
        reachable = True
        try:
            if ttl > 0:  # the hit path reads inline: no task and no extra event-loop hops
                answers = await self._read(key, request, ttl)
                if isinstance(answers, CachedAnswers):
                    flight.set_result((answers, "hit"))
                    return answers, "hit"
                reachable = answers is not _FAILED
        except BaseException:  # cancelled while reading: the flight goes on for the callers that joined it
            self._launch(flight, key, request, compute, ttl, wait, reachable)
            raise
        self._launch(flight, key, request, compute, ttl, wait, reachable)
        return await asyncio.shield(flight)

    def _launch(
        self, flight: _Flight, key: str, request: SystemOneRequestV1, compute: Compute, ttl: float, wait: float,
        reachable: bool,
    ) -> None:
        """Run the miss path in its own task, so a caller that times out does not cancel it for the others."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._lead(flight, key, request, compute, ttl, wait, reachable))
        task.add_done_callback(functools.partial(_settle, flight))
        leads = self._leads.setdefault(loop, set())
        leads.add(task)
        task.add_done_callback(leads.discard)

    async def _lead(
        self, flight: _Flight, key: str, request: SystemOneRequestV1, compute: Compute, ttl: float, wait: float,
        reachable: bool,
    ) -> tuple[CachedAnswers, Lookup]:
        """The miss path of ``flight``, which settles with what this returns (or raises), or earlier, once the
        answers are checked (:meth:`_answered`). ``reachable`` is false when the store did not answer this request's
        read: then no lock is taken and nothing written to it (each would spend another operation timeout of the
        decision's budget before the model is called); the answers are held in process only."""
        if ttl <= 0:
            response, _, _, _ = await _run(compute, request, wait)
            return CachedAnswers(response), "miss"
        self._stats.misses += 1
        if not reachable:
            response, _, decoded, keep = await _run(compute, request, wait)
            if keep:
                self._keep(key, CachedAnswers(decoded), self._local_until(ttl))
            return CachedAnswers(response), "miss"
        token, holder, stored = await self._acquire(key, request, ttl, wait)
        if token is None:  # another replica leads: its answers or its failure, or past FOLLOW_SHARE our own call's
            started = time.monotonic()
            outcome = await self._follow_or_hedge(flight, key, request, compute, wait, ttl, holder)
            if outcome is not None:
                return outcome
            wait = max(wait - (time.monotonic() - started), 0.001)  # the leader vanished early: lead, in what is left
            token, _, stored = await self._acquire(key, request, ttl, wait)  # None: held again: call without it
        if token and stored is not None:  # double-checked: a replica stored the answers between our read and our lock
            await self._release(key, token)
            self._stats.shared += 1
            return stored, "shared"
        try:  # token None: without the lock, which another holds
            outcome = await self._answered(flight, key, await _run(compute, request, wait), ttl)
        except BackendError as exc:
            await self._publish_failure(key, exc, token, flight.budget)
            raise
        finally:  # after the store: no follower sees neither lock nor value
            if token is not None:
                await _to_the_end(lambda: self._release(key, token))
        return outcome

    async def _answered(
        self, flight: _Flight, key: str,
        run: tuple[SystemOneResponseV1, dict[str, Any], SystemOneResponseV1, bool], ttl: float,
    ) -> tuple[CachedAnswers, Lookup]:
        """The outcome of a backend call's checked answers (``run``: what :func:`_run` returns): ``flight`` settles with
        it now, its answers held in process (when they may be stored), so its callers go on while this task writes
        them to the store (counted, never raised; made to the end when the loop's end cancels the task,
        :func:`_to_the_end`). Past :data:`MAX_BACKGROUND_WRITES` writes running on this loop, the flight settles with
        the task instead, after the write."""
        response, value, decoded, keep = run
        outcome: tuple[CachedAnswers, Lookup] = (CachedAnswers(response), "miss")
        if keep:  # a caller in this process finds them while they are written
            self._keep(key, CachedAnswers(decoded), self._local_until(ttl))
        writes = self._writes.setdefault(asyncio.get_running_loop(), set())
        task = asyncio.current_task()
        if task is not None and len(writes) < MAX_BACKGROUND_WRITES and not flight.done():
            writes.add(task)
            task.add_done_callback(writes.discard)
            flight.set_result(outcome)
        if keep:
            await _to_the_end(lambda: self._store_or_count(key, value, decoded, ttl))
        return outcome

    async def _follow_or_hedge(
        self, flight: _Flight, key: str, request: SystemOneRequestV1, compute: Compute, wait: float, ttl: float,
        holder: bytes | None,
    ) -> tuple[CachedAnswers, Lookup] | None:
        """Another replica leads ``key`` (its lock ``holder``): its answers (``"shared"``); or, when they have not come
        within :data:`FOLLOW_SHARE` of ``wait``, the first of its answers and a model call of our own started then
        (``"miss"``, stored), within ``wait`` in all. ``None``: the leader vanished without answers before that (the
        caller leads).

        Raises:
            BackendError: the leader's call failed before ours began (its failure marker), or both failed (ours is
                raised).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        follow = asyncio.ensure_future(self._follow(key, request, wait, ttl, holder, budget=flight.budget))
        own: asyncio.Future[Any] | None = None
        try:
            await asyncio.wait([follow], timeout=wait * FOLLOW_SHARE)
            if follow.done():
                followed = follow.result()  # the leader's answers, its error, or None (vanished)
                if followed is None:
                    return None
                self._stats.shared += 1
                return followed, "shared"
            own = asyncio.ensure_future(_run(compute, request, max(deadline - loop.time(), 0.001)))
            pending = {follow, own}
            while pending:  # the first answer wins; a failure is no answer while the other may still bring one
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if follow in done and follow.exception() is None and follow.result() is not None:
                    self._stats.shared += 1
                    return follow.result(), "shared"
                if own in done and own.exception() is None:
                    return await self._answered(flight, key, own.result(), ttl)
            return await own  # both failed (or the leader vanished and ours failed): ours is this call's error
        finally:
            for task in (follow, own):
                if task is not None and not task.done():
                    task.cancel()
                elif task is not None and not task.cancelled():
                    task.exception()  # retrieved: an error the other's answer made moot is not logged as unread

    async def _store_or_count(self, key: str, value: dict[str, Any], decoded: SystemOneResponseV1, ttl: float) -> None:
        """:meth:`_store`, whose failure of any kind is counted, never the decision's: the answers are right whether
        they are stored or not. A TTL the store cannot take (``inf``, ``nan``) is a cache error (the store's own
        errors it counts itself); anything else raised is guard's own (:meth:`_internal_error`)."""
        try:
            await self._store(key, value, decoded, ttl)
        except (*_STORE_ERRORS, OverflowError, ValueError) as exc:
            self._record_error(exc)
            logger.warning("cache write for %s failed (%s); the answers are used, not stored", key[:16],
                           self._stats.last_error)
        except Exception as exc:  # noqa: BLE001 - a bug: the caller still gets its answers
            self._internal_error(exc, f"writing the answers of {key[:16]}")

    async def _read(self, key: str, request: SystemOneRequestV1, ttl: float) -> CachedAnswers | _Failed | None:
        """The stored answers (counted as a hit), ``None`` (absent, unreadable or of the wrong shape: counted, later
        overwritten), or ``_FAILED`` when the store did not answer."""
        try:
            answers = await self._load(key, request, ttl)
        except MalformedAnswer as exc:
            self._count_bad(key, exc)
            return None
        if not isinstance(answers, CachedAnswers):
            return answers
        self._stats.hits += 1
        return answers

    def _count_bad(self, key: str, exc: MalformedAnswer) -> None:
        if isinstance(exc, ForgedEntry):
            self._bad("forged", "cache value for %s fails its integrity check (forged, edited in the store or sealed "
                      "with another store key); ignoring and overwriting it", key[:16])
        else:
            self._bad("corrupt", "cache value for %s cannot be read (%s); ignoring and overwriting it", key[:16], exc)

    def _bad(self, kind: Literal["forged", "corrupt"], message: str, *args: Any) -> None:
        """Count a ``kind`` value read from the store (health is ``degraded`` for ``degraded_window`` after it) and log
        ``message % args``: a warning when none of that kind was read within that window, else at debug level, so
        values that keep failing (replicas sealing with different store keys, someone writing to Redis) log one
        warning per kind and period, not one per read."""
        was_recent = self._seen(kind)
        setattr(self._stats, kind, getattr(self._stats, kind) + 1)
        (logger.debug if was_recent else logger.warning)(message, *args)

    def _record_error(self, exc: BaseException) -> bool:
        """Count ``exc``, a failure of the store (or of a value it cannot take); returns whether one was counted
        within ``degraded_window`` before it (then it is logged at debug level, not as a warning)."""
        self._stats.errors += 1
        self._stats.last_error = f"{type(exc).__name__}: {exc}"[:200]
        self._stats.last_error_kind = "store"
        return self._seen("store")

    def _internal_error(self, exc: Exception, doing: str) -> None:
        """Count ``exc``, raised by guard's own code while ``doing`` something with the store (a bug: the store did
        not fail), and log it at ERROR with its traceback, once per ``degraded_window`` (then at debug level)."""
        self._stats.internal_errors += 1
        self._stats.last_error = f"{type(exc).__name__}: {exc}"[:200]
        self._stats.last_error_kind = "internal"
        if self._seen("internal"):
            logger.debug("cache: %s raised %s again; a miss", doing, self._stats.last_error)
        else:
            logger.error("cache: %s raised %s, an error in guard, not in the store; treating it as a miss", doing,
                         self._stats.last_error, exc_info=exc)

    def _seen(self, kind: str) -> bool:
        """Note trouble of ``kind`` (a key of :data:`_TROUBLE_CODES`) now; returns whether it was seen within
        ``degraded_window`` before."""
        was_recent = self._recent(self._trouble_at.get(kind))
        self._trouble_at[kind] = time.monotonic()
        return was_recent

    # Storage hooks --------------------------------------------------------------------------------------------------

    async def _load(self, key: str, request: SystemOneRequestV1, ttl: float) -> CachedAnswers | _Failed | None:
        """The checked answers stored under ``key``, ``None`` when absent, or ``_FAILED`` when the store did not
        answer (``ttl``: the policy's, which bounds a local copy).

        Raises:
            MalformedAnswer: the stored value does not have the shape ``encode_checked`` writes for ``request``.
        """
        raise NotImplementedError

    async def _store(self, key: str, value: dict[str, Any], decoded: SystemOneResponseV1, ttl: float) -> None:
        """Store ``value`` (the JSON form) whose decoded form is ``decoded``. What it raises is counted as a cache
        error (:meth:`_store_or_count`), never the decision's."""
        raise NotImplementedError

    async def _acquire(
        self, key: str, request: SystemOneRequestV1, ttl: float, wait: float
    ) -> tuple[str | None, bytes | None, CachedAnswers | None]:
        """``(token, holder, stored)``: our lock token, ``""`` when no cross-process lock applies, or ``None`` when
        another process holds the lock, whose value is then ``holder`` (the lock its followers wait on); with our lock,
        ``stored`` is the checked answers read under ``key`` in the same round trip (stored by another replica since
        this caller's read: the double check; ``None`` when absent or unreadable, not counted again), else ``None``.
        """
        return "", None, None

    async def _release(self, key: str, token: str) -> None:
        return None

    async def _follow(
        self, key: str, request: SystemOneRequestV1, wait: float, ttl: float, holder: bytes | None, *, budget: float
    ) -> CachedAnswers | None:
        """The answers of the leader holding lock ``holder`` (waited for ``wait`` seconds at most), or ``None`` to lead
        instead.

        Raises:
            BackendError: that leader's call failed (its failure marker names ``holder`` or a later lock seen); a
                timeout only when the leader's budget was not shorter than ``budget``, the follower's.
        """
        return None

    async def _publish_failure(self, key: str, exc: BackendError, token: str | None, budget: float) -> None:
        """Tell the followers of lock ``token`` (``None`` or ``""``: none held) that its backend call failed, made
        for a caller whose budget was ``budget`` seconds (:attr:`_Flight.budget`)."""
        return

    # Canary epochs --------------------------------------------------------------------------------------------------

    async def shared_epoch(self, scope: str) -> int | None:
        """The canary epoch other processes sharing this cache published for ``scope`` (a backend's name and
        model revision, :meth:`guard.engine.health.HealthMonitor.check_backend`), or ``None``: no shared store,
        nothing published, the store did not answer, or the value fails its seal."""
        return None

    async def publish_epoch(self, scope: str, epoch: int, *, if_absent: bool = False) -> None:
        """Publish ``epoch`` for ``scope`` to the processes sharing this cache (nothing for an in-process cache).

        ``if_absent``: only when none is published (a value that fails its seal is none): of replicas starting
        together on an empty store one publishes, and every one reads back the same epoch."""
        return

    async def aclose(self) -> None:
        """Wait for this loop's calls still in flight and answers still being written to the store, then release
        connections. Idempotent."""
        await self._finish_writes()

    async def _finish_writes(self) -> None:
        """Wait for the tasks of this loop still running a flight's miss path, its callers gone or not (each bounded
        by its caller's budget), or writing answers whose callers went on (:meth:`_answered`)."""
        loop = asyncio.get_running_loop()
        running = self._leads.get(loop, set()) | self._writes.get(loop, set())
        if running:
            await asyncio.gather(*running, return_exceptions=True)


class MemoryCache(ProbabilityCache):
    """In-process LRU + TTL cache (no cross-process lock needed)."""

    kind = "memory"

    async def _load(self, key: str, request: SystemOneRequestV1, ttl: float) -> CachedAnswers | _Failed | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if time.monotonic() >= entry[0]:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
        return entry[1]

    async def _store(self, key: str, value: dict[str, Any], decoded: SystemOneResponseV1, ttl: float) -> None:
        self._keep(key, CachedAnswers(decoded), time.monotonic() + ttl)  # checked when stored: nothing else writes
        self._stats.stores += 1

    def __len__(self) -> int:
        return len(self._entries)


class ForgedEntry(MalformedAnswer):
    """A stored value whose seal does not check: written by someone without the store key."""


class RedisCache(ProbabilityCache):
    """Redis-backed cache with a cross-replica single-flight lock. One client per event loop (``redis.asyncio``
    connections belong to the loop that opened them).

    Raises:
        ValueError: ``config.url`` is missing or not a URL redis-py can connect with (:func:`redis_options`); no
            store key (:class:`~guard._seal.Sealer`).
    """

    kind = "redis"

    # KEYS[1] = lock key; ARGV[1] = the token this holder set. Deletes only our own lock.
    RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

    # KEYS[1] = key; ARGV[1] = the value read from it; ARGV[2] = its replacement. Sets it only if still unchanged, or
    # when the key holds no string (another type, written outside guard; or none, deleted since).
    REPLACE_SCRIPT = """
if redis.call('type', KEYS[1]).ok ~= 'string' or redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('set', KEYS[1], ARGV[2])
end
return 0
"""

    def __init__(self, config: CacheConfig) -> None:
        if not config.url:
            raise ValueError("RedisCache needs CacheConfig.url, e.g. redis://127.0.0.1:6379/0")
        self._connect_timeout = config.op_timeout if config.connect_timeout is None else config.connect_timeout
        options = redis_options(config.url, config.op_timeout, connect_timeout=self._connect_timeout)
        options["connection_class"] = _allowing_connect(options.get("connection_class", aioredis.Connection))
        self._options = options
        self._sealer = Sealer.resolve(config.store_key, "RedisCache")
        super().__init__(config)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
            weakref.WeakKeyDictionary()
        )
        self._skip_until = 0.0
        self._failures_in_a_row = 0

    def _client(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = aioredis.Redis.from_pool(aioredis.ConnectionPool(**self._options))  # closes its pool
            self._clients[loop] = client
        return client

    def _key(self, kind: str, key: str) -> str:
        return f"{self.config.prefix}{kind}:{key}"

    async def _op(self, fn: Callable[[aioredis.Redis], Awaitable[Any]]) -> Any:
        if time.monotonic() < self._skip_until:
            self._stats.skipped += 1
            return _FAILED
        try:
            async with asyncio.timeout(self.config.op_timeout) as timeout:
                # a connection opened meanwhile moves the timeout on (_allowing_connect)
                entered = _OPERATION.set((timeout, self._connect_timeout, self.config.op_timeout))
                try:
                    result = await fn(self._client())
                finally:
                    _OPERATION.reset(entered)
        except _STORE_ERRORS as exc:  # down, slow, refusing: a miss, never the decision's
            was_recent = self._record_error(exc)
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.config.breaker_after:
                self._skip_until = time.monotonic() + self.config.breaker
                self._failures_in_a_row = 0
            log = logger.debug if was_recent else logger.warning  # once per outage, not once per request
            log("redis cache unavailable (%s); treating as a miss", self._stats.last_error)
            return _FAILED
        except Exception as exc:  # noqa: BLE001 - guard's own error (a bug): a miss too, but logged loudly
            self._internal_error(exc, "a Redis operation")
            return _FAILED
        self._failures_in_a_row = 0
        return result

    def _decode(self, key: str, raw: bytes, request: SystemOneRequestV1, ttl: float) -> CachedAnswers | None:
        """The checked answers in ``raw``, just read from Redis, now held in process for ``local_ttl`` (at most
        ``ttl``): reused when ``raw`` is the value held for ``key`` (the key hashes the questions, so the same bytes
        check and decode the same way; never an empty value, the one answers held without a stored value carry),
        else decoded and checked now. ``None`` when checking it raised an error of guard's own (a bug, counted and
        logged by :meth:`_internal_error`): a miss.

        Raises:
            ForgedEntry: ``raw`` does not carry this cache's seal for ``key``.
            MalformedAnswer: ``raw`` is not JSON, nests past the recursion limit, or is not of the stored shape for
                ``request``.
        """
        with self._lock:
            held = self._entries.get(key)
        if raw and held is not None and held[2] == raw:  # b"" names no stored value: an empty value read is checked
            answers = held[1]
        else:
            try:
                blob = self._opened("a", key, raw)
                if blob is None:
                    raise ForgedEntry("stored answers fail their integrity check")
                try:
                    value = json.loads(blob)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise MalformedAnswer("stored answers are not JSON") from exc
                answers = CachedAnswers(decode_answers(value, request))
            except MalformedAnswer:
                raise
            except RecursionError as exc:  # JSON nested past the recursion limit
                raise MalformedAnswer(f"stored answers cannot be read: {type(exc).__name__}: {exc}"[:200]) from exc
            except Exception as exc:  # noqa: BLE001 - the checks themselves failed (a bug): a miss, logged loudly
                self._internal_error(exc, f"reading the stored answers of {key[:16]}")
                return None
        self._keep(key, answers, self._local_until(ttl), raw)
        return answers

    async def _load(self, key: str, request: SystemOneRequestV1, ttl: float) -> CachedAnswers | _Failed | None:
        name = self._key("a", key)
        if self.config.local_ttl <= 0:  # no copy is served from process: the value alone
            raw, left = await self._op(functools.partial(_get_value, name=name)), ttl
        else:  # and what it has left in Redis, which bounds the copy (another replica may have written it long ago)
            got = await self._op(functools.partial(_get_with_pttl, name=name))
            raw, left_ms = (_FAILED, -2) if got is _FAILED else got
            left = _time_left(ttl, left_ms)
        if raw is None or raw is _FAILED:
            return raw
        if raw is _WRONG_TYPE:  # counted as corrupt (not as the store failing) and overwritten by the answers
            raise MalformedAnswer("its key holds another type than a string (written outside guard)")
        return self._decode(key, raw, request, left)

    async def _store(self, key: str, value: dict[str, Any], decoded: SystemOneResponseV1, ttl: float) -> None:
        blob = b""
        try:
            data = json.dumps(value, separators=(",", ":")).encode()
            blob = self._sealed("a", key, data)
            px = max(1, int(ttl * 1000))  # OverflowError (inf) or ValueError (nan): raised after the finally
            result = await self._op(lambda r: r.set(self._key("a", key), blob, px=px))
            if result is not _FAILED:
                self._stats.stores += 1
        finally:
            # Held in process even when the write failed: these answers are right for local_ttl, Redis or not.
            self._keep(key, CachedAnswers(decoded), self._local_until(ttl), blob)

    async def _acquire(
        self, key: str, request: SystemOneRequestV1, ttl: float, wait: float
    ) -> tuple[str | None, bytes | None, CachedAnswers | None]:
        ttl_ms = max(1, int((wait + 0.5) * 1000))
        # sealed, so a follower can tell it from a planted one; with its end, so a copy put back later is stale
        token = self._sealed_until("l", key, uuid.uuid4().hex.encode(), ttl_ms).decode()
        name, value = self._key("l", key), self._key("a", key)
        with_pttl = self.config.local_ttl > 0  # as _load reads it: what the value has left bounds a local copy

        async def set_and_get(r: aioredis.Redis) -> list[Any]:
            # one transaction, one round trip: the lock, its holder (of a lock we did not get), and the answers as
            # they are once we hold it (the double check a miss makes before it calls the model)
            pipe = r.pipeline(transaction=True)
            pipe.set(name, token, nx=True, px=ttl_ms)
            pipe.get(name)
            pipe.get(value)
            if with_pttl:
                pipe.pttl(value)
            results = await pipe.execute(raise_on_error=False)
            if isinstance(results[1], Exception) and _wrong_type(results[1]):
                results[1] = _WRONG_TYPE  # the lock's key holds another type: no replica's lock
            failed = next((result for result in results[:2] if isinstance(result, Exception)), None)
            if failed is not None:
                raise failed  # no lock to tell of: the operation failed
            return results

        got = await self._op(set_and_get)
        if got is _FAILED:
            return "", None, None  # no lock without Redis; in-process single-flight still holds
        acquired, holder, raw, *left_ms = got
        if holder is _WRONG_TYPE:  # planted (written outside guard): no replica leads, none can take it
            self._bad("forged", "single-flight lock for %s holds another type than a string (written outside guard); "
                      "calling the model without it", key[:16])
            return "", None, None
        if not acquired:
            return None, holder, None
        if isinstance(raw, Exception) and not _wrong_type(raw):  # Redis refused the read alone: the lock is ours
            log = logger.debug if self._record_error(raw) else logger.warning  # once per period, as _op logs
            log("redis cache could not read %s again (%s); calling the model", key[:16], self._stats.last_error)
            return token, None, None
        if raw is None or isinstance(raw, Exception):  # none, or a key of another type: overwritten by our answers
            return token, None, None  # (an unreadable value is counted by the reads that answer, as below)
        try:
            stored = self._decode(key, raw, request, _time_left(ttl, left_ms[0]) if left_ms else ttl)
        except MalformedAnswer:  # unreadable or forged: overwritten by our answers; counted by the reads that answer
            stored = None
        return token, None, stored

    async def _release(self, key: str, token: str) -> None:
        if token:
            await self._op(lambda r: r.eval(self.RELEASE_SCRIPT, 1, self._key("l", key), token))

    async def _follow(
        self, key: str, request: SystemOneRequestV1, wait: float, ttl: float, holder: bytes | None, *, budget: float
    ) -> CachedAnswers | None:
        keys = (self._key("a", key), self._key("f", key), self._key("l", key))
        deadline = time.monotonic() + wait
        ignored: bytes | None = None
        followed = holder  # the last leader's lock seen
        while time.monotonic() < deadline:
            await asyncio.sleep(self.config.poll_interval)
            got = await self._op(lambda r: r.mget(keys))
            if got is _FAILED:
                return None
            value, failure, lock = got
            if value is not None:
                try:
                    return self._decode(key, value, request, ttl)
                except MalformedAnswer as exc:
                    self._count_bad(key, exc)
                    return None
            if failure is not None and failure != ignored:
                marker = self._checked_marker(key, failure)
                # only the failure of the leader waited on: the lock held now, or the last one seen once released
                error = _failure_from_marker(marker, lock if lock is not None else followed, budget) if marker else None
                if error is not None:
                    raise error
                ignored = failure  # counted once, not on every poll
            if lock is not None:
                followed = lock
            if lock is None:
                return None  # the leader vanished without an answer: lead ourselves
            if self._opened_live("l", key, lock) is None:
                self._bad("forged", "single-flight lock for %s fails its integrity check or is past its end (planted "
                          "or put back in the store); not waiting on it", key[:16])
                return None  # no replica holds it: lead ourselves rather than wait out its expiry
        return None

    async def _publish_failure(self, key: str, exc: BackendError, token: str | None, budget: float) -> None:
        if not token:
            return  # no lock held, so no follower waits on this call
        marker = json.dumps({"reason": exc.reason, "message": str(exc)[:300], "backend": exc.backend,
                             "lock": token, "budget": budget}).encode()
        blob = self._sealed_until("f", key, marker, FAILURE_MARKER_MS)
        await self._op(lambda r: r.set(self._key("f", key), blob, px=FAILURE_MARKER_MS))

    async def shared_epoch(self, scope: str) -> int | None:
        key = _scope_key(scope)
        raw = await self._op(functools.partial(_get_value, name=self._key("e", key)))
        if raw is None or raw is _FAILED:
            return None
        data = self._opened("e", key, raw) if isinstance(raw, bytes) else None  # not bytes: a key of another type
        if data is None or not data.isdigit():
            self._bad("forged", "canary epoch of %r fails its integrity check (forged or edited in the store); "
                      "ignoring it", scope.partition("\n")[0])
            return None
        return int(data)

    async def publish_epoch(self, scope: str, epoch: int, *, if_absent: bool = False) -> None:
        key = _scope_key(scope)  # no expiry: the epoch must outlive every answer cached under the epochs before it
        name, blob = self._key("e", key), self._sealed("e", key, b"%d" % epoch)
        if not if_absent:
            await self._op(lambda r: r.set(name, blob))
            return
        if await self._op(lambda r: r.set(name, blob, nx=True)) is not None:  # published, or no store to ask
            return
        held = await self._op(functools.partial(_get_value, name=name))
        if held is _WRONG_TYPE or isinstance(held, bytes) and self._opened("e", key, held) is None:  # not an epoch:
            read = held if isinstance(held, bytes) else b""  # replaced, unless a replica's came meanwhile
            await self._op(lambda r: r.eval(self.REPLACE_SCRIPT, 1, name, read, blob))

    def _sealed(self, kind: str, key: str, data: bytes) -> bytes:
        """``data`` as stored under the ``kind`` key of ``key``: its seal (hex), a newline, the data."""
        return self._sealer.seal(self._key(kind, key), data).encode() + b"\n" + data

    def _opened(self, kind: str, key: str, raw: bytes) -> bytes | None:
        """The data of :meth:`_sealed` ``raw`` read from the ``kind`` key of ``key``; ``None`` when its seal does not
        check."""
        seal, _, data = raw.partition(b"\n")
        return data if self._sealer.check(self._key(kind, key), data, seal) else None

    def _sealed_until(self, kind: str, key: str, data: bytes, ttl_ms: int) -> bytes:
        """:meth:`_sealed` of ``data`` with its end (Unix time in ms, ``ttl_ms`` from now) sealed in front of it."""
        return self._sealed(kind, key, b"%d\n%s" % (int(time.time() * 1000) + ttl_ms, data))

    def _opened_live(self, kind: str, key: str, raw: bytes) -> bytes | None:
        """The data of :meth:`_sealed_until` ``raw``; ``None`` when its seal does not check or its end has passed (by
        more than :data:`CLOCK_SKEW_MS`): Redis drops it by then, so one still there was put back by someone else."""
        opened = self._opened(kind, key, raw)
        if opened is None:
            return None
        end, _, data = opened.partition(b"\n")
        live = end.isdigit() and int(end) + CLOCK_SKEW_MS >= time.time() * 1000
        return data if live else None

    def _checked_marker(self, key: str, raw: bytes) -> bytes | None:
        """The leader's failure marker in ``raw`` when it carries this cache's seal for ``key`` and its end has not
        passed; else ``None``, counted as ``forged``: a marker written without the store key, or a copy of an old one
        put back, cannot put followers in the fail mode."""
        marker = self._opened_live("f", key, raw)
        if marker is not None:
            return marker
        self._bad("forged", "leader failure marker for %s fails its integrity check or is past its end (forged, "
                  "edited or put back in the store); ignoring it", key[:16])
        return None

    async def aclose(self) -> None:
        """Wait for this loop's calls still in flight and answers still being written, then close its client (clients
        of other, finished loops are dropped)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - called outside a loop
            return
        await self._finish_writes()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()


def redis_options(
    url: str, op_timeout: float = DEFAULT_OP_TIMEOUT_S, *, role: str = "cache", connect_timeout: float | None = None
) -> dict[str, Any]:
    """The ``redis.asyncio.ConnectionPool`` options of a Redis cache (or another store guard keeps in Redis, named by
    ``role`` in errors: the ``"review store"``) at ``url``: what the URL names (redis-py's URL syntax; its options win
    over these defaults), socket timeouts of ``op_timeout`` seconds (the TCP connect's ``connect_timeout``, when
    given), no retry on a timeout, and replies as bytes whatever the URL's ``decode_responses`` (the cache stores
    sealed bytes). A new connection sends nothing before its first command but the ``AUTH`` and ``SELECT`` the URL
    asks for: RESP2 (``protocol=2``: redis-py 8 defaults to RESP3, whose ``HELLO 3`` is a round trip of its own; a
    URL's ``?protocol=3`` still asks for it), no ``CLIENT MAINT_NOTIFICATIONS`` (which redis-py 7 and later send on
    every RESP3 connection) and no ``CLIENT SETINFO``. Checked by making a connection object, which connects nothing.

    Raises:
        ValueError: ``url`` is not one redis-py can connect with: another scheme than ``redis://``, ``rediss://``
            and ``unix://`` (``redis+sentinel://``, a bare ``host:port``), a database in the path that is not a
            number, an option redis-py does not know or whose value it cannot read (``?socket_timeout=fast``,
            ``?protocol=4``), a port that is not a number (``redis://user:password``, the ``@`` and host left out), an
            ``@`` after the host that may end a password whose ``/``, ``?`` or ``#`` is not percent-encoded
            (:func:`~guard._urls.password_unclear`: ``redis://user:pa/ss@host/0``; not an ``@`` in a ``unix://``
            socket path or a query value). The message (``<role> URL '...' cannot be used: ...``) names the URL
            without credentials or query (:func:`~guard._urls.shown_url`: ``redis://[hidden]`` when where the
            password ends is unclear, or the port is not a number).
    """
    connect = op_timeout if connect_timeout is None else connect_timeout
    defaults: dict[str, Any] = {"socket_timeout": op_timeout, "socket_connect_timeout": connect,
                                "retry_on_timeout": False, "lib_name": None, "lib_version": None, "protocol": 2}
    if "maint_notifications_config" in inspect.signature(aioredis.ConnectionPool).parameters:  # redis-py 7 and later
        from redis.maint_notifications import MaintNotificationsConfig

        defaults["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    try:
        if password_unclear(url):
            raise ValueError("where its host starts is unclear, as when a password holds a '/', '?' or '#' before an "
                             "'@': percent-encode '@', '/', '?' and '#' in a password (%40, %2F, %3F, %23), else part "
                             "of it is read as the host, database or options")
        split = split_url(url)  # refused without quoting the port: a password, when its @ and host were left out
        options = {**defaults, **parse_url(url), "decode_responses": False}
        database = unquote(split.path).replace("/", "")
        if not url.lower().startswith("unix:") and database and not database.isdigit():
            raise ValueError(f"the database {database!r} in its path is not a number")
        aioredis.ConnectionPool(**options).make_connection()  # refuses an option it does not know, or protocol=4
    except (ValueError, TypeError, RedisError) as exc:
        raise ValueError(f"{role} URL {shown_url(url)!r} cannot be used: {exc}") from None
    return options


#: While a Redis cache operation runs (:meth:`RedisCache._op`): its timeout, the seconds it may take to open a
#: connection (``connect_timeout``) and the seconds its command may then take (``op_timeout``).
_OPERATION: contextvars.ContextVar[tuple[asyncio.Timeout, float, float] | None] = contextvars.ContextVar(
    "guard_cache_operation", default=None
)


@functools.cache
def _allowing_connect(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (the connection class the URL names: TCP, TLS or Unix socket) with a connect that, within a cache
    operation, has the operation's connect allowance, then moves the operation's timeout to ``op_timeout`` from the
    moment it is connected: the command is bounded by ``op_timeout`` and the handshake (TCP, TLS, ``AUTH``,
    ``SELECT``) by ``connect_timeout``, not both by one ``op_timeout`` (with Redis 15 ms away, a handshake and the
    command passed 50 ms; each timeout dropped the connection, so every operation made a new one and timed out).

    A connect that returns after its allowance ran out raises ``TimeoutError`` (a store failure, as a timeout that
    cancels the connect is): the timeout fired, but its cancellation never reached the task (redis-py sends the
    handshake's commands through ``asyncio.wait_for``, which on Python 3.11 drops a cancellation that comes as the
    send completes, as when a busy event loop runs the timeout late), and an expired timeout cannot be moved on."""

    async def connect(self: AbstractConnection) -> None:
        operation = _OPERATION.get()
        if operation is None or self.is_connected or operation[0].expired():
            await base.connect(self)
            return
        timeout, connect_s, op_s = operation
        loop = asyncio.get_running_loop()
        timeout.reschedule(loop.time() + connect_s)
        await base.connect(self)
        if timeout.expired():  # it fired, but its cancellation did not reach this task: out of time all the same
            raise TimeoutError(f"no Redis connection within the {connect_s * 1000:.0f} ms connect timeout")
        timeout.reschedule(loop.time() + op_s)

    return type(f"Guard{base.__name__}", (base,), {"connect": connect, "__doc__": base.__doc__})


def _scope_key(scope: str) -> str:
    """The key part of a canary epoch's ``scope`` (SHA-256 hex: a backend name and revision hold any text)."""
    return hashlib.sha256(scope.encode("utf-8", "surrogatepass")).hexdigest()


class _WrongType:
    """Sentinel: a value's key holds another type than the string the cache writes there (Redis's WRONGTYPE reply)."""


_WRONG_TYPE = _WrongType()


def _wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")


async def _get_value(client: aioredis.Redis, *, name: str) -> Any:
    """``GET name``; :data:`_WRONG_TYPE` when the key holds another type (written outside guard): Redis answered, so
    it is an unreadable value to overwrite, not a failure of the store."""
    try:
        return await client.get(name)
    except ResponseError as exc:
        if _wrong_type(exc):
            return _WRONG_TYPE
        raise


async def _get_with_pttl(client: aioredis.Redis, *, name: str) -> list[Any]:
    """``[GET name, PTTL name]`` in one round trip (PTTL: milliseconds left, -1 without expiry, -2 when absent); the
    GET :data:`_WRONG_TYPE` when the key holds another type, as :func:`_get_value`."""
    pipe = client.pipeline(transaction=False)
    pipe.get(name)
    pipe.pttl(name)
    raw, left_ms = await pipe.execute(raise_on_error=False)
    if isinstance(raw, Exception) and _wrong_type(raw):
        raw = _WRONG_TYPE
    failed = next((result for result in (raw, left_ms) if isinstance(result, Exception)), None)
    if failed is not None:
        raise failed
    return [raw, left_ms]


def _time_left(ttl: float, left_ms: Any) -> float:
    """Seconds a copy of a value read from Redis may answer in process: the policy's ``ttl``, at most what the value
    has left there (``left_ms``, its PTTL: -1 without expiry, -2 when absent)."""
    return min(ttl, left_ms / 1000) if isinstance(left_ms, int) and left_ms >= 0 else ttl


def _end_flight(flights: dict[str, _Flight], key: str, flight: _Flight) -> None:
    if flights.get(key) is flight:
        del flights[key]
    if not flight.cancelled():
        flight.exception()  # retrieved here so a failure nobody awaited is not reported as "never retrieved"


def _settle(flight: asyncio.Future[Any], task: asyncio.Task[Any]) -> None:
    if flight.done():
        return
    if task.cancelled():
        flight.cancel()
    elif task.exception() is not None:
        flight.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        flight.set_result(task.result())


async def _to_the_end(step: Callable[[], Awaitable[Any]]) -> None:
    """Run ``step`` (a write of answers or a lock release: store operations, each bounded by the store's timeouts) to
    its end even when this task is cancelled meanwhile: a flight's task writes and releases after its callers went on,
    and a loop that ends then (``asyncio.run`` around each decision) cancels it. A step so cancelled is made once
    more (the same write, or the same token-checked release), then the cancellation goes on."""
    try:
        await step()
    except asyncio.CancelledError:
        await step()
        raise


async def _run(
    compute: Compute, request: SystemOneRequestV1, wait: float
) -> tuple[SystemOneResponseV1, dict[str, Any], SystemOneResponseV1, bool]:
    """Call ``compute`` within ``wait`` seconds and check its answers (the shared task must not outlive its callers'
    budget even when a backend ignores its timeout); the last value says whether they may be stored
    (:class:`Unstored`)."""
    try:
        async with asyncio.timeout(wait):
            result = await compute()
    except TimeoutError as exc:
        raise BackendTimeout(f"no answer within {wait * 1000:.0f} ms") from exc
    response = result.response if isinstance(result, Unstored) else result
    value, decoded = encode_checked(response, request)
    return response, value, decoded, not isinstance(result, Unstored)


def _failure_from_marker(raw: bytes, lock: bytes | None, budget: float) -> BackendError | None:
    """The error a leader's failure marker ``raw`` (checked) carries, or ``None`` when it names a lock other than
    ``lock`` (the one the follower waited on: an earlier leader's failure is not this flight's), or when it is a
    timeout for a shorter budget than the follower's ``budget`` (seconds): a call of its own may still answer."""
    try:
        info = json.loads(raw)
        reason, message, backend = str(info["reason"]), str(info["message"]), str(info.get("backend", ""))
        named, leader_budget = str(info["lock"]).encode(), float(info["budget"])
    except (ValueError, KeyError, TypeError):
        return None
    if named != lock or (reason == "timeout" and leader_budget < budget):
        return None
    text = f"leader's backend call failed: {message}"
    if reason == "timeout":
        return BackendTimeout(text, backend=backend)
    if reason.startswith(("unavailable", "http_")):
        return BackendUnavailable(text, backend=backend, reason=reason)
    return BackendError(text, backend=backend, reason=reason)
