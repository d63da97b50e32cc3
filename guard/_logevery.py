"""One log line per interval for an error that may repeat at every request (a failing sink, a broken encoder)."""

from __future__ import annotations

import math
import threading
import time

__all__ = ["LogEvery"]


class LogEvery:
    """Lets one log line through per ``interval`` seconds (monotonic clock) and counts the ones held back."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._next = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def due(self) -> int | None:
        """How many lines were held back since the last one let through, when one may be logged now; else ``None``
        (this one is held back and counted)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return None
            self._next = now + self._interval
            held, self._held = self._held, 0
            return held
