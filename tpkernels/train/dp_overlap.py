"""Data-parallel gradient reduction overlapped with the backward, in buckets (as Megatron's DDP).

A parameter's gradient is complete once its last micro-batch's gradient has landed (in B, or in
a zero-bubble W): a post-accumulate-grad hook counts the landings. Complete gradients gather in
buckets of about ``bucket_mb`` MiB, in the order they complete (the reverse of the forward,
roughly); a full bucket starts its all-reduce at once (async), so the reduction of the last
layers overlaps the backward of the first. ``finish()`` flushes the last bucket, waits for all
and divides by the DP size. The TP / replicated-KV / tied-embedding sums of ``finish_grad_sync``
run after it (they are linear: the order does not matter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tpkernels.models.grad_sync import grad_of


class OverlappedGradReduce:
    def __init__(self, params: list[torch.nn.Parameter], dp_group, bucket_mb: float = 25.0):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.world = dp_group, dist.get_world_size(dp_group)
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.expected = 1
        self._count: dict[int, int] = {}
        self._bucket: list[torch.Tensor] = []
        self._bytes = 0
        self._inflight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self.launched_in_backward = 0
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
            g = grad_of(p)
            self._bucket.append(g)
            self._bytes += g.numel() * g.element_size()
            if self._bytes >= self.bucket_bytes:
                self._launch()
                self.launched_in_backward += 1

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
        missing = [p for p in self.params if self._count.get(id(p), 0) != self.expected and grad_of(p) is not None]
        self._bucket += [grad_of(p) for p in missing]  # e.g. parameters whose hooks did not fire
        self._launch()
        for work, flat, grads in self._inflight:
            work.wait()
            flat.div_(self.world)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._inflight = []
