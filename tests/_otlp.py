"""An OTLP/HTTP receiver for tests: the collector a user would run, as a Starlette app that keeps every export
request posted to ``/v1/traces`` and ``/v1/metrics`` (serve it with :func:`tests.worker._serve.serve_app_in_thread`
and point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at its base URL)."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


class Receiver:
    """``app`` receives; ``received`` holds the trace export requests in arrival order (``arrived`` is set on each
    one), ``metrics`` the metric export requests."""

    def __init__(self) -> None:
        self.received: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.arrived = threading.Event()
        self.app = Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"]),
                                     Route("/v1/metrics", self._metrics, methods=["POST"])])  # fmt: skip

    async def _traces(self, request: Request) -> Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.body())
        self.received.append(message)
        self.arrived.set()
        return Response(ExportTraceServiceRequest().SerializeToString(), media_type="application/x-protobuf")

    async def _metrics(self, request: Request) -> Response:
        message = ExportMetricsServiceRequest()
        message.ParseFromString(await request.body())
        self.metrics.append(message)
        return Response(ExportMetricsServiceRequest().SerializeToString(), media_type="application/x-protobuf")

    def metric_names(self) -> set[str]:
        """The names of every metric received."""
        return {
            metric.name
            for message in self.metrics
            for resource in message.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }

    def metric_services(self) -> set[str]:
        """The ``service.name`` of every metrics resource received."""
        return {
            a.value.string_value
            for message in self.metrics
            for resource in message.resource_metrics
            for a in resource.resource.attributes
            if a.key == "service.name"
        }

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """Every span received: (its resource's string attributes, the protobuf ``Span``)."""
        return [
            ({a.key: a.value.string_value for a in resource.resource.attributes}, span)
            for message in self.received
            for resource in message.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
