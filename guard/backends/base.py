"""The one seam between guard and a decision model: ``DecisionBackend.decide(request) -> response``.

Every backend (in-process Clef, the compact CPU model, System One over HTTP) implements this protocol, so the engine,
the cache and the enforcement points never know which model answers.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from guard.systemone import ConfidenceProfile, SystemOneRequestV1, SystemOneResponseV1

__all__ = [
    "PACKAGE_DIR",
    "DecisionBackend",
    "code_digest",
    "installed_code_digest",
    "with_code",
    "with_confidence",
]

#: The installed ``guard`` package: the code and data :func:`with_code` names.
PACKAGE_DIR = Path(__file__).resolve().parent.parent


@runtime_checkable
class DecisionBackend(Protocol):
    """An async System One decision backend.

    Attributes:
        name: short name for logs, spans and verdicts (``"clef-local"``, ``"http:worker"``, ``"compact"``).
        model_revision: identifies the weights that answer (checkpoint hash or remote model id) and anything else
            an answer depends on: the code that computes it (:func:`with_code`, for a model in this process), the
            confidence profile (:func:`with_confidence`); part of the cache key.
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


def code_digest(root: Path = PACKAGE_DIR) -> str:
    """12 hex digits of a SHA-256 over the guard package at ``root``: its code and every file in a folder named
    ``data`` (word lists, confusables), each as its path relative to ``root`` (POSIX form) and its bytes, in the
    order of those paths. The code is each module's source (``*.py``) or, for a module shipped without it (a
    sourceless install), its compiled file where the source would be (``*.pyc``; never ``__pycache__``, whose files
    the interpreter writes as it goes). A link that leads to no file (an editor's lock file, ``.#cache.py``) is not
    part of it. Reads them all (about 150 files, 3 MB) on every call: :func:`with_code` reads the installed package
    once.

    Raises:
        FileNotFoundError: no code under ``root`` (not a folder; a package imported from a zip archive): a digest of
            nothing would not move when the code does.
        OSError: a file cannot be read.
    """
    def is_code(path: Path) -> bool:
        if not path.is_file():  # a folder named *.py, or a link to nothing
            return False
        if path.suffix == ".py":
            return True
        return "__pycache__" not in path.relative_to(root).parts and not path.with_suffix(".py").is_file()

    code = [path for pattern in ("*.py", "*.pyc") for path in root.rglob(pattern) if is_code(path)]
    if not code:
        raise FileNotFoundError(f"no Python code (*.py or *.pyc) under {root}: guard's code cannot be named in the "
                                "cache keys (is the package imported from a zip archive? install it unpacked)")
    data = [path for path in root.glob("**/data/*") if path.is_file()]
    digest = hashlib.sha256()
    for name, path in sorted({path.relative_to(root).as_posix(): path for path in (*code, *data)}.items()):
        for part in (name.encode("utf-8", "surrogateescape"), path.read_bytes()):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest()[:12]


@functools.cache
def installed_code_digest() -> str:
    """:func:`code_digest` of the installed package, read on the first call (backends call it when they are made,
    so the first decision's time budget does not pay for it)."""
    return code_digest()


def with_code(revision: str) -> str:
    """``revision`` with ``+guard=<code_digest()>`` appended: a model in this process answers through guard's code
    (the readout that turns a state into probabilities, the competence checks, the word lists they read), which
    changes between releases while the weights stay, so two builds of guard must not share cached answers. Any
    change to the package's code or data moves it: an upgrade of guard starts with an empty cache (the digest is
    computed once per process)."""
    return f"{revision}+guard={installed_code_digest()}"
