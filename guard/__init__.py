"""guard: decision-model middleware for agents and APIs."""

from __future__ import annotations

__version__ = "0.1.0"
