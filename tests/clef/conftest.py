"""Clef fixtures: golden cases, the golden checkpoint loaded once per dtype, and tiny checkpoints written once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from guard.clef.model import ClefModel
from guard.clef.processor import ClefProcessor
from guard.clef.tiny import write_tiny_checkpoint
from tests.conftest import GOLDEN

CASES_DIR = GOLDEN / "cases"
CASE_FILES = sorted(CASES_DIR.glob("[0-9][0-9]-*.json"))
CASE_IDS = [path.stem for path in CASE_FILES]


def load_case(name: str) -> dict[str, Any]:
    """One golden case by file stem (``01-three-types``); parsed with key order kept (plain ``json`` does)."""
    return json.loads((CASES_DIR / f"{name}.json").read_text(encoding="utf-8"))


def error_cases() -> list[dict[str, Any]]:
    return json.loads((CASES_DIR / "errors.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def golden_processor(golden_checkpoint: Path) -> ClefProcessor:
    return ClefProcessor.from_pretrained(golden_checkpoint)


@pytest.fixture(scope="session")
def golden_fp32(golden_checkpoint: Path) -> ClefModel:
    return ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="session")
def golden_bf16(golden_checkpoint: Path) -> ClefModel:
    return ClefModel.from_pretrained(golden_checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-text"), seed=11)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path) -> ClefModel:
    return ClefModel.from_pretrained(tiny_checkpoint, dtype=torch.float32)
