"""Final norm, LM head and loss (the last pipeline stage).

The loss never forms the logits: :func:`tpkernels.linear_cross_entropy` over the vocabulary-
parallel head weight, padding rows left out (``vocab_size``). Under SP the normed hidden state
is all-gathered along the sequence first; the loss then leaves its input gradient partial (each
vocabulary shard's share) and the gather's backward reduce-scatters it: one reduce-scatter, as
Megatron's column-parallel head does, not an all-reduce and a split. ``logits`` (evaluation, parity checks)
does form them: (batch, seq, vocab), gathered over TP, padding cut off.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.linear_cross_entropy import linear_cross_entropy
from tpkernels.models.context import LayerContext
from tpkernels.models.embedding import vocab_rows
from tpkernels.models.hf_checkpoint import Part
from tpkernels.models.norm import ResidualNorm
from tpkernels.parallel import control
from tpkernels.parallel.param_tags import tag
from tpkernels.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
)


class LMHead(nn.Module):
    """forward(delta, residual) -> normed hidden (batch, seq[/TP], hidden); loss(y, target) -> scalar.

    weight: (padded_vocab / TP, hidden). ``tied_weight``: the embedding table of the same chunk
    (tied embeddings, one pipeline stage); on another stage a tied head keeps its own copy
    (tagged ``tied="copy"``: summed with the embedding over the embedding group, not counted twice)."""

    def __init__(self, ctx: LayerContext, tied_weight: nn.Parameter | None = None):
        super().__init__()
        mc = ctx.mc
        self.ctx = ctx
        self.norm = ResidualNorm(ctx, "final_norm")
        self.shares_embedding = tied_weight is not None
        if tied_weight is not None:
            self.weight = tied_weight
        else:
            self.weight = tag(nn.Parameter(torch.zeros(mc.padded_vocab(ctx.tp_size) // ctx.tp_size, mc.hidden_size,
                                                       **ctx.factory())), split_dim=0,
                              tied="copy" if mc.tied_embeddings else None)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(delta, residual)[0]

    @property
    def _sp(self) -> bool:
        return self.ctx.sequence_parallel and self.ctx.tp_size > 1

    def loss(self, y: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX,
             reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy over the tokens whose target is not ``ignore_index``; target (batch, seq).
        ``reduction="sum"``: the sum of the token losses (a training step divides the sum over all its
        micro-batches and replicas by their count of targets: ``ParallelTransformer.step``).
        ``"mean"``: the token mean of this call; under CP (this rank holds a share of each sequence)
        the share's token sum over the mean count per CP rank, so that the average over the CP group
        is the exact mean over the whole sequences, whatever each share holds."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction ({reduction!r}) must be 'mean' or 'sum'")
        if self._sp:
            y = gather_from_sequence_parallel(y, self.ctx.tp_group, dim=1, reduce_grad=True)
        cp = self.ctx.cp_size
        loss = linear_cross_entropy(y, self.weight, target, tp_group=self.ctx.tp_group,
                                    vocab_size=self.ctx.mc.vocab_size, ignore_index=ignore_index,
                                    reduce_input_grad=not self._sp, check_targets=False,  # checked per step
                                    reduction="sum" if cp > 1 or reduction == "sum" else "mean")
        if cp == 1 or reduction == "sum":
            return loss
        count = (target != ignore_index).sum().to(torch.float64)  # on the device: no host sync
        control.all_reduce_(count, "sum", self.ctx.cp_group)
        return loss * (cp / count.clamp(min=1)).to(loss.dtype)

    def token_logps(self, y: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """log p(target) per position, (batch, seq) fp32 (fp64 for fp64), 0 where target is
        ``ignore_index``: −cross-entropy per token, still without the logits, differentiable (the
        backward redoes the chunk loop with the upstream per-token weights). Every TP rank returns
        the same values. Under CP, this rank's share of the positions (the preference losses sum
        them per document: ``tpkernels.functional.preference``). Targets are not range-checked
        here: as for ``loss``, the model checks a step's targets once (``stage_target``)."""
        if self._sp:
            y = gather_from_sequence_parallel(y, self.ctx.tp_group, dim=1, reduce_grad=True)
        return -linear_cross_entropy(y, self.weight, target, tp_group=self.ctx.tp_group,
                                     vocab_size=self.ctx.mc.vocab_size, ignore_index=ignore_index,
                                     reduce_input_grad=not self._sp, check_targets=False, reduction="none")

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        # each vocabulary shard's logits give a partial input gradient: summed over TP in backward
        if self._sp:
            y = gather_from_sequence_parallel(y, self.ctx.tp_group, dim=1, reduce_grad=True)
        elif self.ctx.tp_size > 1:
            y = copy_to_tensor_parallel(y, self.ctx.tp_group)
        z = y @ self.weight.t()
        if self.ctx.tp_size > 1:
            z = gather_from_tensor_parallel(z, self.ctx.tp_group)
        return z[..., :self.ctx.mc.vocab_size]

    def hf_parts(self, tp_rank: int, tp_size: int | None = None) -> dict[str, list[Part]]:
        parts = {f"norm.{k}": v for k, v in self.norm.hf_parts(tp_rank, tp_size).items()}
        if not self.shares_embedding:
            parts["weight"] = vocab_rows(self.ctx, "embed" if self.ctx.mc.tied_embeddings else "head", tp_rank,
                                         tp_size)
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.norm.hf_shapes()
        if not self.shares_embedding:  # an untied head, or the tied copy on the last stage
            role = "embed" if self.ctx.mc.tied_embeddings else "head"
            shapes[self.ctx.hf(role)] = (self.ctx.mc.vocab_size, self.ctx.mc.hidden_size)
        return shapes
