"""Options shared by every command that loads a Clef checkpoint or opens a decision backend, defined once so that
``--backend``, ``--device`` and ``--dtype`` mean the same in each: ``decide`` and ``worker serve`` (a checkpoint),
``proxy``, ``quickstart``, ``policy explain|test`` and ``eval`` (a backend spec).

A System One server (``http:``, ``unix:``) gets the bearer key in ``$GUARD_BACKEND_API_KEY`` when it is set (a
worker started with ``--api-keys-env``).

``--dtype auto`` (the default) is bfloat16 on CUDA, the reference's setting, and float32 on CPU, the most accurate
mode and the fastest on most CPUs (docs/clef.md, "dtype and device"). ``--device`` and ``--dtype`` apply to a Clef
checkpoint only: given with another backend they are an error, not silently ignored.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from guard.backends.base import DecisionBackend

__all__ = [
    "BACKEND_API_KEY_ENV",
    "DTYPES",
    "add_backend_options",
    "add_device_options",
    "backend_factory",
    "check_device_options",
    "describe_backend",
    "device",
    "device_kind",
    "open_cli_backend",
    "torch_dtype",
]

#: Environment variable holding the bearer key sent to an ``http:`` / ``unix:`` backend.
BACKEND_API_KEY_ENV = "GUARD_BACKEND_API_KEY"
#: ``--dtype`` choices.
DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_DEVICE = "cpu"
BACKEND_HELP = (
    "decision backend: compact (the embedded CPU model), compact:DIR, local:CHECKPOINT_DIR (Clef in process) or "
    "http:URL / a bare http(s)://URL (a System One server such as guard worker serve) or unix:SOCKET (a guard worker "
    "on a Unix socket); a compact model's encoder runs on $GUARD_COMPACT_RUNTIME: auto (default: onnx-int8), onnx, "
    "onnx-int8 or torch"
)


def add_device_options(parser: Any, *, what: str = "the Clef checkpoint") -> None:
    """Add ``--device`` and ``--dtype`` (both ``None`` unless given; :func:`torch_dtype` resolves them)."""
    parser.add_argument(
        "--device", default=None, help=f"where {what} runs: cpu, cuda or cuda:N (default {DEFAULT_DEVICE})"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help=f"dtype of {what}: auto (default) = bfloat16 on cuda (the reference), float32 on cpu",
    )


def add_backend_options(parser: Any, *, default: str | None, group: Any = None, note: str = "") -> None:
    """Add ``--backend SPEC`` (to ``group`` when given, e.g. a mutually exclusive one) and the ``--device`` /
    ``--dtype`` of a ``local:`` backend (to ``parser``)."""
    extra = "".join(f"; {text}" for text in (note, f"default {default}" if default else "") if text)
    (group or parser).add_argument("--backend", default=default, metavar="SPEC", help=BACKEND_HELP + extra)
    add_device_options(parser, what="a local: backend")


def device(args: argparse.Namespace) -> str:
    """``--device``, or the default (``cpu``)."""
    return str(args.device or DEFAULT_DEVICE)


def torch_dtype(args: argparse.Namespace) -> torch.dtype:
    """The torch dtype ``--dtype`` names for ``--device`` (``auto``: bfloat16 on CUDA, float32 on CPU).

    Raises:
        ValueError: ``--device`` is not a CPU or CUDA torch device, or names CUDA when this torch build has none.
    """
    import torch

    kind = device_kind(device(args))
    name = args.dtype or "auto"
    if name == "auto":
        return torch.bfloat16 if kind == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def device_kind(where: str) -> str:
    """The torch device type (``cpu``, ``cuda``) of a ``--device`` value.

    Raises:
        ValueError: ``where`` is not a CPU or CUDA torch device (``mps``, ``meta``, ``xpu`` ... are not run on), or
            names CUDA when this torch build has no CUDA device.
    """
    import torch

    try:
        kind = torch.device(where).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {where!r}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {where}: this torch build has no CUDA device (install a CUDA build of torch, see README.md)"
        )
    return kind


def _is_local(spec: str | None) -> bool:
    return spec is not None and spec.startswith("local:")


def check_device_options(args: argparse.Namespace) -> None:
    """Refuse ``--device`` / ``--dtype`` with a backend that is not ``local:``, or with no ``--backend`` (where a
    command has no default one): they would be ignored.

    Raises:
        ValueError: naming the options and the backend.
    """
    if not _is_local(args.backend) and (args.device is not None or args.dtype is not None):
        given = [f"--{name}" for name in ("device", "dtype") if getattr(args, name) is not None]
        verb = "apply" if len(given) > 1 else "applies"
        backend = f"not --backend {args.backend}" if args.backend else "and no --backend is given"
        raise ValueError(f"{' and '.join(given)} {verb} only to a local: backend, {backend}")


def open_cli_backend(args: argparse.Namespace) -> DecisionBackend:
    """The backend ``--backend`` names, a ``local:`` one on ``--device`` in ``--dtype``, a remote one with the key in
    ``$GUARD_BACKEND_API_KEY``.

    Raises:
        ValueError: an unknown spec, a bad URL, a bad ``--device``, or ``--device``/``--dtype`` with a backend that is
            not ``local:``.
        FileNotFoundError: ``local:DIR`` is not a checkpoint directory.
    """
    from guard.backends import open_backend

    check_device_options(args)
    if _is_local(args.backend):
        return open_backend(args.backend, dtype=torch_dtype(args), device=device(args))
    return open_backend(args.backend, api_key=os.environ.get(BACKEND_API_KEY_ENV) or None)


def backend_factory(args: argparse.Namespace) -> Callable[[], DecisionBackend]:
    """A factory for callers that need one backend per event loop (``guard policy test`` runs each case in its own).

    The backend is opened now, so a bad spec fails before any case runs; the first call returns it. Later calls open
    a new one, except for ``local:``: they wrap the already loaded model in a fresh
    :class:`~guard.backends.local.LocalBackend`, so the checkpoint loads once.

    Raises:
        as :func:`open_cli_backend`.
    """
    from guard.backends.local import LocalBackend

    first = open_cli_backend(args)
    unused = [first]

    def make() -> DecisionBackend:
        if unused:
            return unused.pop()
        if isinstance(first, LocalBackend):
            return LocalBackend(
                first.model, confidence_profile=first.confidence_profile, max_length=first.max_length, name=first.name,
                canaries=first.canaries,
            )
        return open_cli_backend(args)

    return make


def describe_backend(backend: DecisionBackend) -> str:
    """One line naming the backend and what answers: ``clef-local (checkpoint@1a2b..., float32 on cpu)``."""
    from guard.backends.local import LocalBackend

    where = ""
    if isinstance(backend, LocalBackend):
        where = f", {str(backend.model.dtype).removeprefix('torch.')} on {backend.model.device}"
    return f"{backend.name} ({backend.model_revision}{where})"
