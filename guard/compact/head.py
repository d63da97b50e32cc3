"""The compact model's head: Clef's joint schema head, fed by late interaction instead of one prompt.

Clef (``shared/design/clef-runtime.md`` §3) reads one prompt that holds the state and the schema. Here the state and
each question and option are encoded **separately** by the frozen sentence encoder (late interaction), and the head
reads them together:

* memory ``M`` = ``memory_projection(hidden_norm([state rows ; question rows]))`` plus a learned segment
  embedding (state vs question): the positions every option and every field attend to (§3.2 steps 2, 8, 13). Rows
  are token states mean-pooled over runs of ``memory_pool`` tokens (:func:`pool_rows`, 8 in the shipped model),
  which keeps the head's cost low for long states;
* global vector ``g`` = mean of the normed state tokens (Clef: the last prompt token, step 3);
* question vector ``q_j`` = mean of the normed tokens of the question's instructions (step 4);
* option context ``c_k`` = mean of the normed tokens of the rendered option object ``{"description":…,
  "option_id":…}``, and option lexical vector ``ℓ_k`` = mean of the encoder's input word-piece embeddings of those
  tokens (Clef: LM-head rows, step 6).

From there the steps are Clef's (7 to 16): option queries, evidence routing, option summary, the joint field decoder,
``field_norm``, and the prior + gated joint + residual scorer. The module subclasses :class:`JointSchemaHead`, so every
parameter has the release's name; the only addition is ``memory_segment_embedding``. Unlike the reference the
forward pass is batched: padding is masked with key-padding masks, which for one unpadded record gives the per-record
computation.

Shapes: B records, Ls state tokens, Q questions, Lq question tokens, K options, Lo option tokens, H encoder width
(384), W head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from guard.clef.head import LOGIT_SCALE_MAX, JointHeadConfig, JointSchemaHead

__all__ = ["CompactHead", "HeadInputs", "masked_mean", "pool_rows"]

#: Rows of ``memory_segment_embedding``: 0 = state token, 1 = question token.
MEMORY_SEGMENTS = 2


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` ``(..., L, D)`` over the rows where ``mask`` ``(..., L)`` is true; zeros where none is."""
    weights = mask.to(x.dtype).unsqueeze(-1)  # (..., L, 1)
    total = (x * weights).sum(dim=-2)  # (..., D)
    return total / weights.sum(dim=-2).clamp(min=1.0)


def pool_rows(rows: torch.Tensor, pool: int) -> torch.Tensor:
    """Mean of each run of ``pool`` consecutive rows: ``(n, H)`` -> ``(ceil(n / pool), H)`` (the last run may be
    shorter). The state memory is pooled this way so the head's cost grows with ``n / pool``."""
    if pool <= 1 or rows.shape[0] <= 1:
        return rows
    n = rows.shape[0]
    full = n // pool
    parts = [rows[: full * pool].reshape(full, pool, -1).mean(1)] if full else []
    if n % pool:
        parts.append(rows[full * pool :].mean(0, keepdim=True))
    return torch.cat(parts, 0)


@dataclass(frozen=True)
class HeadInputs:
    """Padded encoder outputs for a batch of records (float tensors in the head's dtype, masks ``bool``).

    Questions are stored once per distinct question (``U`` of them) and referenced by index, so a batch that asks
    the same question of every record normalises and pools its tokens once.

    Attributes:
        state: ``(B, Ls, H)`` state rows; ``state_mask`` ``(B, Ls)``.
        question_index: ``(B, Q)`` int64 index into the distinct questions (0 for padding).
        question_mask: ``(B, Q)`` true for real questions (every record has at least one).
        question_tokens: ``(U, Lq, H)``; ``question_token_mask`` ``(U, Lq)``: pooled into the question vector.
        question_rows: ``(U, Lr, H)`` the question's memory rows (its tokens mean-pooled like the state's);
            ``question_row_mask`` ``(U, Lr)``.
        question_type: ``(U,)`` int64, 0 noul, 1 choice, 2 score.
        option_tokens: ``(U, K, Lo, H)``; ``option_token_mask`` ``(U, K, Lo)``.
        option_lexical: ``(U, K, H)`` mean word-piece embedding of each option.
        option_mask: ``(U, K)`` true for real options.
    """

    state: torch.Tensor
    state_mask: torch.Tensor
    question_index: torch.Tensor
    question_mask: torch.Tensor
    question_tokens: torch.Tensor
    question_token_mask: torch.Tensor
    question_rows: torch.Tensor
    question_row_mask: torch.Tensor
    question_type: torch.Tensor
    option_tokens: torch.Tensor
    option_token_mask: torch.Tensor
    option_lexical: torch.Tensor
    option_mask: torch.Tensor


