"""Preference losses over sequence log-probabilities (DPO and its relatives), as TRL defines them.

The pieces, in the order a DPO step uses them (docs/training.md, "Preference losses"):

    token_lp = -linear_cross_entropy(h, w, target, tp_group=tp, reduction="none")   # (rows, seq), no logits
    logps    = sequence_logps(token_lp, loss_mask, doc_index, num_docs)             # (num_docs,) this share's sums
    counts   = sequence_token_counts(loss_mask, doc_index, num_docs)
    logps    = all_reduce_sequence_sums(logps, cp_group)                            # whole sequences (CP)
    losses, metrics = preference_loss(logps[c], logps[r], ref[c], ref[r], beta=0.1, loss_type="sigmoid")
    loss     = losses.mean() + sft_weight * sft_loss(logps[c], counts[c].sum())

How the parallel dimensions reduce:
- TP: nothing to do here. The vocabulary-parallel cross-entropy all-reduces its per-token
  statistics over the TP group, so every TP rank holds the same per-token log-probs (and its
  backward sums the hidden state's gradient over the vocabulary shards).
- CP: each rank holds a share of every sequence; ``sequence_logps`` of a share is a partial sum.
  ``all_reduce_sequence_sums`` adds the shares (all-reduce forward, identity backward). The loss
  after it is then the same on every CP rank; the gradient each rank gets for its own tokens is
  dL/dlogp_t, exactly the unsharded one (an all-reduce in backward would multiply it by the CP
  size). A gradient sync that *averages* over the CP group (the package's does, over DP×CP) must
  therefore be fed cp_size × that loss, as ``ParallelTransformer.step`` scales its token sums.
- DP and micro-batches: the loss is a mean over pairs (and, for the SFT term, over chosen tokens)
  of the whole step; a micro-batch contributes its sums divided by the step's global counts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tpkernels.parallel.mappings import reduce_from_tensor_parallel

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCE_FREE = frozenset({"simpo"})  # the loss types that use no reference model
METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
DEFAULT_SIMPO_GAMMA = 0.5  # TRL's CPOConfig.simpo_gamma


def _check_packed(token_logps: Tensor | None, loss_mask: Tensor, doc_index: Tensor, num_docs: int) -> None:
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs ({num_docs!r}) must be an integer >= 0")
    if token_logps is not None:
        if not isinstance(token_logps, Tensor) or not token_logps.is_floating_point():
            raise ValueError("token_logps must be a floating-point tensor")
        if tuple(token_logps.shape) != tuple(loss_mask.shape):
            raise ValueError(f"token_logps shape {tuple(token_logps.shape)} must equal loss_mask shape "
                             f"{tuple(loss_mask.shape)}")
    if tuple(doc_index.shape) != tuple(loss_mask.shape):
        raise ValueError(f"doc_index shape {tuple(doc_index.shape)} must equal loss_mask shape {tuple(loss_mask.shape)}")
    if loss_mask.is_floating_point() or loss_mask.is_complex():
        raise ValueError(f"loss_mask dtype ({loss_mask.dtype}) must be bool or an integer type")
    if doc_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"doc_index dtype ({doc_index.dtype}) must be int64 (or int32)")
    bad = (doc_index < -1) | (doc_index >= num_docs)
    if bool(bad.any()):  # one host read of the device's verdict
        raise ValueError(f"doc_index ({int(doc_index[bad][0])}) must be in [0, num_docs ({num_docs})) or -1 "
                         "(a token of no document)")


def _selected(loss_mask: Tensor, doc_index: Tensor) -> Tensor:
    return (loss_mask != 0) & (doc_index >= 0)


def sequence_logps(token_logps: Tensor, loss_mask: Tensor, doc_index: Tensor, num_docs: int, *,
                   check: bool = True) -> Tensor:
    """Per document, the sum of the per-token log-probs over its supervised tokens.

    token_logps: (rows, seq) floating, log p(target) of each position (e.g. ``-linear_cross_entropy(...,
    reduction="none")``); loss_mask: (rows, seq) bool or integer, nonzero where the position's target
    is supervised (a completion token); doc_index: (rows, seq) int64, the document each position
    belongs to, in [0, num_docs), or -1 (padding, no document). Positions outside the mask or with
    doc_index -1 add nothing (and get a zero gradient, whatever token_logps holds there).

    Returns (num_docs,) in token_logps' dtype; a document without a supervised token sums to 0.
    Differentiable with respect to token_logps. Under CP this is the share's partial sum: see
    :func:`all_reduce_sequence_sums`. ``check=False`` skips the range check of doc_index (one host read).
    Sums with ``index_add``: on CUDA the order of the additions (atomics) may vary between runs.
    """
    for name, t in (("loss_mask", loss_mask), ("doc_index", doc_index)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if check:
        _check_packed(token_logps, loss_mask, doc_index, num_docs)
    sel = _selected(loss_mask, doc_index)
    values = torch.where(sel, token_logps, torch.zeros((), dtype=token_logps.dtype, device=token_logps.device))
    index = torch.where(sel, doc_index.long(), torch.zeros((), dtype=torch.long, device=doc_index.device))
    out = token_logps.new_zeros(num_docs)
    return out.index_add(0, index.reshape(-1), values.reshape(-1))


def sequence_token_counts(loss_mask: Tensor, doc_index: Tensor, num_docs: int, *, check: bool = True) -> Tensor:
    """Per document, the number of supervised tokens: (num_docs,) int64 (a CP share's counts, like
    :func:`sequence_logps`; sum them over the CP group, or take them from the data layer)."""
    if check:
        _check_packed(None, loss_mask, doc_index, num_docs)
    sel = _selected(loss_mask, doc_index)
    index = torch.where(sel, doc_index.long(), torch.zeros((), dtype=torch.long, device=doc_index.device))
    return torch.zeros(num_docs, dtype=torch.int64, device=loss_mask.device).index_add(
        0, index.reshape(-1), sel.reshape(-1).long())


def all_reduce_sequence_sums(partial: Tensor, cp_group=None) -> Tensor:
    """The sum of ``partial`` over the ranks of ``cp_group`` (context parallelism: each rank's share
    of the sequences), differentiable: all-reduce forward, identity backward.

    Why identity: with S = Σ_r s_r and a loss L(S) computed alike on every rank, the gradient of L
    with respect to rank r's own tokens is dL/dS · ds_r/dtoken, so s_r's gradient is dL/dS as it
    stands; summing the (equal) upstream gradients over the ranks would count it cp_size times.
    Stack several per-document sums (log-probs, and counts as floats) into one tensor to reduce
    them in one collective. ``cp_group`` None is the default group (all ranks) under
