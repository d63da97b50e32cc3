"""The HTTP enforcement point's counters (guard/asgi/_metrics.py): Prometheus text from the private registry, and the
same counters on a given meter provider (what ``guard proxy`` exports over OTLP)."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from guard.asgi._metrics import HttpMetrics


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["guard_policy_id"], s.labels["guard_action"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _count(metrics: HttpMetrics) -> None:
    for policy, action in [("api", "allow"), ("api", "allow"), ("api", "block"), ("tools", "escalate")]:
        metrics.count_request(policy, action)
    metrics.count_review("created")
    metrics.count_upstream_error("timeout")


def test_the_private_registry_writes_prometheus_counters_with_the_engines_label_names() -> None:
    metrics = HttpMetrics()
    _count(metrics)
    text = metrics.render().decode()
    assert _samples(text, "guard_http_guarded_requests_total") == {
        ("api", "allow"): 2.0, ("api", "block"): 1.0, ("tools", "escalate"): 1.0
    }  # fmt: skip
    assert "# TYPE guard_http_guarded_requests_total counter" in text
    assert "# HELP guard_http_guarded_requests_total Guarded requests by policy and action." in text
    assert 'guard_http_reviews_total{event="created"' in text and 'guard_proxy_upstream_errors_total{kind="timeout"' in text
    assert "target_info" not in text  # the process registry's reader writes it; /_guard/metrics serves both
    assert _samples(HttpMetrics().render().decode(), "guard_http_guarded_requests_total") == {}  # one per instance


def test_on_a_given_provider_the_counters_reach_its_readers_and_render_writes_nothing() -> None:
    reader = InMemoryMetricReader()
    metrics = HttpMetrics(meter_provider=MeterProvider(metric_readers=[reader]))
    _count(metrics)
    assert metrics.render() == b""
    points = {
        (metric.name, tuple(sorted(point.attributes.items()))): point.value
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    }
    assert points == {
        ("guard.http.guarded_requests", (("guard.action", "allow"), ("guard.policy.id", "api"))): 2,
        ("guard.http.guarded_requests", (("guard.action", "block"), ("guard.policy.id", "api"))): 1,
        ("guard.http.guarded_requests", (("guard.action", "escalate"), ("guard.policy.id", "tools"))): 1,
        ("guard.http.reviews", (("event", "created"),)): 1,
        ("guard.proxy.upstream_errors", (("kind", "timeout"),)): 1,
    }
