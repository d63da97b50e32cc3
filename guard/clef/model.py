"""Clef / Clef-flash: load a release directory and answer System One requests like the reference ``systemone()``.

Implements the Clef runtime spec §1.8 (loading), §3.7 (which backbone module runs) and §4 (readout):

* backbone ``Qwen3_5ForConditionalGeneration`` (transformers), ``use_cache`` off, prefill only;
* head :class:`~guard.clef.head.JointSchemaHead`, same device and dtype as the backbone (bf16 by default);
* text-only batches run through ``backbone.model.language_model``; a batch with any media through ``backbone.model``
  (the multimodal wrapper computes M-RoPE positions from ``mm_token_type_ids``);
* per-question ``softmax`` in float32 on the head's logits, then :func:`guard.systemone.answer_question`.

The API is split so a micro-batcher can encode on CPU, run one batched forward, and answer each record:
:meth:`ClefModel.encode` -> :meth:`ClefModel.forward_records` -> :meth:`ClefModel.answer`.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from guard.clef.encoding import DEFAULT_MAX_LENGTH, EncodedRecord, collate, encode_record
from guard.clef.head import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, JointHeadConfig, JointSchemaHead
from guard.clef.processor import ClefProcessor
from guard.systemone import (
    ConfidenceProfile,
    SystemOneRequestV1,
    SystemOneResponseV1,
    UsageV1,
    ValidationProfile,
    answer_question,
    require_request,
)

__all__ = ["SUPPORTED_DTYPES", "ClefModel", "check_checkpoint", "checkpoint_date", "checkpoint_revision"]

#: Backbone/head dtypes we run: bf16 (the reference) or float32 (the same bf16 weights upcast exactly).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_REVISION_SMALL_FILES = ("config.json", HEAD_CONFIG_FILE, "model.safetensors.index.json", "tokenizer.json")
_REVISION_SAMPLE_BYTES = 1 << 20


def check_checkpoint(path: str | Path) -> None:
    """Check, without loading any weights, that ``path`` holds a Clef checkpoint's files and a valid joint head config.

    Raises:
        FileNotFoundError: ``"<path> is not a Clef checkpoint: <file> is missing"``.
        ValueError: the joint head config is not JSON or not a valid config (naming the file).
    """
    root = Path(path)
    for required in ("config.json", HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, "tokenizer.json"):
        if not (root / required).is_file():
            raise FileNotFoundError(f"{root} is not a Clef checkpoint: {required} is missing")
    try:
        JointHeadConfig.from_file(root / HEAD_CONFIG_FILE)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{root / HEAD_CONFIG_FILE}: {exc}") from None


def checkpoint_revision(path: str | Path) -> str:
    """A stable identity hash of a checkpoint directory (16 hex digits).

    sha256 over: the small JSON files in full, ``joint_head.safetensors`` in full, and for every backbone
    ``*.safetensors`` shard its name, size and first and last MiB (enough to tell releases apart without reading
    tens of GB).
    """
    root = Path(path)
    digest = hashlib.sha256()
    for name in (*_REVISION_SMALL_FILES, HEAD_WEIGHTS_FILE):
        file = root / name
        if file.exists():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    for shard in sorted(p for p in root.glob("*.safetensors") if p.name != HEAD_WEIGHTS_FILE):
        size = shard.stat().st_size
        digest.update(f"{shard.name}\0{size}\0".encode())
        with shard.open("rb") as handle:
            digest.update(handle.read(_REVISION_SAMPLE_BYTES))
            handle.seek(max(0, size - _REVISION_SAMPLE_BYTES))
            digest.update(handle.read(_REVISION_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def checkpoint_date(path: str | Path) -> datetime.date:
    """The UTC date the checkpoint's weights were written: the newest modification time of its ``*.safetensors``."""
    newest = max(p.stat().st_mtime for p in Path(path).glob("*.safetensors"))
    return datetime.datetime.fromtimestamp(newest, tz=datetime.UTC).date()


