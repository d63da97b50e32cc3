"""Counters of the HTTP enforcement point, as OpenTelemetry instruments (meter ``guard.http``).

The engine counts decisions itself (``guard.decisions``, ``guard.fail_open``); these count what only the HTTP layer
sees: responses by action, fail-open passes, targets and bodies refused before a decision, reviews and handoffs.
Attributes are the engine's (``guard.policy.id``, ``guard.action``), so Prometheus writes the same label names for
both (``guard_policy_id``, ``guard_action``) and one query joins them.

=====================================================================  ===============================================
``guard_http_guarded_requests_total{guard_policy_id, guard_action}``   requests decided, by policy and action
``guard_http_judged_responses_total{guard_policy_id, guard_action}``   upstream responses a response policy judged
``guard_http_fail_open_total{guard_policy_id}``                        requests passed undecided (an enforced fail-open)
``guard_http_body_rejections_total{code}``                             bodies that could not be inspected
``guard_http_target_rejections_total{code}``                           targets refused before matching
``guard_http_reviews_total{event}``                                    review events (created, released, refused, ...)
``guard_http_handoffs_total{outcome}``                                 LLM handoffs by outcome
``guard_proxy_upstream_errors_total{kind}``                            upstream failures (timeout, unavailable, ...)
``guard_http_client_disconnects_total``                                clients that left before the body was read, or
                                                                       (proxy) while their response was relayed
=====================================================================  ===============================================
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from prometheus_client import CollectorRegistry, generate_latest

from guard import __version__

__all__ = ["HttpMetrics"]


class HttpMetrics:
    """The counters of one :class:`~guard.asgi.GuardMiddleware` (and of the proxy in front of it).

    Args:
        meter_provider: where the counters live, e.g. the global SDK provider ``guard proxy`` installs from the
            ``OTEL_*`` variables (its readers export them: OTLP, Prometheus on the process registry); :meth:`render`
            then writes nothing. ``None``: a private provider with a Prometheus reader on a private registry, which
            :meth:`render` writes (several middlewares in one process never mix their series).
    """

    def __init__(self, *, meter_provider: MeterProvider | None = None) -> None:
        self.registry: CollectorRegistry | None = None
        if meter_provider is None:
            self.registry = CollectorRegistry(auto_describe=True)
            # no target_info (the process registry's reader writes it; /_guard/metrics serves both) and no otel_scope_*
            reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=self.registry)
            meter_provider = SdkMeterProvider(metric_readers=[reader])
        meter = meter_provider.get_meter("guard.http", __version__)

        def counter(name: str, description: str) -> Any:
            return meter.create_counter(name, unit="1", description=description)

        self._requests = counter("guard.http.guarded_requests", "Guarded requests by policy and action.")
        self._responses = counter(
            "guard.http.judged_responses", "Upstream responses judged by a response policy, by policy and action."
        )
        self._fail_open = counter(
            "guard.http.fail_open", "Requests passed without a decision because the policy fails open."
        )
        self._body_rejections = counter(
            "guard.http.body_rejections", "Requests refused before a decision because the body could not be inspected."
        )
        self._target_rejections = counter(
            "guard.http.target_rejections",
            "Requests refused before matching: a target that is not a canonical origin-form path, a method override, a "
            "body on a method no policy judges, a repeated tenant header.",
        )
        self._reviews = counter("guard.http.reviews", "Review events: created, released, refused.")
        self._handoffs = counter("guard.http.handoffs", "LLM handoffs by outcome.")
        self._upstream_errors = counter(
            "guard.proxy.upstream_errors", "Proxy upstream failures by kind: timeout, unavailable, broken_stream, busy."
        )
        self._disconnects = counter(
            "guard.http.client_disconnects",
            "Clients that left before the body was read, or while the proxy relayed their response.",
        )

    def count_request(self, policy: str, action: str) -> None:
        """One request decided by ``policy`` with ``action``."""
        self._requests.add(1, {"guard.policy.id": policy, "guard.action": action})

    def count_response(self, policy: str, action: str) -> None:
        """One upstream response judged by the response policy ``policy`` with ``action``."""
        self._responses.add(1, {"guard.policy.id": policy, "guard.action": action})

    def count_fail_open(self, policy: str) -> None:
        """One request passed undecided because ``policy`` (enforced) failed open."""
        self._fail_open.add(1, {"guard.policy.id": policy})

    def count_body_rejection(self, code: str) -> None:
        """One request refused because its body could not be inspected (``code``: the 4xx body's code)."""
        self._body_rejections.add(1, {"code": code})

    def count_target_rejection(self, code: str) -> None:
        """One request refused before matching (``code``: the 4xx body's code)."""
        self._target_rejections.add(1, {"code": code})

    def count_review(self, event: str) -> None:
        """One review event (``created``, ``released``, ``refused``, ``client_quota``, ``store_unavailable``)."""
        self._reviews.add(1, {"event": event})

    def count_handoff(self, outcome: str) -> None:
        """One LLM handoff with ``outcome``."""
        self._handoffs.add(1, {"outcome": outcome})

    def count_upstream_error(self, kind: str) -> None:
        """One upstream failure of the proxy (``timeout``, ``unavailable``, ``broken_stream``, ``busy``)."""
        self._upstream_errors.add(1, {"kind": kind})

    def count_disconnect(self) -> None:
        """One client that left before its body was read, or while the proxy relayed its response."""
        self._disconnects.add(1)

    def render(self) -> bytes:
        """The private registry in Prometheus text format (empty with a ``meter_provider`` given)."""
        return b"" if self.registry is None else generate_latest(self.registry)
