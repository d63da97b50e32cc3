"""``guard quickstart``: the example API behind the guard on real traffic, with a table of verdicts.

Usage::

    guard quickstart [--backend compact | local:DIR [--device cuda] [--dtype auto] | http://URL]
                     [--redis-url redis://...] [--limit N]

The backend is started (a ``local:`` checkpoint or the embedded model warms up) before the first row is timed. The
note on tool calls after the summary is printed only for the embedded CPU model (the default backend). Exit status:
0 after the replay; 2 when it cannot start (invalid options, a backend that cannot be loaded or warmed up, a cache it
cannot use: as ``guard proxy``); 1 when the replay fails after its first row.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from guard._seal import Sealer
from guard.backends.base import DecisionBackend
from guard.backends.options import add_backend_options, check_device_options, describe_backend, open_cli_backend
from guard.engine.verdicts import GUARD_ERROR_RULE
from guard.errors import GuardError

__all__ = ["register"]

EXIT_FAILED = 1
EXIT_USAGE = 2


def register(subparsers: Any) -> None:
    """Add ``guard quickstart``."""
    parser = subparsers.add_parser(
        "quickstart",
        help="run the example API behind the guard on real traffic and print the verdicts",
        description="Replay benign and abusive API requests and agent tool calls through the guard "
        "(embedded CPU model, in-process cache, no GPU, network or Redis needed) and print each verdict.",
    )
    add_backend_options(parser, default="compact")
    parser.add_argument("--redis-url", default=None, help="share the probability cache in this Redis")
    parser.add_argument("--limit", type=int, default=None, help="replay at most N requests and N tool calls")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from guard.quickstart import NEXT_STEPS, TOOL_CALL_NOTE, print_header, print_row, print_summary, run_quickstart

    if args.limit is not None and args.limit < 1:
        print(f"guard quickstart: --limit must be a positive number of requests, got {args.limit}", file=sys.stderr)
        return 2
    if args.redis_url:  # before the table starts: the cache refuses to write to Redis unsealed
        try:
            Sealer.resolve(None, "guard quickstart --redis-url")
        except ValueError as exc:
            print(f"guard quickstart: {exc}", file=sys.stderr)
            return 2
    out = sys.stdout
    out.write(
        "guard quickstart: an example API behind the guard, real traffic replayed through it.\n"
        "Attack rows are real jailbreak prompts and payloads; their text is not printed.\n\n"
    )
    embedded = args.backend == "compact"
    backend: DecisionBackend
    rows = 0

    def on_row(row: Any) -> None:
        nonlocal rows
        rows += 1
        print_row(row, out)

    try:
        check_device_options(args)
        if embedded:
            from guard.backends.compact import CompactBackend

            bar = tqdm(total=1, desc="loading the embedded CPU model", unit="step", file=sys.stderr, leave=False,
                       disable=None)  # no bar where stderr is not a terminal (a log)

            def progress(done: int, total: int, stage: str) -> None:
                bar.total = total
                bar.n = done
                bar.set_postfix_str(stage)
                bar.refresh()

            try:
                backend = CompactBackend.default(progress=progress)
            finally:
                bar.close()  # an error message then starts on its own line
        else:
            backend = open_cli_backend(args)
        out.write(f"backend: {describe_backend(backend)}\n\n")
        print_header(out)
        result = asyncio.run(run_quickstart(backend, redis_url=args.redis_url, limit=args.limit, on_row=on_row))
    except (GuardError, OSError, ValueError) as exc:
        print(f"guard quickstart: {exc}", file=sys.stderr)
        return EXIT_FAILED if rows else EXIT_USAGE
    print_summary(result, out)
    failed = sum(row.rule == GUARD_ERROR_RULE for row in result.rows)
    if failed:  # the backend did not answer: the rows show the fail mode, not the model
        print(f"guard quickstart: {failed} of {len(result.rows)} decisions failed (rule on_error): the backend "
              f"{describe_backend(backend)} did not answer them", file=sys.stderr)
        return EXIT_FAILED
    if embedded:
        out.write(TOOL_CALL_NOTE)
    out.write(NEXT_STEPS)
    return 0
