"""Column- and row-parallel linear layers as autograd functions, with the TP communication of
forward AND backward fused into the GEMMs (tpkernels.functional.gemm_comm).

Column-parallel, weight (out/P, in), x: (..., in):
  SP:     forward  y = all_gather_matmul(x_shard, Wᵀ)            (+ bias shard)
          backward dx_shard = matmul_reduce_scatter(dy, W)       dgrad, ring or collective
                   dW = Σ_chunks dyᵀ·x_full                      wgrad chunks run while the
                                                                 dgrad partial sums travel
  no SP:  forward  y = x · Wᵀ                                    (x replicated)
          backward dx = all_reduce(dy · W), async, overlapped with dW = dyᵀ·x
Row-parallel, weight (out, in/P), x: (..., in/P):
  SP:     forward  y_shard = matmul_reduce_scatter(x, Wᵀ) + bias
          backward dy_full, dx = all_gather_matmul(dy_shard, W)  dgrad; each gathered chunk of dy
                   feeds its wgrad chunk dyᵀ·x while the next chunk travels
                   dbias = all_reduce(Σ dy_shard)                (each rank saw only its tokens)
  no SP:  forward  y = matmul_all_reduce(x, Wᵀ) + bias            (fused on CUDA when auto picks it)
          backward dx = dy · W, dW = dyᵀ·x (dy is replicated)
Weight gradients go through :class:`tpkernels.functional.weight_grad.WeightGrad` (fp32 over
chunks for 16-bit inputs): computed at once, in the shadow of the communication, or, inside a
zero-bubble schedule's B (``defer_weight_grads``), queued with the tensors they need (the gathered
input and output gradient) as one GEMM for the W action.

``algo`` picks the GEMM-comm algorithm by the rule of :mod:`tpkernels.backends` (collective, ring,
or, on CUDA, the fused kernels of :mod:`tpkernels.functional.gemm_comm_fused`); ``overlap``
is its own flag: False runs every weight-gradient GEMM after the communication it could hide
behind (the plain serial form, for measuring what the overlap buys).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.dtypes import widen
from tpkernels.functional.gemm_comm import (all_gather_matmul, check_algo, choose_algo, matmul_all_reduce,
                                            matmul_reduce_scatter)
from tpkernels.functional.weight_grad import WeightGrad, graph_anchor, weight_for_graph
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.mappings import all_gather_dim, all_reduce


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _seq_chunks(t: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    return list(t.movedim(dim, 0).chunk(world, dim=0))


class ColumnParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim, algo, overlap, regather_input, split, anchor):
        ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.overlap = group, sequence_parallel, seq_dim, algo, overlap
        ctx.split = split
        ctx.has_bias, ctx.regather = bias is not None, regather_input
        if sequence_parallel:
            # a frozen weight (LoRA's base) needs no input for its backward: the gathered input is not kept
            keep = (ctx.needs_input_grad[1] or split is not None) and not regather_input
            x_full, (y,) = all_gather_matmul(x, [weight.t()], group, gather_dim=seq_dim,
                                             algo=algo if overlap else "collective", return_a=keep)
            ctx.save_for_backward(x_full if keep else x, weight)
            ctx.regather = not keep
        else:
            y = torch.matmul(x, weight.t())
            ctx.save_for_backward(x, weight)
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        gw = WeightGrad(weight, ctx.needs_input_grad[1], ctx.split)
        db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        _, world = group_rank_size(ctx.group)
        if ctx.sp:
            x_full = (all_gather_dim(x_saved, ctx.seq_dim, ctx.group) if ctx.regather else x_saved) \
                if gw.needed else None
            algo = choose_algo("matmul_reduce_scatter", ctx.algo, world, 2.0 * dy.numel() * weight.shape[1],
                               dy.device, ctx.overlap, dtype=dy.dtype, k=weight.shape[0], n=weight.shape[1],
                               group=ctx.group)
            if not gw.needed:
                side = []
            elif gw.deferred:  # W later, one GEMM: it owns dy and the gathered input
                gw.add(dy, x_full)
                side = []
            elif algo == "ring":  # one weight-gradient chunk per ring step, while partial sums travel
                dys, xs = _seq_chunks(dy, ctx.seq_dim, world), _seq_chunks(x_full, ctx.seq_dim, world)
                side = [lambda j=j: gw.add(dys[j], xs[j]) for j in range(world)]
            else:  # one GEMM, during the reduce-scatter
                side = [lambda: gw.add(dy, x_full)]
            dx = matmul_reduce_scatter(dy, weight, ctx.group, scatter_dim=ctx.seq_dim,
                                       algo="collective" if algo == "local" else algo, side_work=side,
                                       overlap=ctx.overlap)
        else:
            dx = torch.matmul(dy, weight)
            handle = None
            if world > 1:  # all-reduce the input gradient while the weight gradient is computed
                dx_wide = widen(dx)  # dx is fresh: reduced in place when already wide
                handle = dist.all_reduce(dx_wide, group=ctx.group, async_op=True)
                if not ctx.overlap:
                    handle.wait()
            gw.add(dy, x_saved)
            if handle is not None:
                handle.wait()
                dx = dx_wide.to(dy.dtype)
        return dx, gw.result(), db, None, None, None, None, None, None, None, None


class RowParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim, algo, overlap, split, anchor):
        ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.overlap = group, sequence_parallel, seq_dim, algo, overlap
        ctx.has_bias, ctx.split = bias is not None, split
        ctx.save_for_backward(x, weight)
        if sequence_parallel:
            y = matmul_reduce_scatter(x, weight.t(), group, scatter_dim=seq_dim, algo=algo, overlap=overlap)
        else:
            y = matmul_all_reduce(x, weight.t(), group, algo=algo if overlap else "collective")
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        gw = WeightGrad(weight, ctx.needs_input_grad[1], ctx.split)
        db = None
        if ctx.sp:
            rank, world = group_rank_size(ctx.group)
            algo = choose_algo("all_gather_matmul", ctx.algo, world, 2.0 * dy.numel() * weight.shape[1] * world,
                               dy.device, ctx.overlap, dtype=dy.dtype, k=weight.shape[0], n=weight.shape[1],
                               group=ctx.group)
            if algo == "ring" and not gw.deferred and gw.needed:
                # each gathered chunk of dy feeds its weight-gradient GEMM while the next travels
                xs = _seq_chunks(x, ctx.seq_dim, world)
                _, (dx,) = all_gather_matmul(dy, [weight], ctx.group, gather_dim=ctx.seq_dim, algo=algo,
                                             return_a=False, on_chunk=lambda src, chunk: gw.add(chunk, xs[src]))
            else:  # deferred: W owns the gathered dy (one GEMM later)
                dy_full, (dx,) = all_gather_matmul(dy, [weight], ctx.group, gather_dim=ctx.seq_dim,
                                                   algo="collective" if algo == "local" else algo,
                                                   return_a=gw.needed)
                gw.add(dy_full, x)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = all_reduce(_rows(dy).sum(0), ctx.group)
        else:
            dx = torch.matmul(dy, weight)
            gw.add(dy, x)
            db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, gw.result(), db, None, None, None, None, None, None, None


def column_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0,
                           algo="auto", regather_input=False, overlap=True):
    """x: (..., in) — with SP this rank's shard of ``sequence_dim``; weight: (out/P, in); bias: (out/P,).
    Returns (..., out/P) over the full sequence."""
    check_algo(algo, overlap)
    w, split = weight_for_graph(weight)
    return ColumnParallelLinearFunction.apply(x, w, bias, group, sequence_parallel, sequence_dim, algo, overlap,
                                              regather_input, split, graph_anchor(split))


def row_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0, algo="auto",
                        overlap=True):
    """x: (..., in/P) over the full sequence; weight: (out, in/P); bias: (out,) replicated.
    Returns (..., out): with SP this rank's shard of ``sequence_dim``, else the full sum on every rank."""
    check_algo(algo, overlap)
    w, split = weight_for_graph(weight)
    return RowParallelLinearFunction.apply(x, w, bias, group, sequence_parallel, sequence_dim, algo, overlap, split,
                                           graph_anchor(split))
