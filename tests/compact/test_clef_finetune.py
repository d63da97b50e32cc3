from __future__ import annotations

from pathlib import Path

import torch

from guard.compact.clef_finetune import ClefFinetuneConfig, finetune_clef_head
from guard.compact.records import load_records
from tests.compact.conftest import write_jsonl


def test_finetuning_the_golden_head_lowers_the_loss_and_writes_a_loadable_release(golden_checkpoint: Path,
                                                                                    tmp_path: Path) -> None:
    rows = []
    for n in range(6):
        label = n % 2 == 0
        rows.append({"state": "alpha alpha alpha" if label else "omega omega", "questions": {
            "flag": {"type": "noul", "instructions": "Is it alpha?"}}, "labels": {"flag": label}})
    records = load_records(write_jsonl(tmp_path / "r.jsonl", rows))
    config = ClefFinetuneConfig(epochs=4, patience=4, batch_size=3, learning_rate=3e-3)
    report = finetune_clef_head(golden_checkpoint, records, records, config, tmp_path / "out")
    assert report["train_loss"][-1] < report["train_loss"][0]
    assert report["val_loss"][-1] < report["val_loss"][0]

    from guard.clef.model import ClefModel

    tuned = ClefModel.from_pretrained(tmp_path / "out", dtype=torch.float32)
    base = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)
    body = {"model": "clef", "state": "alpha alpha alpha", "questions": rows[0]["questions"]}
    assert tuned.systemone(body).answers["flag"].noul != base.systemone(body).answers["flag"].noul
    assert (tmp_path / "out" / "config.json").is_symlink()
