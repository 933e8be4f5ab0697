"""The grouped GEMM of a MoE layer's experts with its weight gradient through the package's one
weight-gradient mechanism (:mod:`tpkernels.functional.weight_grad`): zero-bubble schedules (zb-h1)
defer dW to their W action, as they do for the TP linears.

    y = grouped_gemm_split(x, w, counts)    # x (N, K) grouped by expert, w (E, K, M), counts (E,) -> (N, M)

Outside ``split_weight_grads()`` (every schedule but zero bubble) it is
:func:`~tpkernels.functional.grouped_gemm.grouped_gemm` itself. Inside it (a zb-h1 F, or its
recomputation), the weight is kept out of B's graph (``weight_for_graph``): B computes dx only
(``grouped_gemm_fwd`` with the transposed weight), and dW_e = x_eᵀ·dy_e
(:func:`~tpkernels.functional.grouped_gemm.grouped_gemm_wgrad`) is queued as the weight format's
product in the active :class:`~tpkernels.functional.weight_grad.WeightGradStore`; W sums a weight's
queued pieces (dispatch_combine's chunks, the micro-batch's calls) and lands them through autograd
once, so gradient hooks and DP bucketing see one landing per micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels.dtypes import accumulation_dtype
from tpkernels.functional.grouped_gemm import grouped_gemm, grouped_gemm_fwd, grouped_gemm_wgrad
from tpkernels.functional.weight_grad import WeightGrad, graph_anchor, splitting, weight_for_graph


class _GroupedGemmSplitFunction(torch.autograd.Function):
    """y = grouped x·w with w out of the graph; dx now, dW through :class:`WeightGrad` (deferred to W)."""

    @staticmethod
    def forward(ctx, x, w, counts, split, anchor):
        ctx.save_for_backward(x, w, counts)
        ctx.split = split
        return grouped_gemm_fwd(x, w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_gemm_fwd(dy, w, counts, trans_w=True) if ctx.needs_input_grad[0] else None

        def product(dy_c, x_c):  # dW (E, K, M) in the accumulation dtype (fp32 for 16-bit weights)
            return grouped_gemm_wgrad(x_c, dy_c, counts).to(accumulation_dtype(x_c.dtype))

        gw = WeightGrad(w, True, ctx.split, product=product)
        gw.add(dy, x)
        return dx, gw.result(), None, None, None


def grouped_gemm_split(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """:func:`~tpkernels.functional.grouped_gemm.grouped_gemm` whose dW a zero-bubble W computes (module
    docstring). x (N, K), w (E, K, M), counts (E,) int64 -> (N, M) in x's dtype."""
    if not (splitting() and w.requires_grad):
        return grouped_gemm(x, w, counts)
    w_graph, split = weight_for_graph(w)
    counts = counts.to(torch.int64)
    anchor = graph_anchor(split) if not x.requires_grad else None  # keeps y in the graph when x needs none
    return _GroupedGemmSplitFunction.apply(x.contiguous(), w_graph, counts, split, anchor)


__all__ = ["grouped_gemm_split"]
