"""The GPU latency bench builds Clef-flash's real shape: checked on the meta device (no memory, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_gpu_bench_backbone_and_head_have_clef_flash_parameter_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from guard.clef.head import JointHeadConfig, JointSchemaHead

    monkeypatch.syspath_prepend(str(BENCH))
    from clef_gpu_latency import flash_config

    backbone_config, head_sizes = flash_config(1)
    with torch.device("meta"):
        backbone = Qwen3_5ForConditionalGeneration._from_config(Qwen3_5Config(**backbone_config), dtype=torch.bfloat16)
        head = JointSchemaHead(JointHeadConfig(**head_sizes))
    # §1.3: backbone 9,409,813,744 = layers 6,919,565,824 + 2 x 1,017,118,720 (untied) + vision 456,010,480.
    assert sum(p.numel() for p in backbone.parameters()) == 9_409_813_744
    assert sum(p.numel() for p in backbone.model.visual.parameters()) == 456_010_480
    assert sum(p.numel() for p in head.parameters()) == 121_762_820
    with pytest.raises(ValueError, match="scale"):
        flash_config(16)
