"""Write a tiny random Clef checkpoint in the exact release file layout, deterministically from a seed.

The layout is the Clef runtime spec §1.2: ``config.json`` (``Qwen3_5ForConditionalGeneration``),
``generation_config.json``, sharded ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` (with
``lm_head.weight``), ``joint_head_config.json`` + ``joint_head.safetensors`` (bf16), ``tokenizer.json`` +
``tokenizer_config.json`` (a small byte-level BPE with the release pipeline and the Qwen special tokens) and
``processor_config.json``. Everything is stored in bf16 like the release. The answers mean nothing; tests, demos and
benchmarks use it so that nothing needs a download.

Weights are not the library defaults (zero norms and biases hide bugs): projections get std 1/sqrt(fan_in), embeddings
std 1, norm weights and biases a random offset, like the golden fixture's generator.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from guard.clef._tiny_tokenizer import SPECIAL_TOKENS, dumps, tokenizer_config, train_tokenizer_json
from guard.clef.head import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, JointHeadConfig, JointSchemaHead

__all__ = ["TinyConfig", "mrope_section", "write_tiny_checkpoint"]

#: Shard size that splits even a tiny backbone into several files, so the index is always written.
_SHARD_SIZE = "200KB"
_PROCESSOR_MEDIA = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "temporal_patch_size": 2,
}


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the tiny checkpoint. Defaults keep the release's shape features (untied embeddings, 3:1 linear/full
    layers, gated attention output, key and value widths that differ, H != W in the head).

    Attributes:
        hidden_size: backbone width H.
        intermediate_size: backbone MLP width.
        layers: decoder layers; every 4th is full attention.
        heads / kv_heads / head_dim: full-attention shape; ``head_dim · partial_rotary`` must give >= 3 frequencies.
        linear_key_heads / linear_key_dim / linear_value_heads / linear_value_dim: Gated DeltaNet shape.
        head_width / head_heads / head_feedforward / head_routing_layers / head_layers: joint schema head shape.
        merges: BPE merges to train (the vocabulary is 256 + merges + 9 special tokens).
    """

    hidden_size: int = 32
    intermediate_size: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 24
    partial_rotary: float = 0.25
    linear_key_heads: int = 2
    linear_key_dim: int = 16
    linear_value_heads: int = 4
    linear_value_dim: int = 8
    head_width: int = 48
    head_heads: int = 4
    head_feedforward: int = 96
    head_routing_layers: int = 2
    head_layers: int = 2
    merges: int = 512


def mrope_section(head_dim: int, partial_rotary: float) -> list[int]:
    """Split the rotary frequencies over the (t, h, w) axes like the release ([11, 11, 10] for 32 frequencies).

    transformers accepts a wrong ``mrope_section`` silently, so tiny configs must derive it from the rotary size.

    Raises:
        ValueError: when there are fewer than 3 frequencies (an axis would get none).
    """
    frequencies = int(head_dim * partial_rotary) // 2
    if frequencies < 3:
        raise ValueError(
            f"head_dim {head_dim} x partial_rotary {partial_rotary} gives {frequencies} frequencies; need 3"
        )
    base, rest = divmod(frequencies, 3)
    return [base + (rest > 0), base + (rest > 1), base]


def _backbone_config(tiny: TinyConfig, vocab: int, special: dict[str, int], vision: bool) -> dict[str, Any]:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(tiny.layers)]
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": special["<|im_end|>"],
        "full_attention_interval": 4,
        "head_dim": tiny.head_dim,
        "hidden_act": "silu",
        "hidden_size": tiny.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": tiny.intermediate_size,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": tiny.linear_key_dim,
        "linear_num_key_heads": tiny.linear_key_heads,
        "linear_num_value_heads": tiny.linear_value_heads,
        "linear_value_head_dim": tiny.linear_value_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 0,
        "num_attention_heads": tiny.heads,
        "num_hidden_layers": tiny.layers,
        "num_key_value_heads": tiny.kv_heads,
        "pad_token_id": special["<|endoftext|>"],
        "partial_rotary_factor": tiny.partial_rotary,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope_section(tiny.head_dim, tiny.partial_rotary),
            "partial_rotary_factor": tiny.partial_rotary,
            "rope_theta": 10000000.0,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab,
    }
    width, depth = (24, 2) if vision else (8, 1)  # text-only: the smallest tower the class accepts
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": special["<|image_pad|>"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "video_token_id": special["<|video_pad|>"],
        "vision_config": {
            "depth": depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": width,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 2 * width,
            "model_type": "qwen3_5_vision",
            "num_heads": 2,
            "num_position_embeddings": 36,
            "out_hidden_size": tiny.hidden_size,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": special["<|vision_end|>"],
        "vision_start_token_id": special["<|vision_start|>"],
    }


