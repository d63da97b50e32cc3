"""The joint schema head: backbone hidden states + LM-head rows of option tokens -> one logit per option.

Implements the Clef runtime spec §3 (reference semantics). Attribute names are the release's
``joint_head.safetensors`` keys (§1.5), so a release file loads with ``strict=True``. The forward pass follows §3.2
step by step, one record at a time (the per-record loop is part of the reference semantics), in whatever dtype the
module is in (bf16 like the reference by default), and returns ``.float()`` logits.

Notation (§3.0): L valid tokens of one record, H backbone width, W head width, F feed-forward width, Q questions,
N options over all questions, n_j options of question j.

The building blocks (:class:`EvidenceRoutingLayer`, :func:`field_decoder_layer`, :func:`residual_scorer`) are public
so that other models can be built from the same parts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from guard.clef.encoding import EncodedRecord

__all__ = [
    "HEAD_CONFIG_FILE",
    "HEAD_WEIGHTS_FILE",
    "LOGIT_SCALE_MAX",
    "EvidenceRoutingLayer",
    "JointHeadConfig",
    "JointSchemaHead",
    "field_decoder_layer",
    "residual_scorer",
]

HEAD_CONFIG_FILE = "joint_head_config.json"
HEAD_WEIGHTS_FILE = "joint_head.safetensors"
#: The two log-space logit scales are clamped at ln 100 before ``exp`` (§3.6).
LOGIT_SCALE_MAX = math.log(100.0)
#: Number of question types, i.e. rows of ``type_embedding`` (noul, choice, score).
NUM_QUESTION_TYPES = 3


@dataclass(frozen=True)
class JointHeadConfig:
    """Hyper-parameters of the head, as stored in ``joint_head_config.json`` (§1.4).

    Attributes:
        hidden_size: backbone width H (= LM-head row width).
        width: head width W.
        routing_layers: evidence-routing blocks (option -> prompt cross-attention).
        layers: joint field decoder blocks.
        heads: attention heads in every head attention; must divide ``width``.
        feedforward: FFN width F in every block.
        dropout: training-only dropout (0 at inference).
    """

    hidden_size: int
    width: int = 1024
    routing_layers: int = 2
    layers: int = 4
    heads: int = 16
    feedforward: int = 4096
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"joint head {name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"joint head width {self.width} must be divisible by heads {self.heads}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"joint head dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JointHeadConfig:
        """Build from the parsed JSON, rejecting unknown keys (the reference passes them as constructor kwargs).

        Raises:
            ValueError: for an unknown or missing key, or an invalid value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"joint head config has unknown keys {unknown}; known keys are {sorted(known)}")
        if "hidden_size" not in raw:
            raise ValueError("joint head config must set hidden_size")
        return cls(**dict(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> JointHeadConfig:
        """Read ``joint_head_config.json`` (or the file at ``path``)."""
        target = Path(path)
        if target.is_dir():
            target = target / HEAD_CONFIG_FILE
        return cls.from_dict(json.loads(target.read_text(encoding="utf-8")))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``dropout`` only when non-zero (the release file omits it)."""
        body = asdict(self)
        if not body["dropout"]:
            del body["dropout"]
        return body


class EvidenceRoutingLayer(nn.Module):
    """Options attend to every prompt position, then a pre-norm FFN (§3.2 step 8).

    Keys: ``query_norm``, ``memory_norm``, ``attention`` (packed-QKV ``nn.MultiheadAttention``), ``feedforward_norm``,
    ``feedforward`` (``0`` up-projection, ``1`` GELU, ``2`` dropout, ``3`` down-projection, ``4`` dropout).
    """

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(feedforward, width),
            nn.Dropout(dropout),
        )

    def forward(self, options: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Route evidence into option vectors.

        Args:
            options: [1, N, W] option queries.
            memory: [1, L, W] projected prompt positions (normalized here, not by the caller).

        Returns:
            [1, N, W] updated option vectors.
        """
        keys = self.memory_norm(memory)  # [1, L, W]
        attended, _ = self.attention(self.query_norm(options), keys, keys, need_weights=False)  # [1, N, W]
        options = options + attended
        routed: torch.Tensor = options + self.feedforward(self.feedforward_norm(options))  # [1, N, W]
        return routed


def field_decoder_layer(width: int, heads: int, feedforward: int, dropout: float = 0.0) -> nn.TransformerDecoderLayer:
    """One joint field decoder block (§3.2 step 13): ``torch.nn.TransformerDecoderLayer``, pre-norm, GELU.

    Keys: ``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1``..``norm3``.
    """
    return nn.TransformerDecoderLayer(
        d_model=width,
        nhead=heads,
        dim_feedforward=feedforward,
        dropout=dropout,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )


def residual_scorer(width: int, dropout: float = 0.0) -> nn.Sequential:
    """The residual scorer MLP: ``[f; o; f⊙o; |f−o|]`` (4W) -> W -> 1 (keys ``0`` and ``3``; §3.2 step 15)."""
    return nn.Sequential(nn.Linear(4 * width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, 1))


class JointSchemaHead(nn.Module):
    """The joint schema head (§3). Attribute names equal the release checkpoint keys (§1.5).

    Args:
        config: the head hyper-parameters.

    Example:
        >>> head = JointSchemaHead.from_pretrained("tests/fixtures/clef-golden/checkpoint")  # doctest: +SKIP
    """

    def __init__(self, config: JointHeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden, width = config.hidden_size, config.width
        self.hidden_norm = nn.LayerNorm(hidden)
        self.memory_projection = nn.Linear(hidden, width, bias=False)
        self.question_projection = nn.Linear(hidden, width, bias=False)
        self.option_question_projection = nn.Linear(hidden, width, bias=False)
        self.global_projection = nn.Linear(hidden, width, bias=False)
        self.option_context_projection = nn.Linear(hidden, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden, width, bias=False)
        self.type_embedding = nn.Embedding(NUM_QUESTION_TYPES, width)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(width, config.heads, config.feedforward, config.dropout)
            for _ in range(config.routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            field_decoder_layer(width, config.heads, config.feedforward, config.dropout) for _ in range(config.layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = residual_scorer(width, config.dropout)
        self.prior_logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.joint_logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.residual_gate = nn.Parameter(torch.tensor(-2.0))

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ) -> JointSchemaHead:
        """Load ``joint_head_config.json`` + ``joint_head.safetensors`` with ``strict=True`` (§1.8).

        Args:
            path: checkpoint directory.
            dtype: head dtype; the reference uses the backbone's (bf16 by default).
            device: where to put it.

        Raises:
            ValueError: bad config; RuntimeError: missing/unexpected keys or shape mismatches (strict loading).
        """
        from safetensors.torch import load_file

        root = Path(path)
        head = cls(JointHeadConfig.from_file(root / HEAD_CONFIG_FILE))
        head.load_state_dict(load_file(str(root / HEAD_WEIGHTS_FILE)), strict=True)
        return head.to(device=device, dtype=dtype).eval()

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        records: Sequence[EncodedRecord],
        output_embedding_weight: torch.Tensor,
    ) -> list[list[torch.Tensor]]:
        """Score every option of every question (§3.2).

        Args:
            hidden_states: [B, T, H] backbone ``last_hidden_state`` (after the final RMSNorm), in the head's dtype.
            input_ids: [B, T] int64, right-padded.
            attention_mask: [B, T], 1 on real tokens.
            records: the B encoded records (spans index into each row).
            output_embedding_weight: [V, H] the backbone's LM-head matrix.

        Returns:
            Per record, per question (request order), a float32 1-D tensor [n_j] of logits in prompt option order.
        """
        normed = self.hidden_norm(hidden_states)  # step 0: [B, T, H]
        return [
            self._score_record(normed[b, : int(attention_mask[b].sum())], input_ids[b], record, output_embedding_weight)
            for b, record in enumerate(records)
        ]

    def _score_record(
        self, x: torch.Tensor, ids: torch.Tensor, record: EncodedRecord, embedding: torch.Tensor
    ) -> list[torch.Tensor]:
        """Steps 1-16 for one record; ``x`` is [L, H] after ``hidden_norm``, ``ids`` is the padded id row [T]."""
        memory = self.memory_projection(x).unsqueeze(0)  # step 2: [L, W] -> [1, L, W]
        global_vector = x[-1]  # step 3: [H], last valid token
        questions = torch.stack([x[s:e].mean(dim=0) for s, e in (q.question_span for q in record.questions)])  # [Q, H]
        type_ids = torch.tensor([q.question_type for q in record.questions], device=x.device)  # step 5: [Q]
        spans = [span for q in record.questions for span in q.option_spans]
        counts = [len(q.option_spans) for q in record.questions]
        contexts = torch.stack([x[s:e].mean(dim=0) for s, e in spans])  # step 6: [N, H]
        lexicals = torch.stack([embedding[ids[s:e]].mean(dim=0) for s, e in spans])  # step 6: [N, H]
        owner = torch.repeat_interleave(
            torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device)
        )
        options = (
            self.option_context_projection(contexts)
            + self.option_lexical_projection(lexicals)
            + self.option_question_projection(questions[owner])
        ).unsqueeze(0)  # step 7: [N, W] -> [1, N, W]
        for layer in self.evidence_layers:  # step 8
            options = layer(options, memory)  # [1, N, W]
        per_question = options[0].split(counts)  # step 9: Q tensors [n_j, W]
        base = self.question_projection(questions)  # step 10: [Q, W]
        scale = math.sqrt(self.config.width)
        summaries = torch.stack(
            [(torch.softmax(o @ f / scale, dim=0).unsqueeze(-1) * o).sum(dim=0) for o, f in zip(per_question, base)]
        )  # step 11: [Q, W]
        fields_ = (
            base
            + self.option_summary_norm(summaries)
            + self.global_projection(global_vector)
            + self.type_embedding(type_ids)
        ).unsqueeze(0)  # step 12: [1, Q, W]
        for layer in self.layers:  # step 13: memory is M as is
            fields_ = layer(fields_, memory)  # [1, Q, W]
        fields_ = self.field_norm(fields_)[0]  # step 14: [Q, W]

        prior_scale = self.prior_logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()
        joint_scale = self.joint_logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()
        gate = torch.sigmoid(self.residual_gate)
        lexical_per_question = torch.split(lexicals, counts)  # Q tensors [n_j, H]
        logits: list[torch.Tensor] = []
        for j, routed in enumerate(per_question):  # step 15
            anchor = F.normalize(questions[j] + global_vector, dim=-1, eps=1e-12)  # [H]
            prior = prior_scale * (F.normalize(lexical_per_question[j], dim=-1, eps=1e-12) @ anchor)  # [n_j]
            option_vectors = self.option_norm(routed)  # [n_j, W]
            field = fields_[j].expand_as(option_vectors)  # [W] -> [n_j, W]
            cosine = F.cosine_similarity(field, option_vectors, dim=-1, eps=1e-8)  # [n_j]
            features = torch.cat(
                [field, option_vectors, field * option_vectors, (field - option_vectors).abs()], dim=-1
            )  # [n_j, 4W]
            residual = self.residual_scorer(features).squeeze(-1)  # [n_j, 1] -> [n_j]
            joint = joint_scale * cosine + residual
            logits.append((prior + gate * joint).float())  # step 16: [n_j]
        return logits
