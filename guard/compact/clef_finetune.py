"""Fine-tune the joint schema head of a Clef checkpoint on labelled System One records, backbone frozen.

``guard train RECORDS --clef CHECKPOINT --out DIR [--device cuda]``. The backbone (``guard.clef.model.ClefModel``)
runs once per record under ``inference_mode`` to get its final hidden states (the layer §3.4 of the Clef runtime
specification names, ``docs/clef.md``); only :class:`~guard.clef.head.JointSchemaHead` is trained, in float32, with
the same loss as the compact model (label-smoothed cross-entropy + Brier, :func:`~guard.compact.train.soft_loss`),
seeded, with validation and early stopping. ``DIR`` receives the new ``joint_head.safetensors`` (in the checkpoint's
dtype) and a copy of ``joint_head_config.json``; every other release file is linked (symlink) to the base checkpoint, so ``DIR`` loads
with ``ClefModel.from_pretrained`` like a release.

Hidden states of all records are kept in memory (``(L, H)`` per record on the model's device); for large sets run it
on a GPU in chunks.
"""

from __future__ import annotations

import math
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from guard.clef.head import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from guard.compact.records import LabelledRecord
from guard.compact.train import soft_loss

__all__ = ["ClefFinetuneConfig", "finetune_clef_head"]


@dataclass(frozen=True)
class ClefFinetuneConfig:
    """Settings (see :class:`~guard.compact.train.TrainConfig` for the meaning of each)."""

    epochs: int = 3
    patience: int = 2
    batch_size: int = 8
    learning_rate: float = 1e-5
    weight_decay: float = 0.01
    label_smoothing: float = 0.05
    brier_weight: float = 0.5
    seed: int = 0

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def finetune_clef_head(
    checkpoint: str | Path,
    train_records: Sequence[LabelledRecord],
    val_records: Sequence[LabelledRecord],
    config: ClefFinetuneConfig,
    out: str | Path,
    *,
    device: str = "cpu",
    progress: Callable[..., Any] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Train the head, write ``out``, and return a report (losses per epoch, best epoch, output path).

    Raises:
        ValueError: no training records, or no labelled question in them.
        FileNotFoundError: ``checkpoint`` is not a Clef checkpoint.
    """
    from safetensors.torch import save_file

    from guard.clef.encoding import collate
    from guard.clef.model import ClefModel

    if not train_records:
        raise ValueError("no training records")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = ClefModel.from_pretrained(checkpoint, dtype=dtype, device=device)
    head = model.head.float()
    head.requires_grad_(True)
    embedding = model.backbone.get_output_embeddings().weight.detach().float()  # (V, H)

    def prepare(records: Sequence[LabelledRecord]) -> list[tuple[Any, torch.Tensor, torch.Tensor, list[int], list[int]]]:
        out_rows = []
        bar = progress(total=len(records), desc="backbone", unit="record") if progress else None
        for record in records:
            encoded = model.encode(record.request)
            batch = collate([encoded], model.processor.pad_token_id, model.device)
            hidden = model.hidden_states(batch).float().clone()  # (1, L, H), outside inference mode for autograd
            picks = [j for j, q in enumerate(record.request.questions) if q.id in record.labels]
            targets = [record.labels[record.request.questions[j].id] for j in picks]
            if picks:
                out_rows.append((encoded, hidden, batch["input_ids"].clone(), picks, targets))
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        return out_rows

    train_rows, val_rows = prepare(train_records), prepare(val_records)
    if not train_rows:
        raise ValueError("no labelled question in the training records")

    def loss_of(rows: Sequence[Any]) -> torch.Tensor:
        losses = []
        for encoded, hidden, ids, picks, targets in rows:
            mask = torch.ones(ids.shape, dtype=torch.long, device=ids.device)
            (logits,) = head(hidden, ids, mask, [encoded], embedding)
            for j, target in zip(picks, targets, strict=True):
                z = logits[j].unsqueeze(0)  # (1, n_j)
                valid = torch.ones_like(z, dtype=torch.bool)
                losses.append(soft_loss(z, torch.tensor([target], device=z.device), valid, config.label_smoothing,
                                        config.brier_weight))
        return torch.stack(losses).mean()

    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    report: dict[str, Any] = {"train_loss": [], "val_loss": [], "best_epoch": 0}
    best_state, best_loss, stale = None, math.inf, 0
    for epoch in range(config.epochs):
        head.train()
        order = list(train_rows)
        rng.shuffle(order)
        total = 0.0
        for start in range(0, len(order), config.batch_size):
            loss = loss_of(order[start : start + config.batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            total += float(loss.detach()) * len(order[start : start + config.batch_size])
        head.eval()
        with torch.no_grad():
            val = float(loss_of(val_rows)) if val_rows else math.nan
        report["train_loss"].append(total / len(order))
        report["val_loss"].append(val)
        log(f"epoch {epoch + 1}: train loss {report['train_loss'][-1]:.4f}, val loss {val:.4f}")
        if not val_rows or val < best_loss - 1e-6:
            best_loss, stale, report["best_epoch"] = val, 0, epoch + 1
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    assert best_state is not None
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    base = Path(checkpoint).resolve()
    for item in base.iterdir():
        if item.name in (HEAD_WEIGHTS_FILE, HEAD_CONFIG_FILE) or (target / item.name).exists():
            continue
        (target / item.name).symlink_to(item)
    shutil.copyfile(base / HEAD_CONFIG_FILE, target / HEAD_CONFIG_FILE)
    save_file({k: v.to(model.dtype).contiguous().cpu() for k, v in best_state.items()},
              str(target / HEAD_WEIGHTS_FILE))
    report["out"] = str(target)
    report["config"] = asdict(config)
    return report
