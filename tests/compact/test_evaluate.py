from __future__ import annotations

import math

import pytest

from guard.compact.evaluate import EvalReport, expected_calibration_error, format_table, question_metrics


def test_noul_metrics_by_hand() -> None:
    # P(true) for 4 records; labels: true, true, false, false (prompt order: true=0, false=1).
    p_true = [0.9, 0.4, 0.6, 0.1]
    probs = [[p, 1 - p] for p in p_true]
    targets = [0, 0, 1, 1]
    m = question_metrics("q", "noul", ["true", "false"], probs, targets, tpr=0.95)
    assert m.accuracy == pytest.approx(0.5)  # 0.9 right, 0.4 wrong, 0.6 wrong, 0.1 right
    # AUROC: positive scores {0.9, 0.4}, negatives {0.6, 0.1}: pairs won 0.9>0.6, 0.9>0.1, 0.4>0.1; lost 0.4<0.6
    assert m.auroc == pytest.approx(3 / 4)
    # TPR >= 0.95 needs threshold 0.4, where negatives 0.6 is above -> FPR 1/2
    assert m.fpr_at_tpr == pytest.approx(0.5)
    # Brier: (0.1² + 0.6² + 0.6² + 0.1²)/4
    assert m.brier == pytest.approx((0.01 + 0.36 + 0.36 + 0.01) / 4)
    # macro-F1: class true P=1/2 R=1/2 F=1/2; class false same -> 0.5
    assert m.macro_f1 == pytest.approx(0.5)
    # ECE (10 bins of top-label confidence): confidences 0.9 (right), 0.6 (wrong), 0.6 (wrong), 0.9 (right)
    # bin 0.9: acc 1, conf 0.9 -> 0.1 * 1/2; bin 0.6: acc 0, conf 0.6 -> 0.6 * 1/2 -> 0.35
    assert m.ece == pytest.approx(0.35)


def test_score_and_choice_metrics_by_hand() -> None:
    probs = [[0.8, 0.2, 0.0], [0.1, 0.8, 0.1], [0.0, 0.3, 0.7]]
    m = question_metrics("s", "score", ["0", "1", "2"], probs, [0, 1, 2])
    assert m.accuracy == 1.0 and m.spearman == pytest.approx(1.0)
    assert m.brier == pytest.approx(((0.2**2 + 0.2**2) + (0.01 + 0.04 + 0.01) + (0.09 + 0.09)) / 3)
    choice = question_metrics("c", "choice", ["a", "b", "oos"], [[0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.5, 0.1, 0.4]],
                              [0, 1, 2])
    assert choice.in_scope_accuracy == pytest.approx(0.5)  # a right, b predicted oos
    assert choice.oos_recall == 0.0
    assert choice.auroc is None


def test_ece_edges() -> None:
    assert expected_calibration_error([1.0, 1.0], [True, True]) == 0.0
    assert math.isnan(expected_calibration_error([], []))


def test_table_lists_every_question() -> None:
    m = question_metrics("q", "noul", ["true", "false"], [[0.9, 0.1], [0.2, 0.8]], [0, 1])
    report = EvalReport("compact", "rev", 2, 0, [m], {"p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 2.0})
    table = format_table(report)
    assert "q" in table and "1.0000" in table and "p50_ms 1.0" in table
    assert report.to_json()["questions"]["q"]["auroc"] == 1.0


def test_fpr_at_tpr_is_not_overstated_where_roc_points_are_collinear() -> None:
    """scikit-learn's ROC curve drops collinear points by default; the threshold that reaches the TPR at the lowest
    FPR could be one of them (20 positives, 10 negatives: at 0.5 the TPR is 19/20 = 0.95 at FPR 1/10, reported as
    2/10)."""
    p_true = [0.9] * 18 + [0.5, 0.3] + [0.5, 0.3] + [0.1] * 8
    targets = [0] * 20 + [1] * 10
    m = question_metrics("q", "noul", ["true", "false"], [[p, 1 - p] for p in p_true], targets, tpr=0.95)
    assert m.fpr_at_tpr == pytest.approx(0.1)


def test_fpr_at_tpr_is_the_lowest_fpr_of_any_threshold_that_reaches_the_tpr() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(4, 40))
        y = rng.integers(0, 2, n)
        if y.sum() in (0, n):
            continue
        p = np.round(rng.random(n), 1)  # ties
        m = question_metrics("q", "noul", ["true", "false"], np.c_[p, 1 - p], np.where(y == 1, 0, 1), tpr=0.95)
        best = min((p[y == 0] >= t).mean() for t in np.unique(np.r_[p, 2.0]) if (p[y == 1] >= t).mean() >= 0.95)
        assert m.fpr_at_tpr == pytest.approx(best)
