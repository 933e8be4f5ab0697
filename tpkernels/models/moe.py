"""The mixture-of-experts block (Mixtral, Qwen2-MoE) at any TP × EP layout, and its router losses.

    y = moe(x)          # x, y: (batch, seq[/TP], hidden), in place of the dense MLP of a MoE layer

One layer, in order (Megatron-Core's alltoall dispatcher with expert TP = TP; T = the tokens of this
rank's (batch, seq), tp the TP size):

1. This TP rank's tokens: with SP its sequence shard (T/tp tokens, no communication); without SP its
   1/tp block of the replicated T tokens (cut locally; backward: the blocks' gradients all-gathered).
   Each TP rank routes different tokens.
2. Router: a replicated linear (E × hidden) in the model's dtype, scores in float32
   (:func:`tpkernels.functional.moe_router.route`, transformers' Mixtral / Qwen2-MoE routing step for
   step). Each TP rank's gradient covers its own tokens: tagged ``partial_grad`` and summed over TP like
   an SP norm weight. A capacity limit counts the assignments of this rank's tokens.
3. Permutation (:func:`~tpkernels.functional.moe_permute.permute`): this rank's T·k/tp token copies
   grouped by global expert; capacity-dropped copies are left out.
4. Experts: :func:`~tpkernels.functional.moe_dispatch.dispatch_combine` sends each copy to the EP rank
   that holds its expert (``ep`` = 1: a direct call). There (:meth:`MoE._expert_tp`) the rows are
   all-gathered over the TP group (each TP rank holds an F/tp slice of every local expert, so each needs
   every row of its local experts), regrouped by local expert, run through the grouped SwiGLU MLP
   (:func:`~tpkernels.functional.grouped_gemm.grouped_swiglu_mlp`) over the E/ep local experts, and the
   partial results reduce-scattered over TP back to the TP rank that received the rows
   (:mod:`tpkernels.functional.moe_expert_tp`); the return all-to-all carries them home. The experts are
   stacked parameters ``w_gate_up`` (E/ep, hidden, 2F/tp) = [gate | up] and ``w_down`` (E/ep, F/tp,
   hidden), TP-split like the dense MLP (columns of gate/up, rows of down).
5. Combine (:func:`~tpkernels.functional.moe_permute.unpermute`): each token's k rows weighted by the
   router weights, complete on this rank. With SP that is the layer's sequence shard; without SP the
   blocks are all-gathered over TP (backward: this rank's block). The shared expert (a dense
   :class:`~tpkernels.models.mlp.MLP` times Qwen2-MoE's sigmoid gate, with its own TP reduction) is added.

The EP all-to-all therefore carries T·k/tp copies per rank each way (Megatron-Core's volume), and the
TP group moves the received rows once each way (all-gather, reduce-scatter).

Router losses (:class:`RouterLosses`, one per model, ``model.moe_losses``): each MoE layer records this
rank's share of its load-balancing and z-loss statistics on every forward. Shares and the global
objective: the tokens of a micro-batch are split over the TP × DP × CP ranks (step 1: each TP rank
routes its own 1/tp of them); f_e (the fraction of assignments expert e got) is all-reduced over TP and
DP × CP without gradient; P_e's and the z-loss's sums over this rank's tokens are divided by the global
token count. The shares of all the ranks of a pipeline stage (TP × DP × CP) therefore sum to the
micro-batch's global loss and gradient, whatever the layout; under DP gradient averaging (``DataParallelGradReduce`` divides by
dp · cp) a rank backpropagates dp · cp × its share, as it does its token-loss share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tpkernels.functional.grouped_gemm import grouped_swiglu_mlp
from tpkernels.functional.grouped_fp8 import check_fp8_shapes, grouped_fp8_gemm
from tpkernels.functional.grouped_quantized import grouped_quantized_gemm
from tpkernels.functional.grouped_weight_grad import grouped_gemm_split
from tpkernels.functional.weight_grad import splitting
from tpkernels.functional.moe_dispatch import dispatch_combine
from tpkernels.functional.moe_expert_tp import even_sizes, gather_rows, reduce_scatter_rows, split_rows
from tpkernels.functional.moe_permute import permute, unpermute
from tpkernels.functional.moe_router import route
from tpkernels.models.context import LayerContext, replicated
from tpkernels.models.hf_checkpoint import Part
from tpkernels.models.mlp import MLP
from tpkernels.models.moe_quant import quantize_experts, quantized_weights
from tpkernels.parallel import control
from tpkernels.parallel.param_tags import tag

AUX_STYLES = ("per_layer", "transformers")


@dataclass
class LayerRouterStats:
    """One MoE layer's router statistics of the last forward on this rank.

    f: (E,) fraction of the micro-batch's global tokens routed to each expert (top-k assignments /
        tokens, summing to k), no gradient. p: (E,) this rank's share of the mean router score of each
        expert (its tokens' sum / the global token count), with gradient. z: this rank's share of the
        z-loss (its tokens' sum of logsumexp(logits)² / the global token count), with gradient.
    counts: (E,) assignments this rank's tokens made to each expert (int64, no gradient).
    dropped: assignments dropped by the capacity limit on this rank (0 when dropless)."""

    f: torch.Tensor
    p: torch.Tensor
    z: torch.Tensor
    counts: torch.Tensor
    dropped: int = 0


@dataclass
class RouterLosses:
    """The router losses of a model's MoE layers for the trainer: read after a forward, reset before the
    next (a recomputed forward overwrites its layer's record with the same values).

    aux_coef, z_coef: ``router_aux_loss_coef`` and ``router_z_loss_coef``. ``aux_style``:
      "per_layer": the mean over the MoE layers of each layer's switch loss E · Σ_e f_e · P_e (what
          :func:`tpkernels.functional.moe_router.load_balancing_loss` gives per layer; Megatron-Core's
          definition, reported as the mean over layers). Each layer's share is its own: it works on any
          pipeline stage.
      "transformers": transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE): the tokens of
          every layer pooled, E · Σ_e mean_l(f_le) · mean_l(P_le). The layers of one stage only see
          their own f, so this style needs every MoE layer on this rank (pp = 1); at pp > 1 it is
          refused by name (use "per_layer").
    Both are linear in the P shares, so the shares of a stage's ranks sum to the global value."""

    num_experts: int
    aux_coef: float = 0.0
    z_coef: float = 0.0
    num_moe_layers: int = 0
    records: dict[int, LayerRouterStats] = field(default_factory=dict)

    def record(self, layer: int, stats: LayerRouterStats) -> None:
        self.records[layer] = stats

    def reset(self) -> None:
        self.records = {}

    def aux_loss(self, style: str = "per_layer") -> torch.Tensor:
        """This rank's share of the load-balancing loss (without its coefficient), a 0-d tensor."""
        if style not in AUX_STYLES:
            raise ValueError(f"style ({style!r}) must be one of {', '.join(AUX_STYLES)}")
        recs = [self.records[k] for k in sorted(self.records)]
        if not recs:
            return torch.zeros(())
        e = self.num_experts
        if style == "per_layer":
            return sum(e * torch.sum(r.f * r.p) for r in recs) / max(self.num_moe_layers, len(recs))
        if len(recs) != self.num_moe_layers:
            raise ValueError(f"style 'transformers' pools the tokens of every MoE layer ({self.num_moe_layers}), but "
                             f"this rank ran {len(recs)} of them (pipeline parallelism: each stage sees its own "
                             "layers); use style 'per_layer'")
        n = len(recs)
        f = torch.stack([r.f for r in recs]).sum(0) / n
        return e * torch.sum(f * torch.stack([r.p for r in recs]).sum(0) / n)

    def z_loss(self) -> torch.Tensor:
        """This rank's share of the router z-loss, the mean over the MoE layers (without its coefficient)."""
        recs = list(self.records.values())
        if not recs:
            return torch.zeros(())
        return sum(r.z for r in recs) / max(self.num_moe_layers, len(recs))

    def loss(self, style: str = "per_layer") -> torch.Tensor:
        """aux_coef · aux + z_coef · z: this rank's share of what the router adds to the objective."""
        return self.aux_coef * self.aux_loss(style) + self.z_coef * self.z_loss()

    def expert_load(self) -> dict[int, torch.Tensor]:
        """Assignments per expert of each layer's last forward on this rank (metrics: sum them over DP)."""
        return {k: r.counts for k, r in sorted(self.records.items())}


def _stats(scores: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor, num_experts: int,
           groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(f, p share, z share, local counts) of one layer (see :class:`LayerRouterStats`). E + 1 values
    all-reduced over each of ``groups`` in turn (the TP group, then the DP × CP ranks: together the
    ranks whose tokens make up the micro-batch), as load_balancing_loss and z_loss do."""
    t = scores.shape[0]
    valid = experts >= 0
    counts = torch.zeros(num_experts, dtype=torch.int64, device=scores.device).scatter_add_(
        0, experts.clamp_min(0).reshape(-1), valid.reshape(-1).to(torch.int64))
    stats = torch.cat([counts.to(scores.dtype), torch.tensor([float(t)], dtype=scores.dtype, device=scores.device)])
    stats = stats.detach()
    for group in groups:
        stats = control.all_reduce_(stats, group=group)
    n = stats[-1].clamp_min(1.0)
    f = stats[:-1] / n
    probs = scores / scores.sum(dim=-1, keepdim=True)  # a no-op for softmax scores
    p = probs.sum(0) / n
    z = torch.logsumexp(logits, dim=-1).square().sum() / n
    return f, p, z, counts


def _keep(t: torch.Tensor) -> torch.Tensor:
    """Saved-tensor hooks that keep a tensor as it is (see MoE._experts)."""
    return t


class MoE(nn.Module):
    """forward(x (batch, seq[/TP], hidden)) -> like x: a MoE layer's feed-forward block (module docstring).

    Parameters: ``router`` (E, hidden) replicated; ``w_gate_up`` (E/ep, hidden, 2F/tp) and ``w_down``
    (E/ep, F/tp, hidden), this EP rank's experts ep_rank·E/ep …; ``shared`` (an MLP of the shared
    expert's width) and ``shared_gate`` (1, hidden) when the model has them."""

    expert_parallel = True  # its hf_parts take ep_rank (TransformerChunk.parts)

    def __init__(self, ctx: LayerContext, layer: int):
        super().__init__()
        mc = ctx.mc
        self.ctx, self.layer = ctx, layer
        self.num_experts, self.top_k = mc.num_experts, mc.experts_per_token
        self.num_local = mc.num_experts // ctx.ep_size
        self.f = mc.expert_ffn // ctx.tp_size
        h, kw = mc.hidden_size, ctx.factory()
        # the router's gradient is partial over TP whether or not SP is on (step 2 of the module docstring)
        self.router = tag(nn.Parameter(torch.empty(mc.num_experts, h, **kw)), partial_grad=ctx.tp_size > 1)
        self.w_gate_up = tag(nn.Parameter(torch.empty(self.num_local, h, 2 * self.f, **kw)), split_dim=2,
                             expert_parallel=True)
        self.w_down = tag(nn.Parameter(torch.empty(self.num_local, self.f, h, **kw)), split_dim=1,
                          expert_parallel=True)
        for p in (self.w_gate_up, self.w_down):
            p.hf_view = "experts"  # its HF parts are those of (E/ep · out, in): hf_checkpoint.experts_view
        self.quantized = None
        self.fp8 = {}  # parameter name -> its FP8 slot (enable_fp8)
        if ctx.quant:  # QLoRA: the experts are a frozen NF4 / int8 base (tpkernels.models.moe_quant)
            quantize_experts(self, ctx.quant)
        s = mc.shared_expert_ffn_hidden_size
        self.shared = None
        if s:
            self.shared = MLP(ctx, layer, ffn_hidden_size=s,
                              hf_name=lambda role, i, param="weight": ctx.moe_hf(f"shared_{role}", i, param=param))
        self.shared_gate = replicated(nn.Parameter(torch.empty(1, h, **kw)), ctx) if mc.shared_expert_gate else None
        self.losses = ctx.moe_losses
        # (E,) float32 aux-loss-free selection bias (DeepSeek-V3), owned and updated by the trainer's
        # tpkernels.train.moe_bias.ExpertBias; None: route on the scores alone
        self.expert_bias: torch.Tensor | None = None
        self.chunks = ctx.moe_chunks  # dispatch_combine's overlap pieces (tpkernels.functional.moe_dispatch)

    # ---- forward ----
    def _expert_tp(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """dispatch_combine's expert_fn: ``rows`` (M, hidden) this TP rank received, grouped by local expert
        (``counts`` (E/ep,)) -> (M, hidden), complete. The TP group's rows are all-gathered (rank-major),
        regrouped expert-major for :meth:`_experts`, and its partial results reduce-scattered back
        (module docstring, step 4). One host read of the TP group's counts per call."""
        tp, group = self.ctx.tp_size, self.ctx.tp_group
        if tp == 1:
            return self._experts(rows, counts)
        per_rank = control.all_gather_ints(counts, group)                # (tp, L) host
        sizes = per_rank.sum(1).tolist()
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):     # see _experts
            full = gather_rows(rows, sizes, group)                        # rank-major, each expert-grouped
            order = None
            if self.num_local > 1:
                at = (torch.cumsum(per_rank.reshape(-1), 0) - per_rank.reshape(-1)).view(per_rank.shape)
                order = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in
                                   zip(at.t().reshape(-1), per_rank.t().reshape(-1))]).to(rows.device)
                full = full.index_select(0, order)                        # expert-major
            y = self._experts(full, per_rank.sum(0).to(counts.device))
            if order is not None:  # back to rank-major: the inverse permutation
                y = y.index_select(0, torch.empty_like(order).index_copy_(0, order, torch.arange(
                    order.numel(), device=order.device)))
            return reduce_scatter_rows(y, sizes, group)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts over ``rows`` (M, hidden) grouped by local expert -> (M, hidden), partial over TP.

        dispatch_combine keeps this graph and differentiates it piece by piece in backward (nested
        ``torch.autograd.grad``): under full recompute (a non-reentrant ``torch.utils.checkpoint``) its saved
        tensors stay out of the checkpoint's hooks, or each nested backward, a graph task of its own, would
        run the whole layer's recomputation again (and re-enter its context: an error)."""
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            # zero bubble: unfused, each GEMM's dW queued for the W action (grouped_gemm_split)
            if self.quantized is None and not splitting() and not self.fp8_active:
                return grouped_swiglu_mlp(rows, self.w_gate_up, self.w_down, counts)
            gate_up = self.expert_gemm("w_gate_up", rows, counts)
            return self.expert_gemm("w_down", F.silu(gate_up[:, :self.f]) * gate_up[:, self.f:], counts)

    def expert_gemm(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, in) grouped by local expert times the local experts' ``name`` ("w_gate_up" or "w_down") in
        its weight format: the dense stacked tensor (grouped_gemm) or the quantised base
        (grouped_quantized_gemm, frozen) -> (M, out)."""
        if self.quantized is not None and name in self.quantized:
            return grouped_quantized_gemm(x, self.quantized[name], counts)
        slot = self.fp8.get(name)
        if slot is not None and slot.enabled:  # FP8 (tpkernels.functional.grouped_fp8), dW deferrable likewise
            return grouped_fp8_gemm(x, getattr(self, name), counts, slot)
        return grouped_gemm_split(x, getattr(self, name), counts)  # dW deferred to a zero-bubble W

    FP8_MATRICES = {"w_gate_up": "gate_up", "w_down": "down"}

    def fp8_names(self) -> dict[str, str]:
        """The experts' FP8 linears by parameter: ``layers.<i>.experts.gate_up`` / ``.down`` (layout-independent)."""
        return {p: f"layers.{self.layer}.experts.{m}" for p, m in self.FP8_MATRICES.items()}

    def enable_fp8(self, state, names: list[str] | None = None) -> None:
        """Run the routed experts' GEMMs (those of ``names``, default both) in FP8 through ``state``'s slots
        (:mod:`tpkernels.functional.grouped_fp8`). The weight's first-step amax is agreed over the ranks
        holding the other shards and experts (TP, then EP)."""
        if self.quantized is not None:
            raise ValueError("fp8 on quantised (QLoRA) experts: their GEMM is the dequantising NF4 / int8 kernel; "
                             "FP8 training of a QLoRA base is not supported (use bf16 with qlora)")
        ctx = self.ctx
        group = tuple(g for g, n in ((ctx.tp_group, ctx.tp_size), (ctx.ep_group, ctx.ep_size)) if n > 1) or None
        for p, name in self.fp8_names().items():
            if names is None or name in names:
                check_fp8_shapes(getattr(self, p), name)
                self.fp8[p] = state.slot(name, group)

    @property
    def fp8_active(self) -> bool:
        return any(s.enabled for s in self.fp8.values())

    def quantized_weights(self) -> dict:
        """The expert weights held quantised, by parameter name (tpkernels.models.moe_quant.QuantizedExperts)."""
        return quantized_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, mc = self.ctx, self.ctx.mc
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        split = ctx.tp_size > 1 and not ctx.sequence_parallel  # replicated tokens: this TP rank's block (step 1)
        if split:
            sizes = even_sizes(b * s, ctx.tp_size)
            tokens = split_rows(tokens, sizes, ctx.tp_group)
        logits = F.linear(tokens, self.router)
        r = route(logits, self.top_k, score=mc.router_score, normalize=mc.router_normalize,
                  capacity_factor=mc.capacity_factor, bias=self.expert_bias)
        experts = r.experts if r.dropped is None else r.experts.masked_fill(r.dropped, -1)
        if self.losses is not None:
            f, p, z, counts = _stats(r.scores, r.logits, experts, self.num_experts, (ctx.tp_group, ctx.dp_cp_group))
            dropped = int(r.dropped.sum()) if r.dropped is not None else 0
            self.losses.record(self.layer, LayerRouterStats(f, p, z, counts, dropped))
        x_sorted, counts, row_map = permute(tokens, experts, self.num_experts)
        weights = [w for w in (self.w_gate_up, self.w_down) if isinstance(w, nn.Parameter)]  # not a quantised base
        y_sorted = dispatch_combine(x_sorted, counts, self._expert_tp, ctx.ep_group if ctx.ep_size > 1 else None,
                                    num_local_experts=self.num_local, chunks=self.chunks, params=weights)
        y = unpermute(y_sorted, row_map, r.weights, tokens.shape[0])  # complete for this rank's tokens
        if split:  # the next layer reads replicated activations (backward: this rank's block of the gradient)
            y = gather_rows(y, sizes, ctx.tp_group, reduce_grad=False)
        y = y.view(b, s, h)
        if self.shared is None:
            return y
        shared = self.shared(x)  # the dense MLP: its own SP gather and reduction, full on return
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return y + shared

    # ---- Hugging Face parts (tpkernels.models.hf_checkpoint) ----
    def hf_parts(self, tp_rank: int, tp_size: int | None = None, ep_rank: int | None = None) -> dict[str, list[Part]]:
        """Rank (``tp_rank``, ``ep_rank``)'s parts (defaults: this layout's TP size, this rank's EP rank).
        The stacked experts' parts are those of their (E/ep · out, in) view (``p.hf_view``)."""
        ctx, i = self.ctx, self.layer
        tp = tp_size or ctx.tp_size
        f = ctx.mc.expert_ffn // tp
        q = ctx.ep_rank if ep_rank is None else ep_rank
        rows = (tp_rank * f, (tp_rank + 1) * f)
        local = range(q * self.num_local, (q + 1) * self.num_local)
        parts = {"router": [Part(ctx.moe_hf("router", i))],
                 "w_gate_up": [Part(ctx.moe_hf(r, i, e), rows=rows) for e in local for r in ("expert_gate", "expert_up")],
                 "w_down": [Part(ctx.moe_hf("expert_down", i, e), rows=(0, ctx.mc.hidden_size), cols=rows) for e in local]}
        if self.shared is not None:
            parts.update({f"shared.{k}": v for k, v in self.shared.hf_parts(tp_rank, tp_size).items()})
        if self.shared_gate is not None:
            parts["shared_gate"] = [Part(ctx.moe_hf("shared_expert_gate", i))]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        ctx, mc, i = self.ctx, self.ctx.mc, self.layer
        h, f = mc.hidden_size, mc.expert_ffn
        shapes = {ctx.moe_hf("router", i): (mc.num_experts, h)}
        for e in range(mc.num_experts):
            shapes.update({ctx.moe_hf("expert_gate", i, e): (f, h), ctx.moe_hf("expert_up", i, e): (f, h),
                           ctx.moe_hf("expert_down", i, e): (h, f)})
        if self.shared is not None:
            shapes.update(self.shared.hf_shapes())
        if self.shared_gate is not None:
            shapes[ctx.moe_hf("shared_expert_gate", i)] = (1, h)
        return shapes

    def extra_repr(self) -> str:
        c = self.ctx
        return (f"experts {self.num_experts} (this rank: {self.num_local} from {c.ep_rank * self.num_local}), "
                f"top-{self.top_k}, ffn {self.ctx.mc.expert_ffn} (/tp {c.tp_size})")


__all__ = ["AUX_STYLES", "LayerRouterStats", "MoE", "RouterLosses"]
