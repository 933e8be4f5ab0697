"""Vocabulary-parallel embedding: the (V, h) table split by rows over the TP group."""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.param_tags import tag
from tpkernels.parallel.mappings import (
    all_gather_dim,
    check_divisible,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding whose rows [r·V/P, (r+1)·V/P) live on TP rank r.

    Each rank looks up the ids it owns (zeros elsewhere), then the partial embeddings are summed
    over the group: an all-reduce (output replicated), or with ``sequence_parallel`` a
    reduce-scatter along ``sequence_dim`` (output = this rank's shard of the sequence, ready for a
    sequence-parallel Transformer).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, sequence_parallel: bool = False, *,
                 sequence_dim: int = 0, device=None, dtype=None, check_ids: bool = True):
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = group_rank_size(tp_group)
        check_divisible(num_embeddings, self.tp_size, "num_embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.sequence_dim, self.check_ids = sequence_parallel, sequence_dim, check_ids
        self.per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = tag(nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype)),
                          split_dim=0)
        nn.init.normal_(self.weight)  # nn.Embedding's init

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (...) int64 in [0, num_embeddings), the same on every rank of the group. Returns
        (..., embedding_dim); with SP the ``sequence_dim`` of the result holds this rank's 1/P of the
        sequence. An id out of range raises IndexError, as in ``nn.Embedding`` (one host read; none with
        ``check_ids=False``, for callers that checked the ids on the host already, as the models do)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids dtype ({ids.dtype}) must be an integer type")
        if self.check_ids:
            out_of_range = (ids < 0) | (ids >= self.num_embeddings)
            if bool(out_of_range.any()):
                raise IndexError(f"ids ({int(ids[out_of_range][0])}) must be in [0, num_embeddings "
                                 f"({self.num_embeddings}))")
        if self.sequence_parallel:
            if ids.dim() <= self.sequence_dim:
                raise ValueError(f"ids shape {tuple(ids.shape)} has no sequence_dim ({self.sequence_dim})")
            check_divisible(ids.shape[self.sequence_dim], self.tp_size, "sequence length",
                            " when sequence_parallel=True")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = nn.functional.embedding(torch.where(outside, torch.zeros_like(local), local), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp_size == 1:
            return out
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.tp_group, self.sequence_dim)
        return reduce_from_tensor_parallel(out, self.tp_group)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp_group=None, **kwargs) -> "VocabParallelEmbedding":
        layer = cls(emb.num_embeddings, emb.embedding_dim, tp_group, device=emb.weight.device,
                    dtype=emb.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(emb.weight[layer.vocab_start:layer.vocab_start + layer.per_rank])
        return layer

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": all_gather_dim(self.weight.detach(), 0, self.tp_group)}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}..."
                f"{self.vocab_start + self.per_rank - 1} here), sequence_parallel={self.sequence_parallel}")
