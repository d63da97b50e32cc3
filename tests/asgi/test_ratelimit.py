"""Token buckets by key: which bucket goes when ``max_keys`` are held (a fake clock; nothing here is timed)."""

from __future__ import annotations

import pytest

from guard.asgi import _ratelimit
from guard.asgi._ratelimit import TokenBuckets, client_key


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


@pytest.mark.parametrize(("client", "key"), [
    ("2001:db8::1", "2001:db8::/64"), ("2001:db8::ffff:1", "2001:db8::/64"),  # one host's /64: one client
    ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
    ("198.51.100.7", "198.51.100.7"), ("::ffff:198.51.100.7", "198.51.100.7"),
    ("64:ff9b::198.51.100.1", "198.51.100.1"), ("64:ff9b::203.0.113.9", "203.0.113.9"),  # NAT64: a gateway's /64
    ("::ffff:0:192.0.2.77", "192.0.2.77"), ("2002:c000:204::1", "192.0.2.4"),  # IPv4-translated, 6to4
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.0.2.45"),  # Teredo: the client's IPv4 address
    ("unknown", "unknown"), (None, ""),
])  # fmt: skip
def test_client_key_counts_an_ipv6_host_by_its_64_and_an_embedded_ipv4_client_by_its_address(
    client: str | None, key: str
) -> None:
    assert client_key(client) == key