torch.distributed, one rank outside it; a group of one rank returns ``partial`` itself.
    Sums are taken in fp32 for 16-bit inputs (``tpkernels.dtypes``).
    """
    return reduce_from_tensor_parallel(partial, cp_group)


def _check_pairs(named: dict[str, Tensor | None]) -> int:
    shape = None
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{type(t).__name__ if not isinstance(t, Tensor) else t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one value per pair), got shape {tuple(t.shape)}")
        if shape is None:
            shape = t.shape
        elif t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from the other inputs' {tuple(shape)}")
    return shape[0] if shape is not None else 0


def _lengths(name: str, t, like: Tensor, loss_type: str) -> Tensor:
    if t is None:
        raise ValueError(f"loss_type {loss_type!r} normalises by the completion length: pass {name} "
                         "(the supervised-token count of each sequence)")
    t = torch.as_tensor(t, device=like.device)
    if t.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must equal the log-probs' {tuple(like.shape)}")
    return t.to(like.dtype).clamp(min=1.0)  # TRL: .clamp(min=1) (an empty completion divides by 1)


def _conservative_sigmoid(logits: Tensor, beta: float, eps: float) -> Tensor:
    """-(1-ε)·log σ(β·x) - ε·log σ(-β·x): DPO's loss with the labels flipped with probability ε (cDPO)."""
    loss = -F.logsigmoid(beta * logits)
    if eps:
        loss = (1.0 - eps) * loss - eps * F.logsigmoid(-beta * logits)
    return loss


