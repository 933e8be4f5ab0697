"""The DPO-family objective on the last pipeline stage, as a ``PipelineRuntime`` loss function.

    objective = PreferenceObjective(model.head, model.state, beta=0.1, loss_type="sigmoid")
    runtime = model.pipeline("1f1b", m, loss_fn=objective)
    objective.begin_step(num_pairs, chosen_tokens, reference)      # reference: (num_pairs, 2) or None
    loss = model.step(ids, {"target": target, "doc": doc}, pos, runtime=runtime, num_targets=num_pairs)

A step's preference pairs are numbered 0 … num_pairs − 1 over the global batch; both sequences of a
pair lie in one row (one micro-batch, one DP replica). Per micro-batch, the targets (rows, seq) keep
only the completion tokens (``ignore_index`` elsewhere) and ``doc`` (rows, seq) names each position's
sequence, ``2·pair`` for the chosen and ``2·pair + 1`` for the rejected one (−1: filler). The
objective takes per-token log-probs from the head (vocabulary-parallel, no logits), sums them per
sequence, adds the CP shares (each CP rank then holds whole sequences' sums: the loss is replicated
over CP, see :func:`~tpkernels.functional.preference.all_reduce_sequence_sums`), and returns the
micro-batch's sum of pair losses (+ the SFT term scaled to the same denominator):

    Σ_pairs here loss_p + sft_weight · num_pairs · (−Σ chosen log-probs here) / chosen_tokens

so that ``ParallelTransformer.step``, which divides by ``num_targets`` (= num_pairs) and averages
over the DP × CP replicas, yields ``mean_p loss_p + sft_weight · (chosen tokens' mean NLL)`` over the
whole step at any layout. The pairs of other micro-batches / replicas are in the tables at zero
weight (a pair is here when both its sequences have a token here), so no host sync picks them out.

``SequenceLogps`` is the same machinery without a loss: a forward-only pass that records each pair's
(chosen, rejected) log-probs, for the reference model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.preference import (DEFAULT_SIMPO_GAMMA, LOSS_TYPES, METRIC_NAMES, REFERENCE_FREE,
                                             all_reduce_sequence_sums, preference_loss, sequence_logps,
                                             sequence_token_counts)



def _sequence_sums(head, state, y: Tensor, t: dict, num_docs: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs, supervised-token counts, tokens) per sequence, (num_docs,) each, whole sequences
    (summed over the CP group); log-probs differentiable."""
    target, doc = t["target"], t["doc"]
    lp = head.token_logps(y, target)
    supervised = target != IGNORE_INDEX
    sums = sequence_logps(lp, supervised, doc, num_docs, check=False)
    counts = sequence_token_counts(supervised, doc, num_docs, check=False).to(lp.dtype)
    present = sequence_token_counts(torch.ones_like(supervised), doc, num_docs, check=False).to(lp.dtype)
    stacked = torch.stack([sums, counts, present])
    if state.cp_size > 1:
        stacked = all_reduce_sequence_sums(stacked, state.cp_group)
    return stacked[0], stacked[1], stacked[2]


class PreferenceObjective:
    """``loss_fn(y, target)`` of the last stage for ``training.task dpo`` (see the module docstring).
    ``metric_sums()`` holds the step's sums of TRL's metrics over the pairs this rank saw (and their
    count), detached, for the trainer to reduce on logging steps."""

    replicated_over_cp = True  # after the CP sum every CP rank computes the same loss: report it once

    def __init__(self, head, state, *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 sft_weight: float = 0.0, simpo_gamma: float = DEFAULT_SIMPO_GAMMA):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"dpo.loss_type ({loss_type!r}) must be one of {', '.join(LOSS_TYPES)}")
        if not sft_weight >= 0:
            raise ValueError(f"dpo.sft_weight ({sft_weight}) must be >= 0")
        self.head, self.state = head, state
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.sft_weight, self.simpo_gamma = sft_weight, simpo_gamma
        self.num_pairs, self.chosen_tokens, self.reference = 0, 0, None
        self._metrics: Tensor | None = None

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def begin_step(self, num_pairs: int, chosen_tokens: int, reference: Tensor | None) -> None:
        """This step's global pair count, supervised chosen tokens (the SFT term's denominator) and the
        reference log-probs (num_pairs, 2) [chosen, rejected] (None for reference-free losses; rows of
        pairs this rank never sees may hold anything finite)."""
        if self.needs_reference and (reference is None or tuple(reference.shape) != (num_pairs, 2)):
            got = None if reference is None else tuple(reference.shape)
            raise ValueError(f"dpo.loss_type {self.loss_type!r} needs the reference log-probs of the step's "
                             f"{num_pairs} pairs as a ({num_pairs}, 2) tensor, got {got}")
        self.num_pairs, self.chosen_tokens, self.reference = num_pairs, chosen_tokens, reference
        self._metrics = None

    def __call__(self, y: Tensor, t: dict) -> Tensor:
        n = self.num_pairs
        sums, counts, present = _sequence_sums(self.head, self.state, y, t, 2 * n)
        pc, pr, nc, nr = sums[0::2], sums[1::2], counts[0::2], counts[1::2]
        here = ((present[0::2] > 0) & (present[1::2] > 0)).to(sums.dtype)
        ref = None if self.reference is None else self.reference.to(device=sums.device)
        losses, metrics = preference_loss(pc, pr, None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
                                          beta=self.beta, loss_type=self.loss_type,
                                          label_smoothing=self.label_smoothing, chosen_lengths=nc,
                                          rejected_lengths=nr, simpo_gamma=self.simpo_gamma)
        total = (losses * here).sum()
        if self.sft_weight:
            total = total + self.sft_weight * n * -(pc * here).sum() / max(self.chosen_tokens, 1)
        sums_here = torch.stack([(metrics[k] * here).sum() for k in METRIC_NAMES] + [here.sum()]).detach()
        self._metrics = sums_here if self._metrics is None else self._metrics + sums_here
        return total

    def metric_sums(self) -> Tensor | None:
        """(len(METRIC_NAMES) + 1,): the metrics summed over the pairs seen this step, then their count."""
        return self._metrics


class SequenceLogps:
    """``loss_fn`` of a forward-only pass that records each pair's (chosen, rejected) log-probs:
    ``begin(num_pairs)``, run the pass, then ``result()`` (num_pairs, 2) on the last stage (zeros for
    pairs of other replicas)."""

    replicated_over_cp = True

    def __init__(self, head, state):
        self.head, self.state = head, state
        self.num_pairs, self._acc = 0, None

    def begin(self, num_pairs: int) -> None:
        self.num_pairs, self._acc = num_pairs, None

    def __call__(self, y: Tensor, t: dict) -> Tensor:
        with torch.no_grad():
            sums = _sequence_sums(self.head, self.state, y, t, 2 * self.num_pairs)[0].double()
        self._acc = sums if self._acc is None else self._acc + sums
        return sums.new_zeros(())

    def result(self) -> Tensor:
        if self._acc is None:
            return torch.zeros(self.num_pairs, 2, dtype=torch.float64)
        return self._acc.view(self.num_pairs, 2).cpu()


__all__ = ["PreferenceObjective", "SequenceLogps"]
