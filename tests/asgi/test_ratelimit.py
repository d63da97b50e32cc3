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


def test_a_new_key_at_max_keys_drops_the_least_recently_used_bucket_once_it_has_refilled(clock: list[float]) -> None:
    buckets = TokenBuckets(1.0, 1, max_keys=2)
    _drain(buckets, "a")
    _drain(buckets, "b")
    assert buckets.take("a") > 0  # a is limited, and now the most recently used
    assert buckets.take("c") == 0.0  # no bucket has refilled: c takes the shared overflow bucket's token
    assert buckets.take("b") > 0 and buckets.take("a") > 0 and buckets.take("d") > 0  # both kept; overflow spent
    clock[0] = 1.0  # both refilled: a new key drops the least recently used (b), in its own bucket
    assert buckets.take("e") == 0.0 and buckets.take("e") > 0
    assert buckets.take("a") == 0.0  # a was kept: its refilled token


def test_rotating_through_more_keys_than_the_table_holds_buys_no_more_than_one_bucket(clock: list[float]) -> None:
    """101 keys in turn against a table of 100 got every request through: each new key dropped the bucket of the
    key coming back next, which came back with a full burst (310,031 of 310,031 tries at the default 10,000)."""
    buckets = TokenBuckets(1.0, 3, max_keys=100)
    allowed = sum(buckets.take(f"k{i}") == 0.0 for _ in range(4) for i in range(101))
    assert allowed == 100 * 3 + 3  # each kept key's burst, and the overflow bucket's for the 101st


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