def preference_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor | None = None,
                    ref_rejected: Tensor | None = None, *, beta: float, loss_type: str = "sigmoid",
                    label_smoothing: float = 0.0, chosen_lengths: Tensor | None = None,
                    rejected_lengths: Tensor | None = None,
                    simpo_gamma: float = DEFAULT_SIMPO_GAMMA) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference losses and TRL's metrics from sequence log-probs.

    policy_chosen, policy_rejected, ref_chosen, ref_rejected: (pairs,) sums of the completion tokens'
    log-probs (:func:`sequence_logps`); the reference ones are unused (may be None) for ``simpo``.
    chosen_lengths, rejected_lengths: (pairs,) supervised-token counts, needed by ``ipo`` and ``simpo``.

    With Δ = (πc − refc) − (πr − refr) (the DPO log-ratio margin), ε = label_smoothing:
      sigmoid  −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)       DPO; ε > 0 is conservative DPO (cDPO)
      ipo      ((πc−refc)/nc − (πr−refr)/nr − 1/(2β))²   IPO, per-token averaged as TRL does
      hinge    max(0, 1 − βΔ)                         SLiC
      simpo    −(1−ε)·log σ(β·(πc/nc − πr/nr) − γ) − ε·log σ(−(β·(πc/nc − πr/nr) − γ))   reference-free
    (nc, nr: the lengths clamped to ≥ 1; γ = simpo_gamma.) ipo and hinge take no label smoothing
    (an error, where TRL's CPO only warns).

    Returns (losses (pairs,), metrics): metrics maps TRL's names to per-pair detached tensors, whose
    mean over the step's pairs is what TRL logs:
      rewards/chosen = β·(πc − refc), rewards/rejected = β·(πr − refr) (simpo: β·πc/nc, β·πr/nr),
      rewards/accuracies = 1.0 where rewards/chosen > rewards/rejected, rewards/margins = their difference,
      logps/chosen = πc, logps/rejected = πr (simpo: the per-token averages, as TRL's CPO logs them).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type ({loss_type!r}) must be one of {', '.join(LOSS_TYPES)}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"beta ({beta!r}) must be a finite number > 0")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing ({label_smoothing!r}) must be in [0, 0.5) (the probability that a "
                         "preference label is flipped)")
    if label_smoothing and loss_type in ("ipo", "hinge"):
        raise ValueError(f"loss_type {loss_type!r} takes no label_smoothing (got {label_smoothing}); it applies "
                         "to 'sigmoid' and 'simpo'")
    if isinstance(simpo_gamma, bool) or not isinstance(simpo_gamma, (int, float)) or not math.isfinite(simpo_gamma):
        raise ValueError(f"simpo_gamma ({simpo_gamma!r}) must be a finite number")
    free = loss_type in REFERENCE_FREE
    if not free and (ref_chosen is None or ref_rejected is None):
        raise ValueError(f"loss_type {loss_type!r} needs the reference log-probs (ref_chosen and ref_rejected)")
    _check_pairs({"policy_chosen": policy_chosen, "policy_rejected": policy_rejected,
                  **({} if free else {"ref_chosen": ref_chosen, "ref_rejected": ref_rejected})})
    beta, eps = float(beta), float(label_smoothing)

    if free:
        nc = _lengths("chosen_lengths", chosen_lengths, policy_chosen, loss_type)
        nr = _lengths("rejected_lengths", rejected_lengths, policy_rejected, loss_type)
        chosen_score, rejected_score = policy_chosen / nc, policy_rejected / nr
        losses = _conservative_sigmoid(chosen_score - rejected_score - simpo_gamma / beta, beta, eps)
        logged_chosen, logged_rejected = chosen_score, rejected_score
    else:
        chosen_score = policy_chosen - ref_chosen.to(policy_chosen.dtype)
        rejected_score = policy_rejected - ref_rejected.to(policy_rejected.dtype)
        delta = chosen_score - rejected_score
        if loss_type == "sigmoid":
            losses = _conservative_sigmoid(delta, beta, eps)
        elif loss_type == "hinge":
            losses = torch.relu(1.0 - beta * delta)
        else:  # ipo
            nc = _lengths("chosen_lengths", chosen_lengths, policy_chosen, loss_type)
            nr = _lengths("rejected_lengths", rejected_lengths, policy_rejected, loss_type)
            losses = (chosen_score / nc - rejected_score / nr - 1.0 / (2.0 * beta)) ** 2
        logged_chosen, logged_rejected = policy_chosen, policy_rejected

    chosen_rewards, rejected_rewards = beta * chosen_score.detach(), beta * rejected_score.detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": logged_chosen.detach(),
        "logps/rejected": logged_rejected.detach(),
    }
    return losses, metrics


def sft_loss(chosen_logps: Tensor, num_tokens) -> Tensor:
    """The RPO / SFT term: the chosen completions' NLL, a mean over tokens: −Σ chosen_logps / num_tokens.

    num_tokens: the count of supervised chosen tokens the mean runs over (a number or a tensor; at
    least 1 is used). For a whole batch this is TRL's ``loss_type=["sigmoid", "sft"]`` term (and the
    former ``rpo_alpha`` one): the mean NLL over every chosen completion token of the batch, not a
    mean of per-sequence means. Over micro-batches and DP replicas pass the step's global count, so
    that the contributions add up to the step's token mean. The objective is
    ``losses.mean() + sft_weight · sft_loss(...)``.
    """
    if not isinstance(chosen_logps, Tensor) or not chosen_logps.is_floating_point():
        raise ValueError("chosen_logps must be a floating-point tensor")
    n = torch.as_tensor(num_tokens, device=chosen_logps.device).to(chosen_logps.dtype).clamp(min=1.0)
    return -chosen_logps.sum() / n


__all__ = ["DEFAULT_SIMPO_GAMMA", "LOSS_TYPES", "METRIC_NAMES", "REFERENCE_FREE", "all_reduce_sequence_sums",
           "preference_loss", "sequence_logps", "sequence_token_counts", "sft_loss"]
