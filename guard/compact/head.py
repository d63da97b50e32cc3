"""The catalog head: the encoder's top layers, fine-tuned, plus one small pooling head per catalog question.

The compact model scores a state window by window (see ``guard/compact/model.py``). For every window the frozen
lower layers of all-MiniLM-L6-v2 give hidden states; :class:`CatalogHead` runs its own copies of the **top encoder
layers** (fine-tuned jointly with the heads by ``guard train``) and then, per question, pools the window's token
states two ways and maps them to that question's option logits:

* ``mean``: the masked mean of the token states (the sentence embedding all-MiniLM-L6-v2 was trained for);
* ``attention``: a softmax over tokens of ``h_t · q / sqrt(H)`` with a learned query ``q`` per question, so a few
  tokens (one injected sentence) can carry the window however long the benign text around them is;
* ``logits = W_q · LayerNorm([mean ; attention]) + b_q``, options beyond a question's count masked with ``-inf``.

Shapes: N windows, L tokens, H = 384, Q questions, K = most options of any question.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from guard.compact.encoder import attention_bias

__all__ = ["CatalogHead", "masked_mean", "pool_rows"]


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


class CatalogHead(nn.Module):
    """The fine-tuned top encoder layers and one pooling head per question.

    Args:
        layers: the encoder's top ``BertLayer`` modules, bottom up (copied; the copies are trained).
        options: option count per question, in head order.
        hidden: the encoder width (384).

    Raises:
        ValueError: no layer.
    """

    def __init__(self, layers: Sequence[nn.Module], options: Sequence[int], hidden: int = 384) -> None:
        super().__init__()
        if not len(layers):
            raise ValueError("the catalog head needs at least one encoder layer to fine-tune")
        self.top = nn.ModuleList(copy.deepcopy(layer).float() for layer in layers)
        self.options = list(options)
        count, width = len(self.options), max(self.options)
        self.query = nn.Parameter(torch.zeros(count, hidden))
        self.norm = nn.LayerNorm(2 * hidden)
        self.weight = nn.Parameter(torch.randn(count, 2 * hidden, width) * (2 * hidden) ** -0.5)
        self.bias = nn.Parameter(torch.zeros(count, width))
        valid = torch.zeros(count, width, dtype=torch.bool)
        for q, k in enumerate(self.options):
            valid[q, :k] = True
        self.register_buffer("valid", valid, persistent=False)

    def encode(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The top layers: ``(N, L, H)`` states below them and ``(N, L)`` bool mask -> ``(N, L, H)`` float32."""
        top_dtype = next(self.top.parameters()).dtype
        x = hidden.to(top_dtype)
        bias = attention_bias(mask, top_dtype)
        for layer in self.top:
            out = layer(x, attention_mask=bias)
            x = out[0] if isinstance(out, tuple) else out
        return x.float()

    def pooled(self, states: torch.Tensor, mask: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """What question index ``question`` ``(N,)`` reads of each window's ``states`` ``(N, L, H)``: the
        layer-normed ``[masked mean, the question's attention pooling]``, ``(N, 2H)`` float32."""
        mean = masked_mean(states, mask)
        scores = torch.einsum("nlh,nh->nl", states, self.query[question]) / math.sqrt(states.shape[-1])
        weights = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
        attended = torch.einsum("nl,nlh->nh", weights, states)
        return self.norm(torch.cat([mean, attended], dim=-1))

    def score(self, states: torch.Tensor, mask: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """Option logits ``(N, K)`` of question index ``question`` ``(N,)`` for each window's ``states``."""
        pooled = self.pooled(states, mask, question)
        logits = torch.einsum("nd,ndk->nk", pooled, self.weight[question]) + self.bias[question]
        return logits.masked_fill(~self.valid[question], -torch.inf)

    def set_noul_readout(self, question: int, weight: torch.Tensor, bias: float) -> None:
        """Make noul question index ``question`` answer ``logit(true) - logit(false) = weight · pooled + bias``
        (``weight`` ``(2H,)``): half of it on each option's row.

        Raises:
            ValueError: the question has other than two options, or ``weight`` another width.
        """
        if self.options[question] != 2:
            raise ValueError(f"question index {question} has {self.options[question]} options, not a noul's 2")
        if weight.shape != self.weight.shape[1:2]:
            raise ValueError(f"readout weight must have shape {tuple(self.weight.shape[1:2])}, got {tuple(weight.shape)}")
        with torch.no_grad():
            self.weight[question, :, 0] = weight / 2
            self.weight[question, :, 1] = -weight / 2
            self.bias[question, 0] = bias / 2
            self.bias[question, 1] = -bias / 2

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """``score(encode(hidden, mask), mask, question)``."""
        return self.score(self.encode(hidden, mask), mask, question)

    def config(self) -> dict[str, Any]:
        """The head's layout as a checkpoint records it: option counts, width and the number of top layers."""
        return {"options": self.options, "hidden": int(self.query.shape[1]), "top_layers": len(self.top)}
