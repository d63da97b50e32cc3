from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from guard.compact.records import load_records
from guard.compact.train import TrainConfig, fit_temperature, soft_loss, train
from tests.compact.conftest import injection_records, write_jsonl

TINY = {"width": 32, "routing_layers": 1, "layers": 1, "heads": 2, "feedforward": 64,
        "batch_size": 8, "dropout": 0.0, "learning_rate": 3e-3}


def test_soft_loss_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    valid = torch.tensor([[True, True, False]])
    # uniform over 2 valid options: CE = ln 2 whatever the smoothing; Brier = 0.5² + 0.5² = 0.5
    loss = soft_loss(logits, torch.tensor([0]), valid, smoothing=0.1, brier_weight=2.0)
    assert float(loss) == pytest.approx(torch.log(torch.tensor(2.0)).item() + 2 * 0.5)


def test_fit_temperature_softens_overconfident_logits() -> None:
    logits = [torch.tensor([4.0, -4.0]), torch.tensor([4.0, -4.0]), torch.tensor([4.0, -4.0]),
              torch.tensor([4.0, -4.0])]
    targets = [0, 0, 0, 1]  # right 3 times in 4: the best temperature makes P ~ 0.75
    t = fit_temperature(logits, targets)
    p = torch.softmax(torch.tensor([4.0, -4.0]) / t, -1)[0]
    assert float(p) == pytest.approx(0.75, abs=0.02)


ROUTES = [{"text": t, "label": label} for label, texts in {
    "billing": ["my invoice is wrong", "refund my payment", "charge on my card twice", "update billing address"],
    "tech": ["the app crashes on start", "cannot log in", "error 500 on upload", "screen stays blank"],
    "oos": ["what is the capital of peru", "tell me a joke", "how tall is everest", "sing a song"],
}.items() for t in texts]


def test_router_training(encoder: Any, tmp_path: Path) -> None:
    records = load_records(write_jsonl(tmp_path / "intents.jsonl", ROUTES), question_id="support.intent")
    model, report = train(records, records, TrainConfig(kind="router", epochs=8, patience=8, **TINY), encoder)
    assert report.train_loss[-1] < report.train_loss[0]
    assert model.questions["support.intent"].labels == ("billing", "oos", "tech")


def test_rejects_empty_and_mixed_router_input(encoder: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no training records"):
        train([], [], TrainConfig(**TINY), encoder)
    with pytest.raises(ValueError, match="guard.compact.finetune"):
        TrainConfig(kind="catalog")
    records = load_records(write_jsonl(tmp_path / "t.jsonl", injection_records()))
    with pytest.raises(ValueError, match="choice"):
        train(records, [], TrainConfig(kind="router", **TINY), encoder)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 10, 11])
def test_any_number_of_optimizer_steps_trains(encoder: Any, tmp_path: Path, steps: int) -> None:
    """Short runs: one-cycle's phases need at least 2 steps each (10 steps at a 10 % warm-up divided by zero)."""
    records = load_records(write_jsonl(tmp_path / "intents.jsonl", ROUTES), question_id="support.intent")
    config = TrainConfig(kind="router", epochs=steps, patience=steps, **{**TINY, "batch_size": len(records)})
    _, report = train(records, [], config, encoder)
    assert len(report.train_loss) == steps


def test_ordinal_term_scores_the_expected_level() -> None:
    """Levels 0..4, all probability on level 1, target 3: the expected level is off by 2 of 4 -> (2/4)² = 0.25."""
    logits = torch.tensor([[0.0, 50.0, 0.0, 0.0, 0.0], [0.0, 50.0, 0.0, 0.0, 0.0]])
    valid = torch.ones(2, 5, dtype=torch.bool)
    target = torch.tensor([3, 3])
    plain = soft_loss(logits, target, valid, 0.0, 0.0)
    score_rows = torch.tensor([True, False])  # only the first row is a score question
    with_term = soft_loss(logits, target, valid, 0.0, 0.0, score_rows, ordinal_weight=2.0)
    assert float(with_term - plain) == pytest.approx(2.0 * 0.25 / 2, abs=1e-4)  # mean over the 2 rows
