"""The ``guard`` command line. Each subcommand lives in its own ``guard/cli/cmd_<name>.py`` module that exposes
``register(subparsers)``; this module only discovers them and dispatches. Only the CLI reads files and environment."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviation of an option (``--js x`` is not ``--json x``) and reports an
    unknown option with the usage of the subcommand it was given to. Subcommands' parsers are of this class too
    (``add_subparsers`` makes parsers of its parser's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # nothing above this parser takes them: reported with the usage of the one they were given to
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = _Parser(prog="guard", description="Decision-model guardrails for agents and APIs.")
    try:
        installed = version("guard")
    except PackageNotFoundError:
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"guard {installed}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (130 when interrupted with Ctrl-C, 2 for an ``OTEL_PROPAGATORS``
    naming a propagator that is not installed). A character of text output that the locale's encoding lacks (ASCII, a
    Windows code page when stdout is a file) is written escaped (``\\xe9``), as on stderr, not a traceback."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:  # OpenTelemetry reads OTEL_PROPAGATORS on this first import (the commands' modules import it) and raises
        from opentelemetry import propagate  # noqa: F401
    except ValueError as exc:
        print(f"guard: OTEL_PROPAGATORS: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C while a command starts (loading torch, a model): no traceback
        print("guard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``guard ... | head``): stop quietly, as Unix tools do
        # stdout's buffer cannot be flushed any more: point it at devnull so the exit flush does not fail again
        with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor has no such flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
