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

__all__ = ["CompactBackend", "DecisionBackend", "LocalBackend", "RetryConfig", "SystemOneClient"]


def __getattr__(name: str) -> Any:
    if name == "CompactBackend":
        from guard.backends.compact import CompactBackend

        return CompactBackend
    raise AttributeError(f"module 'guard.backends' has no attribute {name!r}")
