"""MoE router: scores, top-k selection, capacity dropping, and the router's auxiliary losses.

    r = route(logits, top_k)                                  # Mixtral: softmax, top-k, renormalise
    r = route(logits, top_k, normalize=cfg.norm_topk_prob)    # Qwen2-MoE / Qwen3-MoE
    r = route(logits, top_k, score="sigmoid", bias=b,         # DeepSeek-V3: sigmoid, aux-loss-free bias,
              groups=8, top_groups=4, scale=2.5)              # group-limited, routed_scaling_factor
    aux = load_balancing_loss(r.scores, r.experts, E, group=dp_cp_group)
    z = z_loss(r.logits, group=dp_cp_group)

``route`` follows transformers 5.23's ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` step for step:
the logits are cast to float32 and the softmax runs there (both families do so whatever the model's
dtype), the top-k scores are divided by their sum when the family normalises (Mixtral always,
Qwen2-MoE / Qwen3-MoE with ``norm_topk_prob``). One difference, on purpose: Qwen2-MoE casts its
weights back to the logits' dtype; ours stay float32 (the combine accumulates in float32).

Ties: two experts with the same score go to the LOWER expert id, on every device and run
(``torch.topk`` promises no order among equal values; a stable descending sort does).

The losses are written for any layout: each returns THIS rank's share of the loss over the tokens
of every rank of ``group``, so that summing the shares over the group (what a data-parallel
gradient all-reduce does) gives the global loss, and its gradient, exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tpkernels.parallel import control

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """What the router decided for T tokens, E experts, top-k.

    weights: (T, k) float32 combine weights (after the family's normalisation); 0 where dropped.
    experts: (T, k) int64 expert ids, best first; equal scores go to the lower expert id.
    scores: (T, E) float32 softmax or sigmoid scores, unbiased (what the aux losses read).
    logits: (T, E) float32 router logits (what the z-loss reads).
    dropped: (T, k) bool, assignments dropped by the capacity limit (None when dropless).
    capacity: rows each expert may keep (None when dropless).
    """

    weights: Tensor
    experts: Tensor
    scores: Tensor
    logits: Tensor
    dropped: Tensor | None = None
    capacity: int | None = None

    @property
    def kept_experts(self) -> Tensor:
        """(T, k) expert ids with -1 where the assignment was dropped: what :func:`permute` takes."""
        return self.experts if self.dropped is None else self.experts.masked_fill(self.dropped, -1)

    def tokens_per_expert(self, num_experts: int | None = None) -> Tensor:
        """(E,) int64 assignments each expert keeps (dropped ones left out)."""
        e = self.kept_experts.reshape(-1)
        return torch.bincount(e[e >= 0], minlength=num_experts or self.scores.shape[-1])


def _check_logits(logits: Tensor) -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (tokens, experts), got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits dtype ({logits.dtype}) must be floating point")
    if logits.shape[1] < 1:
        raise ValueError(f"logits must have at least one expert column, got shape {tuple(logits.shape)}")


def topk_lower_id(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest entries of each row, ties to the lower index. (T, E) -> (T, k)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, order), order


def capacity_of(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows each expert keeps: ceil(capacity_factor · T · k / E) (Switch Transformer / GShard)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep(experts: Tensor, priority: Tensor, capacity: int, num_experts: int) -> Tensor:
    """(T, k) bool: the assignments each expert keeps, at most ``capacity`` per expert, the highest
    ``priority`` first and, at equal priority, the earlier token (then the earlier slot).

    Sorts once by priority (stable, so earlier assignments stay first among equals) and once by
    expert (stable, so the priority order stays inside each expert's group); an assignment is kept
    when its rank inside its expert's group is below the capacity. No loop over experts."""
    flat_e, flat_p = experts.reshape(-1), priority.reshape(-1)
    n = flat_e.numel()
    by_priority = torch.sort(flat_p, descending=True, stable=True).indices
    by_expert = by_priority[torch.sort(flat_e[by_priority], stable=True).indices]
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=experts.device) - starts[flat_e[by_expert]]
    keep = torch.empty(n, dtype=torch.bool, device=experts.device)
    keep[by_expert] = rank < capacity
    return keep.view(experts.shape)


def _group_mask(select: Tensor, groups: int, top_groups: int) -> Tensor:
    """(T, E) bool: the experts of each token's ``top_groups`` best groups (DeepSeek-V3's group-limited
    routing: a group's score is the sum of its two best selection scores; ties to the lower group id)."""
    t, e = select.shape
    per = select.view(t, groups, e // groups)
    group_scores = topk_lower_id(per.reshape(t * groups, -1), min(2, e // groups))[0].sum(-1).view(t, groups)
    _, best = topk_lower_id(group_scores, top_groups)
    keep = torch.zeros(t, groups, dtype=torch.bool, device=select.device).scatter_(1, best, True)
    return keep[:, :, None].expand(t, groups, e // groups).reshape(t, e)


def route(logits: Tensor, top_k: int, *, score: str = "softmax", normalize: bool = True, bias: Tensor | None = None,
          capacity_factor: float | None = None, groups: int | None = None, top_groups: int | None = None,
          scale: float = 1.0, score_dtype: torch.dtype = torch.float32) -> Routing:
    """Choose ``top_k`` experts per token from router logits.

    Args:
        logits: (T, E) router logits, any float dtype (cast to ``score_dtype`` first, as transformers does).
        top_k: experts per token, 1 <= top_k <= E.
        score: "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3).
        normalize: divide the k chosen scores by their sum (Mixtral: always; Qwen-MoE: ``norm_topk_prob``;
            DeepSeek-V3: ``norm_topk_prob``).
        bias: (E,) aux-loss-free balancing bias (DeepSeek-V3), added to the scores for the SELECTION
            only; the weights stay the unbiased scores. No gradient flows into it.
        capacity_factor: None = dropless; else each expert keeps at most
            ceil(capacity_factor · T · k / E) assignments of this call, those with the highest unbiased
            score (ties: the earlier token); the others get weight 0 and ``dropped`` True. The weights
            are normalised before dropping (a dropped slot's share is lost, as in Switch/GShard).
        groups, top_groups: DeepSeek-V3's group-limited routing (``n_group``, ``topk_group``): the E experts
            form ``groups`` equal groups, a group scores the sum of its two best selection scores, and a
            token chooses its k experts among its ``top_groups`` best groups only. None: no groups.
        scale: multiplies the weights after normalisation (DeepSeek-V3's ``routed_scaling_factor``).
        score_dtype: float32 (transformers' choice, the default) or float64 (an exact oracle).

    Returns:
        :class:`Routing`. Gradients flow from weights and scores into logits.
    """
    _check_logits(logits)
    t, e = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k ({top_k!r}) must be an int with 1 <= top_k <= num_experts ({e})")
    if score not in SCORES:
        raise ValueError(f"score ({score!r}) must be one of {SCORES}")
    if score_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"score_dtype ({score_dtype}) must be torch.float32 or torch.float64")
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (e,) or not bias.dtype.is_floating_point:
            raise ValueError(f"bias must be a float tensor of shape (num_experts,) = ({e},), got "
                             f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                            and not isinstance(capacity_factor, bool)
                                            and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor ({capacity_factor!r}) must be None (dropless) or a finite number > 0")
    if (groups is None) != (top_groups is None):
        raise ValueError(f"groups ({groups!r}) and top_groups ({top_groups!r}) go together: give both or neither")
    if groups is not None:
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or e % groups:
            raise ValueError(f"groups ({groups!r}) must be an int >= 1 dividing num_experts ({e})")
        if isinstance(top_groups, bool) or not isinstance(top_groups, int) or not 1 <= top_groups <= groups:
            raise ValueError(f"top_groups ({top_groups!r}) must be an int with 1 <= top_groups <= groups ({groups})")
        if top_k > top_groups * (e // groups):
            raise ValueError(f"top_k ({top_k}) must be <= top_groups · experts per group = "
                             f"{top_groups} · {e // groups}: the chosen groups hold too few experts")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale ({scale!r}) must be a finite number > 0")
    z = logits.to(score_dtype)
    scores = torch.softmax(z, dim=-1) if score == "softmax" else torch.sigmoid(z)
    select = scores.detach() if bias is None else scores.detach() + bias.detach().to(device=z.device, dtype=score_dtype)
    if groups is not None:
        select = select.masked_fill(~_group_mask(select, groups, top_groups), float("-inf"))
    _, experts = topk_lower_id(select, top_k)
    weights = scores.gather(1, experts)
    if normalize:  # DeepSeek-V3 guards its sigmoid sum with 1e-20; transformers' softmax routers divide plainly
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
    if scale != 1.0:
        weights = weights * scale
    dropped = capacity = None
    if capacity_factor is not None:
        capacity = capacity_of(capacity_factor, t, top_k, e)
        dropped = ~capacity_keep(experts, scores.detach().gather(1, experts), capacity, e)
        weights = weights.masked_fill(dropped, 0.0)
    return Routing(weights=weights, experts=experts, scores=scores, logits=z, dropped=dropped, capacity=capacity)


# ---- auxiliary losses ----

def _sum_over(t: Tensor, group) -> Tensor:
    """``t`` summed over ``group`` without gradient; ``group`` None: this rank's own (not the default world
    group, which control's helpers would take None for)."""
    return t if group is None else control.all_reduce_(t, group=group)


def _token_weights(token_mask: Tensor | None, t: int, like: Tensor) -> Tensor:
    if token_mask is None:
        return torch.ones(t, dtype=like.dtype, device=like.device)
    if not isinstance(token_mask, Tensor) or token_mask.shape != (t,):
        raise ValueError(f"token_mask must be a tensor of shape (tokens,) = ({t},), got "
                         f"{tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__}")
    return token_mask.to(device=like.device, dtype=like.dtype).detach()


def load_balancing_loss(scores: Tensor, experts: Tensor, num_experts: int, *, token_mask: Tensor | None = None,
                        group=None, per_sequence: Tensor | None = None) -> Tensor:
    """Switch-style load-balancing loss E · Σ_e f_e · P_e, this rank's share.

    As transformers' ``load_balancing_loss_func`` (one layer): f_e = (top-k assignments to expert e) /
    tokens (so Σ f_e = k), P_e = mean score of expert e; a uniform router scores k. Tokens are those of
    every rank of ``group`` (None: this rank only). f_e and the token counts are all-reduced without
    gradient; P_e's sum over this rank's tokens is divided by the global token count, so the shares
    summed over ``group`` are the global loss and its gradient.

    Scores are normalised per token (s / Σ_e s) before P is taken: a no-op for softmax scores, and
    DeepSeek-V3's normalisation for sigmoid ones.

    Args:
        scores: (T, E) router scores (``Routing.scores``), gradient flows into them.
        experts: (T, k) int64 chosen experts (``Routing.experts``); entries < 0 are not counted.
        num_experts: E.
        token_mask: (T,) bool or 0/1, tokens that count (padding out), like transformers' attention_mask.
        group: process group whose tokens make the global loss (the data-parallel × context-parallel group).
        per_sequence: (T,) int64 sequence id of each token: the sequence-level variant (DeepSeek-V2/V3's
            sequence-wise balance loss): the same loss over each sequence's tokens, averaged over the
            sequences that have a counted token. Ids name sequences across ``group`` (a sequence split
            over context-parallel ranks carries one id on each; give data-parallel ranks disjoint ids).
            Costs one host read (the number of sequences).

    Returns:
        0-d float tensor (dtype of scores).
    """
    if not isinstance(scores, Tensor) or scores.dim() != 2 or not scores.dtype.is_floating_point:
        raise ValueError(f"scores must be a 2-D float tensor (tokens, experts), got "
                         f"{tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    t = scores.shape[0]
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts != scores.shape[1]:
        raise ValueError(f"num_experts ({num_experts!r}) must equal scores.shape[1] ({scores.shape[1]})")
    if not isinstance(experts, Tensor) or experts.dim() != 2 or experts.shape[0] != t or experts.dtype.is_floating_point:
        raise ValueError(f"experts must be an integer tensor of shape (tokens, k) with tokens = {t}, got "
                         f"{tuple(experts.shape) if isinstance(experts, Tensor) else type(experts).__name__}")
    e = num_experts
    m = _token_weights(token_mask, t, scores)
    probs = scores / scores.sum(dim=-1, keepdim=True)
    valid = experts >= 0
    hits = torch.zeros(t, e, dtype=scores.dtype, device=scores.device).scatter_add_(
        1, experts.clamp_min(0).to(scores.device), valid.to(scores.dtype).to(scores.device)) * m[:, None]
    if per_sequence is None:
        stats = _sum_over(torch.cat([hits.sum(0), m.sum().reshape(1)]).detach(), group=group)
        f, n = stats[:e], stats[e].clamp_min(1.0)
        return e * torch.sum(f / n * (probs * m[:, None]).sum(0) / n)
    if not isinstance(per_sequence, Tensor) or per_sequence.shape != (t,) or per_sequence.dtype.is_floating_point:
        raise ValueError(f"per_sequence must be an integer tensor of shape (tokens,) = ({t},), got "
                         f"{tuple(per_sequence.shape) if isinstance(per_sequence, Tensor) else type(per_sequence).__name__}")
    seq = per_sequence.to(scores.device)
    local = [int(seq.max()) + 1 if t else 0, -int(seq.min()) if t else 0]
    if group is not None:
        local = control.all_reduce_values(local, op="max", group=group)
    num_seq, neg = (int(v) for v in local)
    if neg > 0:
        raise ValueError(f"per_sequence ids must be >= 0, got {-neg}")
    s = max(num_seq, 1)
    f_s = torch.zeros(s, e, dtype=scores.dtype, device=scores.device).index_add_(0, seq, hits)
    n_s = torch.zeros(s, dtype=scores.dtype, device=scores.device).index_add_(0, seq, m)
    stats = _sum_over(torch.cat([f_s, n_s[:, None]], dim=1).detach(), group=group)
    f_s, n_s = stats[:, :e], stats[:, e]
    sequences = (n_s > 0).sum().clamp_min(1)
    p_s = torch.zeros(s, e, dtype=scores.dtype, device=scores.device).index_add(0, seq, probs * m[:, None])
    n_s = n_s.clamp_min(1.0)[:, None]
    return e * torch.sum(f_s / n_s * p_s / n_s) / sequences


def z_loss(logits: Tensor, *, token_mask: Tensor | None = None, group=None) -> Tensor:
    """Router z-loss (ST-MoE): mean over the tokens of every rank of ``group`` of logsumexp(logits)²,
    this rank's share (the token count is all-reduced; the shares sum to the global loss).

    logits: (T, E) (``Routing.logits``); token_mask: (T,) bool or 0/1. Returns a 0-d tensor."""
    _check_logits(logits)
    m = _token_weights(token_mask, logits.shape[0], logits)
    n = _sum_over(m.sum().reshape(1).detach(), group=group)[0].clamp_min(1.0)
    return torch.sum(torch.logsumexp(logits, dim=-1).square() * m) / n


@torch.no_grad()
def update_balance_bias(bias: Tensor, counts: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's aux-loss-free balancing, in place: b_e += rate · sign(mean(counts) − counts_e)
    (an overloaded expert's bias falls, an idle one's rises). ``counts``: (E,) tokens each expert got
    this step (all-reduce them over the data-parallel group first so every replica moves the same way).
    Returns ``bias``."""
    if not isinstance(bias, Tensor) or bias.dim() != 1 or not bias.dtype.is_floating_point:
        raise ValueError(f"bias must be a 1-D float tensor (num_experts,), got "
                         f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    if not isinstance(counts, Tensor) or counts.shape != bias.shape:
        raise ValueError(f"counts must be a tensor of bias's shape {tuple(bias.shape)}, got "
                         f"{tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__}")
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate ({rate!r}) must be a finite number >= 0")
    c = counts.to(device=bias.device, dtype=torch.float64)
    bias.add_(torch.sign(c.mean() - c).to(bias.dtype), alpha=rate)
    return bias


__all__ = ["Routing", "capacity_keep", "capacity_of", "load_balancing_loss", "route", "topk_lower_id",
           "update_balance_bias", "z_loss"]
