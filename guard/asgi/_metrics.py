"""Counters of the HTTP enforcement point, in a private Prometheus registry (one per middleware instance).

The engine counts decisions itself (OpenTelemetry ``guard.decisions``, ``guard.fail_open``); these count what only
the HTTP layer sees: responses by action, fail-open passes, targets and bodies refused before a decision, reviews and handoffs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["HttpMetrics"]


class _GuardedRequests(Collector):
    """``guard_http_guarded_requests_total{policy, action}`` (and its ``_created``, as a ``Counter`` writes them),
    counted in a dict: one lock and one dict lookup per request, where a labelled ``Counter`` child's ``inc()`` runs
    four Python calls of prometheus_client (a noticeable part of a cache hit). The registry reads the counts when it
    renders them."""

    NAME = "guard_http_guarded_requests"
    HELP = "Guarded requests by policy and action."

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[float]] = {}  # (policy, action) -> [count, created (epoch s)]
        self._lock = threading.Lock()

    def inc(self, policy: str, action: str) -> None:
        key = (policy, action)
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:
                self._counts[key] = [1.0, time.time()]
            else:
                entry[0] += 1

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.HELP, labels=["policy", "action"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.NAME, self.HELP, labels=["policy", "action"])
        with self._lock:
            counts = [(key, entry[0], entry[1]) for key, entry in self._counts.items()]
        with_created = getattr(prometheus_metrics, "_use_created", True)  # off after disable_created_metrics()
        for (policy, action), count, created in counts:
            family.add_metric([policy, action], count, created=created if with_created else None)
        yield family


class HttpMetrics:
    """Prometheus counters for one :class:`~guard.asgi.GuardMiddleware`.

    Attributes:
        registry: the private registry; :meth:`render` writes it in the text exposition format.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = _GuardedRequests()
        self.registry.register(self.requests)
        self.fail_open = Counter(
            "guard_http_fail_open",
            "Requests passed without a decision because the policy fails open.",
            ["policy"],
            registry=self.registry,
        )
        self.body_rejections = Counter(
            "guard_http_body_rejections",
            "Requests refused before a decision because the body could not be inspected.",
            ["code"],
            registry=self.registry,
        )
        self.target_rejections = Counter(
            "guard_http_target_rejections",
            "Requests refused before matching because their target is not a canonical origin-form path.",
            ["code"],
            registry=self.registry,
        )
        self.reviews = Counter(
            "guard_http_reviews", "Review events: created, released, refused.", ["event"], registry=self.registry
        )
        self.handoffs = Counter("guard_http_handoffs", "LLM handoffs by outcome.", ["outcome"], registry=self.registry)
        self.upstream_errors = Counter(
            "guard_proxy_upstream_errors",
            "Proxy upstream failures by kind: timeout, unavailable, broken_stream.",
            ["kind"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "guard_http_client_disconnects", "Clients that left before the body was read.", registry=self.registry
        )

    def count_request(self, policy: str, action: str) -> None:
        """Add one to ``guard_http_guarded_requests_total{policy, action}``."""
        self.requests.inc(policy, action)

    def render(self) -> bytes:
        """The counters in Prometheus text format."""
        return generate_latest(self.registry)
