"""The gradient reductions a TP × PP × DP model needs after the backward of a step, read from the
parameters' TP tags (:mod:`tpkernels.parallel.param_tags`).

1. Sequence parallelism: parameters replicated over TP that see a slice of the sequence (norms,
   learned positions: ``partial_grad``) hold partial gradients; summed over the TP group
   (Megatron's ``allreduce_sequence_parallel_grads``).
2. Replicated KV heads (TP > KV heads): the KV rows of the fused q/k/v weight (``kv_replica_rows``)
   hold the gradient of this rank's query heads only; summed over the ranks sharing the head.
3. Tied embeddings on different pipeline stages (``tied``): summed over the embedding group (first
   and last stage), so both copies take the same step.
4. Data parallelism: averaged over the DP group by :class:`DataParallelGradReduce`, the one DP
   path: in buckets after the backward, or (``overlap``) each bucket started as soon as its
   gradients are complete, during the backward (Megatron's DDP). A MoE layer's routed experts
   (``expert_parallel``) differ over the EP group: their reducer runs over the expert-data-parallel
   group (the replicas of the same experts, dp · cp / ep ranks) and divides by dp · cp all the same
   (``average_over``): an expert's gradient already sums the tokens that the EP group's ranks sent it.

1–3 are one coalesced all-reduce per dtype (the gradients flattened into one buffer): a few large
messages instead of one per parameter. All are sums, so their order does not matter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.param_tags import tag_of


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's gradient: its fp32 ``main_grad`` under mixed precision (the trainer accumulates
    the micro-batches' gradients there), else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def coalesced_all_reduce(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, one all-reduce per dtype."""
    if not tensors or group_rank_size(group)[1] == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = _flatten_dense_tensors(ts)
        dist.all_reduce(flat, group=group)
        for t, synced in zip(ts, _unflatten_dense_tensors(flat, ts)):
            t.copy_(synced)


def finish_grad_sync(params: list[torch.nn.Parameter], *, tp_group=None, kv_group=None,
                     embedding_group=None) -> None:
    """Complete the TP-side gradients of ``params`` (this rank's parameters, each once) after a step's
    backward: 1–3 of the module docstring."""
    grads = [(tag_of(p), grad_of(p)) for p in params if grad_of(p) is not None]
    coalesced_all_reduce([g for t, g in grads if t is not None and t.partial_grad], tp_group)
    if kv_group is not None:
        coalesced_all_reduce([g[slice(*t.kv_replica_rows)] for t, g in grads
                              if t is not None and t.kv_replica_rows is not None], kv_group)
    if embedding_group is not None:
        coalesced_all_reduce([g for t, g in grads if t is not None and t.tied is not None], embedding_group)


class DataParallelGradReduce:
    """Average the gradients of ``params`` over ``dp_group`` in buckets of about ``bucket_mb`` MiB.

    overlap=False: ``finish()`` reduces every bucket after the backward.
    overlap=True: a post-accumulate-grad hook counts each gradient's landings (in B, or in a
    zero-bubble W); after its last micro-batch's it joins the current bucket, and a full bucket
    starts its all-reduce at once (async), so the reduction of the last layers overlaps the
    backward of the first. ``finish()`` flushes the rest, waits for all and divides by the DP size.

    Per step: ``start(num_microbatches)`` before the backward, ``finish()`` after it.

    ``average_over``: what the sum is divided by (default: the group's size). Expert parameters are
    summed over their expert-data-parallel group and divided by dp · cp (module docstring, 4); with
    one replica per expert (ep = dp · cp) there is no reduction, only the division."""

    def __init__(self, params: list[torch.nn.Parameter], dp_group, bucket_mb: float = 25.0, overlap: bool = True,
                 average_over: int | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.world = dp_group, group_rank_size(dp_group)[1]
        self.divisor = self.world if average_over is None else int(average_over)
        if self.divisor < 1:
            raise ValueError(f"average_over ({average_over!r}) must be a positive integer")
        self.bucket_bytes = max(1, int(bucket_mb * 2 ** 20))
        self.overlap = overlap
        self.expected = 1
        self._count: dict[int, int] = {}
        self._bucket: list[torch.Tensor] = []
        self._bytes = 0
        self._inflight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self.launched_in_backward = 0
        if overlap and self.world > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._landed)

    def start(self, microbatches: int) -> None:
        """Before a step's backward: each gradient is complete after ``microbatches`` landings."""
        self.expected, self._count = microbatches, {}
        self._bucket, self._bytes, self._inflight = [], 0, []
        self.launched_in_backward = 0

    def _landed(self, p: torch.Tensor) -> None:
        if p.grad is None and getattr(p, "main_grad", None) is None:
            return  # autograd also runs the hook for an undefined gradient
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        if n == self.expected:
            if self._add(grad_of(p)):
                self.launched_in_backward += 1

    def _add(self, g: torch.Tensor) -> bool:
        """Add a complete gradient to the bucket; launch the bucket when full (True if it did)."""
        self._bucket.append(g)
        self._bytes += g.numel() * g.element_size()
        if self._bytes >= self.bucket_bytes:
            self._launch()
            return True
        return False

    def _launch(self) -> None:
        if not self._bucket:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in self._bucket:
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            self._inflight.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, grads))
        self._bucket, self._bytes = [], 0

    def finish(self) -> None:
        """The rest of the buckets, then every reduction done and averaged (call after the backward)."""
        if self.world == 1:
            if self.divisor != 1:
                for p in self.params:
                    if grad_of(p) is not None:
                        grad_of(p).div_(self.divisor)
            return
        seen = self._count if self.overlap else {}
        for p in self.params:  # without overlap: all of them; with it: those whose hooks did not fire
            g = grad_of(p)
            if g is not None and seen.get(id(p), 0) != self.expected:
                self._add(g)
        self._launch()
        for work, flat, grads in self._inflight:
            work.wait()
            flat.div_(self.divisor)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._inflight = []


__all__ = ["DataParallelGradReduce", "coalesced_all_reduce", "finish_grad_sync", "grad_of"]