class ClefModel:
    """A loaded Clef checkpoint: backbone + joint schema head + processor.

    Use :meth:`from_pretrained`. Attributes: ``backbone``, ``head``, ``processor``, ``dtype``, ``device``,
    ``max_length`` (default prompt limit), ``model_id`` (the directory name), ``revision`` (see
    :func:`checkpoint_revision`), ``released`` (UTC date the weights were written, see :func:`checkpoint_date`; ``None``
    when unknown).

    Example:
        >>> model = ClefModel.from_pretrained("tests/fixtures/clef-golden/checkpoint", dtype=torch.float32)
        ... # doctest: +SKIP
        >>> model.systemone({"model": "clef", "state": "hi", "questions": {"q": {"type": "noul"}}})  # doctest: +SKIP
    """

    def __init__(
        self,
        backbone: Any,
        head: JointSchemaHead,
        processor: ClefProcessor,
        *,
        model_id: str,
        revision: str,
        max_length: int = DEFAULT_MAX_LENGTH,
        released: datetime.date | None = None,
    ) -> None:
        self.backbone = backbone
        self.head = head
        self.processor = processor
        self.model_id = model_id
        self.revision = revision
        self.max_length = max_length
        self.released = released
        self.dtype: torch.dtype = head.hidden_norm.weight.dtype
        self.device: torch.device = head.hidden_norm.weight.device

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        max_length: int = DEFAULT_MAX_LENGTH,
        attn_implementation: str | None = None,
    ) -> ClefModel:
        """Load a release directory (§1.8). Nothing is downloaded.

        Args:
            path: directory with ``config.json``, backbone safetensors, ``joint_head*``, tokenizer and processor files.
            dtype: ``torch.bfloat16`` (reference) or ``torch.float32``; the head gets the same dtype.
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            max_length: default prompt limit for :meth:`encode` (the reference's 16384).
            attn_implementation: optional transformers attention backend (default SDPA).

        Raises:
            FileNotFoundError: when ``path`` is not a checkpoint directory.
            ValueError: for an unsupported dtype or a non-positive ``max_length``.
        """
        from transformers import Qwen3_5ForConditionalGeneration

        root = Path(path)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        check_checkpoint(root)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        backbone: Any = Qwen3_5ForConditionalGeneration.from_pretrained(str(root), **kwargs)
        backbone.config.use_cache = False
        backbone = backbone.to(device).eval()
        head = JointSchemaHead.from_pretrained(root, dtype=dtype, device=device)
        return cls(
            backbone,
            head,
            ClefProcessor.from_pretrained(root),
            model_id=root.resolve().name,
            revision=checkpoint_revision(root),
            max_length=max_length,
            released=checkpoint_date(root),
        )

    def encode(self, request: SystemOneRequestV1, *, max_length: int | None = None) -> EncodedRecord:
        """Encode one request (§2); CPU only, no forward pass.

        Raises:
            TypeError: ``request`` is not a :class:`SystemOneRequestV1` (build one with
                ``SystemOneRequestV1.from_json(body)``).
            RequestValidationError: (a ``ValueError``) when the schema alone exceeds ``max_length`` (reference
                message), or an image cannot be decoded.
        """
        request = require_request(request, "ClefModel.encode()")
        return encode_record(request, self.processor, max_length=max_length or self.max_length)

    @torch.inference_mode()
    def hidden_states(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Backbone prefill: [B, T, H] ``last_hidden_state`` after the final RMSNorm (§3.4, §3.7).

        Text-only batches call ``backbone.model.language_model``; a batch with media calls ``backbone.model`` with
        the media tensors and ``mm_token_type_ids``.
        """
        if "mm_token_type_ids" in batch:
            out = self.backbone.model(**batch, use_cache=False, return_dict=True)
        else:
            out = self.backbone.model.language_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, return_dict=True
            )
        hidden: torch.Tensor = out.last_hidden_state  # [B, T, H]
        return hidden

    @torch.inference_mode()
    def forward_records(self, records: Sequence[EncodedRecord]) -> list[list[torch.Tensor]]:
        """One batched prefill + head over ``records``.

        In a batch with media, a text-only record whose text holds an image or video pad id (embedded as a plain
        token, as the reference does) runs in a text-only pass of its own: the multimodal pass would take its pads
        for media slots and fail the whole batch.

        Returns:
            Per record, per question (request order), float32 CPU logits [n_j] in prompt option order.
        """
        pads = self.processor.media_pad_ids
        apart = [r.media is None and not pads.isdisjoint(r.input_ids) for r in records]
        if any(apart) and any(r.media is not None for r in records):
            groups = [[i for i, a in enumerate(apart) if a], [i for i, a in enumerate(apart) if not a]]
            logits: dict[int, list[torch.Tensor]] = {}
            for group in groups:
                logits.update(zip(group, self._forward([records[i] for i in group]), strict=True))
            return [logits[i] for i in range(len(records))]
        return self._forward(records)

    def _forward(self, records: Sequence[EncodedRecord]) -> list[list[torch.Tensor]]:
        batch = collate(list(records), self.processor.pad_token_id, self.device)
        hidden = self.hidden_states(batch)  # [B, T, H]
        logits = self.head(
            hidden.to(self.dtype),
            batch["input_ids"],
            batch["attention_mask"],
            records,
            self.backbone.get_output_embeddings().weight,  # [V, H]
        )
        return [[z.float().cpu() for z in per_record] for per_record in logits]

    def answer(
        self,
        request: SystemOneRequestV1,
        record: EncodedRecord,
        logits: Sequence[torch.Tensor],
        *,
        confidence_profile: ConfidenceProfile = "reference",
    ) -> SystemOneResponseV1:
        """Readout (§4): float32 softmax per question, then answers in request order.

        ``usage.input_tokens`` is ``len(record.input_ids)`` (media and truncation included); ``output_tokens`` is 0;
        ``state_tokens_dropped`` is the tail of the state cut to fit ``max_length`` (§2.5; only the state is cut).
        """
        answers = {}
        for question, z in zip(request.questions, logits, strict=True):
            probabilities = torch.softmax(z.float(), dim=-1).tolist()
            answers[question.id] = answer_question(question, probabilities, confidence_profile=confidence_profile)
        dropped = max(record.untruncated_length - len(record.input_ids), 0)
        usage = UsageV1(len(record.input_ids), state_tokens_dropped=dropped)
        return SystemOneResponseV1(model=request.model, answers=answers, usage=usage)

    def systemone(
        self,
        request: SystemOneRequestV1 | Mapping[str, Any],
        *,
        max_length: int | None = None,
        confidence_profile: ConfidenceProfile = "reference",
        validation_profile: ValidationProfile = "reference",
    ) -> SystemOneResponseV1:
        """Answer one request, like the reference ``systemone(model, processor, request, max_length)``.

        Args:
            request: a validated request, or a parsed JSON body (validated with ``validation_profile``).
            max_length: prompt limit (default :attr:`max_length`).
            confidence_profile: ``reference`` (top probability), ``workers-ai`` or ``jev`` (§4.1).
            validation_profile: profile for a dict body; ``reference`` accepts what the reference accepts.

        Raises:
            RequestValidationError: invalid request or schema longer than ``max_length``.
        """
        if not isinstance(request, SystemOneRequestV1):
            request = SystemOneRequestV1.from_json(request, profile=validation_profile)
        record = self.encode(request, max_length=max_length)
        (logits,) = self.forward_records([record])
        return self.answer(request, record, logits, confidence_profile=confidence_profile)
