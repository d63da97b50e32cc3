"""The one seam between guard and a decision model: ``DecisionBackend.decide(request) -> response``.

Every backend (in-process Clef, the compact CPU model, System One over HTTP) implements this protocol, so the engine,
the cache and the enforcement points never know which model answers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from guard.systemone import ConfidenceProfile, SystemOneRequestV1, SystemOneResponseV1

__all__ = ["DecisionBackend", "require_request", "with_confidence"]


def require_request(request: Any, backend: str) -> SystemOneRequestV1:
    """``request`` itself when it is a :class:`~guard.systemone.SystemOneRequestV1`.

    Raises:
        TypeError: for anything else (a parsed JSON body included), naming the backend and how to build a request.
    """
    if isinstance(request, SystemOneRequestV1):
        return request
    raise TypeError(
        f"{backend}: decide() takes a SystemOneRequestV1, not {type(request).__name__}; "
        "build one from a JSON body with SystemOneRequestV1.from_json(body)"
    )


@runtime_checkable
class DecisionBackend(Protocol):
    """An async System One decision backend.

    Attributes:
        name: short name for logs, spans and verdicts (``"clef-local"``, ``"http:worker"``, ``"compact"``).
        model_revision: identifies the weights that answer (checkpoint hash or remote model id) and anything else
            an answer depends on (:func:`with_confidence`); part of the cache key.
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


def with_confidence(revision: str, profile: ConfidenceProfile) -> str:
    """``revision`` with ``+confidence=<profile>`` appended unless ``profile`` is ``reference``: the answers'
    ``confidence`` follows the profile (spec §4.1), so two profiles must not share cached answers."""
    return revision if profile == "reference" else f"{revision}+confidence={profile}"
