"""The expert-grouped quantised weight: a MoE layer's stacked experts held as a frozen NF4 / int8 base
(QLoRA on routed experts), and its grouped GEMM.

    gq = GroupedQuantizedWeight("nf4", num_experts=L, shape=(out, in), dtype=torch.bfloat16)
    gq.load_(w, row_splits)                   # w (L, in, out) stacked like the experts; w can be freed
    y = grouped_quantized_gemm(x, gq, counts) # x (N, in) grouped by expert, counts (L,) -> (N, out)
    gq.dequantize()                           # (L, in, out): the values the GEMMs compute with

The weight format of the experts (``tpkernels.models.moe.MoE``), beside the dense stacked tensor that
:func:`tpkernels.functional.grouped_gemm.grouped_gemm` multiplies: each local expert's slice is one
:class:`~tpkernels.functional.quantized_weight.QuantizedWeight` of its (out, in) matrix (the transposed
(in, out) slice of the stacked tensor, i.e. the Hugging Face tensor's TP rectangle), quantised piece by
piece along its rows, one piece per Hugging Face tensor it is made of (``row_splits``: the gate and up
rows of a gate_up slice are two pieces, as the dense gate/up layer's): expert e of a one-process
model holds exactly bitsandbytes' bytes of each of its Hugging Face tensors (w1, w3, w2), and a TP
rank its rectangle of each quantised alone, as the TP linears' NF4 base does. No full-precision copy
is kept.

The GEMM runs the quantised weight's own kernels (``nf4_linear``: Triton on CUDA, C++ panels or the
reference on the CPU; int8 panels) expert by expert over each expert's contiguous rows: a loop over
the L local experts with one host read of ``counts`` (an empty expert costs nothing), since the NF4
kernels take one 2-D weight per launch. The weight is frozen: the backward gives the input gradient
only (dy · W_e per expert) and saves nothing of ``x``. Adapters on top
(:mod:`tpkernels.models.expert_lora`) add their own grouped GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpkernels.functional.quantized_weight import QuantizedWeight


class GroupedQuantizedWeight(nn.Module):
    """``num_experts`` frozen quantised (out, in) matrices, stacked (module docstring). ``dtype``: the
    activations' (and what ``dequantize`` returns)."""

    def __init__(self, fmt: str, num_experts: int, shape: tuple[int, int], dtype: torch.dtype, device=None):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts ({num_experts!r}) must be a positive int")
        self.fmt, self.shape, self.dtype = fmt, tuple(int(s) for s in shape), dtype
        self.experts = nn.ModuleList(QuantizedWeight(fmt, self.shape, dtype, device) for _ in range(num_experts))

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def loaded(self) -> bool:
        return all(q.loaded for q in self.experts)

    @property
    def device(self) -> torch.device:
        return self.experts[0].device

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.experts)

    @torch.no_grad()
    def load_(self, w: Tensor, row_splits: list[int] | None = None) -> "GroupedQuantizedWeight":
        """Quantise ``w`` (num_experts, in, out), any float dtype, expert by expert. ``row_splits``: the
        rows (of the experts' (out, in) view, expert after expert) of each piece, summing to
        num_experts · out; default one piece per expert."""
        out, inp = self.shape
        want = (self.num_experts, inp, out)
        if tuple(w.shape) != want:
            raise ValueError(f"stacked weight shape {tuple(w.shape)} must be (num_experts, in, out) = {want}")
        splits = list(row_splits) if row_splits else [out] * self.num_experts
        per_expert, cur, acc = [], [], 0
        for n in splits:
            cur.append(n)
            acc += n
            if acc == out:
                per_expert.append(cur)
                cur, acc = [], 0
            elif acc > out:
                break
        if cur or len(per_expert) != self.num_experts:
            raise ValueError(f"row_splits {splits} must cut each of the {self.num_experts} experts' {out} rows into "
                             "pieces that end at an expert's last row")
        for q, m, rows in zip(self.experts, w, per_expert):
            q.load_(m.t(), rows)
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """(num_experts, in, out): the values the GEMMs compute with, in ``dtype`` (default the layer's)."""
        return torch.stack([q.dequantize(dtype).t() for q in self.experts])

    def extra_repr(self) -> str:
        return f"{self.fmt}, {self.num_experts} experts of {self.shape} (out, in), {self.nbytes} bytes"


def _bounds(counts: Tensor, rows: int, num_experts: int) -> list[int]:
    """Row offsets of each expert's group (host), checked against the rows of ``x``."""
    if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.numel() != num_experts or \
            counts.is_floating_point():
        got = f"shape {tuple(counts.shape)} {counts.dtype}" if isinstance(counts, Tensor) else type(counts).__name__
        raise ValueError(f"counts ({got}) must be a 1-D integer tensor of {num_experts} row counts, one per expert")
    c = [int(v) for v in counts.tolist()]
    if min(c, default=0) < 0 or sum(c) != rows:
        raise ValueError(f"counts must be non-negative and sum to the rows of x ({rows}), got {c}")
    b = [0]
    for v in c:
        b.append(b[-1] + v)
    return b


def _gemm(x: Tensor, gq: GroupedQuantizedWeight, bounds: list[int], transposed: bool) -> Tensor:
    """Per expert: x_e · W_eᵀ (forward, ``transposed``) or dy_e · W_e (input gradient)."""
    out, inp = gq.shape
    y = x.new_empty((x.shape[0], out if transposed else inp))
    for e, q in enumerate(gq.experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = q.forward_gemm(x[lo:hi]) if transposed else q.input_grad(x[lo:hi])
    return y


class _GroupedQuantizedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gq: GroupedQuantizedWeight, bounds: list[int]) -> Tensor:
        ctx.gq, ctx.bounds = gq, bounds  # the frozen weight only: nothing of x is kept
        return _gemm(x.detach(), gq, bounds, transposed=True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx = _gemm(dy.contiguous(), ctx.gq, ctx.bounds, transposed=False) if ctx.needs_input_grad[0] else None
        return dx, None, None


def grouped_quantized_gemm(x: Tensor, gq: GroupedQuantizedWeight, counts: Tensor) -> Tensor:
    """x (N, in) rows grouped by expert, ``gq`` the experts' frozen (out, in) matrices, counts (L,) integer
    rows per expert summing to N -> (N, out) in x's dtype: rows of group e times W_eᵀ, W_e as ``gq``
    dequantises it (accumulated in fp32, fp64 for fp64). Gradient: x only (the base is frozen)."""
    if not isinstance(gq, GroupedQuantizedWeight):
        raise TypeError(f"gq must be a GroupedQuantizedWeight, got {type(gq).__name__}")
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != gq.shape[1]:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x ({got}) must be (N, in) with in = {gq.shape[1]} (the experts' (out, in) = {gq.shape})")
    if not gq.loaded:
        raise RuntimeError("the quantised experts were never loaded (load the model's weights first: from_hf, "
                           "load_hf_ or init_weights_)")
    return _GroupedQuantizedGemm.apply(x, gq, _bounds(counts, x.shape[0], gq.num_experts))


__all__ = ["GroupedQuantizedWeight", "grouped_quantized_gemm"]
