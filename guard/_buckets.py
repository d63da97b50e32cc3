"""Histogram bucket bounds shared by every guard duration metric, in seconds.

They resolve 25 us steps at the bottom (a cache hit costs tens of microseconds) and reach 10 s (a cold model call):
25 us, 50 us, 100 us, 250 us, 500 us, 1 ms, 2.5 ms, ... 5 s, 10 s.
"""

from __future__ import annotations

__all__ = ["DURATION_BUCKETS_S"]

#: Upper bounds in seconds (Prometheus ``le``), for ``*_duration_seconds`` histograms.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
