"""Joint schema head (spec §1.4, §1.5, §3): config validation, checkpoint key set and shapes, strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from guard.clef.head import (
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    EvidenceRoutingLayer,
    JointHeadConfig,
    JointSchemaHead,
    field_decoder_layer,
    residual_scorer,
)


def test_config_reads_the_release_file(golden_checkpoint: Path) -> None:
    config = JointHeadConfig.from_file(golden_checkpoint)
    raw = json.loads((golden_checkpoint / HEAD_CONFIG_FILE).read_text())
    assert config.to_dict() == raw
    assert (config.hidden_size, config.width) == (raw["hidden_size"], raw["width"])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"hidden_size": 20, "width": 24, "heads": 5}, "divisible by heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"hidden_size": 20, "layers": 2.0}, "layers must be a positive integer"),
        ({"hidden_size": 20, "dropout": 1.0}, "dropout"),
        ({"hidden_size": 20, "colour": "red"}, "unknown keys \\['colour'\\]"),
        ({"width": 24}, "must set hidden_size"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JointHeadConfig.from_dict(raw)


def test_state_dict_keys_and_shapes_equal_the_checkpoint(golden_checkpoint: Path) -> None:
    stored = load_file(str(golden_checkpoint / HEAD_WEIGHTS_FILE))
    head = JointSchemaHead(JointHeadConfig.from_file(golden_checkpoint))
    ours = head.state_dict()
    assert set(ours) == set(stored)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in stored.items()}
    assert len(stored) == 86 and all(v.dtype == torch.bfloat16 for v in stored.values())


@pytest.mark.parametrize(("hidden_size", "parameters"), [(4096, 121_762_820), (5120, 128_056_324)])
def test_release_sizes_have_122_tensors_and_the_published_parameter_count(hidden_size: int, parameters: int) -> None:
    # Clef-flash / Clef (§1.3, §1.5), built on the meta device so nothing is allocated.
    with torch.device("meta"):
        head = JointSchemaHead(JointHeadConfig(hidden_size=hidden_size))
    assert len(head.state_dict()) == 122
    assert sum(p.numel() for p in head.parameters()) == parameters


def test_from_pretrained_loads_strictly_with_the_stored_scalars(golden_checkpoint: Path) -> None:
    head = JointSchemaHead.from_pretrained(golden_checkpoint, dtype=torch.float32)
    stored = load_file(str(golden_checkpoint / HEAD_WEIGHTS_FILE))
    assert head.prior_logit_scale.item() == stored["prior_logit_scale"].float().item()
    assert head.residual_gate.item() == stored["residual_gate"].float().item()
    assert not head.training and head.hidden_norm.weight.dtype == torch.float32
    assert torch.equal(head.layers[1].linear2.weight, stored["layers.1.linear2.weight"].float())


def _copy_checkpoint_head(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / HEAD_CONFIG_FILE).write_text((src / HEAD_CONFIG_FILE).read_text())
    save_file(tensors, str(dst / HEAD_WEIGHTS_FILE))
    return dst


def test_strict_loading_rejects_missing_and_misshapen_tensors(golden_checkpoint: Path, tmp_path: Path) -> None:
    stored = load_file(str(golden_checkpoint / HEAD_WEIGHTS_FILE))
    missing = {k: v for k, v in stored.items() if k != "residual_gate"}
    with pytest.raises(RuntimeError, match="residual_gate"):
        JointSchemaHead.from_pretrained(_copy_checkpoint_head(golden_checkpoint, tmp_path / "a", missing))
    misshapen = dict(stored, **{"type_embedding.weight": torch.zeros(4, stored["type_embedding.weight"].shape[1])})
    with pytest.raises(RuntimeError, match="type_embedding"):
        JointSchemaHead.from_pretrained(_copy_checkpoint_head(golden_checkpoint, tmp_path / "b", misshapen))


def test_building_blocks_keep_shapes_and_checkpoint_names() -> None:
    layer = EvidenceRoutingLayer(width=24, heads=4, feedforward=48).eval()
    options, memory = torch.randn(1, 5, 24), torch.randn(1, 9, 24)
    assert layer(options, memory).shape == (1, 5, 24)
    assert {k.split(".")[0] for k in layer.state_dict()} == {
        "query_norm",
        "memory_norm",
        "attention",
        "feedforward_norm",
        "feedforward",
    }
    assert {k for k in layer.state_dict() if k.startswith("feedforward.")} == {
        "feedforward.0.weight",
        "feedforward.0.bias",
        "feedforward.3.weight",
        "feedforward.3.bias",
    }
    decoder = field_decoder_layer(24, 4, 48).eval()
    assert decoder(torch.randn(1, 3, 24), memory).shape == (1, 3, 24)
    assert residual_scorer(24)(torch.randn(7, 96)).shape == (7, 1)
