"""Decision backends: one async protocol, ``decide(request) -> response``, and its implementations.

* :class:`DecisionBackend`: the protocol every backend implements.
* :class:`LocalBackend`: in-process Clef behind the micro-batcher (:class:`MicroBatcher`, :class:`BatcherConfig`),
  no HTTP hop; the worker serves the same backend over HTTP.
* :class:`FixtureBackend`: answers from hand-written specs (policy tests, ``guard policy explain``).
* :class:`SystemOneClient`: System One over HTTP(S) or a Unix socket (our worker, Workers AI, Jev, OpenRouter).
* :class:`CompactBackend`: the shipped compact CPU model for a catalog of built-in questions.
* :func:`open_backend`: a backend from a command-line spec; :func:`start_backend`: its startup step (warm-up).

``CompactBackend`` is imported on first use so that importing this package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guard._urls import named_url, shown_url
from guard.backends.base import DecisionBackend
from guard.backends.batcher import BatcherConfig, BatcherState, BatcherStats, BatchInfo, MicroBatcher
from guard.backends.fixture import FixtureBackend
from guard.backends.http import RetryConfig, SystemOneClient
from guard.backends.local import LocalBackend

if TYPE_CHECKING:
    from guard.backends.compact import CompactBackend

__all__ = [
    "BatchInfo",
    "BatcherConfig",
    "BatcherState",
    "BatcherStats",
    "CompactBackend",
    "DecisionBackend",
    "FixtureBackend",
    "LocalBackend",
    "MicroBatcher",
    "RetryConfig",
    "SystemOneClient",
    "open_backend",
    "start_backend",
]

BACKEND_SPECS = "compact, compact:DIR, local:CHECKPOINT_DIR, http:URL, a bare http(s)://URL or unix:SOCKET"


def open_backend(spec: str, *, dtype: Any = None, device: str = "cpu", api_key: str | None = None) -> DecisionBackend:
    """Build a backend from a command-line spec.

    Args:
        spec: ``compact`` (the shipped CPU model), ``compact:DIR`` (a checkpoint from ``guard train``),
            ``local:DIR`` (a Clef release directory, in process), or a System One server such as
            ``guard worker serve``: ``http:URL`` or the URL itself (``http://...`` / ``https://...``), or
            ``unix:SOCKET`` for a worker on a Unix socket (``guard worker serve --uds SOCKET``).
        dtype: torch dtype for ``local:``; ``None`` is :meth:`LocalBackend.from_pretrained`'s default (bfloat16).
            The CLI passes ``--dtype`` (``auto``: bfloat16 on CUDA, float32 on CPU).
        device: ``cpu``, ``cuda`` or ``cuda:N`` for ``local:``.
        api_key: bearer key sent to an ``http:`` / ``unix:`` server (a worker started with ``--api-keys-env``).

    Raises:
        ValueError: naming ``--backend`` and the spec: an unknown spec, or a URL that is not http(s) or has no host.
        FileNotFoundError: ``local:DIR`` or ``compact:DIR`` is not a checkpoint directory.
    """
    kind, _, arg = spec.partition(":")
    if kind in ("http", "https") and arg.startswith("//"):
        return _http_backend(spec, spec, api_key)
    if kind == "local" and arg:
        return LocalBackend.from_pretrained(arg, dtype=dtype, device=device)
    if kind == "http" and arg:
        return _http_backend(spec, arg, api_key)
    if kind == "unix" and arg:
        return SystemOneClient.worker(uds=arg, api_key=api_key)
    if kind == "compact":
        from guard.backends.compact import CompactBackend

        return CompactBackend.from_pretrained(arg) if arg else CompactBackend.default()
    raise ValueError(f"--backend {named_url(spec)!r}: expected {BACKEND_SPECS}")


def _http_backend(spec: str, url: str, api_key: str | None) -> SystemOneClient:
    """The System One client of ``url``, the URL in ``spec``; raises ``ValueError`` naming ``--backend`` and the spec
    (as :func:`~guard._urls.shown_url` shows it: no credentials) for a URL the client refuses."""
    try:
        return SystemOneClient(url, api_key=api_key)
    except ValueError as exc:
        shown = spec[: len(spec) - len(url)] + shown_url(url)  # "http:" kept before the URL that follows it
        raise ValueError(f"--backend {shown!r}: {exc}") from None


async def start_backend(backend: DecisionBackend) -> None:
    """Run ``backend``'s startup step, when it has one, before anything is timed.

    A :class:`LocalBackend` starts its batcher and warms up with the worker's self-test (its first forward pass sets
    up kernels and allocators, which would otherwise eat the first decision's deadline); the compact backend reads a
    short text with every loaded model. Backends without a ``start()`` coroutine (HTTP) need none. Call it on the
    event loop that will use the backend.

    Raises:
        BackendUnavailable: the self-test failed.
        RuntimeError: the backend was closed.
    """
    start = getattr(backend, "start", None)
    if callable(start):
        await start()


def __getattr__(name: str) -> Any:
    if name == "CompactBackend":
        from guard.backends.compact import CompactBackend

        return CompactBackend
    raise AttributeError(f"module 'guard.backends' has no attribute {name!r}")
