"""``guard eval``: run a decision backend over labelled JSONL; print accuracy, macro-F1, AUROC, FPR at a fixed TPR,
ECE, Brier, Spearman (score), in-scope accuracy / out-of-scope recall (choice) and latency percentiles, as a table
and as JSON (see ``guard/compact/evaluate.py`` for the definitions).

Backends (``--backend``): ``compact`` (the shipped model), ``compact:DIR`` (a ``guard train`` checkpoint; add
``--router DIR`` for routers), ``local:DIR`` (a Clef checkpoint in process, on ``--device`` in ``--dtype``),
``http:URL`` or a bare ``http(s)://`` URL (a System One server). The backend is started (warmed up) before the first
record is timed.

Examples::

    guard eval build/compact-data/test/prompt_injection.jsonl --by source
    guard eval clinc_val.jsonl --backend compact:routers/intent --question-id support.intent --json report.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from typing import Any

from guard.backends.options import add_backend_options, check_device_options, open_cli_backend
from guard.cli._args import fraction, positive_int, positive_seconds
from guard.cli._output import file_problem

__all__ = ["open_eval_backend", "register"]


def register(subparsers: Any) -> None:
    """Add ``guard eval``."""
    parser = subparsers.add_parser(
        "eval",
        help="measure a backend on labelled JSONL",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", nargs="+", help="labelled JSONL files (System One records or text/label lines)")
    add_backend_options(parser, default="compact")
    parser.add_argument("--router", action="append", default=[], metavar="DIR", help="extra compact checkpoints")
    parser.add_argument("--by", choices=("source", "fold"), default="",
                        help="also report each question per record 'source' or 'fold' (the held-out view)")
    parser.add_argument("--tpr", type=fraction, default=0.95, help="true-positive rate for the FPR column")
    parser.add_argument("--oos-label", default="oos", help="out-of-scope option id of choice questions")
    parser.add_argument("--timeout", type=positive_seconds, default=None, help="seconds per request")
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here ('-' = stdout, the default)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--label-field", default="label")
    parser.add_argument("--question-id", default="route", help="choice question id for text/label lines")
    parser.add_argument("--instructions", help="wording of that question (default: its id)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=run)


def open_eval_backend(args: argparse.Namespace) -> Any:
    """The backend ``--backend`` names; compact specs honour ``--router``, ``local:`` ones ``--device`` and
    ``--dtype``.

    Raises:
        ValueError: an unknown spec, or ``--device``/``--dtype`` with a backend that is not ``local:``.
    """
    kind, _, arg = args.backend.partition(":")
    if kind == "compact":
        from guard.backends.compact import DEFAULT_WEIGHTS, CompactBackend

        check_device_options(args)
        paths = [arg] if arg else ([] if args.router else [str(DEFAULT_WEIGHTS)])
        return CompactBackend.from_checkpoints([*paths, *args.router])
    return open_cli_backend(args)


def run(args: argparse.Namespace) -> int:
    from guard.backends import start_backend
    from guard.compact.evaluate import evaluate_backend, format_table
    from guard.compact.records import load_records
    from guard.errors import GuardError

    if args.json and args.json != "-" and (problem := file_problem(args.json)) is not None:
        print(f"guard eval: --json: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    records = []
    try:
        for path in args.data:
            records.extend(
                load_records(
                    path,
                    text_field=args.text_field,
                    label_field=args.label_field,
                    question_id=args.question_id,
                    instructions=args.instructions,
                )
            )
        backend = open_eval_backend(args)
    except (OSError, ValueError) as exc:
        print(f"guard eval: {exc}", file=sys.stderr)
        return 2

    async def go() -> Any:
        await start_backend(backend)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records), desc="eval", unit="record", file=sys.stderr)
        try:
            return await evaluate_backend(
                backend,
                records,
                tpr=args.tpr,
                oos_label=args.oos_label,
                timeout=args.timeout,
                progress=bar.update if bar else None,
                by=args.by,
            )
        finally:
            if bar:
                bar.close()
            await backend.aclose()

    try:
        report = asyncio.run(go())
    except ValueError as exc:
        print(f"guard eval: {exc}", file=sys.stderr)
        return 2
    except GuardError as exc:  # the backend failed to start (self-test) or to answer
        print(f"guard eval: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    body = json.dumps(report.to_json(), indent=2)
    if args.json and args.json != "-":
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(body + "\n")
    else:
        print(body)
    if report.refused:
        _print_refusals(report.errors, report.refused, report.records)
    return 1 if report.records and report.refused == report.records else 0


def _print_refusals(errors: list[str], refused: int, records: int) -> None:
    """The distinct reasons records were refused (``record_id: reason`` lines), most frequent first, on stderr."""
    reasons = collections.Counter(error.split(": ", 1)[-1] for error in errors)
    what = "every record" if refused == records else f"{refused} of {records} records"
    print(f"guard eval: the backend refused {what} (not scored):", file=sys.stderr)
    for reason, count in reasons.most_common(3):
        print(f"  {count} x {reason[:500]}", file=sys.stderr)
    if len(reasons) > 3:
        print(f"  ... and {len(reasons) - 3} other reasons (the JSON report lists each record)", file=sys.stderr)
