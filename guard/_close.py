"""Closing OpenTelemetry providers within a bound, shared by the worker and ``guard proxy``: the SDK's own timeouts
do not bound an export already sent to a collector that accepts connections and never answers (about
``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s by default, for each batch still queued)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["CLOSE_TIMEOUT_S", "close_within"]

logger = logging.getLogger(__name__)

#: How long a shutdown waits for the spans and metrics still queued to be exported (seconds).
CLOSE_TIMEOUT_S = 5.0


def _run_logged(name: str, call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:
        logger.exception("%s failed", name)


def close_within(calls: Mapping[str, Callable[[], object]], timeout: float = CLOSE_TIMEOUT_S) -> bool:
    """Run each of ``calls`` (a provider's ``force_flush`` or ``shutdown``, by a name for the log) in a daemon thread
    and wait for them all at most ``timeout`` seconds; returns whether they finished. A call still running then is
    left behind (it ends with the process) and logged at WARNING: the spans or metrics it was exporting may be lost.
    A call that raises is logged."""
    deadline = time.monotonic() + timeout
    threads = {name: threading.Thread(target=_run_logged, args=(name, call), name=f"guard-close: {name}", daemon=True)
               for name, call in calls.items()}
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    late = [name for name, thread in threads.items() if thread.is_alive()]
    if late:
        logger.warning("%s did not finish within %g s (the telemetry collector does not answer?); the spans and "
                       "metrics still queued may be lost", " and ".join(late), timeout)
    return not late
