"""``guard eval``: run a decision backend over labelled JSONL; print accuracy, macro-F1, AUROC, FPR at a fixed TPR,
ECE, Brier, Spearman (score), in-scope accuracy / out-of-scope recall (choice) and latency percentiles, as a table
and as JSON (see ``guard/compact/evaluate.py`` for the definitions).

Backends (``--backend``): ``compact`` (the shipped model), ``compact:DIR`` (a ``guard train`` checkpoint; add
``--router DIR`` for routers), ``local:DIR`` (a Clef checkpoint in process, on ``--device`` in ``--dtype``),
``http:URL`` or a bare ``http(s)://`` URL (a System One server). The backend is started (warmed up) before the first
record is timed.

Exit status: 0 when every record was scored and the report written; 1 when the backend refused any record (the report
covers the others) or the ``--json`` file could not be written (the report then goes to stdout); 2 for bad arguments
or input (each bad line is named ``file:line``).

Examples::

    guard eval build/compact-data/test/prompt_injection.jsonl --by source
    guard eval clinc_val.jsonl --backend compact:routers/intent --question-id support.intent --json report.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from typing import Any

from guard.backends.options import add_backend_options, check_device_options, open_cli_backend
from guard.cli._args import fraction, name, positive_int, positive_seconds
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
    parser.add_argument("--question-id", type=name, default="route", help="choice question id for text/label lines")
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
    from guard.backends.compact import CompactBackend
    from guard.compact.evaluate import evaluate_backend, format_table
    from guard.compact.records import load_records, read_records_file
    from guard.errors import GuardError

    if args.json and args.json != "-" and (problem := file_problem(args.json)) is not None:
        print(f"guard eval: --json: {problem}", file=sys.stderr)
        return 2
    if args.json and args.json != "-" and (data := _same_file(args.json, args.data)) is not None:
        print(f"guard eval: --json {args.json} is the data file {data}: the report would overwrite the labelled "
              "records; give another path", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    records = []
    backend = None
    try:
        for path in args.data:  # before the backend loads (seconds): a missing or unreadable file is said at once
            read_records_file(path)
        backend = open_eval_backend(args)
        # text/label lines scored against a trained router ask it its own labels, not only those the files hold
        labels = backend.trained_labels(args.question_id) if isinstance(backend, CompactBackend) else ()
        for path in args.data:
            records.extend(
                load_records(
                    path,
                    text_field=args.text_field,
                    label_field=args.label_field,
                    question_id=args.question_id,
                    instructions=args.instructions,
                    labels=labels,
                )
            )
    except (OSError, ValueError) as exc:
        if backend is not None:
            asyncio.run(backend.aclose())
        print(f"guard eval: {exc}", file=sys.stderr)
        return 2
    for warning in _record_warnings(records, args.by):
        print(f"guard eval: warning: {warning}", file=sys.stderr)

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
    written = True
    if args.json and args.json != "-":
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(body + "\n")
        except OSError as exc:  # a device (/dev/full), /proc, a disk that filled up during the run
            print(f"guard eval: cannot write the JSON report to {args.json}: {exc.strerror or exc}; it follows on "
                  "stdout", file=sys.stderr)
            written = False
    if not written or not args.json or args.json == "-":
        print(body)
    if report.refused:
        _print_refusals(report.errors, report.refused, report.records)
    return 1 if report.refused or not written else 0


def _same_file(output: str, inputs: list[str]) -> str | None:
    """The input among ``inputs`` that ``output`` names (the same file, through links or other spellings), if any."""
    resolved = os.path.realpath(output)
    for path in inputs:
        try:
            if os.path.samefile(output, path):
                return path
        except OSError:  # one of them does not exist (yet): compare the paths
            if os.path.realpath(path) == resolved:
                return path
    return None


def _record_warnings(records: list[Any], by: str) -> list[str]:
    """What the report would hide: records that label no question (decided, not scored), records without the
    ``--by`` field (reported under ``-``) and record ids given conflicting labels (each line is still scored as it
    stands)."""
    warnings = []
    unlabelled = [record for record in records if not record.labels]
    if unlabelled:
        where = ", ".join(record.where or record.record_id for record in unlabelled[:3])
        more = f" and {len(unlabelled) - 3} more" if len(unlabelled) > 3 else ""
        warnings.append(f"{len(unlabelled)} of {len(records)} records label no question ({where}{more}): they are "
                        "decided but not scored; give each a 'labels' object")
    if by and (missing := sum(1 for record in records if not getattr(record, by))):
        warnings.append(f"{missing} of {len(records)} records have no {by!r} field; --by {by} reports them under "
                        "'-'")
    seen: dict[str, Any] = {}
    conflicts = 0
    for record in records:
        first = seen.setdefault(record.record_id, record)
        if first is record:
            continue
        clash = sorted(qid for qid in record.labels.keys() & first.labels.keys()
                       if _label_name(record, qid) != _label_name(first, qid))
        if clash:
            conflicts += 1
            if conflicts <= 5:
                warnings.append(f"record id {record.record_id!r} at {first.where or '?'} and {record.where or '?'} "
                                f"labels {clash[0]!r} {_label_name(first, clash[0])!r} and "
                                f"{_label_name(record, clash[0])!r}")
    if conflicts > 5:
        warnings.append(f"... and {conflicts - 5} more records whose id an earlier record gave another label")
    return warnings


def _label_name(record: Any, qid: str) -> str:
    """The option id a record labels question ``qid`` with (indices differ between files of text/label lines)."""
    return record.request.question(qid).options()[record.labels[qid]][0]


def _print_refusals(errors: list[str], refused: int, records: int) -> None:
    """The distinct reasons records were refused (``record_id: reason`` lines), most frequent first, on stderr."""
    reasons = collections.Counter(error.split(": ", 1)[-1] for error in errors)
    what = "every record" if refused == records else f"{refused} of {records} records"
    print(f"guard eval: the backend refused {what} (not scored; the report covers the rest, exit status 1):"
          if refused != records else f"guard eval: the backend refused {what} (not scored):", file=sys.stderr)
    for reason, count in reasons.most_common(3):
        print(f"  {count} x {reason[:500]}", file=sys.stderr)
    if len(reasons) > 3:
        print(f"  ... and {len(reasons) - 3} other reasons (the JSON report lists each record)", file=sys.stderr)
