"""``guard tiny``: write a tiny random Clef checkpoint in the release layout (:func:`guard.clef.write_tiny_checkpoint`).

Usage::

    guard tiny DIR [--seed N] [--vision]

The checkpoint loads like a real release (``guard decide --model DIR``, ``--backend local:DIR``, ``guard worker serve
--model DIR``) and runs the whole path on CPU in milliseconds; its answers mean nothing. The same seed gives
byte-identical files. ``DIR`` must be new or empty, so a real release directory is never overwritten. Invalid
arguments exit 2 with one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run"]

EXIT_INVALID = 2
#: torch's seed range (``torch.manual_seed``); the tiny writer also uses ``seed + 2``.
_MAX_SEED = 2**63 - 3


def register(subparsers: Any) -> None:
    """Add ``guard tiny``."""
    parser = subparsers.add_parser(
        "tiny",
        help="write a tiny random Clef checkpoint (release layout) for tests and plumbing",
        description="Write a tiny random Clef checkpoint in the release file layout into DIR (new or empty). "
        "Its answers mean nothing; it exercises the real loading and inference path on CPU.",
    )
    parser.add_argument("dir", metavar="DIR", help="directory to write (created; must be empty if it exists)")
    parser.add_argument(
        "--seed", type=int, default=0, help="weights and layout seed; same seed, same bytes (default 0)"
    )
    parser.add_argument(
        "--vision", action="store_true", help="add a small working vision tower and processor_config.json (images)"
    )
    parser.set_defaults(handler=run)


def _fail(message: str) -> int:
    print(f"guard tiny: {message}", file=sys.stderr)
    return EXIT_INVALID


def run(args: argparse.Namespace) -> int:
    """Handler: 0 after writing the checkpoint; 2 for a bad seed or a ``DIR`` that is a file or not empty."""
    target = Path(args.dir)
    if not 0 <= args.seed <= _MAX_SEED:
        return _fail(f"--seed must be an integer from 0 to {_MAX_SEED}, got {args.seed}")
    if target.exists() and not target.is_dir():
        return _fail(f"{target} exists and is not a directory")
    try:
        occupied = target.is_dir() and any(target.iterdir())
    except OSError as exc:
        return _fail(f"cannot read {target}: {exc.strerror or exc}")
    if occupied:
        return _fail(f"{target} is not empty; give a new or empty directory (a checkpoint is never written over files)")

    import transformers

    from guard.clef.tiny import write_tiny_checkpoint

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        written = write_tiny_checkpoint(target, seed=args.seed, vision=args.vision)
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror or exc}")
    kind = "with a vision tower" if args.vision else "text-only"
    print(f"wrote a tiny Clef checkpoint ({kind}, seed {args.seed}) to {written}")
    return 0
