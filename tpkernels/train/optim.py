"""Optimizer, learning-rate schedule and global-norm gradient clipping for a TP × PP × DP model.

The global gradient norm counts every parameter of the whole model exactly once, by its TP tag
(:mod:`tpkernels.parallel.param_tags`, set where the parameter was made):

* TP-split parameters (column/row-parallel weights, column biases, vocabulary tables, the
  head, LoRA's split factor) hold different slices on each TP rank: their squares are summed
  over the TP group;
* replicated parameters (norms, row-parallel biases, learned positions) are equal on every TP
  rank after ``finish_grad_sync``: counted on one of them (weight 1/TP before the TP sum);
* replicated KV rows (TP > KV heads) are equal on the ``kv_replicas`` ranks sharing a head:
  weight 1/kv_replicas;
* the tied head's copy on the last stage is the embedding's gradient again: weight 0;
* stages hold different layers: summed over the PP group; DP replicas are equal: counted once;
* a MoE layer's routed experts (``expert_parallel``) differ over the EP group (each rank holds
  E/ep of them): their squares are summed over the EP group first; their replicas over the
  expert-data-parallel group are equal: counted once.

A parameter without a tag is an error (it would be counted wrong without a word).

AdamW is torch's (``foreach`` on the CPU, ``fused`` on CUDA); biases, norms and other 1-D
parameters get no weight decay. The schedule is linear warm-up then cosine decay to ``min_lr``.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch

from tpkernels.models.grad_sync import grad_of
from tpkernels.parallel import control
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.param_tags import tag_of


def global_grad_norm(model, tp_group=None, pp_group=None, ep_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (see the module docstring), on every rank; fp32.
    ``tp_group`` / ``pp_group`` / ``ep_group``: the model's TP, pipeline and expert-parallel groups;
    None means there is no such parallelism (not the default group, as for the ops: a norm summed
    over the wrong ranks would be silently wrong)."""
    _, tp = group_rank_size(tp_group) if tp_group is not None else (0, 1)
    named = [(n, p) for n, p in model.named_parameters() if grad_of(p) is not None]
    device = grad_of(named[0][1]).device if named else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named:
        t = tag_of(p, required=True, name=name)
        g = grad_of(p).double()
        if t.tied == "copy":
            continue
        if getattr(t, "expert_parallel", False):
            experts += g.square().sum() if t.split_dim is not None else g.square().sum() / tp
        elif t.split_dim is None:
            total += g.square().sum() / tp
        elif t.kv_replica_rows is not None and t.kv_replicas > 1:
            lo, hi = t.kv_replica_rows
            total += g[:lo].square().sum() + g[lo:hi].square().sum() / t.kv_replicas + g[hi:].square().sum()
        else:
            total += g.square().sum()
    if ep_group is not None:  # every rank of an EP group runs this (its experts may have no gradient)
        control.all_reduce_(experts, "sum", ep_group)
    total += experts
    for group in (tp_group, pp_group):
        if group is not None:
            control.all_reduce_(total, "sum", group)
    return total.sqrt().float()


def clip_grads_(model, max_norm: float, norm: torch.Tensor) -> float:
    """Scale every gradient by min(1, max_norm / norm) (no-op when max_norm is 0); returns the norm."""
    value = float(norm)
    if max_norm > 0 and value > max_norm:
        scale = max_norm / (value + 1e-6)
        for p in model.parameters():
            if grad_of(p) is not None:
                grad_of(p).mul_(scale)
    return value


def _adamw_groups(params) -> list[dict]:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": None}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(params, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, *,
                   zero1_group=None, experts=None, expert_zero1_group=None):
    """AdamW over ``params`` (the model's, or their fp32 masters); 1-D tensors without weight decay.

    ``zero1_group``: shard the optimizer states over this (data-parallel, DP × CP) group with torch's
    ``ZeroRedundancyOptimizer`` (ZeRO stage 1): each DP rank keeps the AdamW states of its share of
    the parameters, steps them, and broadcasts the updated values. It composes with TP/PP as is:
    the gradients it sees are already complete (``finish_grad_sync``), and it only partitions the
    parameters this rank holds, so chosen over a home-made distributed optimizer.

    ``experts`` (a set of ``id``s of ``params``: a MoE model's routed experts at ep > 1) with
    ``zero1_group``: those differ over the EP ranks of the DP × CP group, so ZeRO must not hand one
    rank's update to another; they get their own ZeroRedundancyOptimizer over
    ``expert_zero1_group`` (the expert-data-parallel group: the replicas of the same experts), or
    plain AdamW when that group is one rank (:class:`SplitOptimizer` steps both)."""
    params = [p for p in params if p.requires_grad]
    cuda = any(p.is_cuda for p in params if p.dim() >= 2)
    kw = dict(fused=True) if cuda else dict(foreach=True)

    def one(ps, group):
        groups = [{**g, "weight_decay": weight_decay if g["weight_decay"] is None else g["weight_decay"]}
                  for g in _adamw_groups(ps)]
        if group is not None and group_rank_size(group)[1] > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415

            return ZeroRedundancyOptimizer([g for g in groups if g["params"]], optimizer_class=torch.optim.AdamW,
                                           process_group=group, lr=lr, betas=betas, eps=eps, **kw)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kw)

    experts = set(experts or ())
    if zero1_group is None or not experts:
        return one(params, zero1_group)
    dense = [p for p in params if id(p) not in experts]
    routed = [p for p in params if id(p) in experts]
    return SplitOptimizer([one(ps, g) for ps, g in ((dense, zero1_group), (routed, expert_zero1_group)) if ps])


class _RoutedState(MutableMapping):
    """The AdamW states of a :class:`SplitOptimizer`'s parts as one mapping (parameter -> its state), each
    read and write going to the part that steps the parameter."""

    def __init__(self, parts):
        self.parts = parts
        self._of = {id(q): part for part in parts for g in part.param_groups for q in g["params"]}

    def _part(self, p):
        if id(p) not in self._of:
            raise KeyError(p)
        return self._of[id(p)]

    def __getitem__(self, p):
        return self._part(p).state[p]

    def __setitem__(self, p, value):
        self._part(p).state[p] = value

    def __delitem__(self, p):
        del self._part(p).state[p]

    def __iter__(self):
        for part in self.parts:
            yield from part.state

    def __len__(self):
        return sum(len(part.state) for part in self.parts)


class SplitOptimizer:
    """Two optimizers stepped as one: ZeRO-1 over the DP × CP group for the dense parameters, and over the
    expert-data-parallel group for the routed experts (:func:`make_optimizer`). ``optim``: the local
    optimizer view the checkpoints read (each part's ZeRO shard, or the part itself)."""

    def __init__(self, parts):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    @property
    def optim(self):
        local = [getattr(part, "optim", part) for part in self.parts]
        return local[0] if len(local) == 1 else _LocalView(local)


class _LocalView:
    """The local optimizers of a SplitOptimizer's parts, read as one (param_groups, state)."""

    def __init__(self, parts):
        self.parts = parts
        self.state = _RoutedState(parts)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``lr`` to ``min_lr`` at ``total``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
