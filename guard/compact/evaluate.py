"""``guard eval``: run any decision backend over labelled JSONL and measure its answers.

Per question id (records may mix questions) the report holds:

* ``accuracy`` (argmax, ties to the first option in prompt order) and ``macro_f1`` (scikit-learn, over the labels
  present);
* noul only: ``auroc`` of P(true) and ``fpr_at_tpr``: the false-positive rate at the highest threshold whose
  true-positive rate reaches ``tpr`` (default 0.95), from scikit-learn's ROC curve with every threshold kept
  (``drop_intermediate=False``); ``brier`` = mean (P(true) − y)²;
* choice and score: ``brier`` = mean Σ_k (p_k − y_k)² over the options;
* ``ece``: top-label expected calibration error, 10 equal-width confidence bins, Σ_b (n_b/n)·|acc_b − conf_b|;
* score only: ``spearman`` between the expected level Σ i·p_i and the labelled level (SciPy);
* choice with an out-of-scope label (``--oos-label``, default ``oos``): ``in_scope_accuracy`` and ``oos_recall``;

and over all records the latency percentiles (``p50_ms``, ``p95_ms``, ``p99_ms``) of ``backend.decide``, measured
one record at a time, plus ``refused`` (records the backend refused, e.g. with ``UnsupportedQuestion``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.compact.records import LabelledRecord
from guard.errors import GuardError
from guard.systemone import QuestionV1

__all__ = ["EvalReport", "QuestionMetrics", "evaluate_backend", "expected_calibration_error", "format_table",
           "question_metrics"]

DEFAULT_TPR = 0.95
ECE_BINS = 10


@dataclass
class QuestionMetrics:
    """Metrics of one question id (``None`` where a metric does not apply or cannot be computed)."""

    question_id: str
    type: str
    n: int
    accuracy: float
    macro_f1: float
    ece: float
    brier: float
    auroc: float | None = None
    fpr_at_tpr: float | None = None
    tpr: float | None = None
    spearman: float | None = None
    in_scope_accuracy: float | None = None
    oos_recall: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class EvalReport:
    """A whole evaluation: per-question metrics, latency percentiles and counts."""

    backend: str
    model_revision: str
    records: int
    refused: int
    questions: list[QuestionMetrics] = field(default_factory=list)
    latency_ms: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    by: str = ""
    groups: dict[str, list[QuestionMetrics]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model_revision": self.model_revision,
            "records": self.records,
            "refused": self.refused,
            "latency_ms": self.latency_ms,
            "questions": {m.question_id: m.to_json() for m in self.questions},
            **({"by": self.by, "groups": {g: {m.question_id: m.to_json() for m in ms} for g, ms in
                                          self.groups.items()}} if self.by else {}),
            "errors": self.errors[:20],
        }


def expected_calibration_error(confidence: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> float:
    """Top-label ECE with ``bins`` equal-width bins over [0, 1] (the last bin includes 1.0)."""
    conf = np.asarray(confidence, dtype=float)
    hits = np.asarray(correct, dtype=float)
    if conf.size == 0:
        return math.nan
    which = np.minimum((conf * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.mean() * abs(hits[inside].mean() - conf[inside].mean())
    return float(total)


def question_metrics(question_id: str, question_type: str, option_ids: Sequence[str], probabilities: Sequence[
        Sequence[float]], targets: Sequence[int], *, tpr: float = DEFAULT_TPR, oos_label: str | None = "oos"
) -> QuestionMetrics:
    """Metrics for one question from probabilities in prompt option order and target indices.

    Args:
        question_id, question_type: identify the question.
        option_ids: option ids in prompt order (noul ``true``, ``false``).
        probabilities: ``(n, K)`` per-record probabilities.
        targets: ``(n,)`` label indices.
        tpr: the true-positive rate for ``fpr_at_tpr`` (noul).
        oos_label: the out-of-scope option id of a choice question, if any.
    """
    from sklearn.metrics import f1_score, roc_auc_score, roc_curve

    probs = np.asarray(probabilities, dtype=float)
    y = np.asarray(targets, dtype=int)
    predicted = probs.argmax(axis=1)
    confidence = probs.max(axis=1)
    metrics = QuestionMetrics(
        question_id=question_id,
        type=question_type,
        n=int(y.size),
        accuracy=float((predicted == y).mean()),
        macro_f1=float(f1_score(y, predicted, labels=np.unique(y), average="macro", zero_division=0)),
        ece=expected_calibration_error(confidence, predicted == y),
        brier=math.nan,
    )
    onehot = np.eye(probs.shape[1])[y]
    if question_type == "noul":
        positive = (y == option_ids.index("true")).astype(int)
        p_true = probs[:, option_ids.index("true")]
        metrics.brier = float(((p_true - positive) ** 2).mean())
        if 0 < positive.sum() < positive.size:
            metrics.auroc = float(roc_auc_score(positive, p_true))
            # every threshold: the default drops collinear points, and the lowest FPR that reaches the TPR can be one
            fpr, tpr_curve, _ = roc_curve(positive, p_true, drop_intermediate=False)
            metrics.fpr_at_tpr = float(fpr[int(np.argmax(tpr_curve >= tpr))])
            metrics.tpr = tpr
    else:
        metrics.brier = float(((probs - onehot) ** 2).sum(axis=1).mean())
    if question_type == "score" and y.size > 1:
        from scipy.stats import spearmanr

        expected = probs @ np.arange(probs.shape[1])
        constant = np.ptp(expected) == 0 or np.ptp(y) == 0  # no rank order: reported as None, not a scipy warning
        metrics.spearman = None if constant else float(spearmanr(expected, y).statistic)
    if question_type == "choice" and oos_label is not None and oos_label in option_ids:
        oos = option_ids.index(oos_label)
        scope = y != oos
        if scope.any():
            metrics.in_scope_accuracy = float((predicted[scope] == y[scope]).mean())
        if (~scope).any():
            metrics.oos_recall = float((predicted[~scope] == oos).mean())
    return metrics


async def evaluate_backend(backend: Any, records: Sequence[LabelledRecord], *, tpr: float = DEFAULT_TPR,
                           oos_label: str | None = "oos", timeout: float | None = None,
                           progress: Callable[[int], None] | None = None, by: str = "") -> EvalReport:
    """Ask ``backend`` every record (one at a time) and score the labelled questions.

    Args:
        by: also report every question per value of this record field (``source`` or ``fold``, see
            :class:`~guard.compact.records.LabelledRecord`); ``""`` = not.

    Raises:
        ValueError: when no record has a labelled question, or ``by`` is not ``source``, ``fold`` or ``""``.
    """
    if by not in ("", "source", "fold"):
        raise ValueError(f"by must be 'source' or 'fold', got {by!r}")
    per_question: dict[str, tuple[QuestionV1, list[list[float]], list[int]]] = {}
    per_group: dict[tuple[str, str], tuple[QuestionV1, list[list[float]], list[int]]] = {}
    latencies: list[float] = []
    report = EvalReport(backend=getattr(backend, "name", type(backend).__name__),
                        model_revision=str(getattr(backend, "model_revision", "")), records=len(records), refused=0)
    for record in records:
        started = time.perf_counter()
        try:
            response = await backend.decide(record.request, timeout=timeout)
        except GuardError as exc:
            report.refused += 1
            report.errors.append(f"{record.record_id}: {exc}")
            if progress:
                progress(1)
            continue
        latencies.append((time.perf_counter() - started) * 1000.0)
        for qid, target in record.labels.items():
            question = record.request.question(qid)
            answer = response.answers[qid]
            prompt_ids = [option_id for option_id, _ in question.options()]
            probabilities = [float(answer.probabilities[option_id]) for option_id in prompt_ids]
            buckets = [per_question.setdefault(qid, (question, [], []))]
            if by:
                buckets.append(per_group.setdefault((getattr(record, by) or "-", qid), (question, [], [])))
            for bucket in buckets:
                bucket[1].append(probabilities)
                bucket[2].append(target)
        if progress:
            progress(1)
    if not per_question and not report.refused:
        raise ValueError("no record has a labelled question")
    for qid, (question, probs, targets) in per_question.items():
        option_ids = [option_id for option_id, _ in question.options()]
        report.questions.append(question_metrics(qid, question.type, option_ids, probs, targets, tpr=tpr,
                                                 oos_label=oos_label))
    report.by = by
    for (group, qid), (question, probs, targets) in sorted(per_group.items()):
        option_ids = [option_id for option_id, _ in question.options()]
        report.groups.setdefault(group, []).append(question_metrics(qid, question.type, option_ids, probs, targets,
                                                                    tpr=tpr, oos_label=oos_label))
    if latencies:
        values = np.asarray(latencies)
        report.latency_ms = {f"p{q}_ms": float(np.percentile(values, q)) for q in (50, 95, 99)}
    return report


def format_table(report: EvalReport) -> str:
    """A plain-text table of the report (one row per question, then one per question and group when grouped)."""
    columns = ["question", "type", "n", "acc", "macro_f1", "auroc", "fpr@tpr", "ece", "brier", "spearman",
               "in_scope", "oos_rec"]
    if report.by:
        columns.insert(1, report.by)
    rows = []
    listed = [("all", m) for m in report.questions] + [(g, m) for g, ms in report.groups.items() for m in ms]
    for group, m in listed:
        rows.append([m.question_id, *([group] if report.by else []), m.type, str(m.n)] + [
            "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
            for v in (m.accuracy, m.macro_f1, m.auroc, m.fpr_at_tpr, m.ece, m.brier, m.spearman,
                      m.in_scope_accuracy, m.oos_recall)
        ])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    latency = ", ".join(f"{k} {v:.1f}" for k, v in report.latency_ms.items())
    lines.append(f"backend {report.backend} ({report.model_revision}); records {report.records}, refused "
                 f"{report.refused}; latency {latency or '-'}")
    return "\n".join(lines)
