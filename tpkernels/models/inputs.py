"""What a ParallelTransformer's pipeline stages take, and the checked inputs of a step.

Every stage takes the same tuple, ``StageInput.astuple()``, the form P2P carries between stages:

    (hidden, position_ids, documents)
    hidden        (input_ids,) on the first stage, (batch, seq) int; after it (delta, residual),
                  (batch, seq[/TP], hidden) each: the previous stage's output
    position_ids  (batch, seq) int64: this rank's positions (global ones under CP: rotary uses them)
    documents     (batch, n) int32: each row's document boundaries in the whole sequence (the global
                  one of S = seq·CP tokens under CP), ascending from 0, padded with the sequence
                  length; (batch, 0) when every row is one document. A host tensor on the first
                  stage (found there, no device read); later stages get it on the device with the
                  activations and read it once per micro-batch.

Documents are marked the Hugging Face way: positions restart at 0. Under CP each rank holds a
zigzag share, so the first stage all-gathers the host positions over the CP group once per step
(``control.all_gather_ints``) and every rank finds the global boundaries: the CP attention plans
its kernel calls from them on the host.

The inputs of a step are checked once, where they are (free for host tensors, the trainer's; one
device read per step otherwise): ids in the vocabulary, positions in the position table, shapes
and dtypes agreed over the TP group; the layers then check nothing per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.context_parallel import zigzag_indices, zigzag_merge
from tpkernels.functional.vocab_parallel import out_of_range_targets, target_range_error
from tpkernels.models.sequence import default_positions, positions_from_cu_seqlens
from tpkernels.parallel import consistency, control


@dataclass
class StageInput:
    """One stage's input (see the module docstring); ``astuple()`` is what the stages exchange."""

    hidden: tuple[Tensor, ...]
    position_ids: Tensor
    documents: Tensor

    def astuple(self) -> tuple:
        return (tuple(self.hidden), self.position_ids, self.documents)

    @classmethod
    def of(cls, x) -> "StageInput":
        hidden, position_ids, documents = x
        return cls(tuple(hidden), position_ids, documents)


def document_bounds(position_ids: Tensor) -> Tensor:
    """(batch, n) int32 boundaries of the documents of host positions (batch, T) (a document starts
    where its position is 0, and at every row start), padded with T; (batch, 0) for one per row."""
    b, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    per_row = [torch.nonzero(starts[r]).reshape(-1) for r in range(b)]
    n = max(len(p) for p in per_row)
    if n == 1:
        return torch.empty(b, 0, dtype=torch.int32)
    out = torch.full((b, n + 1), T, dtype=torch.int32)
    for r, p in enumerate(per_row):
        out[r, :len(p)] = p
    return out


def agree_tp(model, what: str, t: Tensor) -> None:
    """The TP ranks of a stage must be given the same shapes and dtypes (ranks that are not compute
    garbage, or abort inside gloo): checked with one small collective on the first call and whenever
    this rank's shape or dtype changes, while ``model.check_inputs`` is on (the default; the trainer,
    whose batches agree by construction, checks its first step)."""
    key = (tuple(t.shape), t.dtype)
    if model.check_inputs and model.state.tp_size > 1 and model._checked.get(what) != key:
        consistency.agree(model.state.tp_group, "ParallelTransformer inputs", force=True,
                          **{f"{what}.shape": key[0], f"{what}.dtype": key[1]})
        model._checked[what] = key


def _check_ids(model, input_ids: Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    agree_tp(model, "input_ids", input_ids)
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids dtype ({input_ids.dtype}) must be an integer type")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)}: the batch and the sequence length must be >= 1")


def _positions(ctx, input_ids: Tensor, position_ids, cu_seqlens) -> tuple[Tensor, bool]:
    """(position_ids, whether they may hold several documents per row)."""
    if cu_seqlens is not None:
        if position_ids is not None:
            raise ValueError("give position_ids or cu_seqlens, not both")
        return positions_from_cu_seqlens(cu_seqlens, *input_ids.shape), True
    if position_ids is None and ctx.cp_size > 1:  # this CP rank's zigzag share of whole sequences
        share = zigzag_indices(input_ids.shape[1] * ctx.cp_size, ctx.cp_size, ctx.cp_rank)
        return share.expand(input_ids.shape), False
    if position_ids is None:
        return default_positions(input_ids), False
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")
    return position_ids, bool((position_ids[:, 1:] == 0).any())  # the user's: packed when they restart


def _check_ranges(config, input_ids: Tensor, position_ids: Tensor) -> None:
    vocab, positions = config.vocab_size, config.max_position_embeddings
    bad_ids, bad_pos = torch.stack([((input_ids < 0) | (input_ids >= vocab)).any(),
                                    ((position_ids < 0) | (position_ids >= positions)).any()]).tolist()
    if bad_ids:
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0]
        raise IndexError(f"input_ids ({int(bad)}) must be in [0, vocab_size ({vocab}))")
    if bad_pos:
        raise ValueError(f"position_ids must be in [0, max_position_embeddings ({positions}))")


def stage_batch(model, input_ids: Tensor, position_ids=None, cu_seqlens=None) -> tuple:
    """The first stage's input of a step (``StageInput.astuple()``), checked once for the whole step and
    moved to the model's device; the documents stay on the host. Under CP one all-gather of the host
    positions over the CP group (every rank then knows the global documents)."""
    _check_ids(model, input_ids)
    ctx = model.ctx
    position_ids, packed = _positions(ctx, input_ids, position_ids, cu_seqlens)
    _check_ranges(model.config, input_ids, position_ids)
    if ctx.cp_size > 1:  # (cp, batch, share) -> the global positions (batch, S)
        every = control.all_gather_ints(position_ids, ctx.cp_group)
        documents = document_bounds(zigzag_merge(list(every), dim=1))
    elif packed:
        documents = document_bounds(position_ids.cpu())
    else:
        documents = torch.empty(input_ids.shape[0], 0, dtype=torch.int32)
    device = model._device()
    return StageInput((input_ids.to(device, non_blocking=True),), position_ids.to(device, non_blocking=True)
                      .contiguous(), documents).astuple()


def stage_target(model, target: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The last stage's targets of a step, checked once (ids in the vocabulary or ignore_index) where
    they are, and moved to the model's device."""
    agree_tp(model, "target", target)
    if target.dim() != 2 or target.shape[0] < 1 or target.shape[1] < 1:
        raise ValueError(f"target shape {tuple(target.shape)}: must be (batch, seq), the batch and the sequence "
                         "length >= 1")
    bad = out_of_range_targets(target, model.config.vocab_size, ignore_index)
    if bool(bad.any()):
        raise target_range_error(target, bad, model.config.vocab_size, ignore_index)
    return target.to(model._device(), non_blocking=True)


__all__ = ["StageInput", "agree_tp", "document_bounds", "stage_batch", "stage_target"]
