"""The router losses of a mixture-of-experts model in the training objective, and the MoE metrics.

    objective = the token mean of the global batch                       (tpkernels.train.trainer)
              + aux_coef · (1/m) Σ_micro-batches load-balancing loss      (switch style, per layer: the mean
              + z_coef   · (1/m) Σ_micro-batches router z-loss             over the MoE layers, as Megatron)

Each MoE layer (:class:`tpkernels.models.moe.MoE`) records on every forward this rank's *share* of its
statistics (``model.moe_losses.records[layer]``): f_e (fraction of the micro-batch's tokens routed to
expert e, over every DP × CP replica: no gradient), this rank's share of P_e (the mean router score)
and of the z-loss. The shares of the TP × DP × CP ranks of a stage sum to the global micro-batch's
value (tpkernels.models.moe's docstring). A micro-batch here is *global*: micro-batch i of every DP
replica (the trainer hands replica r the r-th rows of each, so at a given ``num_microbatches`` the
same rows make micro-batch i at every DP size, and the objective is the same at every TP × EP × PP
× CP × DP layout). The balancing loss is a per-micro-batch statistic (E · Σ f · P is not linear in the
tokens), so unlike the token loss it changes with the number of micro-batches, as Megatron-Core's does.

How the shares reach the gradient, at any pipeline schedule: a forward hook on every model chunk
(pipeline stage) that holds MoE layers reads, right after the chunk's forward of a micro-batch, the
records of its layers, and attaches their weighted share to the chunk's output with
:class:`_AddToObjective` (Megatron's ``MoEAuxLossAutoScaler``): an identity whose backward also
gives the share the gradient ``scale`` = loss scale × dp · cp / m, so each stage's backward adds its
own layers' share, whichever schedule (gpipe, 1f1b, interleaved, zb-h1) orders it. The hook is on the
chunk, not on the layer, so recompute (which re-runs a *layer* in backward, with the same routing)
never adds a share twice nor counts a metric twice; and it acts only inside a training step
(:meth:`RouterObjective.training_step`): validation, the DPO reference pass, eval samples and
timing passes leave the objective and the metrics alone.

Metrics per step (``moe/*`` in the metrics file, the progress line and TensorBoard), summed over the
ranks of the step by one all-reduce: ``moe/aux_loss`` and ``moe/z_loss`` (the terms above without
their coefficients), ``moe/load`` (assignments per expert of each MoE layer over the step, a list per
layer), ``moe/load_max_over_mean`` (the worst layer's busiest expert over the mean expert: 1 is
perfect balance), ``moe/dropped_tokens`` (assignments dropped by the capacity factor).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpkernels.parallel import control

AUX_STYLES = ("per_layer", "transformers")


class _AddToObjective(torch.autograd.Function):
    """y = out (the identity); backward: out's gradient as is, and ``scale`` for ``share`` (a 0-d loss
    term that the pipeline's loss never sees: this is how it joins the objective)."""

    @staticmethod
    def forward(ctx, out, share, scale: float):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def _attach(output, share: torch.Tensor, scale: float):
    """``output`` (a tensor, or a stage's nested tuple) with ``share`` attached to its first tensor that takes
    a gradient (the delta of a stage's ((delta, residual), positions, documents), or the last stage's
    hidden state)."""
    leaves, spec = tree_flatten(output)
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            leaves[i] = _AddToObjective.apply(t, share, scale)
            return tree_unflatten(leaves, spec)
    raise RuntimeError("a pipeline stage with MoE layers returned no tensor that takes a gradient: its router "
                       "losses cannot join the objective")


