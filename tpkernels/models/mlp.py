"""The MLP with TP: column-parallel up (+ gate) GEMM, activation, row-parallel down GEMM.

SwiGLU (Llama family): gate and up are one column-parallel GEMM whose per-rank output is
[gate of rank r | up of rank r], feeding :func:`tpkernels.swiglu` on the fused tensor.
GeLU (GPT-2): the up GEMM runs without its bias, which :func:`tpkernels.bias_gelu` adds inside
the activation kernel (one pass instead of two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkernels.functional.bias_gelu import bias_gelu
from tpkernels.functional.swiglu import swiglu
from tpkernels.models.context import LayerContext
from tpkernels.models.hf_checkpoint import Part
from tpkernels.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.param_tags import tag


class MLP(nn.Module):
    """forward(x (batch, seq[/TP], hidden)) -> like x.

    ffn_hidden_size / hf_name: another width and HF naming than the model's dense MLP (a MoE block's
    shared expert: ``hf_name(role, layer, param)`` with role "gate", "up" or "down")."""

    def __init__(self, ctx: LayerContext, layer: int, *, ffn_hidden_size: int | None = None, hf_name=None):
        super().__init__()
        mc = ctx.mc
        self.ctx, self.layer, self.kind = ctx, layer, mc.activation
        self.ffn = ffn_hidden_size or mc.ffn_hidden_size
        self._hf = hf_name or ctx.hf
        self.f = self.ffn // ctx.tp_size
        kw = ctx.tp_kwargs()
        if mc.activation == "swiglu":
            self.gate_up = ColumnParallelLinear(mc.hidden_size, 2 * self.ffn, bias=mc.mlp_bias, **kw)
        else:
            self.up = ColumnParallelLinear(mc.hidden_size, self.ffn, bias=False, **kw)
            self.up_bias = tag(nn.Parameter(torch.zeros(self.f, **ctx.factory())), split_dim=0) if mc.mlp_bias else None
        self.down = RowParallelLinear(self.ffn, mc.hidden_size, bias=mc.mlp_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down(swiglu(self.gate_up(x)))
        y = self.up(x)
        approximate = "tanh" if self.kind == "gelu_tanh" else "none"
        y = bias_gelu(y, self.up_bias, approximate) if self.up_bias is not None else F.gelu(y, approximate=approximate)
        return self.down(y)

    def hf_parts(self, tp_rank: int, tp_size: int | None = None) -> dict[str, list[Part]]:
        """Rank ``tp_rank``'s parts at TP size ``tp_size`` (default the model's)."""
        ctx, i, hf = self.ctx, self.layer, self._hf
        f = self.ffn // (tp_size or ctx.tp_size)
        t = ctx.transposed
        rows, cols = (tp_rank * f, (tp_rank + 1) * f), (tp_rank * f, (tp_rank + 1) * f)
        parts = {"down.weight": [Part(hf("down", i), cols=cols, transpose=t)]}
        if self.down.bias is not None:
            parts["down.bias"] = [Part(hf("down", i, "bias"))]
        if self.kind == "swiglu":
            parts["gate_up.weight"] = [Part(hf(r, i), rows=rows, transpose=t) for r in ("gate", "up")]
            if self.gate_up.bias is not None:
                parts["gate_up.bias"] = [Part(hf(r, i, "bias"), rows=rows) for r in ("gate", "up")]
        else:
            parts["up.weight"] = [Part(hf("up", i), rows=rows, transpose=t)]
            if self.up_bias is not None:
                parts["up_bias"] = [Part(hf("up", i, "bias"), rows=rows)]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        mc, i, hf = self.ctx.mc, self.layer, self._hf
        h, f = mc.hidden_size, self.ffn
        shapes = {hf("down", i): (h, f)}
        ups = ("gate", "up") if self.kind == "swiglu" else ("up",)
        for r in ups:
            shapes[hf(r, i)] = (f, h)
            if mc.mlp_bias:
                shapes[hf(r, i, "bias")] = (f,)
        if mc.mlp_bias:
            shapes[hf("down", i, "bias")] = (h,)
        return shapes
