"""Latency of one decision on a backbone at Clef-flash's real dimensions (random bf16 weights built on the GPU).

Builds ``Qwen3_5ForConditionalGeneration`` with Clef-flash's shape (the Clef runtime specification §1.3, see docs/clef.md: hidden
4096, 32 layers in the 3 linear-attention : 1 full-attention pattern, 16 query / 4 KV heads of dim 256 with the output
gate, FFN 12288, vocabulary 248320, Gated DeltaNet 16 key / 32 value heads of dim 128, vision tower depth 27 width
1152) and the joint schema head at its release shape (W 1024, 2 routing + 4 decoder layers, 16 heads, FFN 4096),
directly on the device in bf16, and measures p50/p95/p99 of one decision (encode + prefill + head + readout, batch
size 1) at 128/512/2048 state tokens x 1/8/64 questions, with the head's share of the time.

Weights are random, so the answers mean nothing; the compute is the real model's. The prompt is tokenized with the
golden fixture's small tokenizer (ids are valid rows of the real vocabulary), so ``input tokens`` over-counts the schema
compared with the real Qwen vocabulary; the table prints the exact count used.

Usage::

    python bench/clef_gpu_latency.py                        # on a CUDA machine, real size (needs ~20 GB)
    python bench/clef_gpu_latency.py --device cpu --scale 8 --repeats 1 --states 128 --questions 1   # dry run

Without ``flash-linear-attention`` / ``causal-conv1d`` transformers runs the DeltaNet layers in pure PyTorch; the
script prints which kernels were found.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch
from clef_latency import DEFAULT_MODEL, QUESTIONS, REPEATS, STATE_TOKENS, WARMUP, measure_table, print_table

from guard.clef.tiny import mrope_section

# ---- settings: Clef-flash (§1.3, §1.4) ------------------------------------------------------------------------------
HIDDEN = 4096
LAYERS = 32
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256
FFN = 12288
VOCAB = 248320
LINEAR_KEY_HEADS, LINEAR_VALUE_HEADS, LINEAR_HEAD_DIM = 16, 32, 128
PARTIAL_ROTARY = 0.25
VISION_DEPTH, VISION_WIDTH, VISION_FFN, VISION_HEADS = 27, 1152, 4304, 16
HEAD_WIDTH, HEAD_FFN, HEAD_HEADS, HEAD_ROUTING, HEAD_LAYERS = 1024, 4096, 16, 2, 4
# ---------------------------------------------------------------------------------------------------------------------


def flash_config(scale: int) -> tuple[dict[str, Any], dict[str, int]]:
    """Backbone config dict and head sizes; ``scale`` divides every width (1 = real size; <= 8 keeps M-RoPE valid)."""
    if scale < 1 or HEAD_DIM // scale * PARTIAL_ROTARY // 2 < 3:
        raise ValueError(f"--scale must be between 1 and 8, got {scale}")
    head_dim = HEAD_DIM // scale
    layers = max(4, LAYERS // scale // 4 * 4)
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": HIDDEN // scale,
        "intermediate_size": FFN // scale,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": head_dim,
        "attn_output_gate": True,
        "linear_num_key_heads": LINEAR_KEY_HEADS,
        "linear_num_value_heads": LINEAR_VALUE_HEADS,
        "linear_key_head_dim": LINEAR_HEAD_DIM // scale,
        "linear_value_head_dim": LINEAR_HEAD_DIM // scale,
        "linear_conv_kernel_dim": 4,
        "vocab_size": VOCAB // scale,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 0,
        "mamba_ssm_dtype": "float32",
        "partial_rotary_factor": PARTIAL_ROTARY,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_interleaved": True,
            "mrope_section": mrope_section(head_dim, PARTIAL_ROTARY),
        },
    }
    vision = {
        "model_type": "qwen3_5_vision",
        "depth": max(1, VISION_DEPTH // scale),
        "hidden_size": VISION_WIDTH // scale,
        "intermediate_size": VISION_FFN // scale,
        "num_heads": VISION_HEADS,
        "out_hidden_size": HIDDEN // scale,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = {"text_config": text, "vision_config": vision, "tie_word_embeddings": False}
    head = {
        "hidden_size": HIDDEN // scale,
        "width": HEAD_WIDTH // scale,
        "feedforward": HEAD_FFN // scale,
        "heads": HEAD_HEADS,
        "routing_layers": HEAD_ROUTING,
        "layers": HEAD_LAYERS,
    }
    return config, head


def build_model(device: str, scale: int, tokenizer_dir: Path) -> Any:
    """Random bf16 backbone + head created directly on ``device``, wrapped as a ClefModel."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from guard.clef.head import JointHeadConfig, JointSchemaHead
    from guard.clef.model import ClefModel
    from guard.clef.processor import ClefProcessor

    backbone_config, head_sizes = flash_config(scale)
    with torch.device(device):
        backbone = Qwen3_5ForConditionalGeneration._from_config(Qwen3_5Config(**backbone_config), dtype=torch.bfloat16)
        head = JointSchemaHead(JointHeadConfig(**head_sizes)).to(torch.bfloat16)
    backbone.config.use_cache = False
    return ClefModel(
        backbone.eval(),
        head.eval(),
        ClefProcessor.from_pretrained(tokenizer_dir),
        model_id=f"clef-flash-shape-random-1/{scale}",
        revision="random",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this (CPU dry runs)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--states", type=int, nargs="+", default=list(STATE_TOKENS))
    parser.add_argument("--questions", type=int, nargs="+", default=list(QUESTIONS))
    parser.add_argument("--tokenizer", default=str(DEFAULT_MODEL), help="checkpoint dir whose tokenizer encodes")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --device cpu --scale 8 for a dry run")
    kernels = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    started = time.perf_counter()
    model = build_model(args.device, args.scale, Path(args.tokenizer))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    build_s = time.perf_counter() - started
    parameters = sum(p.numel() for p in model.backbone.parameters())
    head_parameters = sum(p.numel() for p in model.head.parameters())
    rows = measure_table(
        model,
        state_tokens=tuple(args.states),
        questions=tuple(args.questions),
        warmup=args.warmup,
        repeats=args.repeats,
        sync=sync,
    )
    where = torch.cuda.get_device_name() if cuda else "CPU"
    memory = f" · peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    print_table(
        rows,
        f"Clef-flash shape 1/{args.scale} · backbone {parameters / 1e9:.2f} B + head {head_parameters / 1e6:.1f} M "
        f"params · bf16 · {where}{memory} · build {build_s:.1f} s · kernels {kernels} · torch {torch.__version__} · "
        f"transformers {transformers.__version__}",
    )


if __name__ == "__main__":
    main()
