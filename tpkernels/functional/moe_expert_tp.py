"""Expert tensor parallelism: rows of uneven length moved over the TP group, as autograd functions.

With expert TP = TP (Megatron-Core's alltoall dispatcher), each TP rank routes and dispatches only its
own share of the tokens, while each holds an F/tp slice of every local expert. So the rows an EP
all-to-all brings to a TP rank are all-gathered over the TP group before the expert GEMMs (every TP
rank needs every row of its local experts) and the partial results are reduce-scattered back to the
TP rank that received them:

    rows = gather_rows(mine (M_r, H), sizes, group)            # (sum(sizes), H) rank-major; bwd: reduce-scatter
    mine = reduce_scatter_rows(y (sum(sizes), H'), sizes, group)  # (M_r, H') this rank's block of the sum; bwd: all-gather
    mine = split_rows(x (sum(sizes), H), sizes, group)         # (M_r, H) this rank's block; bwd: all-gather
    full = gather_rows(mine, sizes, group, reduce_grad=False)  # bwd: this rank's block of the gradient

``sizes`` (one int per rank of ``group``, host ints) are the rows each rank holds; they may differ
(dispatch counts differ per rank) and may be 0. The transfers pad every rank's block to max(sizes)
(the collectives take equal blocks): the padding is zeros and never read. Sums are taken in the
accumulation dtype (fp32 for 16-bit rows), as :mod:`tpkernels.parallel.mappings` does. A group of one
rank is the identity.
"""

from __future__ import annotations

import torch

from tpkernels.dtypes import widen
from tpkernels.parallel.collectives import all_gather_into, reduce_scatter_into
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.trace import CommSpan


def _index(sizes: list[int], pad: int, device) -> torch.Tensor:
    """Rows of the padded (P·pad, ...) buffer that hold real rows, rank-major."""
    return torch.cat([torch.arange(s, dtype=torch.int64) + r * pad for r, s in enumerate(sizes)]).to(device)


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    p, pad = len(sizes), max(sizes)
    if pad == 0:
        return x.new_empty((0,) + tuple(x.shape[1:]))
    buf = x.new_zeros((pad,) + tuple(x.shape[1:]))
    buf[:x.shape[0]] = x
    out = x.new_empty((p * pad,) + tuple(x.shape[1:]))
    span = CommSpan("moe expert-tp all_gather", x.device.type, bytes=out.numel() * out.element_size())
    all_gather_into(out, buf, group)
    span.done()
    return out if sum(sizes) == p * pad else out.index_select(0, _index(sizes, pad, x.device))


def _reduce_scatter_rows(y: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    p, pad = len(sizes), max(sizes)
    if pad == 0:
        return y.new_empty((0,) + tuple(y.shape[1:]))
    w = widen(y)
    if sum(sizes) == p * pad:
        buf = w.contiguous()
    else:
        buf = w.new_zeros((p * pad,) + tuple(y.shape[1:])).index_copy_(0, _index(sizes, pad, y.device), w)
    out = buf.new_empty((pad,) + tuple(y.shape[1:]))
    span = CommSpan("moe expert-tp reduce_scatter", y.device.type, bytes=buf.numel() * buf.element_size())
    reduce_scatter_into(out, buf, group)
    span.done()
    return out[:sizes[rank]].to(y.dtype)


def _mine(x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, reduce_grad):
        ctx.sizes, ctx.group, ctx.reduce_grad = sizes, group, reduce_grad
        ctx.rank = group_rank_size(group)[0]
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return _reduce_scatter_rows(g, ctx.sizes, ctx.rank, ctx.group), None, None, None
        return _mine(g, ctx.sizes, ctx.rank).contiguous(), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(y, sizes, group_rank_size(group)[0], group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_rows(g.contiguous(), ctx.sizes, ctx.group), None, None


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _mine(x, sizes, group_rank_size(group)[0]).clone()

    @staticmethod
    def backward(ctx, g):
        return _all_gather_rows(g.contiguous(), ctx.sizes, ctx.group), None, None


def _checked(x: torch.Tensor, sizes, group, rows: int | None, what: str) -> tuple[list[int], int]:
    rank, world = group_rank_size(group)
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"sizes ({sizes}) must hold one non-negative row count per rank of the group ({world})")
    n = sizes[rank] if rows is None else rows
    if x.shape[0] != n:
        raise ValueError(f"{what} has {x.shape[0]} rows but sizes ({sizes}) say {n}")
    return sizes, world


def gather_rows(x: torch.Tensor, sizes, group, *, reduce_grad: bool = True) -> torch.Tensor:
    """(sizes[r], ...) on each rank r -> (sum(sizes), ...) every rank's rows, rank-major. Backward: the
    gradient's rows are summed over the group and this rank's block kept (the consumer is TP-split, each
    rank's gradient a partial sum), or with ``reduce_grad=False`` only this rank's block kept."""
    sizes, world = _checked(x, sizes, group, None, "x")
    return x if world == 1 else _GatherRows.apply(x, sizes, group, reduce_grad)


def reduce_scatter_rows(y: torch.Tensor, sizes, group) -> torch.Tensor:
    """(sum(sizes), ...) partial sums on every rank -> (sizes[r], ...): rank r's block of their sum.
    Backward: every rank's gradient block all-gathered."""
    sizes, world = _checked(y, sizes, group, sum(int(s) for s in sizes), "y")
    return y if world == 1 else _ReduceScatterRows.apply(y, sizes, group)


def split_rows(x: torch.Tensor, sizes, group) -> torch.Tensor:
    """(sum(sizes), ...) the same on every rank -> (sizes[r], ...) this rank's block. Backward: the
    blocks' gradients all-gathered (each rank then holds the whole input's gradient)."""
    sizes, world = _checked(x, sizes, group, sum(int(s) for s in sizes), "x")
    return x if world == 1 else _SplitRows.apply(x, sizes, group)


def even_sizes(n: int, world: int) -> list[int]:
    """``n`` rows cut into ``world`` consecutive blocks as ``torch.tensor_split`` does (the first n % world
    blocks one row longer)."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


__all__ = ["even_sizes", "gather_rows", "reduce_scatter_rows", "split_rows"]
