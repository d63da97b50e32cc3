"""Cross-request micro-batching: many concurrent callers, few full prefill batches, one inference thread.

Key components:

* :class:`BatcherConfig`: the limits (batch size, padded-token budget, longest wait, queue bound, length bucketing).
* :class:`MicroBatcher`: an asyncio queue in front of one synchronous ``run_batch`` callable that runs on a single
  dedicated thread, so the event loop never blocks on torch.

How a batch forms: the oldest waiting request anchors the batch; the
batcher waits until that request has waited ``max_wait_ms`` or the queue already holds a full batch (``max_batch``
requests or ``max_batch_tokens`` tokens), then adds the waiting requests whose lengths are closest to the anchor's,
as long as the padded cost ``longest × count`` stays within ``max_batch_tokens`` and the longest is at most
``max_length_ratio`` times the shortest (records are right-padded to the longest, so very different lengths would
pad each other to waste). Requests whose caller went away or whose deadline passed are dropped before compute. While
one batch computes, new requests queue up and form the next one.

Typical usage::

    config = BatcherConfig(max_batch=32, max_wait_ms=2.0)
    async with MicroBatcher(run_batch, tokens=lambda item: item.length, config=config) as batcher:
        result = await batcher.submit(item, timeout=0.5)

This module is generic (no torch, no HTTP) so :class:`guard.backends.local.LocalBackend` and the worker share it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from guard.backends._batch_types import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_LENGTH_RATIO,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT_MS,
    MIN_RETRY_AFTER_S,
    BatcherConfig,
    BatcherState,
    BatcherStats,
    BatchInfo,
)
from guard.errors import BackendTimeout, Overloaded

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_LENGTH_RATIO",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_WAIT_MS",
    "BatchInfo",
    "BatcherConfig",
    "BatcherState",
    "BatcherStats",
    "MicroBatcher",
]

logger = logging.getLogger("guard.worker")

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

_EWMA_ALPHA = 0.2


@dataclass(eq=False, slots=True)
class _Pending(Generic[ItemT, ResultT]):
    """One waiting request: its item, length, future and deadline (loop time), kept off the batcher."""

    item: ItemT
    tokens: int
    future: asyncio.Future[ResultT]
    enqueued_at: float
    deadline: float | None
    timeout: float | None = None
    timed_out: bool = False
    arrival_gap: float = float("inf")

    def alive(self) -> bool:
        return not self.future.done()


class MicroBatcher(Generic[ItemT, ResultT]):
    """Coalesces concurrent ``submit`` calls into batches for one synchronous ``run_batch`` on one thread.

    Args:
        run_batch: ``run_batch(items) -> results``, one result per item in the same order; called on the batcher's
            single inference thread, never on the event loop. If it raises, each request of a multi-request batch is
            rerun alone so that only the request at fault fails.
        tokens: the length of one item in tokens (an int >= 1), used for the padded-token budget and bucketing.
        config: limits; :class:`BatcherConfig` defaults when ``None``.
        on_batch: called on the event loop after every forward pass with a :class:`BatchInfo` (for metrics); errors
            it raises are logged and ignored.
        name: what the queue is called in error messages.

    Example:
        >>> async def main():
        ...     async with MicroBatcher(lambda xs: [x * 2 for x in xs], tokens=lambda x: 1) as batcher:
        ...         return await asyncio.gather(*(batcher.submit(i) for i in range(4)))
        >>> asyncio.run(main())
        [0, 2, 4, 6]
    """

    def __init__(
        self,
        run_batch: Callable[[Sequence[ItemT]], Sequence[ResultT]],
        *,
        tokens: Callable[[ItemT], int],
        config: BatcherConfig | None = None,
        on_batch: Callable[[BatchInfo], None] | None = None,
        name: str = "decision queue",
    ) -> None:
        self.config = config if config is not None else BatcherConfig()
        self.name = name
        self._run_batch = run_batch
        self._tokens = tokens
        self.on_batch = on_batch
        self._state = BatcherState.UNOPENED
        self._stats = BatcherStats()
        self._queue: deque[_Pending[ItemT, ResultT]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._collector: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight = 0
        self._avg_batch_s = 0.0
        self._avg_batch_size = 1.0
        self._last_arrival = float("-inf")

    def __repr__(self) -> str:
        return f"MicroBatcher(name={self.name!r}, state={self._state.value}, queue={len(self._queue)}, {self.config!r})"

    # ---------------------------------------------------------------------------------------------------- lifecycle

    @property
    def state(self) -> BatcherState:
        """Where the batcher is in its lifecycle (:class:`BatcherState`)."""
        return self._state

    @property
    def stats(self) -> BatcherStats:
        """The live counters (read them, do not change them)."""
        return self._stats

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch; one whose caller left or whose deadline passed leaves the queue (and this
        count) at once."""
        return len(self._queue)

    def check_room(self) -> None:
        """Refuse as :meth:`submit` would when ``max_queue`` live requests are already waiting, without queueing
        anything: a server checks before reading and parsing a request it could not queue.

        Raises:
            Overloaded: the queue is full (counted in ``stats.rejected``).
        """
        if len(self._queue) >= self.config.max_queue and not all(p.alive() for p in self._queue):
            self._drop_finished()
        if len(self._queue) >= self.config.max_queue:
            self._stats.rejected += 1
            raise Overloaded(self.name, self.config.max_queue, self._retry_after())

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop ``start()`` ran on (``None`` before); ``submit`` works only there."""
        return self._loop

    @property
    def in_flight(self) -> int:
        """Requests in the batch being computed now."""
        return self._in_flight

    async def start(self) -> None:
        """Start the collector task and the inference thread on the running event loop.

        Raises:
            RuntimeError: when already started or closed (a batcher is never reopened).
        """
        if self._state is not BatcherState.UNOPENED:
            raise RuntimeError(f"Cannot start a MicroBatcher that is {self._state.value}; create a new one.")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-inference")
        self._state = BatcherState.RUNNING
        self._collector = self._loop.create_task(self._collect(), name=f"guard-batcher:{self.name}")

    async def aclose(self) -> None:
        """Stop accepting requests, finish every queued request, then stop the inference thread. Idempotent."""
        if self._state is BatcherState.UNOPENED:
            self._state = BatcherState.CLOSED
            return
        if self._state is BatcherState.RUNNING:
            self._state = BatcherState.CLOSING
            assert self._wake is not None
            self._wake.set()
        if self._collector is not None:
            await asyncio.shield(self._collector)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._state = BatcherState.CLOSED

    async def __aenter__(self) -> MicroBatcher[ItemT, ResultT]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------------------------------------- submit

    async def submit(self, item: ItemT, *, timeout: float | None = None) -> ResultT:
        """Queue one item and wait for its result.

        Args:
            item: what ``run_batch`` receives.
            timeout: seconds the caller will wait, queue and compute together; ``None`` waits for the result. A
                request still queued at its deadline is dropped before compute.

        Returns:
            The item's result from ``run_batch``.

        Raises:
            Overloaded: at once, when ``max_queue`` live requests are already waiting.
            BackendTimeout: when no result arrived within ``timeout``.
            RuntimeError: when the batcher is not running (not started, closing or closed) or runs on another loop.
            ValueError: when ``tokens(item)`` is not an int >= 1, or ``timeout`` is not a number > 0.
            Exception: whatever ``run_batch`` raised for this item.
        """
        if self._state is not BatcherState.RUNNING:
            if self._state is BatcherState.UNOPENED:
                raise RuntimeError("MicroBatcher has not been started; call start() or use 'async with' first.")
            raise RuntimeError(f"Cannot submit to a MicroBatcher that is {self._state.value}.")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise RuntimeError("MicroBatcher.submit was called from a different event loop than start().")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0 or not math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        length = self._tokens(item)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"tokens(item) must be an integer >= 1, got {length!r}")
        self.check_room()
        now = loop.time()
        future: asyncio.Future[ResultT] = loop.create_future()
        deadline = now + timeout if timeout is not None else None
        pending = _Pending(item, length, future, now, deadline, timeout, arrival_gap=now - self._last_arrival)
        self._last_arrival = now
        self._queue.append(pending)
        future.add_done_callback(lambda _: self._discard(pending))
        self._stats.submitted += 1
        assert self._wake is not None
        self._wake.set()
        if deadline is None:
            return await future
        timer = loop.call_at(deadline, self._expire, pending)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, pending: _Pending[ItemT, ResultT]) -> None:
        """Deadline timer: answer the caller with ``BackendTimeout``; the collector then drops or discards it."""
        if pending.alive():
            pending.timed_out = True
            pending.future.set_exception(
                BackendTimeout(
                    f"no answer from the {self.name} within {(pending.timeout or 0.0) * 1000:g} ms", backend=self.name
                )
            )

    def _retry_after(self) -> float:
        """Seconds until the queue should have drained, from the running averages; at least ``MIN_RETRY_AFTER_S``."""
        batches_ahead = math.ceil(len(self._queue) / max(self._avg_batch_size, 1.0)) + 1
        return float(max(MIN_RETRY_AFTER_S, math.ceil(batches_ahead * self._avg_batch_s)))

    # ----------------------------------------------------------------------------------------------------- collector

    async def _collect(self) -> None:
        assert self._wake is not None and self._loop is not None
        while True:
            self._prune_head()
            if not self._queue:
                if self._state is not BatcherState.RUNNING:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch: list[_Pending[ItemT, ResultT]] = []
            try:
                if self._state is BatcherState.RUNNING:
                    await self._wait_for_fill()
                batch = self._take_batch()
                if batch:
                    await self._run(batch)
            except Exception as exc:  # pragma: no cover - a bug here must not leave callers waiting forever
                logger.exception("micro-batcher collector error; failing the affected requests")
                for pending in batch or list(self._queue):
                    self._fail(pending, RuntimeError(f"{self.name} failed internally: {exc}"))
                if not batch:
                    self._queue.clear()

    def _prune_head(self) -> None:
        """Drop finished (cancelled or timed-out) requests from the head, so the oldest live one anchors."""
        while self._queue and not self._queue[0].alive():
            self._count_dropped(self._queue.popleft())

    def _drop_finished(self) -> None:
        """Drop every finished (cancelled or timed-out) request from the queue, wherever it sits: a full queue is
        checked for live requests before anyone is refused, since a request finished this loop turn leaves the queue
        only when its done callback runs, a turn later. Called only when one has (a full queue of live requests
        costs a refusal one pass over it, no copy)."""
        live = []
        for pending in self._queue:
            if pending.alive():
                live.append(pending)
            else:
                self._count_dropped(pending)
        self._queue.clear()
        self._queue.extend(live)

    def _discard(self, pending: _Pending[ItemT, ResultT]) -> None:
        """Done callback of a request: one answered while still queued (its caller left, its deadline passed) leaves
        the queue at once, not when the next batch forms, so ``queue_depth`` (what the autoscaler reads) counts only
        live requests. One already taken into a batch or dropped is not in the queue and was counted there; one
        answered by its batch never is (no pass over the queue for it)."""
        if not (pending.future.cancelled() or pending.timed_out):
            return
        try:
            self._queue.remove(pending)
        except ValueError:
            return
        self._count_dropped(pending)

    def _count_dropped(self, pending: _Pending[ItemT, ResultT]) -> None:
        if pending.timed_out:
            self._stats.expired += 1
        else:
            self._stats.cancelled += 1

    def _queue_full(self) -> bool:
        if len(self._queue) >= self.config.max_batch:
            return True
        return sum(p.tokens for p in self._queue) >= self.config.max_batch_tokens

    async def _wait_for_fill(self) -> None:
        """Wait until the oldest request has waited ``max_wait_ms``, a full batch is queued, or closing begins."""
        assert self._wake is not None and self._loop is not None
        oldest = self._queue[0]
        max_wait = self.config.max_wait_ms / 1000.0
        if len(self._queue) == 1 and oldest.arrival_gap > max_wait:
            return  # sparse traffic: nobody arrived within max_wait before it, so waiting would only add latency
        limit = oldest.enqueued_at + max_wait
        while self._state is BatcherState.RUNNING and not self._queue_full():
            remaining = limit - self._loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Pending[ItemT, ResultT]]:
        """Remove and return the next batch: the oldest live request plus the closest lengths that fit."""
        assert self._loop is not None
        now = self._loop.time()
        live: list[_Pending[ItemT, ResultT]] = []
        for pending in self._queue:
            if pending.alive() and pending.deadline is not None and now >= pending.deadline:
                self._expire(pending)
            if pending.alive():
                live.append(pending)
            else:
                self._count_dropped(pending)
        self._queue.clear()
        if not live:
            return []
        anchor, rest = live[0], live[1:]
        config = self.config
        batch = [anchor]
        shortest = longest = anchor.tokens
        for pending in sorted(rest, key=lambda p: abs(math.log(p.tokens / anchor.tokens))):
            if len(batch) >= config.max_batch:
                break
            low, high = min(shortest, pending.tokens), max(longest, pending.tokens)
            if high > low * config.max_length_ratio or high * (len(batch) + 1) > config.max_batch_tokens:
                continue
            batch.append(pending)
            shortest, longest = low, high
        chosen = set(map(id, batch))
        self._queue.extend(p for p in rest if id(p) not in chosen)
        return batch

    async def _run(self, batch: list[_Pending[ItemT, ResultT]]) -> None:
        """Compute one batch on the inference thread and resolve each request's future."""
        assert self._loop is not None
        self._in_flight = len(batch)
        try:
            try:
                results = await self._compute(batch)
            except Exception as exc:  # noqa: BLE001 - whatever run_batch raised belongs to its callers
                if len(batch) == 1:
                    self._fail(batch[0], exc)
                    return
                logger.warning("batch of %d failed (%s); rerunning each request alone", len(batch), exc)
                for pending in batch:
                    if not pending.alive():
                        continue
                    try:
                        (result,) = await self._compute([pending])
                    except Exception as single_exc:  # noqa: BLE001 - delivered to this request's caller
                        self._fail(pending, single_exc)
                    else:
                        self._succeed(pending, result)
                return
            for pending, result in zip(batch, results, strict=True):
                self._succeed(pending, result)
        finally:
            self._in_flight = 0
            if self._queue:
                assert self._wake is not None
                self._wake.set()

    async def _compute(self, batch: list[_Pending[ItemT, ResultT]]) -> Sequence[ResultT]:
        assert self._loop is not None and self._executor is not None
        items = [pending.item for pending in batch]
        started_loop = self._loop.time()
        started = time.perf_counter()
        self._stats.batches += 1
        self._stats.batched_requests += len(batch)
        ok = False
        try:
            results = await self._loop.run_in_executor(self._executor, self._run_batch_caught, items)
            if len(results) != len(items):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} items")
            ok = True
            return results
        finally:
            compute_s = time.perf_counter() - started
            self._avg_batch_s += _EWMA_ALPHA * (compute_s - self._avg_batch_s)
            self._avg_batch_size += _EWMA_ALPHA * (len(batch) - self._avg_batch_size)
            if self.on_batch is not None:
                info = BatchInfo(
                    size=len(batch),
                    tokens=sum(p.tokens for p in batch),
                    padded_tokens=max(p.tokens for p in batch) * len(batch),
                    max_queue_wait_s=max(started_loop - p.enqueued_at for p in batch),
                    compute_s=compute_s,
                    ok=ok,
                )
                try:
                    self.on_batch(info)
                except Exception:  # a metrics hook must never break serving
                    logger.exception("on_batch hook failed")

    def _run_batch_caught(self, items: list[ItemT]) -> Sequence[ResultT]:
        """``run_batch`` on the inference thread, a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
        a library's own) raised as a ``RuntimeError``: it fails the batch's requests, as any error does, where it
        would have ended the collector and left every later request waiting."""
        try:
            return self._run_batch(items)
        except Exception:
            raise
        except BaseException as exc:
            raise RuntimeError(f"run_batch raised {type(exc).__name__}: {exc}") from exc

    def _succeed(self, pending: _Pending[ItemT, ResultT], result: ResultT) -> None:
        if pending.alive():
            pending.future.set_result(result)
            self._stats.completed += 1

    def _fail(self, pending: _Pending[ItemT, ResultT], exc: BaseException) -> None:
        if pending.alive():
            pending.future.set_exception(exc)
            self._stats.failed += 1
