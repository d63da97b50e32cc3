"""The decision engine: :class:`Guard` (``guard.engine.guard``) matches a policy, makes or reuses its plan, reads the
probability cache or asks the backend, applies the rules and returns a :class:`~guard.verdict.Verdict`; verdicts
made without a model answer and the one recording path live in ``guard.engine.verdicts``. Also here: the
probability cache (``cache``) and its keys (``keys``), per-policy plans (``plan``), spans, counters and the decision
log (``telemetry``), decision ids (``ids``)."""

from __future__ import annotations

from guard.engine.guard import DEFAULT_BACKEND, STATE_TOO_LONG_RULE, STATE_TOO_LONG_STATUS, Guard

__all__ = ["DEFAULT_BACKEND", "STATE_TOO_LONG_RULE", "STATE_TOO_LONG_STATUS", "Guard"]