@torch.no_grad()
def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Overwrite every parameter (in name order) with non-default random values; ``A_log`` keeps its init."""
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            continue

        def noise(std: float, param: torch.Tensor = param) -> torch.Tensor:
            return torch.randn(param.shape, generator=generator, dtype=torch.float32) * std

        if param.dim() == 0:
            continue  # head scalars are set explicitly
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.copy_(noise(1.0))
        elif name.endswith(("type_embedding.weight", "pos_embed.weight")):
            param.copy_(noise(0.5))
        elif param.dim() >= 2:
            fan_in = param[0].numel()
            param.copy_(noise(1.0 / math.sqrt(fan_in)))
        elif leaf == "dt_bias":
            param.copy_(1.0 + noise(0.3))
        elif leaf == "bias":
            param.copy_(noise(0.1))
        else:  # norm weights: (1 + w) norms start at 0, plain ones at 1; both get a random offset
            param.copy_(param.float() + noise(0.2))


def write_tiny_checkpoint(
    path: str | Path, *, seed: int = 0, vision: bool = False, config: TinyConfig | None = None
) -> Path:
    """Write a tiny random Clef checkpoint into ``path`` (created if needed).

    Args:
        path: target directory.
        seed: seeds module construction, the weight generator and nothing else; same seed, same bytes.
        vision: ``True`` for a small working vision tower and ``processor_config.json`` (images accepted);
            ``False`` for a text-only checkpoint (minimal tower, no processor config: media requests are rejected).
        config: sizes (default :class:`TinyConfig`).

    Returns:
        The directory, loadable by :meth:`guard.clef.model.ClefModel.from_pretrained`.
    """
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tiny = config or TinyConfig()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer_json(tiny.merges)
    special = {entry["content"]: entry["id"] for entry in tokenizer["added_tokens"]}
    vocab = 64 * math.ceil((len(tokenizer["model"]["vocab"]) + len(SPECIAL_TOKENS)) / 64)
    (root / "tokenizer.json").write_text(dumps(tokenizer), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(dumps(tokenizer_config()), encoding="utf-8")

    backbone_config = _backbone_config(tiny, vocab, special, vision)
    torch.manual_seed(seed)
    backbone: Any = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**backbone_config))
    generator = torch.Generator().manual_seed(seed + 1)
    _randomize(backbone, generator)
    backbone.to(torch.bfloat16).save_pretrained(str(root), max_shard_size=_SHARD_SIZE)
    (root / "config.json").write_text(json.dumps(backbone_config, indent=2) + "\n", encoding="utf-8")

    head_config = JointHeadConfig(
        hidden_size=tiny.hidden_size,
        width=tiny.head_width,
        routing_layers=tiny.head_routing_layers,
        layers=tiny.head_layers,
        heads=tiny.head_heads,
        feedforward=tiny.head_feedforward,
    )
    head = JointSchemaHead(head_config)
    _randomize(head, torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        head.prior_logit_scale.fill_(math.log(8.0))
        head.joint_logit_scale.fill_(math.log(12.0))
        head.residual_gate.fill_(-1.5)
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(root / HEAD_WEIGHTS_FILE))
    (root / HEAD_CONFIG_FILE).write_text(json.dumps(head_config.to_dict(), indent=2) + "\n", encoding="utf-8")

    processor = root / "processor_config.json"
    if vision:
        media = dict(_PROCESSOR_MEDIA)
        document = {
            "image_processor": {
                **media,
                "image_processor_type": "Qwen2VLImageProcessor",
                "size": {"longest_edge": 1048576, "shortest_edge": 65536},
            },
            "processor_class": "Qwen3VLProcessor",
            "video_processor": {
                **media,
                "do_sample_frames": True,
                "fps": 2,
                "max_frames": 768,
                "min_frames": 4,
                "return_metadata": False,
                "size": {"longest_edge": 262144, "shortest_edge": 4096},
                "video_processor_type": "Qwen3VLVideoProcessor",
            },
        }
        processor.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    elif processor.exists():
        processor.unlink()
    return root
