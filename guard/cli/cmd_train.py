"""``guard train``: fit the compact model (the catalog questions: the encoder's last layer fine-tuned with per-question
heads, leave-one-source-group-out folds first, then the tool-call question's argument grounding; or a router over
your own labels) from labelled JSONL, fine-tune the head of a Clef checkpoint (``--clef DIR``) with its backbone
frozen, or refit only the argument grounding of a trained catalog checkpoint (``--ground DIR``).

Examples::

    # the shipped catalog model (docs/compact-model.md, "Reproducing the shipped weights")
    python -m guard.compact.data data/ build/compact-data
    guard train build/compact-data/train.jsonl --val build/compact-data/val.jsonl --out guard/compact/weights \\
        --epochs 1 --fold-share 1.0 --threads 2 --head-epochs 20 \\
        --head-questions guard.harm_severity,guard.refusal,guard.tool_call_serves_task --layer-epochs 1

    # the argument grounding of guard.tool_call_serves_task alone, on a catalog checkpoint not yet grounded
    guard train build/compact-data/train.jsonl --val build/compact-data/val.jsonl --ground build/catalog \\
        --out build/grounded

    # a router over your own intents: one {"text": ..., "label": ...} per line
    guard train intents.jsonl --kind router --question-id support.intent --out routers/intent
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from guard.backends.options import device_kind
from guard.cli._args import count, finite, fraction, name, non_negative, positive_int, share
from guard.cli._output import directory_problem

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``guard train``."""
    parser = subparsers.add_parser(
        "train", help="train the compact model (or a Clef head) on labelled JSONL",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("train", help="labelled JSONL: System One records, or {text, label} lines for a router")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--val", help="validation JSONL (early stopping, calibration); default: --val-fraction of train")
    parser.add_argument("--val-fraction", type=fraction, default=0.1, help="held out from train when --val is absent")
    parser.add_argument("--kind", choices=("catalog", "router"), default=None,
                        help="catalog: any questions (default for System One records); router: one choice question "
                        "over fixed labels (default for text/label lines)")
    parser.add_argument("--clef", metavar="CHECKPOINT", help="fine-tune the joint head of this Clef checkpoint instead")
    parser.add_argument("--device", help="device for --clef (cpu, cuda, cuda:N; default cpu)")
    parser.add_argument("--ground", metavar="CHECKPOINT",
                        help="refit only the tool-call argument grounding of this catalog checkpoint on the records of "
                             "train and --val (leave one source out; no encoder or head training) and write it to --out")
    router = parser.add_argument_group("text/label lines")
    router.add_argument("--text-field", default="text")
    router.add_argument("--label-field", default="label")
    router.add_argument("--question-id", type=name, default="route", help="id of the choice question policies will ask")
    router.add_argument("--instructions", help="wording of that question (default: its id)")
    hyper = parser.add_argument_group("training")
    hyper.add_argument("--epochs", type=positive_int, default=None)
    hyper.add_argument("--patience", type=positive_int, default=None)
    hyper.add_argument("--batch-size", type=positive_int, default=None)
    hyper.add_argument("--lr", type=_rate, default=None, dest="learning_rate", help="learning rate (> 0)")
    hyper.add_argument("--label-smoothing", type=_smoothing, default=None, help="0 or more, below 1")
    hyper.add_argument("--brier-weight", type=non_negative, default=None)
    hyper.add_argument("--ordinal-weight", type=non_negative, default=None,
                       help="weight of the expected-level error of score questions (default 1; 0 = off)")
    hyper.add_argument("--max-state-tokens", type=positive_int, default=None)
    hyper.add_argument("--width", type=positive_int, default=None)
    hyper.add_argument("--seed", type=int, default=None)
    hyper.add_argument("--outside-label", default=None, metavar="LABEL",
                       help="router: the out-of-scope label (e.g. oos); its logit is biased so --outside-rate of "
                       "in-scope validation records would go to it")
    hyper.add_argument("--outside-rate", type=share, default=None, help="router: 0 to 1 (default 0.03)")
    hyper.add_argument("--layer-lr", type=_layer_rate, default=None, dest="layer_learning_rate",
                       help="catalog: learning rate of the fine-tuned encoder layers (0 = frozen)")
    hyper.add_argument("--train-windows", type=positive_int, default=None,
                       help="catalog: most windows per training text of a pair question")
    hyper.add_argument("--train-pieces", type=positive_int, default=None,
                       help="catalog: most sentence pieces per long training text of a text question")
    hyper.add_argument("--top-layers", type=positive_int, default=None,
                       help="catalog: encoder layers fine-tuned (the top ones; the rest stay frozen)")
    hyper.add_argument("--fold-epochs", type=positive_int, default=None,
                       help="catalog: epochs of each leave-one-fold-out model (default 1)")
    hyper.add_argument("--head-epochs", type=count, default=None,
                       help="catalog: epochs of the heads alone on the fine-tuned layers' states, after the joint "
                            "epochs (default 0: none)")
    hyper.add_argument("--layer-epochs", type=count, default=None,
                       help="catalog: epochs of the fine-tuned layers alone, every head frozen, after the joint "
                            "epochs (default 0: none)")
    hyper.add_argument("--head-questions", type=lambda text: tuple(q.strip() for q in text.split(",") if q.strip()),
                       default=None, metavar="ID[,ID...]",
                       help="catalog: the questions whose heads the head epochs train (default: all)")
    hyper.add_argument("--fold-share", type=_fold_share, default=None,
                       help="catalog: share of the other folds' records each fold model trains on (above 0, at most 1)")
    hyper.add_argument("--source-balance", type=share, default=None,
                       help="catalog: exponent of source-balanced sampling, 1 = as the data is, 0 = every source alike")
    hyper.add_argument("--no-folds", action="store_true",
                       help="catalog: skip the leave-one-source-group-out models (temperatures fitted on --val)")
    hyper.add_argument("--fold-models", metavar="DIR", default=None,
                       help="catalog: also save each leave-one-fold-out model in DIR/<fold> (score its held-out "
                            "records again with guard eval --backend compact:DIR/<fold> --by fold)")
    hyper.add_argument("--window", type=positive_int, default=160, help="catalog: encoder window in word pieces")
    hyper.add_argument("--overlap", type=count, default=48, help="catalog: word pieces shared by neighbouring windows")
    hyper.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--cache-dir", default=None, help="encoder embedding cache (default $XDG_CACHE_HOME/guard/compact, else ~/.cache/guard/compact)")
    parser.add_argument("--no-cache", action="store_true", help="keep embeddings in memory only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def _rate(text: str) -> float:
    """A learning rate: a finite number > 0."""
    return finite(text, 0, above=True, what="a learning rate (a number > 0)")


def _layer_rate(text: str) -> float:
    """The encoder layers' learning rate: a finite number, 0 (frozen) or more."""
    return finite(text, 0, what="a learning rate (a number > 0, or 0 to freeze the layers)")


def _smoothing(text: str) -> float:
    """A label smoothing: a number of 0 or more, below 1."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a label smoothing (0 or more, below 1)")
    return value


def _fold_share(text: str) -> float:
    """A share of records: a number above 0, at most 1."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share (above 0, at most 1)")
    return value


def _hyper(args: argparse.Namespace) -> dict[str, Any]:
    names = ("epochs", "patience", "batch_size", "learning_rate", "label_smoothing", "brier_weight",
             "ordinal_weight", "max_state_tokens", "width", "seed", "outside_label", "outside_rate",
             "layer_learning_rate", "train_windows", "train_pieces", "top_layers", "fold_epochs", "fold_share",
             "head_epochs", "layer_epochs", "head_questions", "source_balance")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def run(args: argparse.Namespace) -> int:
    import torch

    from guard.compact.records import load_records

    if (problem := directory_problem(args.out)) is not None:
        print(f"guard train: --out: {problem}", file=sys.stderr)
        return 2
    try:
        replaced = _replaced_kind(args)
    except ValueError as exc:
        print(f"guard train: --out {args.out}: {exc}", file=sys.stderr)
        return 2
    if args.ground and (args.clef or args.fold_models or args.kind == "router"):
        other = "--clef" if args.clef else "--fold-models" if args.fold_models else "--kind router"
        print(f"guard train: --ground refits a catalog checkpoint's grounding; it cannot go with {other}",
              file=sys.stderr)
        return 2
    if args.clef:
        from guard.clef.model import check_checkpoint

        try:  # before the data is read: the files the fine-tuning loads, and its head config
            check_checkpoint(args.clef)
        except (OSError, ValueError) as exc:
            print(f"guard train: --clef: {exc}", file=sys.stderr)
            return 2
    if args.device is not None:
        if not args.clef:
            print("guard train: --device applies only to --clef (the compact model trains on the CPU)",
                  file=sys.stderr)
            return 2
        try:
            device_kind(args.device)
        except ValueError as exc:
            print(f"guard train: {exc}", file=sys.stderr)
            return 2
    if args.fold_models and (args.no_folds or args.clef):
        print(f"guard train: --fold-models saves the leave-one-fold-out models of a catalog run; it cannot go with "
              f"{'--no-folds' if args.no_folds else '--clef'}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"text_field": args.text_field, "label_field": args.label_field, "question_id": args.question_id,
               "instructions": args.instructions}
    try:
        records = load_records(args.train, **options)
        if args.val:
            val = load_records(args.val, **options)
        else:
            shuffled = list(records)
            random.Random(args.seed or 0).shuffle(shuffled)
            cut = int(len(shuffled) * args.val_fraction)
            val, records = shuffled[:cut], shuffled[cut:]
        if not val:  # its loss would be NaN, written into the report and the checkpoint's config
            raise ValueError(_empty_validation(args, len(records)))
    except (OSError, ValueError) as exc:
        print(f"guard train: {exc}", file=sys.stderr)
        return 2
    for warning in _unlabelled(records, "train") + _unlabelled(val, "validation"):
        print(f"guard train: warning: {warning}", file=sys.stderr)
    progress = None if args.no_progress else _tqdm()
    log = lambda line: print(line, file=sys.stderr)
    if args.clef:
        from safetensors import SafetensorError

        from guard.compact.clef_finetune import ClefFinetuneConfig, finetune_clef_head

        config = ClefFinetuneConfig(**{k: v for k, v in _hyper(args).items() if k in ClefFinetuneConfig.fields()})
        try:
            report = finetune_clef_head(args.clef, records, val, config, args.out, device=args.device or "cpu",
                                        progress=progress, log=log)
        except SafetensorError as exc:  # a damaged weights file (the other files were checked before the data)
            print(f"guard train: --clef {args.clef}: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError, RuntimeError) as exc:  # the data (no labelled question), writing --out
            print(f"guard train: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(report, indent=2))
        return 0
    if args.ground:
        return _ground(args, records, val, progress)
    from guard.compact._cache import DEFAULT_CACHE_DIR, EmbeddingCache
    from guard.compact.encoder import EncoderConfig, TextEncoder

    router_lines = records and len(records[0].request.questions) == 1 and records[0].request.questions[0].type == \
        "choice" and not _is_system_one(args.train)
    kind = args.kind or ("router" if router_lines else "catalog")
    if replaced not in (None, kind):
        print(f"guard train: --out {args.out}: holds a compact {replaced} checkpoint; a {kind} is not written over it "
              f"(give a new or empty directory)", file=sys.stderr)
        return 2
    if args.fold_models and kind != "catalog":
        print("guard train: --fold-models applies to catalog training; a router has no leave-one-fold-out models",
              file=sys.stderr)
        return 2
    try:
        if kind == "catalog":
            from guard.compact.finetune import FinetuneConfig, train_catalog

            names = set(FinetuneConfig.__dataclass_fields__)
            config: Any = FinetuneConfig(**{k: v for k, v in _hyper(args).items() if k in names})
            window = EncoderConfig(window=args.window, overlap=args.overlap)
        else:
            from guard.compact.train import TrainConfig, train

            config = TrainConfig(kind=kind, **{k: v for k, v in _hyper(args).items()
                                               if k in TrainConfig.__dataclass_fields__})
    except ValueError as exc:
        print(f"guard train: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if kind == "catalog":
            model, report = train_catalog(records, val, config, TextEncoder.load(window), folds=not args.no_folds,
                                          fold_models=Path(args.fold_models) if args.fold_models else None,
                                          progress=progress, log=log)
        else:
            encoder = TextEncoder.load()
            cache = EmbeddingCache(encoder, None if args.no_cache else Path(args.cache_dir) if args.cache_dir else
                                   DEFAULT_CACHE_DIR)
            model, report = train(records, val, config, encoder, cache=cache, progress=progress, log=log)
    except ValueError as exc:
        print(f"guard train: {exc}", file=sys.stderr)
        return 2
    model.meta["wall_seconds"] = round(time.perf_counter() - started, 1)
    model.meta["command"] = " ".join(["guard", "train", *sys.argv[2:]]) if sys.argv[1:2] == ["train"] else ""
    out = model.save(args.out)
    print(json.dumps({"out": str(out), "kind": kind, "train_records": len(records), "val_records": len(val),
                      **report.to_json()}, indent=2))
    return 0


def _replaced_kind(args: argparse.Namespace) -> str | None:
    """The kind of the compact checkpoint ``--out`` holds and this run replaces (``None``: ``--out`` is new or empty).

    Raises:
        ValueError: ``--out`` holds other files (``--clef`` writes only into a new or empty directory, never its own
            checkpoint), or a compact checkpoint whose config cannot be read.
    """
    from guard.compact.model import COMPACT_CONFIG_FILE

    target = Path(args.out)
    if args.clef and target.resolve() == Path(args.clef).resolve():
        raise ValueError("is the --clef checkpoint; give a new or empty directory for the fine-tuned one")
    try:
        names = {item.name for item in target.iterdir()} if target.is_dir() else set()
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    if not names:
        return None
    if args.clef or COMPACT_CONFIG_FILE not in names:
        what = "a new or empty directory" if args.clef else "a new or empty directory, or a compact checkpoint to replace"
        raise ValueError(f"is not empty; give {what} (a checkpoint is never written over other files)")
    try:
        kind = json.loads((target / COMPACT_CONFIG_FILE).read_text(encoding="utf-8"))["kind"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"holds a {COMPACT_CONFIG_FILE} that cannot be read ({exc}); give a new or empty "
                         f"directory") from None
    if args.ground and kind != "catalog":
        raise ValueError(f"holds a compact {kind} checkpoint; a catalog is not written over it (give a new or empty "
                         f"directory)")
    return str(kind)


def _ground(args: argparse.Namespace, train: list[Any], val: list[Any], progress: Any) -> int:
    """``--ground``: load the checkpoint (torch, as training reads it), fit its grounding on train and val, save it
    to ``--out``. The checkpoint's training report then describes the grounded question as training would have: no
    temperature, and its ``val`` entry the grounded answer's (not held out)."""
    from guard.compact.finetune import ground, grounded_val
    from guard.compact.grounding import QUESTION
    from guard.compact.model import CompactModel

    records = [*train, *val]
    started = time.perf_counter()
    try:
        model = CompactModel.load(args.ground, runtime="torch")
        report = ground(model, records, progress)
    except (OSError, ValueError) as exc:
        print(f"guard train: --ground {args.ground}: {exc}", file=sys.stderr)
        return 2
    trained = model.meta.setdefault("report", {})
    if isinstance(trained.get("temperatures"), dict):
        trained["temperatures"].pop(QUESTION, None)
    if isinstance(trained.get("val"), dict) and QUESTION in trained["val"]:
        if any(QUESTION in record.labels for record in val):
            trained["val"][QUESTION] = grounded_val(model, val)
        else:
            del trained["val"][QUESTION]  # the head's numbers before the grounding: not the saved answer's
    trained["grounding"] = report
    model.meta["grounding_seconds"] = round(time.perf_counter() - started, 1)
    model.meta["grounding_command"] = " ".join(["guard", "train", *sys.argv[2:]]) if sys.argv[1:2] == ["train"] else ""
    out = model.save(args.out)
    print(json.dumps({"out": str(out), "kind": "catalog", "records": len(records), "grounding": report}, indent=2))
    return 0


def _empty_validation(args: argparse.Namespace, records: int) -> str:
    """The usage error for a validation set with no record: ``--val``'s file, or a ``--val-fraction`` of ``records``
    too small to hold one out."""
    if args.val:
        return f"--val {args.val}: holds no records"
    needed = 1 / args.val_fraction  # inf for a subnormal fraction
    more = f"at least {math.ceil(needed)} records" if math.isfinite(needed) else "a larger --val-fraction"
    return f"the validation split is empty ({records} records, --val-fraction {args.val_fraction}): give --val or {more}"


def _unlabelled(records: list[Any], role: str) -> list[str]:
    """Records that label no question (``labels`` missing, ``null`` or empty): nothing to learn from them."""
    missing = [record for record in records if not record.labels]
    if not missing:
        return []
    where = ", ".join(record.where or record.record_id for record in missing[:3])
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    warning = (f"{len(missing)} {role} record(s) label no question ({where}{more}): they are not trained on; give "
               f"each a 'labels' object")
    return [warning]


def _is_system_one(path: str) -> bool:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                return '"questions"' in line
    return False


def _tqdm() -> Any:
    from tqdm import tqdm

    def factory(**kwargs: Any) -> Any:
        return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)

    return factory
