"""Decision backends: one async protocol, ``decide(request) -> response``, and its implementations.

* :class:`DecisionBackend`: the protocol every backend implements.
* :class:`LocalBackend`: in-process Clef behind the micro-batcher (no HTTP hop).
* :class:`SystemOneClient`: System One over HTTP(S) or a Unix socket (our worker, Workers AI, Jev, OpenRouter).
* :class:`CompactBackend`: the shipped compact CPU model for a catalog of built-in questions.

``CompactBackend`` is imported on first use so that importing this package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guard.backends.base import DecisionBackend
from guard.backends.http import RetryConfig, SystemOneClient
from guard.backends.local import LocalBackend

if TYPE_CHECKING:
    from guard.backends.compact import CompactBackend

__all__ = ["CompactBackend", "DecisionBackend", "LocalBackend", "RetryConfig", "SystemOneClient", "open_backend"]

BACKEND_SPECS = "compact, compact:DIR, local:CHECKPOINT_DIR or http:URL"


def open_backend(spec: str, *, dtype: Any = None, device: str = "cpu") -> DecisionBackend:
    """Build a backend from a command-line spec.

    Args:
        spec: ``compact`` (the shipped CPU model), ``compact:DIR`` (a checkpoint from ``guard train``),
            ``local:DIR`` (a Clef release directory, in process) or ``http:URL`` (a System One server such as
            ``guard worker serve``).
        dtype: torch dtype for ``local:`` (default: the runtime's choice for ``device``).
        device: ``cpu`` or ``cuda`` for ``local:``.

    Raises:
        ValueError: for an unknown spec.
    """
    kind, _, arg = spec.partition(":")
    if kind == "local" and arg:
        return LocalBackend.from_pretrained(arg, dtype=dtype, device=device)
    if kind == "http" and arg:
        return SystemOneClient(arg)
    if kind == "compact":
        from guard.backends.compact import CompactBackend

        return CompactBackend.from_pretrained(arg) if arg else CompactBackend.default()
    raise ValueError(f"--backend {spec!r}: expected {BACKEND_SPECS}")


def __getattr__(name: str) -> Any:
    if name == "CompactBackend":
        from guard.backends.compact import CompactBackend

        return CompactBackend
    raise AttributeError(f"module 'guard.backends' has no attribute {name!r}")
