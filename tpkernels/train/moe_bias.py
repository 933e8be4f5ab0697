"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert selection bias on every MoE layer, the run
state that owns it.

    training.moe_expert_bias_rate = 1e-3      # Megatron-Core's moe_router_bias_update_rate; 0 = off

Each MoE layer routes with ``route(logits, k, bias=b)``: b (E,) float32 is added to the router scores
for the SELECTION of the top-k experts only; the combine weights stay the unbiased scores, and no
gradient reaches b. Once per training step (not per micro-batch), after the optimizer step, every
layer's bias moves toward balance from that layer's GLOBAL assignment counts of the step (summed over
the step's micro-batches and every rank that holds tokens, DP × CP × the TP shards):

    b_e += rate · sign(mean_e'(load_e') − load_e)       (tpkernels.functional.moe_router.update_balance_bias)

The counts are those of the ``moe/load`` metric (:meth:`RouterObjective.step_metrics`: one all-reduce
per step for every layer, rounded to whole assignments), so the update adds no collective and gives the
same bias on every rank, at every TP × EP × PP × CP × DP layout, by construction.

:class:`ExpertBias` is the one owner of these tensors (DESIGN.md, "Run state has one owner"):
(a) saved and restored with each checkpoint under layout-independent keys ``moe:layers.<i>.expert_bias``
(each pipeline stage writes its own layers', every (E,) whole: routing needs every expert's bias on
every rank, not only the local experts'), so a resume at another layout continues bit for bit;
(b) frozen in every pass that is not a training step: it changes only in :meth:`after_step`, which the
trainer calls after the optimizer step, so validation, the DPO reference pass, a recomputed forward
(which must route as its forward did), eval samples, timing and generation route with the current
bias and never move it; (c) identical on every rank (global counts); with ``TPKERNELS_CHECK_RANKS=1``
:meth:`after_step` checks it with one small all-reduce.
"""

from __future__ import annotations

import math

import torch

from tpkernels.functional.moe_router import update_balance_bias
from tpkernels.parallel import consistency, control

KEY = "moe:layers.{}.expert_bias"


def moe_layers(model) -> dict[int, torch.nn.Module]:
    """This rank's MoE blocks by global layer index (those of its pipeline stage(s))."""
    from tpkernels.models.moe import MoE

    return {m.layer: m for m in model.modules() if isinstance(m, MoE)}


class ExpertBias:
    """The selection biases of ``model``'s MoE layers held on this rank (module docstring), fp32 (E,) each,
    zero at the start. ``rate``: the update step (0: held and restored, never moved, e.g. for generation).
    Attaching sets each layer's ``expert_bias``, which its forward passes to ``route``."""

    def __init__(self, model, rate: float):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"training.moe_expert_bias_rate ({rate!r}) must be a finite number >= 0")
        self.rate = float(rate)
        self.num_layers, self.num_experts = model.config.num_layers, model.config.num_experts
        self.layers = moe_layers(model)
        self.bias: dict[int, torch.Tensor] = {}
        for i, m in sorted(self.layers.items()):
            b = torch.zeros(m.num_experts, dtype=torch.float32, device=m.router.device)
            self.bias[i] = m.expert_bias = b

    def detach(self) -> None:
        """Route without the biases again (the layers forget them)."""
        for m in self.layers.values():
            m.expert_bias = None

    # ---- checkpoint (tpkernels.train.checkpoint.RunState) ----
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {KEY.format(i): b for i, b in self.bias.items()}

    def load_state_tensors(self, found: dict[str, torch.Tensor]) -> None:
        """The stored biases of the keys the checkpoint holds; a layer it lacks (a checkpoint of a run without
        the option) starts at zero."""
        for i, b in self.bias.items():
            t = found.get(KEY.format(i))
            if t is None:
                b.zero_()
                continue
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"checkpoint's {KEY.format(i)} has shape {tuple(t.shape)}, the model's layer {i} "
                                 f"routes over {b.shape[0]} experts")
            b.copy_(t.to(device=b.device, dtype=b.dtype))

    # ---- the training step's update ----
    @torch.no_grad()
    def after_step(self, load: dict[str, list[int]]) -> None:
        """One step's update from ``load`` (the ``moe/load`` metric: layer -> its global assignments per
        expert over the step, the same on every rank). Called once per training step, after it."""
        for i, b in self.bias.items():
            counts = load.get(str(i))
            if counts is None:
                raise RuntimeError(f"the step's moe/load has no counts of MoE layer {i}")
            update_balance_bias(b, torch.tensor(counts, dtype=torch.float64), self.rate)
        if consistency.enabled():
            self.check_same_on_every_rank()

    def check_same_on_every_rank(self) -> None:
        """Raise unless every rank that holds a layer holds the same bias for it (collective over the world:
        one all-reduce of max and −min per layer slot)."""
        if control.group_size() == 1:
            return
        hi = torch.full((self.num_layers, self.num_experts), -math.inf, dtype=torch.float64)
        for i, b in self.bias.items():
            hi[i] = b.double().cpu()
        lo = torch.where(torch.isinf(hi), hi, -hi)
        both = control.all_reduce_(torch.stack([hi, lo]), "max")
        for i, b in self.bias.items():
            if not (torch.equal(both[0, i], b.double().cpu()) and torch.equal(-both[1, i], b.double().cpu())):
                raise RuntimeError(f"the expert bias of MoE layer {i} differs between ranks (max − min = "
                                   f"{float((both[0, i] + both[1, i]).max()):.3g}): the ranks' moe/load counts disagree")


__all__ = ["ExpertBias", "KEY", "moe_layers"]
