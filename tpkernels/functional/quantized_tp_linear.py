"""Column- and row-parallel linears over a frozen quantised weight (QLoRA's base), with the TP
communication around the dequantising GEMM as for 16-bit weights (tpkernels.functional.tp_linear):

Column-parallel, W (out/P, in) quantised, x: (..., in):
  SP:     forward  y = all_gather_matmul(x_shard, Wᵀ)          ring: chunk i+1 travels while chunk i is
                                                               multiplied by the dequantising GEMM
          backward dx_shard = matmul_reduce_scatter(dy, W)     input gradient, ring or collective
  no SP:  forward  y = x · Wᵀ;  backward dx = all_reduce(dy · W)
Row-parallel, W (out, in/P) quantised, x: (..., in/P):
  SP:     forward  y_shard = matmul_reduce_scatter(x, Wᵀ) + bias
          backward dx = all_gather_matmul(dy_shard, W)
  no SP:  forward  y = matmul_all_reduce(x, Wᵀ) + bias;  backward dx = dy · W

No weight gradient, so nothing of x is saved (not even the gathered input under SP: a frozen base
needs only W for its backward) and nothing is deferred in a zero-bubble schedule (the adapters'
weight gradients are ordinary autograd). Biases may train (their gradient is the usual sum). The
fused GEMM-comm kernels read 16-bit weights: ``algo`` "auto" picks ring or collective here, an
explicit "fused" is refused by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.dtypes import widen
from tpkernels.functional.gemm_comm import all_gather_matmul, check_algo, matmul_all_reduce, matmul_reduce_scatter
from tpkernels.functional.quantized_weight import QuantizedWeight
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.mappings import all_reduce


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _bias_grad(ctx, dy: torch.Tensor, reduce_group=None):
    if not (ctx.has_bias and ctx.needs_input_grad[1]):
        return None
    db = _rows(dy).sum(0)
    return all_reduce(db, reduce_group) if reduce_group is not None else db


def _keep(ctx, qw, bias, group, sequence_parallel, seq_dim, algo, overlap) -> None:
    """What the backward needs: the quantised weight and the layout, never x."""
    ctx.qw, ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.overlap = qw, group, sequence_parallel, seq_dim, algo, overlap
    ctx.has_bias = bias is not None


class QuantizedColumnParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, qw: QuantizedWeight, group, sequence_parallel, seq_dim, algo, overlap):
        _keep(ctx, qw, bias, group, sequence_parallel, seq_dim, algo, overlap)
        if sequence_parallel:
            _, (y,) = all_gather_matmul(x, [qw.operand(transposed=True)], group, gather_dim=seq_dim,
                                        algo=algo if overlap else "collective", return_a=False)
        else:
            y = qw.forward_gemm(x)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        db = _bias_grad(ctx, dy)
        dx = None
        if ctx.needs_input_grad[0]:
            _, world = group_rank_size(ctx.group)
            if ctx.sp:
                dx = matmul_reduce_scatter(dy, ctx.qw.operand(transposed=False), ctx.group, scatter_dim=ctx.seq_dim,
                                           algo=ctx.algo, overlap=ctx.overlap)
            else:
                dx = ctx.qw.input_grad(dy)
                if world > 1:
                    wide = widen(dx)
                    dist.all_reduce(wide, group=ctx.group)
                    dx = wide.to(dy.dtype)
        return dx, db, None, None, None, None, None, None


class QuantizedRowParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, qw: QuantizedWeight, group, sequence_parallel, seq_dim, algo, overlap):
        _keep(ctx, qw, bias, group, sequence_parallel, seq_dim, algo, overlap)
        b = qw.operand(transposed=True)
        if sequence_parallel:
            y = matmul_reduce_scatter(x, b, group, scatter_dim=seq_dim, algo=algo, overlap=overlap)
        else:
            y = matmul_all_reduce(x, b, group, algo=algo if overlap else "collective")
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        dx = None
        if ctx.sp:
            db = _bias_grad(ctx, dy, ctx.group)  # each rank saw its tokens only
            if ctx.needs_input_grad[0]:
                _, (dx,) = all_gather_matmul(dy, [ctx.qw.operand(transposed=False)], ctx.group,
                                             gather_dim=ctx.seq_dim, algo=ctx.algo if ctx.overlap else "collective",
                                             return_a=False)
        else:
            db = _bias_grad(ctx, dy)
            if ctx.needs_input_grad[0]:
                dx = ctx.qw.input_grad(dy)
        return dx, db, None, None, None, None, None, None


def quantized_column_parallel_linear(x, qw: QuantizedWeight, bias=None, group=None, sequence_parallel=False,
                                     sequence_dim=0, algo="auto", overlap=True):
    """x: (..., in) — with SP this rank's shard of ``sequence_dim``; qw: the (out/P, in) shard quantised;
    bias: (out/P,). Returns (..., out/P) over the full sequence."""
    check_algo(algo, overlap)
    return QuantizedColumnParallelLinearFunction.apply(x, bias, qw, group, sequence_parallel, sequence_dim, algo,
                                                       overlap)


def quantized_row_parallel_linear(x, qw: QuantizedWeight, bias=None, group=None, sequence_parallel=False,
                                  sequence_dim=0, algo="auto", overlap=True):
    """x: (..., in/P) over the full sequence; qw: the (out, in/P) shard quantised; bias: (out,) replicated.
    Returns (..., out): with SP this rank's shard of ``sequence_dim``, else the full sum on every rank."""
    check_algo(algo, overlap)
    return QuantizedRowParallelLinearFunction.apply(x, bias, qw, group, sequence_parallel, sequence_dim, algo, overlap)


__all__ = ["quantized_column_parallel_linear", "quantized_row_parallel_linear"]
