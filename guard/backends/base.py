"""The one seam between guard and a decision model: ``DecisionBackend.decide(request) -> response``.

Every backend (in-process Clef, the compact CPU model, System One over HTTP) implements this protocol, so the engine,
the cache and the enforcement points never know which model answers.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from guard.systemone import SystemOneRequestV1, SystemOneResponseV1

__all__ = ["DecisionBackend"]


@runtime_checkable
class DecisionBackend(Protocol):
    """An async System One decision backend.

    Attributes:
        name: short name for logs, spans and verdicts (``"clef-local"``, ``"http:worker"``, ``"compact"``).
        model_revision: identifies the weights that answer (checkpoint hash or remote model id); part of the cache key.
    """

    name: str

    @property
    def model_revision(self) -> str: ...

    async def decide(self, request: SystemOneRequestV1, *, timeout: float | None = None) -> SystemOneResponseV1:
        """Answer every question of ``request``.

        Args:
            request: a validated request.
            timeout: seconds the caller will wait; ``None`` for the backend's default.

        Raises:
            BackendTimeout, BackendUnavailable, BackendRejected, MalformedAnswer, UnsupportedQuestion.
        """
        ...

    async def aclose(self) -> None:
        """Release threads, connections and models. Idempotent."""
        ...
