"""OpenTelemetry set up from the standard ``OTEL_*`` variables, for the long-running commands (``proxy``, ``worker
serve``). ``opentelemetry-instrument`` works too: a provider it installed first is kept."""

from __future__ import annotations

import os

__all__ = ["install_metrics_from_env", "install_tracing_from_env", "shutdown_providers"]


def install_metrics_from_env() -> None:
    """Install the meter provider the ``OTEL_METRICS_EXPORTER`` variables describe (once per process): the engine's
    metrics on /_guard/metrics (``prometheus``, the default) and/or pushed over OTLP or to the console. Raises
    ValueError for an unknown exporter."""
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider

    from guard._resource import resource_from_env
    from guard.engine.telemetry import metric_readers_from_env

    if not isinstance(metrics.get_meter_provider(), MeterProvider):
        readers, prometheus = metric_readers_from_env(os.environ)
        # no otel_scope_* labels: the series keep the label names the docs list, and an upgrade starts no new ones
        scraped = [PrometheusMetricReader(scope_info_enabled=False)] if prometheus else []
        # the spans' resource (service name ``guard`` unless OTEL_SERVICE_NAME says otherwise), so the two join
        resource = resource_from_env(os.environ, "guard")
        metrics.set_meter_provider(MeterProvider(metric_readers=[*scraped, *readers], resource=resource))


def install_tracing_from_env() -> None:
    """Install the tracer provider the ``OTEL_*`` variables describe (once per process; none when they ask for
    none). Raises ValueError for an unknown ``OTEL_TRACES_EXPORTER``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from guard.engine.telemetry import tracer_provider_from_env

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return  # already configured, e.g. by opentelemetry-instrument
    provider = tracer_provider_from_env(os.environ)
    if provider is not None:
        trace.set_tracer_provider(provider)


def shutdown_providers() -> None:
    """Shut the global tracer and meter providers down (their last exports) within
    :data:`guard._close.CLOSE_TIMEOUT_S` seconds, before the exit hooks the SDK registered would do it and wait for a
    collector that never answers (about ``OTEL_EXPORTER_OTLP_TIMEOUT`` a batch)."""
    from opentelemetry import metrics, trace

    from guard._close import close_within

    providers = {"the trace shutdown": trace.get_tracer_provider(), "the metrics shutdown": metrics.get_meter_provider()}
    # the SDK's providers; the default no-op ones have no shutdown
    close_within({name: p.shutdown for name, p in providers.items() if callable(getattr(p, "shutdown", None))})
