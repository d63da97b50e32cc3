"""A router head: a fixed set of user labels (intents, queues) scored from the state, built from Clef head parts.

Each label owns a learned query that, together with the state's global vector, attends over the state tokens through
Clef's :class:`~guard.clef.head.EvidenceRoutingLayer` (§3.2 step 8, with key-padding masks for batches); a linear
scorer on the ``option_norm``-ed routed query gives the label's logit. The labels are answered as one ``choice``
question whose option ids must be exactly the trained labels.
"""

from __future__ import annotations

import torch
from torch import nn

from guard.clef.head import EvidenceRoutingLayer, JointHeadConfig
from guard.compact.head import masked_mean

__all__ = ["RouterHead"]


class RouterHead(nn.Module):
    """Scores ``labels`` from state token states.

    Args:
        config: head sizes (``hidden_size`` = encoder width; ``routing_layers`` routing blocks; ``layers`` unused).
        labels: number of labels K.
    """

    def __init__(self, config: JointHeadConfig, labels: int) -> None:
        super().__init__()
        if labels < 2:
            raise ValueError(f"a router needs at least 2 labels, got {labels}")
        self.config = config
        self.hidden_norm = nn.LayerNorm(config.hidden_size)
        self.memory_projection = nn.Linear(config.hidden_size, config.width, bias=False)
        self.global_projection = nn.Linear(config.hidden_size, config.width, bias=False)
        self.label_queries = nn.Parameter(torch.randn(labels, config.width) * 0.02)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(config.width, config.heads, config.feedforward, config.dropout)
            for _ in range(config.routing_layers)
        )
        self.option_norm = nn.LayerNorm(config.width)
        self.label_scorer = nn.Linear(config.width, 1)
        self.label_bias = nn.Parameter(torch.zeros(labels))

    def forward(self, state: torch.Tensor, state_mask: torch.Tensor) -> torch.Tensor:
        """Label logits.

        Args:
            state: ``(B, L, H)`` state token states; ``state_mask`` ``(B, L)`` bool.

        Returns:
            ``(B, K)`` float32 logits in label order.
        """
        x = self.hidden_norm(state)  # (B, L, H)
        memory = self.memory_projection(x)  # (B, L, W)
        padding = ~state_mask
        queries = self.label_queries.unsqueeze(0) + self.global_projection(masked_mean(x, state_mask)).unsqueeze(1)
        for layer in self.evidence_layers:  # (B, K, W)
            keys = layer.memory_norm(memory)
            attended, _ = layer.attention(layer.query_norm(queries), keys, keys, key_padding_mask=padding,
                                          need_weights=False)
            queries = queries + attended
            queries = queries + layer.feedforward(layer.feedforward_norm(queries))
        return (self.label_scorer(self.option_norm(queries)).squeeze(-1) + self.label_bias).float()  # (B, K)
