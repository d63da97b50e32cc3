"""A token bucket per key (a reviewer's token, a client address), in process: ``rate`` requests per second on
average, bursts of up to ``burst``.

Each key's bucket holds up to ``burst`` tokens and refills at ``rate`` per second; a request takes one, and is
refused while the bucket is empty. At most ``max_keys`` buckets are kept: when full, a new key drops the least
recently used bucket if it has refilled completely (it carries no state a new one would not), in constant time;
else the new key shares one overflow bucket with every other key that found no room, so rotating through more keys
than the table holds buys no more than one bucket's rate (a new client may wait on that shared bucket while
such a flood lasts). Every replica limits on its own, so N replicas let through up to N times
the rate. A client is keyed by :func:`client_key`: an IPv6 client by its /64 network, since one host commonly has
all of one.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import OrderedDict

__all__ = ["TokenBuckets", "client_key"]


#: IPv6 prefixes whose last 32 bits are an IPv4 client's address: NAT64 (RFC 6052) and IPv4-translated (RFC 2765).
_EMBEDDING_IPV4 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("::ffff:0:0:0/96"))


@functools.lru_cache(maxsize=4096)
def client_key(client: str | None) -> str:
    """What limits and quotas count one client by: an IPv6 address's /64 network (``2001:db8::/64``: a host gets a
    whole /64 and can send from any address in it), or the IPv4 address one carries (NAT64, 6to4, Teredo: the /64
    is a gateway's there, shared by many clients); else the client as given (an IPv4 address, a name a trusted
    header gave, ``""`` for none)."""
    if not client:
        return ""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if not isinstance(address, ipaddress.IPv6Address):
        return client
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if any(address in network for network in _EMBEDDING_IPV4):
        return str(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    if address.teredo is not None:
        return str(address.teredo[1])
    if address.sixtofour is not None:
        return str(address.sixtofour)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class TokenBuckets:
    """Token buckets by key.

    Args:
        rate: tokens added per second (> 0).
        burst: most tokens a bucket holds (>= 1).
        max_keys: most buckets kept.

    Raises:
        ValueError: a rate or burst out of range.
    """

    def __init__(self, rate: float, burst: int, *, max_keys: int = 10_000) -> None:
        if not rate > 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"rate {rate} must be > 0, burst {burst} and max_keys {max_keys} at least 1")
        self.rate, self.burst, self.max_keys = float(rate), burst, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at), least recent first
        self._overflow = (float(burst), time.monotonic())  # shared by new keys while no bucket can be dropped

    def take(self, key: str) -> float:
        """Take one token for ``key``: ``0.0`` when allowed, else the seconds until one is available."""
        now = time.monotonic()
        if key in self._buckets or self._room(now):
            tokens, wait = self._spend(self._buckets.pop(key, (float(self.burst), now)), now)
            self._buckets[key] = (tokens, now)  # the most recently used
        else:
            tokens, wait = self._spend(self._overflow, now)
            self._overflow = (tokens, now)
        return wait

    def _spend(self, bucket: tuple[float, float], now: float) -> tuple[float, float]:
        """The tokens ``bucket`` (``(tokens, at)``) holds after refilling to ``now`` and taking one if it can, and
        the seconds to wait (``0.0`` when one was taken)."""
        tokens, at = bucket
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            return tokens - 1.0, 0.0
        return tokens, (1.0 - tokens) / self.rate

    def _room(self, now: float) -> bool:
        """Whether a new key gets a bucket of its own: the table has room, or its least recently used bucket has
        refilled completely (it is dropped)."""
        if len(self._buckets) < self.max_keys:
            return True
        tokens, at = next(iter(self._buckets.values()))
        if tokens + (now - at) * self.rate < self.burst:
            return False
        self._buckets.popitem(last=False)
        return True
