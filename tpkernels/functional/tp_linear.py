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
  no SP:  forward  y = all_reduce(x · Wᵀ) + bias
          backward dx = dy · W, dW = dyᵀ·x (dy is replicated)
Weight gradients accumulate in fp32 over chunks for 16-bit inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.functional.gemm_comm import all_gather_matmul, choose_algo, group_rank_size, matmul_reduce_scatter
from tpkernels.parallel.mappings import all_gather_dim, all_reduce


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _WeightGrad:
    """dW = Σ dyᵀ·x, one GEMM per chunk, accumulated in fp32 for 16-bit inputs."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.acc = weight, None

    def add(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        dy2, x2 = _rows(dy), _rows(x)
        if self.acc is None:
            p = torch.matmul(dy2.t(), x2)
            self.acc = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        elif self.acc.dtype == dy2.dtype:
            self.acc.addmm_(dy2.t(), x2)
        else:
            self.acc.add_(torch.matmul(dy2.t(), x2))

    def result(self) -> torch.Tensor:
        if self.acc is None:
            return torch.zeros_like(self.weight)
        return self.acc.to(self.weight.dtype)


def _resolve(algo: str, world: int, flops: float, device) -> str:
    """The algorithm the op will run (decided here so the weight gradient can follow it)."""
    how = choose_algo(algo, world, flops, device)
    return "collective" if how == "local" else how


def _seq_chunks(t: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    return list(t.movedim(dim, 0).chunk(world, dim=0))


class ColumnParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim, algo, regather_input):
        ctx.group, ctx.sp, ctx.seq_dim, ctx.algo = group, sequence_parallel, seq_dim, algo
        ctx.has_bias, ctx.regather = bias is not None, regather_input
        if sequence_parallel:
            x_full, (y,) = all_gather_matmul(x, [weight.t()], group, gather_dim=seq_dim, algo=algo,
                                             return_a=not regather_input)
            ctx.save_for_backward(x if regather_input else x_full, weight)
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
        gw = _WeightGrad(weight)
        db = _rows(dy).sum(0) if ctx.has_bias else None
        if ctx.sp:
            _, world = group_rank_size(ctx.group)
            x_full = all_gather_dim(x_saved, ctx.seq_dim, ctx.group) if ctx.regather else x_saved
            algo = _resolve(ctx.algo, world, 2.0 * dy.numel() * weight.shape[1], dy.device)
            if algo == "ring":  # one weight-gradient chunk per ring step, while partial sums travel
                dys, xs = _seq_chunks(dy, ctx.seq_dim, world), _seq_chunks(x_full, ctx.seq_dim, world)
                side = [lambda j=j: gw.add(dys[j], xs[j]) for j in range(world)]
            else:  # one GEMM, during the reduce-scatter
                side = [lambda: gw.add(dy, x_full)]
            dx = matmul_reduce_scatter(dy, weight, ctx.group, scatter_dim=ctx.seq_dim, algo=algo, side_work=side)
        else:
            dx = torch.matmul(dy, weight)
            _, world = group_rank_size(ctx.group)
            handle = None
            if world > 1:  # all-reduce the input gradient while the weight gradient is computed
                dx_wide = dx.float() if dx.dtype in (torch.float16, torch.bfloat16) else dx
                handle = dist.all_reduce(dx_wide, group=ctx.group, async_op=True)
                if ctx.algo == "collective":  # overlap_comm=False: the plain, serial form
                    handle.wait()
            gw.add(dy, x_saved)
            if handle is not None:
                handle.wait()
                dx = dx_wide.to(dy.dtype)
        return dx, gw.result(), db, None, None, None, None, None


class RowParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim, algo):
        ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.has_bias = group, sequence_parallel, seq_dim, algo, bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel:
            y = matmul_reduce_scatter(x, weight.t(), group, scatter_dim=seq_dim, algo=algo)
        else:
            y = all_reduce(torch.matmul(x, weight.t()), group) if group_rank_size(group)[1] > 1 else \
                torch.matmul(x, weight.t())
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        gw = _WeightGrad(weight)
        db = None
        if ctx.sp:
            rank, world = group_rank_size(ctx.group)
            algo = _resolve(ctx.algo, world, 2.0 * dy.numel() * weight.shape[1] * world, dy.device)
            if algo == "ring":  # each gathered chunk of dy feeds its weight-gradient GEMM while the next travels
                xs = _seq_chunks(x, ctx.seq_dim, world)
                _, (dx,) = all_gather_matmul(dy, [weight], ctx.group, gather_dim=ctx.seq_dim, algo=algo,
                                             return_a=False, on_chunk=lambda src, chunk: gw.add(chunk, xs[src]))
            else:
                dy_full, (dx,) = all_gather_matmul(dy, [weight], ctx.group, gather_dim=ctx.seq_dim, algo=algo)
                gw.add(dy_full, x)
            if ctx.has_bias:
                db = all_reduce(_rows(dy).sum(0), ctx.group) if world > 1 else _rows(dy).sum(0)
        else:
            dx = torch.matmul(dy, weight)
            gw.add(dy, x)
            db = _rows(dy).sum(0) if ctx.has_bias else None
        return dx, gw.result(), db, None, None, None, None


def column_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0,
                           algo="auto", regather_input=False):
    """x: (..., in) — with SP this rank's shard of ``sequence_dim``; weight: (out/P, in); bias: (out/P,).
    Returns (..., out/P) over the full sequence."""
    return ColumnParallelLinearFunction.apply(x, weight, bias, group, sequence_parallel, sequence_dim, algo,
                                              regather_input)


def row_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0, algo="auto"):
    """x: (..., in/P) over the full sequence; weight: (out, in/P); bias: (out,) replicated.
    Returns (..., out): with SP this rank's shard of ``sequence_dim``, else the full sum on every rank."""
    return RowParallelLinearFunction.apply(x, weight, bias, group, sequence_parallel, sequence_dim, algo)
