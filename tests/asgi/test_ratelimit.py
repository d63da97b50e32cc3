"""Token buckets by key: which bucket goes when ``max_keys`` are held (a fake clock; nothing here is timed)."""

from __future__ import annotations

import pytest

from guard.asgi import _ratelimit
from guard.asgi._ratelimit import TokenBuckets


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds ``time.monotonic`` answers in the module; set ``clock[0]`` to move time."""
    now = [0.0]
    monkeypatch.setattr(_ratelimit.time, "monotonic", lambda: now[0])
    return now


def _drain(buckets: TokenBuckets, key: str) -> None:
    while buckets.take(key) == 0.0:
        pass


def test_a_new_key_at_max_keys_drops_the_least_recently_used_bucket(clock: list[float]) -> None:
    buckets = TokenBuckets(1.0, 1, max_keys=2)
    _drain(buckets, "a")
    _drain(buckets, "b")
    assert buckets.take("a") > 0  # a is limited, and now the most recently used
    buckets.take("c")  # b goes, not a
    assert buckets.take("a") > 0
    assert buckets.take("b") == 0.0  # a new bucket: b's state was dropped


def test_the_least_recently_used_goes_even_when_another_bucket_has_refilled(clock: list[float]) -> None:
    """Dropping the least recently used bucket is what keeps a new key's cost constant: no bucket is scanned for
    one that has refilled."""
    buckets = TokenBuckets(1.0, 10, max_keys=2)
    _drain(buckets, "a")  # 0 of 10 tokens
    clock[0] = 1.0
    buckets.take("b")  # 9 of 10
    clock[0] = 6.0  # a has 6 tokens, b is full again
    buckets.take("c")  # a goes
    assert [buckets.take("a") for _ in range(10)] == [0.0] * 10  # a full new bucket, not one with 6 tokens
