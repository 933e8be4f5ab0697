"""One pre-norm decoder layer, its residual adds fused into the norms.

The residual stream travels as (delta, residual): a layer receives the previous layer's MLP
output and the stream before it, so both adds of a layer happen inside a norm kernel:

    y, h = norm1(delta, residual)       h = residual + delta      (the first layer: h = embeddings)
    y2, h2 = norm2(attention(y), h)     h2 = h + attention(y)
    return mlp(y2), h2         (a MoE layer's mlp: tpkernels.models.moe.MoE)
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.models.attention import SelfAttention
from tpkernels.models.context import LayerContext
from tpkernels.models.mlp import MLP
from tpkernels.models.moe import MoE
from tpkernels.models.norm import ResidualNorm
from tpkernels.models.recompute import recomputed
from tpkernels.models.sequence import SequenceInfo


class TransformerBlock(nn.Module):
    """forward(delta, residual or None, info, rope) -> (delta', residual'), each (batch, seq[/TP], hidden)."""

    def __init__(self, ctx: LayerContext, layer: int):
        super().__init__()
        self.layer, self.full_recompute = layer, ctx.recompute == "full"
        self.norm1 = ResidualNorm(ctx, "norm1", layer)
        self.attention = SelfAttention(ctx, layer)
        self.norm2 = ResidualNorm(ctx, "norm2", layer)
        self.mlp = MoE(ctx, layer) if ctx.mc.is_moe_layer(layer) else MLP(ctx, layer)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, info: SequenceInfo,
                rope) -> tuple[torch.Tensor, torch.Tensor]:
        if self.full_recompute and delta.requires_grad:
            return recomputed(self._forward, delta, residual, info, rope)
        return self._forward(delta, residual, info, rope)

    def _forward(self, delta, residual, info, rope):
        y, h = self.norm1(delta, residual)
        y2, h2 = self.norm2(self.attention(y, info, rope), h)
        return self.mlp(y2), h2

    def children_with_parts(self):
        return {"norm1": self.norm1, "attention": self.attention, "norm2": self.norm2, "mlp": self.mlp}
