"""The norms of a pre-norm residual stream, fused with the residual add.

    y, h = norm(x, residual)       h = x + residual (the stream the next add uses), y = norm(h)

RMSNorm (Llama family) runs :func:`tpkernels.rms_norm`, LayerNorm (GPT-2) :func:`tpkernels.layer_norm`:
Triton / C++ / reference, one pass for add + norm each way.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.functional.norms import layer_norm, rms_norm
from tpkernels.models.context import LayerContext, replicated
from tpkernels.models.hf_checkpoint import Part


class ResidualNorm(nn.Module):
    """weight (hidden,) [and bias (hidden,) for LayerNorm], replicated over TP.

    forward(x, residual=None): x, residual (batch, seq or seq/TP, hidden) -> (y, h), both like x."""

    def __init__(self, ctx: LayerContext, role: str, layer: int | None = None):
        super().__init__()
        mc = ctx.mc
        self.kind, self.eps, self.role, self.layer = mc.norm, mc.norm_eps, role, layer
        self.weight = replicated(nn.Parameter(torch.ones(mc.hidden_size, **ctx.factory())), ctx)
        self.bias = None
        if mc.norm == "layernorm":
            self.bias = replicated(nn.Parameter(torch.zeros(mc.hidden_size, **ctx.factory())), ctx)
        self._names = {p: ctx.hf(role, layer, p) for p in ("weight", "bias")}
        self._hidden = mc.hidden_size

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "rmsnorm":
            if residual is None:
                return rms_norm(x, self.weight, self.eps), x
            return rms_norm(x, self.weight, self.eps, residual=residual)
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps), x
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def hf_parts(self, tp_rank: int, tp_size: int | None = None) -> dict[str, list[Part]]:  # replicated: whole
        parts = {"weight": [Part(self._names["weight"])]}
        if self.bias is not None:
            parts["bias"] = [Part(self._names["bias"])]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {self._names[p]: (self._hidden,) for p in (["weight", "bias"] if self.bias is not None else ["weight"])}

    def extra_repr(self) -> str:
        return f"{self.kind}, hidden={self._hidden}, eps={self.eps}"
