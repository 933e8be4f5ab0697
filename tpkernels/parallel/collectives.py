"""Thin wrappers over torch.distributed collectives that differ between torch releases.

torch 2.14 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); we support torch ≥ 2.6, which has only the old ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (P·n, ...) ← the ``inp`` (n, ...) of every rank, in rank order (dim 0)."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (n, ...) ← rows [r·n, (r+1)·n) of the sum over ranks of ``inp`` (P·n, ...)."""
    return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
