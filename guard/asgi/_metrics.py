"""Counters of the HTTP enforcement point, in a private Prometheus registry (one per middleware instance).

The engine counts decisions itself (OpenTelemetry ``guard.decisions``, ``guard.fail_open``); these count what only
the HTTP layer sees: responses by action, fail-open passes, targets and bodies refused before a decision, reviews and handoffs.
Label names follow the engine's attributes as Prometheus writes them (``guard.policy.id`` -> ``guard_policy_id``,
``guard.action`` -> ``guard_action``), so one query joins both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

__all__ = ["HttpMetrics"]


class HttpMetrics:
    """Prometheus counters for one :class:`~guard.asgi.GuardMiddleware`.

    Attributes:
        registry: the private registry; :meth:`render` writes it in the text exposition format.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "guard_http_guarded_requests", "Guarded requests by policy and action.", ["guard_policy_id", "guard_action"],
            registry=self.registry,
        )  # fmt: skip
        self.responses = Counter(
            "guard_http_judged_responses", "Upstream responses judged by a response policy, by policy and action.",
            ["guard_policy_id", "guard_action"], registry=self.registry,
        )  # fmt: skip
        self.fail_open = Counter(
            "guard_http_fail_open",
            "Requests passed without a decision because the policy fails open.",
            ["guard_policy_id"],
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
            "Requests refused before matching: a target that is not a canonical origin-form path, a method override, a "
            "body on a method no policy judges, a repeated tenant header.",
            ["code"],
            registry=self.registry,
        )
        self.reviews = Counter(
            "guard_http_reviews", "Review events: created, released, refused.", ["event"], registry=self.registry
        )
        self.handoffs = Counter("guard_http_handoffs", "LLM handoffs by outcome.", ["outcome"], registry=self.registry)
        self.upstream_errors = Counter(
            "guard_proxy_upstream_errors",
            "Proxy upstream failures by kind: timeout, unavailable, broken_stream, busy.",
            ["kind"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "guard_http_client_disconnects", "Clients that left before the body was read.", registry=self.registry
        )

    def count_request(self, policy: str, action: str) -> None:
        """Add one to ``guard_http_guarded_requests_total{guard_policy_id, guard_action}``."""
        self.requests.labels(policy, action).inc()

    def render(self) -> bytes:
        """The counters in Prometheus text format."""
        return generate_latest(self.registry)
