"""Input embedding: vocabulary-parallel token table (+ GPT-2's learned positions).

The token table has ``mc.padded_vocab(tp)`` rows split over TP (rows past ``vocab_size`` are zero
padding, never looked up). Under SP the output is this rank's slice of the sequence (the
reduce-scatter of the vocabulary-parallel lookup), and each rank adds the position rows of its
own slice.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.models.context import LayerContext, replicated
from tpkernels.models.hf_checkpoint import Part
from tpkernels.nn.vocab_parallel import VocabParallelEmbedding
from tpkernels.parallel.param_tags import retag


def vocab_rows(ctx: LayerContext, role: str, tp_rank: int, tp_size: int | None = None) -> list[Part]:
    """Rank ``tp_rank``'s rows of a padded (vocab, hidden) table stored as HF tensor ``role`` (at TP size
    ``tp_size``, default the model's)."""
    mc, tp = ctx.mc, tp_size or ctx.tp_size
    per = mc.padded_vocab(tp) // tp
    lo, hi = tp_rank * per, (tp_rank + 1) * per
    real = max(0, min(hi, mc.vocab_size) - lo)
    parts = [Part(ctx.hf(role), rows=(lo, lo + real))] if real else []
    if real < per:
        parts.append(Part(None, zero_shape=(per - real, mc.hidden_size)))
    return parts


class Embedding(nn.Module):
    """forward(input_ids (batch, seq) int, position_ids (batch, seq) or None) -> (batch, seq[/TP], hidden)."""

    def __init__(self, ctx: LayerContext):
        super().__init__()
        mc = ctx.mc
        self.ctx = ctx
        # the ids were checked once for the step, on the host (ParallelTransformer): no check per micro-batch
        self.tokens = VocabParallelEmbedding(mc.padded_vocab(ctx.tp_size), mc.hidden_size, ctx.tp_group,
                                             sequence_parallel=ctx.sequence_parallel, sequence_dim=1,
                                             check_ids=False, **ctx.factory())
        if mc.tied_embeddings:  # summed with the head's copy (another stage)
            retag(self.tokens.weight, tied="embedding")
        self.positions = None
        if mc.positions == "learned":
            self.positions = nn.Embedding(mc.max_position_embeddings, mc.hidden_size, **ctx.factory())
            replicated(self.positions.weight, ctx)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids)
        if self.positions is not None:
            if self.ctx.sequence_parallel and self.ctx.tp_size > 1:
                per = position_ids.shape[1] // self.ctx.tp_size
                position_ids = position_ids[:, self.ctx.tp_rank * per:(self.ctx.tp_rank + 1) * per]
            x = x + self.positions(position_ids)
        return x

    def hf_parts(self, tp_rank: int, tp_size: int | None = None) -> dict[str, list[Part]]:
        parts = {"tokens.weight": vocab_rows(self.ctx, "embed", tp_rank, tp_size)}
        if self.positions is not None:
            parts["positions.weight"] = [Part(self.ctx.hf("positions"))]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        mc = self.ctx.mc
        shapes = {self.ctx.hf("embed"): (mc.vocab_size, mc.hidden_size)}
        if self.positions is not None:
            shapes[self.ctx.hf("positions")] = (mc.max_position_embeddings, mc.hidden_size)
        return shapes
