"""Execute any schedule on real stages.

    stages = split_layers(layers, p, v, first=embedding, last=head)        # same on every rank
    runtime = PipelineRuntime(chunks_of_rank(stages, rank, p), "1f1b", num_microbatches=8,
                              loss_fn=lambda out, target: F.cross_entropy(out, target))
    loss = runtime.step(inputs=batch if rank == 0 else None, targets=labels if rank == p - 1 else None)

Inputs are split into micro-batches along dim 0 on the first stage, targets on the last. The loss
of each micro-batch is multiplied by ``loss_scale`` (default 1/num_microbatches: the gradients are
those of the mean of the micro-batch losses), and ``step`` returns the sum of the scaled losses on
every rank. A model whose loss_fn returns a token sum passes 1/(tokens of the step) instead, so
the objective is the token mean of the whole batch however it is cut into micro-batches.
Losses accumulate on the device: the host waits for them once per step, not once per micro-batch.

Zero-bubble schedules: F runs inside ``split_weight_grads()`` and B inside
``defer_weight_grads(store)``, so every linear layer of the
package (``ColumnParallelLinear``, ``RowParallelLinear``, and plain ``nn.Linear`` through
``enable_weight_grad_split``) queues its weight gradient, and W (``store.flush()``) computes it
and accumulates it through autograd (``.grad`` and post-accumulate-grad hooks as usual).

End of step: a status message travels 0 → p−1 (every stage finished) and back p−1 → 0 (with the
loss), over the same P2P engine as the data, so a rank that fails at any point, even in its
last action while its neighbours have nothing more to receive from it, reaches every rank as a
``PipelineAbortError`` with its cause, and a rank that dies as a ``PipelinePeerLostError`` naming
it; no rank is left in a collective it cannot leave.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from tpkernels.functional.weight_grad import WeightGradStore, defer_weight_grads, split_weight_grads
from tpkernels.parallel.groups import group_rank_size
from tpkernels.pipeline.p2p import (
    KIND_ACT,
    KIND_GRAD,
    KIND_STATUS,
    P2P,
    PipelineAbortError,
    PipelinePeerLostError,
    flatten,
)
from tpkernels.pipeline.actions import Action, Schedule, ScheduleError, communication, stage_owner
from tpkernels.pipeline.schedules import make_schedule
from tpkernels.pipeline.weight_grad import enable_weight_grad_split

_UP, _DOWN = 0, 1  # the two legs of the end-of-step status chain (sent as the message's chunk)


def split_microbatches(obj: Any, m: int, what: str) -> list[Any]:
    """Split every tensor of ``obj`` (tensor / tuple / list / dict) into ``m`` equal parts along dim 0."""
    if isinstance(obj, torch.Tensor):
        if obj.shape[0] % m:
            raise ValueError(f"{what}: batch size ({obj.shape[0]}) must be divisible by num_microbatches ({m})")
        return list(obj.chunk(m, dim=0))
    if isinstance(obj, (tuple, list)):
        parts = [split_microbatches(x, m, what) for x in obj]
        return [type(obj)(p[i] for p in parts) for i in range(m)]
    if isinstance(obj, dict):
        parts = {k: split_microbatches(x, m, what) for k, x in obj.items()}
        return [{k: parts[k][i] for k in parts} for i in range(m)]
    raise TypeError(f"{what} must be a tensor or a tuple/list/dict of tensors, not {type(obj).__name__}")


class PipelineRuntime:
    """Runs this rank's part of a pipeline schedule.

    chunks: this rank's model chunks by chunk index (one unless interleaved).
    schedule: a name ("gpipe", "1f1b", "interleaved", "zb-h1") or explicit per-rank actions.
    loss_fn(output, target) → scalar, applied on the last virtual stage.
    schedule_costs: (f, b, w) of one micro-batch on a stage, for ZB-H1's order (``zb_h1``); every
    rank of the pipeline must pass the same values.
    """

    def __init__(self, chunks: Sequence[nn.Module], schedule: str | Schedule, num_microbatches: int, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, group=None,
                 device: torch.device | None = None, timeout_s: float = 300.0,
                 schedule_costs: tuple[float, float, float] | None = None):
        self.group = group
        self.rank, self.p = group_rank_size(group)
        self.chunks = list(chunks)
        self.v = len(self.chunks)
        self.m = num_microbatches
        if isinstance(schedule, str):
            self.name = schedule
            self.schedule = make_schedule(schedule, self.p, num_microbatches, self.v, schedule_costs)
        else:
            self.name, self.schedule = "custom", schedule
            if len(schedule) != self.p:
                raise ScheduleError(f"schedule has {len(schedule)} ranks but the group has {self.p}")
        self.split_backward = any(a.kind == "W" for a in self.schedule[self.rank])
        if self.split_backward:
            for c in self.chunks:
                enable_weight_grad_split(c)
        self.last_vs = self.p * self.v - 1
        self.is_last = stage_owner(self.last_vs, self.p)[0] == self.rank
        if self.is_last and loss_fn is None:
            raise ValueError("loss_fn is required on the rank that runs the last stage")
        self.loss_fn = loss_fn
        self.p2p = P2P(group, device, timeout_s)
        # for each receive: does another message from the same peer follow in this step?
        ops = [(op, a, peer) for op, a, peer in communication(self.schedule, self.v)[self.rank] if op.startswith("recv")]
        if self.rank > 0:
            ops.append(("recv_status", Action("S", -1, _UP), self.rank - 1))
        if self.rank < self.p - 1:
            ops.append(("recv_status", Action("S", -1, _DOWN), self.rank + 1))
        self._more_after: dict[tuple[str, int, int], bool] = {}
        for i, (op, a, peer) in enumerate(ops):
            self._more_after[(a.kind, a.mb, a.chunk)] = any(q == peer for _, _, q in ops[i + 1:])
        self.timeline: list[tuple[Action, float, float]] = []
        self.loss_scale: float | torch.Tensor = 1.0 / self.m

    def _vs(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def step(self, inputs: Any = None, targets: Any = None, return_loss: bool = True,
             loss_scale: float | torch.Tensor | None = None) -> float | None:
        """One step over ``num_microbatches`` micro-batches: forwards, backwards (gradients accumulate
        in the parameters' .grad) and, if asked, the sum of the scaled micro-batch losses on every rank.
        ``loss_scale`` (read on the last stage; default 1/num_microbatches) multiplies each
        micro-batch's loss before its backward."""
        self.loss_scale = 1.0 / self.m if loss_scale is None else loss_scale
        saved: dict[tuple[int, int], tuple] = {}
        stores: dict[tuple[int, int], WeightGradStore] = {}
        losses: list[torch.Tensor] = []
        self.timeline = []
        try:
            xs, ys = self._split_batch(inputs, targets)
            for a in self.schedule[self.rank]:
                # timeline spans start once the inputs have arrived: waiting is bubble, not work
                if a.kind == "F":
                    loss = self._forward(a, xs, ys, saved)
                    if loss is not None:
                        losses.append(loss)
                elif a.kind == "B":
                    self._backward(a, saved, stores)
                else:
                    t0 = time.perf_counter()
                    stores.pop((a.mb, a.chunk)).flush()
                    self.timeline.append((a, t0, time.perf_counter()))
            self.p2p.wait_sends()
            total = self._end_of_step(losses)
        except PipelineAbortError as e:
            self.p2p.abort([n for n in self._neighbours() if n != e.source], str(e))  # pass it on
            raise
        except PipelinePeerLostError as e:
            self.p2p.abort([n for n in self._neighbours() if n != e.peer], str(e))
            raise
        except Exception as e:
            msg = f"pipeline stage on rank {self.rank} raised {type(e).__name__}: {e}"
            self.p2p.abort(self._neighbours(), msg)
            raise
        return float(total) if return_loss else None  # the one host sync of the step

    def fail(self, error: BaseException) -> None:
        """This rank's step failed before it began (e.g. its inputs were refused): the neighbouring
        stages, waiting for its activations or gradients, stop with its message instead of a timeout."""
        self.p2p.abort(self._neighbours(), f"pipeline stage on rank {self.rank} raised {type(error).__name__}: "
                                           f"{error}")

    def _split_batch(self, inputs: Any, targets: Any) -> tuple[list | None, list | None]:
        """Micro-batches of the inputs (first stage) and targets (last stage); errors here abort the peers."""
        xs = ys = None
        if self.rank == 0:
            if inputs is None:
                raise ValueError("inputs are required on rank 0 (the first pipeline stage)")
            xs = split_microbatches(inputs, self.m, "inputs")
        if self.is_last:
            if targets is None:
                raise ValueError(f"targets are required on rank {self.rank} (the last pipeline stage)")
            ys = split_microbatches(targets, self.m, "targets")
        return xs, ys

    def _end_of_step(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Up the chain: every stage before this rank finished; down the chain: the loss. Returns the
        sum of the scaled losses (a float64 tensor; summed on the device, no host sync here)."""
        r, p = self.rank, self.p
        dev = self.p2p.device
        if self.is_last:
            total = torch.stack([x.detach().to(torch.float64) for x in losses]).sum() if losses else \
                torch.zeros((), dtype=torch.float64)
            total = total.reshape(1).to(dev)
        if p == 1:
            return total
        if r > 0:
            self.p2p.recv(r - 1, KIND_STATUS, -1, _UP, self._more_after[("S", -1, _UP)])
        if r < p - 1:
            self.p2p.send(torch.zeros(1, dtype=torch.float64, device=dev), r + 1, KIND_STATUS, -1, _UP)
            total = self.p2p.recv(r + 1, KIND_STATUS, -1, _DOWN, self._more_after[("S", -1, _DOWN)])
        if r > 0:
            self.p2p.send(total, r - 1, KIND_STATUS, -1, _DOWN)
        self.p2p.wait_sends()
        return total

    def _neighbours(self) -> list[int]:
        """Ranks this one exchanges activations or gradients with (wrapping round only when interleaved)."""
        r, p = self.rank, self.p
        if self.v > 1:
            return sorted({(r - 1) % p, (r + 1) % p} - {r})
        return [n for n in (r - 1, r + 1) if 0 <= n < p]

    def _forward(self, a: Action, xs, ys, saved) -> torch.Tensor | None:
        vs = self._vs(a.chunk)
        if vs == 0:
            x = xs[a.mb]
        else:
            x = self.p2p.recv(stage_owner(vs - 1, self.p)[0], KIND_ACT, a.mb, vs, self._more_after[("F", a.mb, a.chunk)])
        t0 = time.perf_counter()
        with split_weight_grads(self.split_backward):  # zero bubble: weights reach autograd in W only
            out = self.chunks[a.chunk](x)
        if vs == self.last_vs:
            loss = self.loss_fn(out, ys[a.mb]) * self.loss_scale
            saved[(a.mb, a.chunk)] = (x, loss)
            self.timeline.append((a, t0, time.perf_counter()))
            return loss.detach()
        self.p2p.send(out, stage_owner(vs + 1, self.p)[0], KIND_ACT, a.mb, vs + 1)
        saved[(a.mb, a.chunk)] = (x, out)
        self.timeline.append((a, t0, time.perf_counter()))
        return None

    def _backward(self, a: Action, saved, stores) -> None:
        vs = self._vs(a.chunk)
        x, out = saved.pop((a.mb, a.chunk))
        if vs == self.last_vs:
            outs, grads = [out], [None]
        else:
            g = self.p2p.recv(stage_owner(vs + 1, self.p)[0], KIND_GRAD, a.mb, vs, self._more_after[("B", a.mb, a.chunk)])
            outs = [t for t in flatten(out)[0] if t.requires_grad]
            grads = list(g)
        x_leaves = [t for t in flatten(x)[0] if t.requires_grad] if vs > 0 else []
        t0 = time.perf_counter()
        if self.split_backward:
            store = stores[(a.mb, a.chunk)] = WeightGradStore()
            with defer_weight_grads(store):
                torch.autograd.backward(outs, grads)
        else:
            torch.autograd.backward(outs, grads)
        if vs > 0:
            dx = [t.grad if t.grad is not None else torch.zeros_like(t) for t in x_leaves]
            self.p2p.send(dx, stage_owner(vs - 1, self.p)[0], KIND_GRAD, a.mb, vs - 1)
        self.timeline.append((a, t0, time.perf_counter()))
