"""The OpenTelemetry resource the standard ``OTEL_*`` variables describe, shared by the engine's tracer provider and
the worker's metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

__all__ = ["resource_from_env"]


def resource_from_env(environ: Mapping[str, str], service: str) -> Any:
    """The SDK ``Resource`` of ``OTEL_RESOURCE_ATTRIBUTES`` (``key=value`` pairs, comma-separated, each value
    percent-decoded as OpenTelemetry specifies) with the service name from ``OTEL_SERVICE_NAME``, else those
    attributes' ``service.name``, else ``service``."""
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {}
    for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = unquote(value.strip())
    attributes["service.name"] = environ.get("OTEL_SERVICE_NAME") or attributes.get("service.name") or service
    return Resource.create(attributes)
