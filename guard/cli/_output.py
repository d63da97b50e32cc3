"""Checks on the paths commands write to, made before the work starts (an evaluation or a training run is not lost
to a typo in ``--json`` or ``--out``), and documents written to stdout as UTF-8."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["directory_problem", "file_problem", "write_utf8"]


def file_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (``None`` when it can): a directory is there, its folder does not
    exist, or either is not writable."""
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory; give a file path"
    folder = target.parent
    if not folder.is_dir():
        return f"folder {folder} does not exist; create it first"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{path} is not writable"
    if not target.exists() and not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable"
    return None


def directory_problem(path: str) -> str | None:
    """Why a checkpoint directory cannot be written at ``path`` (``None`` when it can): a file is there or above it,
    or the nearest existing folder is not writable."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        return f"{path} exists and is not a directory"
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file; the directory cannot be made below it"
    if not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


def write_utf8(text: str) -> None:
    """Write ``text`` (a JSON document or report, JUnit XML, a schema) to stdout as UTF-8, whatever the locale's
    encoding (a Windows code page when stdout is a file, ASCII, Latin-1): JSON is read as UTF-8 and the XML says it is
    UTF-8, so another encoding's bytes would not parse, and a character that encoding lacks stopped the output."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a text-only stream (a StringIO put in its place) takes the text; no stdout (>&-) nothing
        print(text, end="")
        return
    sys.stdout.flush()  # what was printed before comes first
    buffer.write(text.encode("utf-8"))
    buffer.flush()
