"""The conjugate communication mappings of tensor and sequence parallelism, as autograd functions
(Megatron-LM's ``mappings.py``), for building custom TP layers.

    x = copy_to_tensor_parallel(x, g)            # fwd: identity       bwd: all-reduce
    y = reduce_from_tensor_parallel(y, g)        # fwd: all-reduce     bwd: identity
    x = scatter_to_sequence_parallel(x, g, dim)  # fwd: keep my chunk  bwd: all-gather
    x = gather_from_sequence_parallel(x, g, dim) # fwd: all-gather     bwd: reduce-scatter (or split)
    y = reduce_scatter_to_sequence_parallel(y, g, dim)  # fwd: reduce-scatter  bwd: all-gather
    y = gather_from_tensor_parallel(y, g)        # last dim: fwd all-gather, bwd split
    x = scatter_to_tensor_parallel(x, g)         # last dim: fwd split, bwd all-gather

Sums over ranks are taken in the accumulation dtype of ``tpkernels.dtypes`` (fp32 for 16-bit
inputs). Every function is the identity for a group of one rank. With ``TPKERNELS_CHECK_RANKS=1``
every collective first checks that all ranks pass the same shape and dtype
(:mod:`tpkernels.parallel.consistency`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.dtypes import widen
from tpkernels.parallel import consistency
from tpkernels.parallel.collectives import all_gather_into, reduce_scatter_into
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.trace import CommSpan


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group (a new tensor, dtype of x)."""
    if group_rank_size(group)[1] == 1:
        return x
    consistency.agree(group, "all_reduce", **{"x.shape": x.shape, "x.dtype": x.dtype})
    y = widen(x).clone()
    span = CommSpan("all_reduce", x.device.type, bytes=y.numel() * y.element_size())
    dist.all_reduce(y, group=group)
    span.done()
    return y.to(x.dtype)


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, world = group_rank_size(group)
    if world == 1:
        return x
    consistency.agree(group, "all_gather", **{"x.shape": x.shape, "x.dtype": x.dtype, "dim": dim})
    xm = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * xm.shape[0],) + tuple(xm.shape[1:]), dtype=x.dtype, device=x.device)
    span = CommSpan("all_gather", x.device.type, bytes=out.numel() * out.element_size())
    all_gather_into(out, xm, group)
    span.done()
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, world = group_rank_size(group)
    if world == 1:
        return x
    consistency.agree(group, "reduce_scatter", **{"x.shape": x.shape, "x.dtype": x.dtype, "dim": dim})
    check_divisible(x.shape[dim], world, f"dim {dim} of the input")
    xm = widen(x).movedim(dim, 0).contiguous()
    out = torch.empty((xm.shape[0] // world,) + tuple(xm.shape[1:]), dtype=xm.dtype, device=x.device)
    span = CommSpan("reduce_scatter", x.device.type, bytes=xm.numel() * xm.element_size())
    reduce_scatter_into(out, xm, group)
    span.done()
    return out.to(x.dtype).movedim(0, dim)


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, world = group_rank_size(group)
    if world == 1:
        return x
    check_divisible(x.shape[dim], world, f"dim {dim} of the input")
    return x.chunk(world, dim=dim)[rank].contiguous()


def check_divisible(size: int, world: int, what: str, when: str = "") -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) must be divisible by tensor_parallel_size ({world}){when}")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        g = reduce_scatter_dim(g, ctx.dim, ctx.group) if ctx.reduce_grad else split_dim(g, ctx.dim, ctx.group)
        return g, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Input of a column-parallel layer without SP: identity forward, all-reduce of the gradient."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Output of a row-parallel layer without SP: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Keep this rank's chunk of ``dim`` (a replicated activation enters the SP region)."""
    return _ScatterToSP.apply(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group=None, dim: int = 0, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather along ``dim``. Backward reduce-scatters (the consumer is TP: each rank's gradient is
    a partial sum), or only splits with ``reduce_grad=False`` (the consumer is replicated)."""
    return _GatherFromSP.apply(x, group, dim, reduce_grad)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Sum partial results over ranks and keep this rank's chunk of ``dim``; backward all-gathers."""
    return _ReduceScatterToSP.apply(x, group, dim)


def gather_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last (feature) dim; backward keeps this rank's slice of the gradient."""
    return _GatherFromSP.apply(x, group, -1, False)


def scatter_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last (feature) dim; backward all-gathers."""
    return _ScatterToSP.apply(x, group, -1)
