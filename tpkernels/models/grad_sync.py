"""The gradient reductions a TP × PP × DP model needs after the backward of a step.

1. Sequence parallelism: parameters replicated over TP that see a slice of the sequence (norms,
   learned positions) hold partial gradients; summed over the TP group (Megatron's
   ``allreduce_sequence_parallel_grads``).
2. Replicated KV heads (TP > KV heads): the KV rows of the fused q/k/v weight hold the gradient
   of this rank's query heads only; summed over the ranks sharing the head.
3. Tied embeddings on different pipeline stages: summed over the embedding group (first and last
   stage), so both copies take the same step.
4. Data parallelism: averaged over the DP group.

Each is one coalesced all-reduce per dtype (the gradients flattened into one buffer): a few large
messages instead of one per parameter. Issue-14's trainer overlaps (4) with the backward instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tpkernels.parallel.groups import group_rank_size


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's gradient: its fp32 ``main_grad`` under mixed precision (the trainer accumulates
    the micro-batches' gradients there), else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def coalesced_all_reduce(tensors: list[torch.Tensor], group, average: bool = False) -> None:
    """Sum (or average) ``tensors`` over ``group`` in place, one all-reduce per dtype."""
    if not tensors or group_rank_size(group)[1] == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = _flatten_dense_tensors(ts)
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(group_rank_size(group)[1])
        for t, synced in zip(ts, _unflatten_dense_tensors(flat, ts)):
            t.copy_(synced)


def finish_grad_sync(params: list[torch.nn.Parameter], *, tp_group=None, kv_group=None, embedding_group=None,
                     dp_group=None, average_dp: bool = True) -> None:
    """Complete the gradients of ``params`` (this rank's parameters, each once) after a step's backward."""
    grads = [(p, grad_of(p)) for p in params if grad_of(p) is not None]
    coalesced_all_reduce([g for p, g in grads if getattr(p, "tp_partial_grad", False)], tp_group)
    if kv_group is not None:
        coalesced_all_reduce([g[slice(*p.kv_replica_rows)] for p, g in grads if hasattr(p, "kv_replica_rows")],
                             kv_group)
    if embedding_group is not None:
        coalesced_all_reduce([g for p, g in grads if getattr(p, "tied_embedding", False)], embedding_group)
    if dp_group is not None:
        coalesced_all_reduce([g for _, g in grads], dp_group, average=average_dp)
