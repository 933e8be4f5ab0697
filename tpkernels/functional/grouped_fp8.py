"""The FP8 format of a MoE layer's routed experts: their grouped GEMM through the FP8 scaled GEMM.

    y = grouped_fp8_gemm(x, w, counts, slot)   # x (N, K) grouped by expert, w (E, K, M) 16-bit -> (N, M)

One FP8 "linear" per MoE layer and matrix (``layers.<i>.experts.gate_up``, ``layers.<i>.experts.down``,
slots of the model's :class:`~tpkernels.quant.fp8_state.Fp8State`), tensorwise: one scale for the
weight of *all* the experts (the stacked local experts, its first-step amax MAX-reduced over the ranks
that hold the others: the slot's group, EP × TP), one for the rows' input and one for their output
gradient. Under the delayed recipe every scale comes from the history, whose amaxes ``end_step``
MAX-reduces over the world, so it does not depend on the EP layout nor on dispatch_combine's chunks;
a role with no history yet (the first step), and the current recipe, cast with the amax of the rows
at hand (this rank's chunk). Per expert e, as the dense FP8 linear (:mod:`tpkernels.functional.fp8_format`),
accumulated in fp32 (:func:`tpkernels.quant.fp8.fp8_gemm`):

    forward       y_e  = x_e · W_e          A = x_e (E4M3),  B = W_eᵀ (E4M3)
    input grad    dx_e = dy_e · W_eᵀ        A = dy_e (grad format), B = W_e
    weight grad   dW_e = x_eᵀ · dy_e        A = x_eᵀ, B = dy_eᵀ    (fp32; the contraction over the expert's
                                                                    rows zero-padded to a multiple of 16)

The weight gradient goes through the package's one weight-gradient mechanism
(:class:`~tpkernels.functional.weight_grad.WeightGrad`: deferred to a zero-bubble W with the FP8
operands kept), as :func:`~tpkernels.functional.grouped_weight_grad.grouped_gemm_split` does in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tpkernels.functional.weight_grad import WeightGrad, graph_anchor, weight_for_graph
from tpkernels.quant.fp8 import fp8_gemm
from tpkernels.quant.fp8_state import Fp8Slot

FP8_MULTIPLE = 16  # the FP8 GEMM's K and N (cuBLASLt's rule; a weight dim that is not one is refused)


def _bounds(counts: Tensor) -> list[int]:
    b = [0]
    for v in counts.tolist():
        b.append(b[-1] + int(v))
    return b


def _per_expert(a8: Tensor, sa: Tensor, w8: Tensor, sw: Tensor, bounds: list[int], out: int,
                out_dtype: torch.dtype) -> Tensor:
    """Rows of group e of ``a8`` (N, K) times ``w8[e]`` given as (out, K): (N, out) ``out_dtype``."""
    y = torch.zeros((a8.shape[0], out), dtype=out_dtype, device=a8.device)
    for e in range(w8.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = fp8_gemm(a8[lo:hi], sa, w8[e], sw, out_dtype)
    return y


def _wgrad(x8: Tensor, sx: Tensor, dy8: Tensor, sdy: Tensor, bounds: list[int]) -> Tensor:
    """dW (E, K, M) fp32: per expert x_eᵀ · dy_e, the rows (the contraction) zero-padded to 16s."""
    e_count = len(bounds) - 1
    k, m = x8.shape[1], dy8.shape[1]
    dw = torch.zeros((e_count, k, m), dtype=torch.float32, device=x8.device)
    for e in range(e_count):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        pad = -(hi - lo) % FP8_MULTIPLE  # zero rows add nothing to the sums
        xt = F.pad(x8[lo:hi].view(torch.uint8).t(), (0, pad)).view(x8.dtype).contiguous()    # (K, rows)
        dyt = F.pad(dy8[lo:hi].view(torch.uint8).t(), (0, pad)).view(dy8.dtype).contiguous()  # (M, rows)
        dw[e] = fp8_gemm(xt, sx, dyt, sdy, torch.float32)
    return dw


class _GroupedFp8Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, slot, split, anchor):
        bounds = _bounds(counts)
        w8, sw = slot.cast("w", w.detach())                       # (E, K, M), one scale: every expert
        x8, sx = slot.cast("x", x.detach())                       # (N, K)
        wt8 = w8.transpose(1, 2).contiguous()                     # (E, M, K): B of the forward
        ctx.slot, ctx.bounds, ctx.split, ctx.dtype = slot, bounds, split, x.dtype
        ctx.save_for_backward(x8, sx, w8, sw, w)
        return _per_expert(x8, sx, wt8, sw, bounds, w.shape[2], x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x8, sx, w8, sw, w = ctx.saved_tensors
        slot, bounds = ctx.slot, ctx.bounds
        dy8, sdy = slot.cast("dy", dy.contiguous())
        dx = _per_expert(dy8, sdy, w8, sw, bounds, w8.shape[1], ctx.dtype) if ctx.needs_input_grad[0] else None

        def product(d8, a8):  # dW (E, K, M) fp32 from the FP8 operands this backward cast
            return _wgrad(a8, sx, d8, sdy, bounds)

        gw = WeightGrad(w, ctx.needs_input_grad[1], ctx.split, product=product)
        gw.add(dy8, x8)
        return dx, gw.result(), None, None, None, None


def check_fp8_shapes(w: Tensor, name: str) -> None:
    """FP8 GEMMs take K and N in multiples of 16: the experts' (in, out) per rank must be."""
    bad = [f"{d} {v}" for d, v in (("in", w.shape[1]), ("out", w.shape[2])) if v % FP8_MULTIPLE]
    if bad:
        raise ValueError(f"{name}: the experts' per-rank (in, out) = {tuple(w.shape[1:])} must be multiples of "
                         f"{FP8_MULTIPLE} for FP8 GEMMs ({', '.join(bad)} is not); keep them bf16")


def grouped_fp8_gemm(x: Tensor, w: Tensor, counts: Tensor, slot: Fp8Slot) -> Tensor:
    """x (N, K) 16-bit rows grouped by expert, w (E, K, M) the stacked experts, counts (E,) integer rows per
    expert summing to N, ``slot`` the matrix's FP8 slot -> (N, M) in x's dtype (module docstring)."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x ({tuple(x.shape)}) must be (N, K) and w ({tuple(w.shape)}) (E, K, M) with the same K")
    if counts.numel() != w.shape[0] or int(counts.sum()) != x.shape[0]:
        raise ValueError(f"counts ({counts.tolist()}) must hold one row count per expert ({w.shape[0]}) summing "
                         f"to the rows of x ({x.shape[0]})")
    w_graph, split = weight_for_graph(w)
    anchor = graph_anchor(split) if not x.requires_grad else None
    return _GroupedFp8Gemm.apply(x.contiguous(), w_graph, counts.cpu(), slot, split, anchor)


__all__ = ["FP8_MULTIPLE", "check_fp8_shapes", "grouped_fp8_gemm"]
