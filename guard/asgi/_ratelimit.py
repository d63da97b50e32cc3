"""A token bucket per key (a reviewer's token, a client address), in process: ``rate`` requests per second on
average, bursts of up to ``burst``.

Each key's bucket holds up to ``burst`` tokens and refills at ``rate`` per second; a request takes one, and is
refused while the bucket is empty. At most ``max_keys`` buckets are kept: when full, a new key drops the least
recently used bucket, in constant time (it has been idle longest, so it is the first to have refilled completely
and carry no state a new one would not). Every replica limits on its own, so N replicas let through up to N times
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

    def take(self, key: str) -> float:
        """Take one token for ``key``: ``0.0`` when allowed, else the seconds until one is available."""
        now = time.monotonic()
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            self._store(key, tokens - 1.0, now)
            return 0.0
        self._store(key, tokens, now)
        return (1.0 - tokens) / self.rate

    def _store(self, key: str, tokens: float, now: float) -> None:
        """Keep ``key``'s bucket (:meth:`take` took it out) as the most recently used; at ``max_keys`` drop the least
        recently used one."""
        if len(self._buckets) >= self.max_keys:
            self._buckets.popitem(last=False)
        self._buckets[key] = (tokens, now)
