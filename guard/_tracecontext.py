"""Reading a caller's trace context headers without logging what the caller sent."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

__all__ = ["TRACE_CONTEXT_LOGGERS", "quietly"]

#: The OpenTelemetry loggers that warn of a malformed ``traceparent``, ``tracestate`` or ``baggage`` header while it
#: is read, quoting it (``Member doesn't match the w3c identifiers format <the caller's text>``, a 100 KB ``baggage``
#: header whole).
TRACE_CONTEXT_LOGGERS = (
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.trace.span",
    "opentelemetry.baggage.propagation",
)

_READING = contextvars.ContextVar("guard_reading_trace_context", default=False)


class _QuietWhileReading(logging.Filter):
    """Drops what :data:`TRACE_CONTEXT_LOGGERS` log inside :func:`quietly`: a malformed header is the caller's, its
    context is dropped, and a caller sending one on every request would fill the log with its text."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _READING.get()


for _name in TRACE_CONTEXT_LOGGERS:
    logging.getLogger(_name).addFilter(_QuietWhileReading())


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """Within: :data:`TRACE_CONTEXT_LOGGERS` log nothing (in this context only; elsewhere they still do)."""
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)