class CompactHead(JointSchemaHead):
    """Clef's joint schema head read over separately encoded state, questions and options.

    Args:
        config: the head hyper-parameters (``hidden_size`` is the encoder width).
    """

    def __init__(self, config: JointHeadConfig) -> None:
        super().__init__(config)
        self.memory_segment_embedding = nn.Embedding(MEMORY_SEGMENTS, config.width)

    def forward_batch(self, inputs: HeadInputs) -> torch.Tensor:
        """Score every option of every question.

        Args:
            inputs: the padded batch.

        Returns:
            ``(B, Q, K)`` float32 logits; ``-inf`` at padded options (and everywhere in padded questions).
        """
        index, asked = inputs.question_index, inputs.question_mask  # (B, Q)
        batch, questions = index.shape
        options = inputs.option_mask.shape[1]
        segment = self.memory_segment_embedding.weight  # (2, W)

        # Distinct questions first: normalise, pool and project their tokens once (U rows).
        question_rows = self.hidden_norm(inputs.question_tokens)  # (U, Lq, H)
        unique_questions = masked_mean(question_rows, inputs.question_token_mask)  # (U, H)
        unique_contexts = masked_mean(self.hidden_norm(inputs.option_tokens), inputs.option_token_mask)  # (U, K, H)
        unique_memory = self.memory_projection(self.hidden_norm(inputs.question_rows)) + segment[1]  # (U, Lr, W)

        state = self.hidden_norm(inputs.state)  # (B, Ls, H)
        question_memory = unique_memory[index].reshape(batch, -1, unique_memory.shape[-1])  # (B, Q*Lr, W)
        question_memory_mask = (inputs.question_row_mask[index] & asked.unsqueeze(-1)).reshape(batch, -1)
        memory = torch.cat([self.memory_projection(state) + segment[0], question_memory], dim=1)  # (B, Lm, W)
        padding = ~torch.cat([inputs.state_mask, question_memory_mask], dim=1)  # (B, Lm)

        global_vector = masked_mean(state, inputs.state_mask)  # (B, H)
        question_vectors = unique_questions[index]  # (B, Q, H)
        option_mask = inputs.option_mask[index] & asked.unsqueeze(-1)  # (B, Q, K)
        lexical_raw = inputs.option_lexical[index]  # (B, Q, K, H)
        option_vectors = (
            self.option_context_projection(unique_contexts[index])
            + self.option_lexical_projection(lexical_raw)
            + self.option_question_projection(question_vectors).unsqueeze(2)
        ).reshape(batch, questions * options, -1)  # (B, Q*K, W)
        for layer in self.evidence_layers:  # Clef step 8, with key-padding masks for the batch
            keys = layer.memory_norm(memory)  # (B, Lm, W)
            attended, _ = layer.attention(
                layer.query_norm(option_vectors), keys, keys, key_padding_mask=padding, need_weights=False
            )
            option_vectors = option_vectors + attended
            option_vectors = option_vectors + layer.feedforward(layer.feedforward_norm(option_vectors))
        routed = option_vectors.reshape(batch, questions, options, -1)  # (B, Q, K, W)

        base = self.question_projection(question_vectors)  # (B, Q, W)
        affinity = torch.einsum("bqkw,bqw->bqk", routed, base) / math.sqrt(self.config.width)
        affinity = affinity.masked_fill(~option_mask, float("-inf"))
        weights = torch.softmax(affinity.float(), dim=-1).nan_to_num(0.0).to(routed.dtype)  # (B, Q, K)
        summaries = torch.einsum("bqk,bqkw->bqw", weights, routed)  # (B, Q, W)
        fields_ = (
            base
            + self.option_summary_norm(summaries)
            + self.global_projection(global_vector).unsqueeze(1)
            + self.type_embedding(inputs.question_type[index])
        )  # (B, Q, W)
        for layer in self.layers:  # Clef step 13
            fields_ = layer(fields_, memory, tgt_key_padding_mask=~asked, memory_key_padding_mask=padding)
        fields_ = self.field_norm(fields_)  # (B, Q, W)

        prior_scale = self.prior_logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()
        joint_scale = self.joint_logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()
        gate = torch.sigmoid(self.residual_gate)
        anchor = F.normalize(question_vectors + global_vector.unsqueeze(1), dim=-1, eps=1e-12)  # (B, Q, H)
        lexical = F.normalize(lexical_raw, dim=-1, eps=1e-12)  # (B, Q, K, H)
        prior = prior_scale * torch.einsum("bqkh,bqh->bqk", lexical, anchor)
        option_normed = self.option_norm(routed)  # (B, Q, K, W)
        field = fields_.unsqueeze(2).expand_as(option_normed)  # (B, Q, K, W)
        cosine = F.cosine_similarity(field, option_normed, dim=-1, eps=1e-8)  # (B, Q, K)
        features = torch.cat([field, option_normed, field * option_normed, (field - option_normed).abs()], dim=-1)
        residual = self.residual_scorer(features).squeeze(-1)  # (B, Q, K, 4W) -> (B, Q, K)
        logits = (prior + gate * (joint_scale * cosine + residual)).float()
        return logits.masked_fill(~option_mask, float("-inf"))
