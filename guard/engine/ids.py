"""Decision ids: a random UUID (version 4, RFC 9562 section 5.4) in its canonical text form, one per decision."""

from __future__ import annotations

import uuid

__all__ = ["new_decision_id"]


def new_decision_id() -> str:
    """A new decision id, ``str(uuid.uuid4())``: 122 random bits from ``os.urandom``, so ids are unique across
    threads and forked processes without any shared state."""
    return str(uuid.uuid4())
