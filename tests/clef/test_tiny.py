"""Tiny checkpoint writer: release layout, determinism, correct M-RoPE sections, loadable and answering."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from guard.clef.model import ClefModel
from guard.clef.tiny import TinyConfig, mrope_section, write_tiny_checkpoint
from guard.errors import RequestValidationError
from guard.systemone import SystemOneRequestV1
from tests.conftest import GOLDEN

RELEASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "joint_head.safetensors",
    "joint_head_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
REQUEST = {
    "model": "tiny",
    "state": {"ticket": {"subject": "Card charged twice", "body": "Refund today or I cancel."}},
    "questions": {
        "churn": {"type": "noul", "instructions": "Does the customer threaten to leave?"},
        "queue": {"type": "choice", "instructions": "Which queue?", "criteria": {"tech": "Bugs", "billing": None}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["later", "this week", "today"]},
    },
}


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_layout_matches_the_release(tiny_checkpoint: Path) -> None:
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert RELEASE_FILES <= names and "processor_config.json" not in names
    shards = sorted(n for n in names if n.startswith("model-") and n.endswith(".safetensors"))
    assert len(shards) >= 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"] and set(index["weight_map"].values()) == set(shards)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and not config["tie_word_embeddings"]
    frequencies = int(text["head_dim"] * text["partial_rotary_factor"]) // 2
    assert sum(text["rope_parameters"]["mrope_section"]) == frequencies
    with safe_open(str(tiny_checkpoint / "joint_head.safetensors"), "pt") as head:
        assert {head.get_tensor(k).dtype for k in head.keys()} == {torch.bfloat16}  # noqa: SIM118 (safe_open is not a dict)
    tokenizer_config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert tokenizer_config["pad_token"] == "<|endoftext|>" and tokenizer_config["eos_token"] == "<|im_end|>"


def test_same_seed_same_bytes_other_seed_other_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", seed=11)
    assert _digests(again) == _digests(tiny_checkpoint)
    other = _digests(write_tiny_checkpoint(tmp_path / "other", seed=12))
    assert other["joint_head.safetensors"] != _digests(tiny_checkpoint)["joint_head.safetensors"]
    assert other["tokenizer.json"] == _digests(tiny_checkpoint)["tokenizer.json"]


@pytest.mark.parametrize(
    ("head_dim", "rotary", "section"),
    [(256, 0.25, [11, 11, 10]), (40, 0.25, [2, 2, 1]), (32, 0.25, [2, 1, 1]), (24, 0.25, [1, 1, 1])],
)
def testmrope_section_matches_the_rotary_size(head_dim: int, rotary: float, section: list[int]) -> None:
    assert mrope_section(head_dim, rotary) == section


def testmrope_section_refuses_too_few_frequencies() -> None:
    with pytest.raises(ValueError, match="need 3"):
        write_tiny_checkpoint("/nonexistent-never-written", config=TinyConfig(head_dim=8))


def test_tiny_model_answers_every_question_type(tiny_model: ClefModel) -> None:
    response = tiny_model.systemone(REQUEST)
    body = response.to_json()
    assert list(body["answers"]) == ["churn", "queue", "urgency"]
    assert 0.0 <= body["answers"]["churn"]["noul"] <= 1.0
    assert list(body["answers"]["queue"]["probabilities"]) == ["tech", "billing"]
    for answer in response.answers.values():
        assert abs(sum(answer.probabilities.values()) - 1.0) < 1e-5
    request = SystemOneRequestV1.from_json(REQUEST, profile="reference")
    assert body["usage"]["input_tokens"] == len(tiny_model.encode(request).input_ids)


def test_text_only_tiny_rejects_images(tiny_model: ClefModel) -> None:
    png = base64.b64encode((GOLDEN / "media" / "yard-320x256.png").read_bytes()).decode()
    with pytest.raises(RequestValidationError, match="text-only") as info:
        tiny_model.systemone({**REQUEST, "images": [f"data:image/png;base64,{png}"]})
    assert info.value.field == "images"


def test_vision_tiny_answers_an_image_request_through_the_multimodal_model(tmp_path: Path) -> None:
    root = write_tiny_checkpoint(tmp_path / "vision", seed=5, vision=True)
    assert (root / "processor_config.json").is_file()
    model = ClefModel.from_pretrained(root, dtype=torch.float32)
    png = base64.b64encode((GOLDEN / "media" / "yard-320x256.png").read_bytes()).decode()
    with_image = model.systemone({**REQUEST, "images": [{"content_type": "image/png", "base64": png}]})
    without = model.systemone(REQUEST)
    assert with_image.usage.input_tokens == without.usage.input_tokens + 83  # 80 pads + start, end, newline
    assert with_image.answers["churn"].noul != without.answers["churn"].noul
