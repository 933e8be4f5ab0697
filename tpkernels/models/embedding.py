"""Input embedding: vocabulary-parallel token table (+ GPT-2's learned positions).

The token table has ``mc.padded_vocab(tp)`` rows split over TP (rows past ``vocab_size`` are zero
padding, never looked up). Under SP the output is this rank's slice of the sequence (the
reduce-scatter of the vocabulary-parallel lookup), and each rank adds the position rows of its
own slice.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.models.context import LayerContext, mark_tp_partial
from tpkernels.models.hf_checkpoint import Part
from tpkernels.nn.vocab_parallel import VocabParallelEmbedding


def vocab_rows(ctx: LayerContext, role: str, tp_rank: int) -> list[Part]:
    """Rank ``tp_rank``'s rows of a padded (vocab, hidden) table stored as HF tensor ``role``."""
    mc = ctx.mc
    per = mc.padded_vocab(ctx.tp_size) // ctx.tp_size
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
        self.tokens = VocabParallelEmbedding(mc.padded_vocab(ctx.tp_size), mc.hidden_size, ctx.tp_group,
                                             sequence_parallel=ctx.sequence_parallel, sequence_dim=1,
                                             **ctx.factory())
        self.tokens.weight.tied_embedding = mc.tied_embeddings  # summed with the head's copy (other stage)
        self.positions = None
        if mc.positions == "learned":
            self.positions = nn.Embedding(mc.max_position_embeddings, mc.hidden_size, **ctx.factory())
            mark_tp_partial(self.positions.weight, ctx)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        mc = self.ctx.mc
        if bool(((input_ids < 0) | (input_ids >= mc.vocab_size)).any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= mc.vocab_size)][0]
            raise IndexError(f"input_ids ({int(bad)}) must be in [0, vocab_size ({mc.vocab_size}))")
        x = self.tokens(input_ids)
        if self.positions is not None:
            if self.ctx.sequence_parallel and self.ctx.tp_size > 1:
                per = position_ids.shape[1] // self.ctx.tp_size
                position_ids = position_ids[:, self.ctx.tp_rank * per:(self.ctx.tp_rank + 1) * per]
            x = x + self.positions(position_ids)
        return x

    def hf_parts(self, tp_rank: int) -> dict[str, list[Part]]:
        parts = {"tokens.weight": vocab_rows(self.ctx, "embed", tp_rank)}
        if self.positions is not None:
            parts["positions.weight"] = [Part(self.ctx.hf("positions"))]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        mc = self.ctx.mc
        shapes = {self.ctx.hf("embed"): (mc.vocab_size, mc.hidden_size)}
        if self.positions is not None:
            shapes[self.ctx.hf("positions")] = (mc.max_position_embeddings, mc.hidden_size)
        return shapes
