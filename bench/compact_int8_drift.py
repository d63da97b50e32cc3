"""The catalog model's encoder in ONNX Runtime int8 against float32: answer drift, and quality out of fold.

Every record is answered twice, with ``runtime="onnx"`` (float32) and ``runtime="onnx-int8"`` (the same graph
quantised, ``guard/compact/runtime.py``). Per question it prints the answers' drift (|dp| of p(``true``); severity:
expected level / 4; max, 99th percentile, mean), the share of answers on the other side of the shipped policies'
review and block lines (0.5, 0.85; yes/no questions) and each runtime's AUROC (yes/no questions) or Spearman
(severity), both as ``guard eval`` defines them (``guard.compact.evaluate.question_metrics``).

With ``--folds DIR`` (the fold models ``guard train --fold-models DIR`` saved) each fold model answers only the
records of the fold it was trained without, as the out-of-fold numbers of training do, so the table is
leave-one-source-group-out: per question the pooled metric (temperature 1) and the mean over folds of each fold's
metric, for both runtimes. Without it the shipped weights (or ``--weights``) answer every record.

Usage::

    python -m guard.compact.data data build/compact-data
    guard train build/compact-data/train.jsonl --val build/compact-data/val.jsonl --out run \\
        --fold-models run-folds --epochs 1 --fold-share 1.0 --threads 2
    python bench/compact_int8_drift.py build/compact-data/train.jsonl build/compact-data/val.jsonl \\
        --folds run-folds --step 3
    python bench/compact_int8_drift.py build/compact-data/test/*.jsonl --step 3     # the shipped weights
"""

from __future__ import annotations

import argparse
import collections
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guard.systemone import QuestionV1

RUNTIMES = ("onnx", "onnx-int8")
LINES = (0.5, 0.85)  # the shipped policies' review and block lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("records", nargs="+", help="labelled JSONL files (guard eval's format)")
    parser.add_argument("--step", type=int, default=1, help="answer every N-th record of each fold (default 1)")
    parser.add_argument("--folds", type=Path, help="fold models of guard train --fold-models")
    parser.add_argument("--weights", type=Path, help="a catalog checkpoint (default: the shipped weights)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    args = parser.parse_args()
    if args.step < 1:
        parser.error("--step must be >= 1")

    import numpy as np
    import torch
    from tqdm import tqdm

    from guard.backends.compact import DEFAULT_WEIGHTS, CompactBackend
    from guard.compact.evaluate import question_metrics
    from guard.compact.records import load_records

    torch.set_num_threads(args.threads)
    records = [r for path in args.records for r in load_records(path)]
    if args.folds:
        plan = [(d, [r for r in records if r.fold == d.name][:: args.step])
                for d in sorted(p for p in args.folds.iterdir() if p.is_dir())]
    else:
        plan = [(args.weights or DEFAULT_WEIGHTS, records[:: args.step])]
    # values[qid][fold][runtime]: p(true), or the expected level / 4; probabilities[qid][fold][runtime]: every option's
    # probability in prompt order; values[qid][fold]["label"]: the labelled option's index
    values: dict[str, dict[str, dict[str, list[Any]]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    probabilities: dict[str, dict[str, dict[str, list[list[float]]]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    questions: dict[str, QuestionV1] = {}
    for weights, chosen in plan:
        backends = {name: CompactBackend.from_pretrained(weights, runtime=name) for name in RUNTIMES}
        for record in tqdm(chosen, desc=weights.name, unit="record"):
            asked = {q.id: q for q in record.request.questions}
            for name, backend in backends.items():
                response = backend.decide_sync(record.request)
                for qid in record.labels:
                    answer, questions[qid] = response.answers[qid], asked[qid]
                    value = float(answer.score) / 4 if answer.noul is None else float(answer.probabilities["true"])
                    values[qid][weights.name][name].append(value)
                    probabilities[qid][weights.name][name].append(
                        [float(answer.probabilities[option]) for option, _ in asked[qid].options()])
            for qid, target_index in record.labels.items():
                values[qid][weights.name]["label"].append(target_index)
    scores = {qid for qid, question in questions.items() if question.type == "score"}

    def metric(qid: str, labels: list[int], answers: list[list[float]]) -> float:
        """AUROC of p(true), or Spearman of the expected level (guard eval's definitions); NaN where undefined."""
        question = questions[qid]
        found = question_metrics(qid, question.type, [option for option, _ in question.options()], answers, labels)
        value = found.spearman if qid in scores else found.auroc
        return math.nan if value is None else value

    print(f"{'question':30s} {'n':>5s}  {'|dp| max':>8s} {'p99':>6s} {'mean':>6s}  {'flip@.5':>7s} {'@.85':>6s}   metric   "
          f"{'pooled f32':>10s} {'int8':>6s}" + (f"   {'fold mean f32':>13s} {'int8':>6s}" if args.folds else ""))
    for qid, folds in values.items():
        pooled = {k: np.concatenate([np.array(f[k]) for f in folds.values()]) for k in (*RUNTIMES, "label")}
        answers = {name: [row for f in probabilities[qid].values() for row in f[name]] for name in RUNTIMES}
        labels = pooled["label"].tolist()
        drift = np.abs(pooled["onnx"] - pooled["onnx-int8"])
        flips = ["-" if qid in scores else
                 f"{100 * np.mean((pooled['onnx'] >= cut) != (pooled['onnx-int8'] >= cut)):.1f}%"
                 for cut in LINES]
        line = (f"{qid:30s} {len(drift):5d}  {drift.max():8.3f} {np.quantile(drift, 0.99):6.3f} {drift.mean():6.4f}"
                f"  {flips[0]:>7s} {flips[1]:>6s}"
                f"   {'Spearman' if qid in scores else 'AUROC   '} "
                f"{metric(qid, labels, answers['onnx']):10.4f} {metric(qid, labels, answers['onnx-int8']):6.4f}")
        if args.folds:
            per_fold = {name: [metric(qid, folds[fold]["label"], probabilities[qid][fold][name]) for fold in folds]
                        for name in RUNTIMES}
            line += f"   {_mean(per_fold['onnx']):13.4f} {_mean(per_fold['onnx-int8']):6.4f}"
        print(line)


def _mean(values: list[float]) -> float:
    """The mean of the values that are numbers (a fold without both labels has no AUROC); NaN when none is."""
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


if __name__ == "__main__":
    main()
