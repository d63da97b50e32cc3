"""A router head: a fixed set of user labels (intents, queues) scored from the state, built from Clef head parts.

A few learned pooling queries, each offset by the state's global vector, attend over the state rows through Clef's
:class:`~guard.clef.head.EvidenceRoutingLayer` (§3.2 step 8, with key-padding masks for batches); the ``option_norm``
-ed pooled vectors, concatenated, go through one linear layer to a logit per label. The cost does not grow with the
number of labels. The labels are answered as one ``choice`` question whose option ids must be exactly the trained
labels.
"""

from __future__ import annotations

import torch
from torch import nn

from guard.clef.head import EvidenceRoutingLayer, JointHeadConfig
from guard.compact.head import masked_mean

__all__ = ["POOL_QUERIES", "RouterHead"]

#: Learned pooling queries that read the state.
POOL_QUERIES = 4


class RouterHead(nn.Module):
    """Scores ``labels`` from state rows.

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
        self.pool_queries = nn.Parameter(torch.randn(POOL_QUERIES, config.width) * 0.02)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(config.width, config.heads, config.feedforward, config.dropout)
            for _ in range(config.routing_layers)
        )
        self.option_norm = nn.LayerNorm(config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.label_scorer = nn.Linear(POOL_QUERIES * config.width, labels)

    def forward(self, state: torch.Tensor, state_mask: torch.Tensor) -> torch.Tensor:
        """Label logits.

        Args:
            state: ``(B, L, H)`` state rows; ``state_mask`` ``(B, L)`` bool.

        Returns:
            ``(B, K)`` float32 logits in label order.
        """
        x = self.hidden_norm(state)  # (B, L, H)
        memory = self.memory_projection(x)  # (B, L, W)
        padding = ~state_mask
        queries = self.pool_queries.unsqueeze(0) + self.global_projection(masked_mean(x, state_mask)).unsqueeze(1)
        for layer in self.evidence_layers:  # (B, P, W)
            keys = layer.memory_norm(memory)
            attended, _ = layer.attention(layer.query_norm(queries), keys, keys, key_padding_mask=padding,
                                          need_weights=False)
            queries = queries + attended
            queries = queries + layer.feedforward(layer.feedforward_norm(queries))
        pooled = self.dropout(self.option_norm(queries).flatten(1))  # (B, P*W)
        return self.label_scorer(pooled).float()  # (B, K)
