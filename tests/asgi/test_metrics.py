"""The HTTP enforcement point's Prometheus counters (guard/asgi/_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.parser import text_string_to_metric_families

from guard.asgi._metrics import HttpMetrics


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["guard_policy_id"], s.labels["guard_action"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_guarded_requests_are_written_as_a_prometheus_counter_writes_them() -> None:
    metrics = HttpMetrics()
    reference_registry = CollectorRegistry(auto_describe=True)
    reference = Counter("guard_http_guarded_requests", "Guarded requests by policy and action.",
                        ["guard_policy_id", "guard_action"], registry=reference_registry)  # fmt: skip
    for policy, action in [("api", "allow"), ("api", "allow"), ("api", "block"), ("tools", "escalate")]:
        metrics.count_request(policy, action)
        reference.labels(policy, action).inc()
    ours, theirs = metrics.render().decode(), generate_latest(reference_registry).decode()
    assert _samples(ours, "guard_http_guarded_requests_total") == {
        ("api", "allow"): 2.0, ("api", "block"): 1.0, ("tools", "escalate"): 1.0
    }  # fmt: skip
    assert _samples(ours, "guard_http_guarded_requests_total") == _samples(theirs, "guard_http_guarded_requests_total")
    assert _samples(ours, "guard_http_guarded_requests_created").keys() == _samples(
        theirs, "guard_http_guarded_requests_created"
    ).keys()
    header = [line for line in ours.splitlines() if "guard_http_guarded_requests_total" in line and line[0] == "#"]
    assert header == [line for line in theirs.splitlines() if "guarded_requests_total" in line and line[0] == "#"]


def test_guarded_requests_honour_disabled_created_series(monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``prometheus_client.disable_created_metrics()`` a labelled Counter writes no ``_created`` line; nor do
    these."""
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    metrics = HttpMetrics()
    metrics.count_request("p", "allow")
    text = metrics.render().decode()
    assert 'guard_http_guarded_requests_total{guard_action="allow",guard_policy_id="p"} 1.0' in text
    assert "_created" not in text
