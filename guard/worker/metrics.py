"""The worker's OpenTelemetry metrics, exported in Prometheus text format on ``GET /metrics``.

Instruments (Prometheus names after OpenTelemetry's translation):

=====================================================  =========  ====================================================
``guard_worker_requests_total{outcome}``               counter    requests by outcome (``ok``, ``invalid``, ``timeout``,
                                                                  ``overloaded``, ``cancelled``, ``error``, ...)
``guard_worker_request_duration_seconds``              histogram  time from request to response, by outcome
``guard_worker_queue_depth``                           gauge      requests waiting for a batch
``guard_worker_in_flight``                             gauge      requests in the batch being computed
``guard_worker_body_bytes``                            gauge      bytes of request bodies held in memory (counted as
                                                                  they arrive, until answered)
``guard_worker_batch_size``                            histogram  requests per forward pass
``guard_worker_batch_tokens``                          histogram  real tokens per forward pass
``guard_worker_batch_padded_tokens``                   histogram  padded tokens (longest × size) per forward pass
``guard_worker_batch_queue_wait_seconds``              histogram  longest queue wait in each batch
``guard_worker_batch_compute_seconds``                 histogram  forward pass time on the inference thread
``guard_worker_forward_passes_total{ok}``              counter    forward passes
=====================================================  =========  ====================================================

Each :class:`WorkerMetrics` owns a private ``MeterProvider`` and Prometheus registry (so several workers in one
process, as in tests, never mix their series) unless a ``meter_provider`` is passed in, in which case the instruments
go to that provider's readers (OTLP, say) and ``/metrics`` serves nothing of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from guard._buckets import DURATION_BUCKETS_S
from guard._resource import resource_from_env
from guard.backends.batcher import BatchInfo

__all__ = ["PROMETHEUS_CONTENT_TYPE", "WorkerMetrics"]

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Histogram bucket boundaries (seconds for durations: guard's shared 25 us - 10 s bounds plus 30 s, the longest
#: default deadline; counts for sizes).
LATENCY_BUCKETS_S = (*DURATION_BUCKETS_S, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144)

_METER_NAME = "guard.worker"
#: ``service.name`` of the private provider's resource.
SERVICE_NAME = "guard-worker"


def _views() -> list[View]:
    def histogram(name: str, buckets: Iterable[float]) -> View:
        return View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(tuple(buckets)))

    return [
        histogram("guard.worker.request.duration", LATENCY_BUCKETS_S),
        histogram("guard.worker.batch.queue_wait", LATENCY_BUCKETS_S),
        histogram("guard.worker.batch.compute", LATENCY_BUCKETS_S),
        histogram("guard.worker.batch.size", BATCH_SIZE_BUCKETS),
        histogram("guard.worker.batch.tokens", TOKEN_BUCKETS),
        histogram("guard.worker.batch.padded_tokens", TOKEN_BUCKETS),
    ]


class WorkerMetrics:
    """Request and batch metrics of one worker.

    Args:
        meter_provider: where the instruments live; ``None`` builds a private SDK provider with a Prometheus reader
            on a private registry, rendered by :meth:`render`.
        extra_readers: more readers for the private provider (OTLP or console, from
            :func:`guard.engine.telemetry.metric_readers_from_env`).

    Example:
        >>> metrics = WorkerMetrics()
        >>> metrics.request_done("ok", 0.012)
        >>> b"guard_worker_requests_total" in metrics.render()
        True
    """

    def __init__(self, *, meter_provider: MeterProvider | None = None, extra_readers: Sequence[Any] = ()) -> None:
        self.registry: CollectorRegistry | None = None
        self._own_provider: SdkMeterProvider | None = None
        if meter_provider is None:
            self.registry = CollectorRegistry(auto_describe=True)
            reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)  # no otel_scope_* labels
            self._own_provider = SdkMeterProvider(
                metric_readers=[reader, *extra_readers],
                views=_views(),
                resource=resource_from_env(os.environ, SERVICE_NAME),  # as the spans' (their default: guard)
            )
            meter_provider = self._own_provider
        meter = meter_provider.get_meter(_METER_NAME)
        self._queue_depth: Callable[[], int] = lambda: 0
        self._in_flight: Callable[[], int] = lambda: 0
        self._body_bytes: Callable[[], int] = lambda: 0
        self._requests = meter.create_counter("guard.worker.requests", unit="1", description="Requests by outcome.")
        self._duration = meter.create_histogram(
            "guard.worker.request.duration", unit="s", description="Time from request to response."
        )
        self._passes = meter.create_counter("guard.worker.forward_passes", unit="1", description="Forward passes.")
        self._batch_size = meter.create_histogram(
            "guard.worker.batch.size", unit="1", description="Requests per batch."
        )
        self._batch_tokens = meter.create_histogram(
            "guard.worker.batch.tokens", unit="1", description="Real tokens per forward pass."
        )
        self._batch_padded = meter.create_histogram(
            "guard.worker.batch.padded_tokens", unit="1", description="Padded tokens (longest x size) per forward pass."
        )
        self._queue_wait = meter.create_histogram(
            "guard.worker.batch.queue_wait", unit="s", description="Longest queue wait among a batch's requests."
        )
        self._compute = meter.create_histogram(
            "guard.worker.batch.compute", unit="s", description="Forward pass time on the inference thread."
        )
        meter.create_observable_gauge(
            "guard.worker.queue_depth", callbacks=[self._observe_queue], unit="1", description="Requests waiting."
        )
        meter.create_observable_gauge(
            "guard.worker.in_flight", callbacks=[self._observe_in_flight], unit="1", description="Requests computing."
        )
        meter.create_observable_gauge(
            "guard.worker.body_bytes",
            callbacks=[self._observe_body_bytes],
            unit="By",
            description="Bytes of request bodies held in memory, from their arrival until their requests are answered.",
        )

    def bind_queue(self, queue_depth: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """Read the gauges from these callables (the batcher's ``queue_depth``/``in_flight``) at each scrape."""
        self._queue_depth = queue_depth
        self._in_flight = in_flight

    def bind_body_bytes(self, body_bytes: Callable[[], int]) -> None:
        """Read the body-bytes gauge from this callable at each scrape."""
        self._body_bytes = body_bytes

    def _observe_queue(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._queue_depth())]

    def _observe_in_flight(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._in_flight())]

    def _observe_body_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._body_bytes())]

    def observe_batch(self, info: BatchInfo) -> None:
        """Record one forward pass (the batcher's ``on_batch`` hook)."""
        self._passes.add(1, {"ok": str(info.ok).lower()})
        self._batch_size.record(info.size)
        self._batch_tokens.record(info.tokens)
        self._batch_padded.record(info.padded_tokens)
        self._queue_wait.record(info.max_queue_wait_s)
        self._compute.record(info.compute_s)

    def request_done(self, outcome: str, seconds: float) -> None:
        """Count one finished request and its latency under ``outcome`` (a short snake_case word)."""
        attributes = {"outcome": outcome}
        self._requests.add(1, attributes)
        self._duration.record(seconds, attributes)

    def render(self) -> bytes:
        """The Prometheus text exposition of this worker's metrics (empty when an outside provider is used)."""
        if self.registry is None:
            return b""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Release the private provider (and unregister its Prometheus collector). Idempotent."""
        if self._own_provider is not None:
            self._own_provider.shutdown()
            self._own_provider = None
