"""Worker fixtures: the golden tiny checkpoint loaded once (float32) for every worker test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guard.clef.model import ClefModel


@pytest.fixture(scope="session")
def clef_fp32(golden_checkpoint: Path) -> ClefModel:
    return ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)
