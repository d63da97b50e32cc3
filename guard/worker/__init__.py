"""The decision worker: a micro-batched, co-located Clef server speaking System One over HTTP.

Key components:

* :func:`create_app` / :class:`WorkerConfig`: the Starlette app behind ``guard worker serve``.
* :class:`WorkerMetrics`: its OpenTelemetry metrics, exported for Prometheus on ``GET /metrics``.

The micro-batcher it serves through is :class:`guard.backends.MicroBatcher`. The names here are imported lazily, so
that importing ``guard.worker`` does not pull in the HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guard.worker.app import WorkerConfig, WorkerPhase, create_app
    from guard.worker.metrics import WorkerMetrics

__all__ = [
    "WorkerConfig",
    "WorkerMetrics",
    "WorkerPhase",
    "create_app",
]

_LAZY = {
    "WorkerConfig": "guard.worker.app",
    "WorkerPhase": "guard.worker.app",
    "create_app": "guard.worker.app",
    "WorkerMetrics": "guard.worker.metrics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'guard.worker' has no attribute {name!r}")