class RouterObjective:
    """The router losses of ``model``'s MoE layers in the training objective, and their metrics (module
    docstring). One per trainer; ``aux_coef`` / ``z_coef``: the coefficients (the model's
    ``router_aux_loss_coef`` / ``router_z_loss_coef`` unless the training config overrides them);
    ``style``: "per_layer" (Megatron-Core's: the mean over the MoE layers of each layer's switch loss)
    or "transformers" (the tokens of every layer pooled, as transformers' ``load_balancing_loss_func``;
    every MoE layer on one stage: pp = 1). ``tokens_per_microbatch``: the tokens of a global micro-batch
    (micro_batch_size × dp × seq_length), which turn each layer's f (the fraction of them routed to each
    expert, the same on every rank of its stage however TP splits the routing) into counts."""

    def __init__(self, model, aux_coef: float, z_coef: float, style: str = "per_layer", *,
                 tokens_per_microbatch: int):
        if style not in AUX_STYLES:
            raise ValueError(f"training.moe_aux_loss_style ({style!r}) must be one of {', '.join(AUX_STYLES)}")
        self.model, self.losses = model, model.moe_losses
        mc = model.config
        self.num_experts, self.num_layers = mc.num_experts, mc.num_layers
        self.num_moe_layers = mc.num_moe_layers
        self.moe_layers = [i for i in range(mc.num_layers) if mc.is_moe_layer(i)]
        self.aux_coef, self.z_coef, self.style = float(aux_coef), float(z_coef), style
        pc = model.state.config
        self.stage_ranks = pc.tp * pc.dp * pc.cp  # the ranks of one pipeline stage: each holds the stage's f
        self.tokens, self.top_k = int(tokens_per_microbatch), mc.experts_per_token
        self._scale: float | None = None
        self._m = 1
        chunks = [(c, [b.layer for b in c.layers if mc.is_moe_layer(b.layer)]) for c in model.chunks]
        chunks = [(c, layers) for c, layers in chunks if layers]
        if style == "transformers" and (len(chunks) > 1 or sum(len(ls) for _, ls in chunks) != self.num_moe_layers):
            raise ValueError(f"training.moe_aux_loss_style (transformers) pools the tokens of every MoE layer, which "
                             f"needs them all on one pipeline stage (parallel.pp 1, now {model.state.config.pp}); "
                             "use per_layer")
        self._handles = [c.register_forward_hook(self._hook(layers)) for c, layers in chunks]
        self._reset()

    def _reset(self) -> None:
        self._aux = self._z = None
        self._counts: dict[int, torch.Tensor] = {}
        self._microbatches = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def training_step(self, scale: float, num_microbatches: int):
        """The block of one training step's forward and backward: the shares join the objective with
        gradient ``scale`` / ``num_microbatches`` (``scale``: the loss scale × the DP × CP replicas, whose
        gradient average divides it again) and the step's metrics accumulate."""
        self._reset()
        self._scale = scale / num_microbatches
        self._m = num_microbatches
        try:
            yield self
        finally:
            self._scale = None

    def _shares(self, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux, z): this rank's shares of the two losses for ``layers`` (their last forward's records)."""
        recs = [self.losses.records[i] for i in layers]
        n = max(self.num_moe_layers, 1)
        if self.style == "transformers":
            aux = self.losses.aux_loss("transformers")
        else:
            aux = sum(self.num_experts * torch.sum(r.f * r.p) for r in recs) / n
        z = sum(r.z for r in recs) / n
        return aux, z

    def _hook(self, layers: list[int]):
        def hook(module, args, output):
            if self._scale is None:  # not a training step: no objective, no metrics
                return None
            missing = [i for i in layers if i not in self.losses.records]
            if missing:
                raise RuntimeError(f"MoE layers {missing} recorded no router statistics in this forward")
            aux, z = self._shares(layers)
            with torch.no_grad():
                self._aux = aux.detach().double() + (0 if self._aux is None else self._aux)
                self._z = z.detach().double() + (0 if self._z is None else self._z)
                for i in layers:
                    r = self.losses.records[i]
                    # the global micro-batch's kept assignments per expert: f × its tokens
                    c = r.f.detach().double() * self.tokens
                    self._counts[i] = c + self._counts[i] if i in self._counts else c
            share = self.aux_coef * aux + self.z_coef * z
            if not share.requires_grad or (self.aux_coef == 0 and self.z_coef == 0):
                return None
            return _attach(output, share, self._scale)

        return hook

    def step_metrics(self, group=None) -> dict:
        """The step's ``moe/*`` metrics (module docstring), the same on every rank: one all-reduce over
        ``group`` (default: the world) of the ranks' shares and counts. Collective."""
        e, layers = self.num_experts, self.moe_layers
        device = next(iter(self._counts.values())).device if self._counts else torch.device("cpu")
        vec = torch.zeros(2 + len(layers) * e, dtype=torch.float64, device=device)
        if self._aux is not None:
            vec[0], vec[1] = self._aux.to(device), self._z.to(device)
        for j, i in enumerate(layers):
            if i in self._counts:
                vec[2 + j * e:2 + (j + 1) * e] = self._counts[i].to(device=device, dtype=torch.float64)
        vec = control.all_reduce_(vec, "sum", group).cpu()
        m = self._m
        # every rank of a layer's stage holds the same f (over its TP × DP × CP tokens)
        counts = (vec[2:] / self.stage_ranks).round().view(len(layers), e)
        dropped = self.top_k * self.tokens * m * len(layers) - int(counts.sum())  # assignments not kept
        mean = counts.mean(dim=1).clamp_min(1e-12)
        imbalance = (counts.max(dim=1).values / mean)
        return {"moe/aux_loss": float(vec[0]) / m, "moe/z_loss": float(vec[1]) / m,
                "moe/load_max_over_mean": float(imbalance.max()) if len(layers) else 1.0,
                "moe/dropped_tokens": int(dropped),
                "moe/load": {str(i): [int(c) for c in counts[j].tolist()] for j, i in enumerate(layers)}}


__all__ = ["AUX_STYLES", "RouterObjective"]
