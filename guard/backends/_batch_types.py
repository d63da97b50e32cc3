"""Value types of the micro-batcher: its configuration (with the named defaults), lifecycle state and counters."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_LENGTH_RATIO",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_WAIT_MS",
    "MIN_RETRY_AFTER_S",
    "BatchInfo",
    "BatcherConfig",
    "BatcherState",
    "BatcherStats",
]

#: Most requests in one forward pass.
DEFAULT_MAX_BATCH = 32
#: Most padded tokens (``longest record × batch size``) in one forward pass.
DEFAULT_MAX_BATCH_TOKENS = 32_768
#: Longest time the oldest waiting request is held back so that others can join its batch.
DEFAULT_MAX_WAIT_MS = 3.0
#: Most requests waiting (not counting the batch being computed); beyond it ``submit`` raises ``Overloaded``.
DEFAULT_MAX_QUEUE = 1024
#: Longest record in a batch is at most this many times the shortest one.
DEFAULT_MAX_LENGTH_RATIO = 2.0
#: Floor of the ``retry_after`` hint given with ``Overloaded``, in seconds.
MIN_RETRY_AFTER_S = 1.0


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BatcherConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class BatcherConfig:
    """Limits of a :class:`MicroBatcher`, validated at construction.

    Attributes:
        max_batch: most requests in one forward pass (``1`` turns batching off).
        max_batch_tokens: most padded tokens in one forward pass, ``longest record × batch size``; a single record
            longer than this still runs, alone.
        max_wait_ms: milliseconds the oldest waiting request may be held so that others can join (``0``: never wait;
            requests still coalesce while the previous batch computes). A request alone in the queue whose
            predecessor arrived more than ``max_wait_ms`` earlier is not held (sparse traffic gains nothing by it).
        max_queue: most requests waiting for a batch; when full, ``submit`` raises ``Overloaded`` at once.
        max_length_ratio: a batch's longest record is at most this many times its shortest (``math.inf`` disables
            length bucketing).

    Raises:
        ValueError: naming the field, the value and the allowed range.

    Example:
        >>> BatcherConfig(max_batch=1)  # batching off
        BatcherConfig(max_batch=1, max_batch_tokens=32768, max_wait_ms=3.0, max_queue=1024, max_length_ratio=2.0)
    """

    max_batch: int = DEFAULT_MAX_BATCH
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    max_queue: int = DEFAULT_MAX_QUEUE
    max_length_ratio: float = DEFAULT_MAX_LENGTH_RATIO

    def __post_init__(self) -> None:
        _positive_int("max_batch", self.max_batch)
        _positive_int("max_batch_tokens", self.max_batch_tokens)
        _positive_int("max_queue", self.max_queue)
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not math.isfinite(wait) or wait < 0:
            raise ValueError(f"BatcherConfig.max_wait_ms must be a finite number >= 0, got {wait!r}")
        ratio = self.max_length_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio) or ratio < 1:
            raise ValueError(f"BatcherConfig.max_length_ratio must be a number >= 1 (or math.inf), got {ratio!r}")


class BatcherState(enum.Enum):
    """Lifecycle of a :class:`MicroBatcher`: ``UNOPENED -> RUNNING -> CLOSING -> CLOSED``; never reopened."""

    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class BatchInfo:
    """What one forward pass did; passed to the ``on_batch`` hook (metrics).

    Attributes:
        size: requests in the batch.
        tokens: real tokens (sum of record lengths).
        padded_tokens: ``longest × size``, what a right-padded prefill computes.
        max_queue_wait_s: seconds the longest-waiting request of the batch spent queued.
        compute_s: seconds ``run_batch`` took on the inference thread.
        ok: ``False`` when ``run_batch`` raised.
    """

    size: int
    tokens: int
    padded_tokens: int
    max_queue_wait_s: float
    compute_s: float
    ok: bool


@dataclass
class BatcherStats:
    """Running counters of a :class:`MicroBatcher` (monotonic since ``start()``).

    Attributes:
        submitted: requests accepted into the queue.
        completed: requests answered with a result.
        failed: requests answered with an exception from ``run_batch``.
        expired: requests dropped before compute because their deadline passed.
        cancelled: requests dropped before compute because their caller went away.
        rejected: ``submit`` (or ``check_room``) calls refused with ``Overloaded``.
        batches: calls of ``run_batch`` (forward passes), including single-request reruns after a failed batch.
        batched_requests: requests that went through ``run_batch`` (sum of batch sizes).
    """

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    expired: int = 0
    cancelled: int = 0
    rejected: int = 0
    batches: int = 0
    batched_requests: int = 0
