"""Vocabulary-parallel cross-entropy: the loss over logits whose vocabulary dim is split over the
TP group, without ever forming full-vocabulary logits on one rank (Megatron-LM's
``vocab_parallel_cross_entropy``).

Per token, with z the logits, V the vocabulary and ε the label smoothing:
    loss = log Σ_v exp z_v − (1−ε)·z_target − ε/V · Σ_v z_v          (= F.cross_entropy)
Three all-reduces over the TP group, each of one number per token (max, Σexp, and the target
logit plus the logit sum), not of the logits. Work floor: read the (tokens, V/P) logits twice
(forward; backward writes the gradient once). Computed in fp32 for 16-bit logits, in float64 for
float64 ones (``tpkernels.dtypes``).

Like ``F.cross_entropy``, a target outside [0, V) that is not ``ignore_index`` is an error (one
small host read of the targets' range); so are shard widths that differ between ranks (every
rank must hold V/P columns), detected inside the first all-reduce at no extra collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.dtypes import widen
from tpkernels.parallel import consistency
from tpkernels.parallel.groups import group_rank_size


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, ignore_index):
        rank, world = group_rank_size(group)
        v_local = logits.shape[-1]
        vocab = v_local * world
        lo = rank * v_local
        z = widen(logits)
        # the shard width rides along the max: max(w) and max(-w) over ranks tell whether all agree
        zmax = torch.cat([z.max(dim=-1).values.reshape(-1),
                          torch.tensor([v_local, -v_local], dtype=z.dtype, device=z.device)])
        _all_reduce(zmax, group, dist.ReduceOp.MAX)
        bad = out_of_range_targets(target, vocab, ignore_index)
        widest, narrowest, any_bad = torch.stack([zmax[-2], -zmax[-1], bad.any().to(zmax.dtype)]).tolist()  # 1 sync
        if widest != narrowest:
            raise ValueError(f"logits_shard.shape[-1] differs across the TP group (from {int(narrowest)} to "
                             f"{int(widest)} columns; {v_local} here): every rank must hold vocab_size / "
                             "tensor_parallel_size")
        if any_bad:
            raise target_range_error(target, bad, vocab, ignore_index)
        zmax = zmax[:-2].view(target.shape)
        z = z - zmax.unsqueeze(-1)  # a fresh tensor: safe to reuse for the softmax below
        local_t = target - lo
        mine = (local_t >= 0) & (local_t < v_local) & (target != ignore_index)
        idx = torch.where(mine, local_t, torch.zeros_like(local_t))
        stats = torch.stack([
            torch.where(mine, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(zmax)),  # target logit
            z.sum(dim=-1),  # for label smoothing
        ])
        z.exp_()
        sum_exp = z.sum(dim=-1)
        _all_reduce(stats, group)
        _all_reduce(sum_exp, group)
        log_z = sum_exp.log()
        eps = label_smoothing
        loss = log_z - (1.0 - eps) * stats[0] - eps / vocab * stats[1]
        valid = target != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        z.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward (tokens × V/P, like the logits)
        ctx.save_for_backward(z, idx, mine, valid)
        ctx.eps, ctx.vocab, ctx.dtype = eps, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax  # reuse the saved buffer: backward runs once
        if ctx.eps:
            g.sub_(ctx.eps / ctx.vocab)
        onehot = (1.0 - ctx.eps) * mine.to(g.dtype)
        g.scatter_add_(-1, idx.unsqueeze(-1), -onehot.unsqueeze(-1))
        g.mul_((dloss * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def out_of_range_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """Mask of the targets outside ``[0, vocab)`` that are not ``ignore_index``."""
    return (target != ignore_index) & ((target < 0) | (target >= vocab))


def target_range_error(target: torch.Tensor, bad: torch.Tensor, vocab: int, ignore_index: int) -> ValueError:
    """The error for the first target ``bad`` (from ``out_of_range_targets``) marks."""
    return ValueError(f"target ({int(target[bad][0])}) must be in [0, vocab_size ({vocab})) or equal ignore_index "
                      f"({ignore_index})")


def check_loss_args(target: torch.Tensor, rows_shape, label_smoothing: float, reduction: str, what: str) -> None:
    """The arguments every loss of the package checks alike (``what``: the tensor target must match)."""
    if tuple(rows_shape) != tuple(target.shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal {what} shape without its last dim "
                         f"{tuple(rows_shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target dtype ({target.dtype}) must be an integer type")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 1]")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction ({reduction!r}) must be 'none', 'sum' or 'mean'")


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits.

    logits_shard: (..., V/P) — rank r holds vocabulary entries [r·V/P, (r+1)·V/P); target: (...) int64
    ids in [0, V) or ``ignore_index``. reduction: "none" → (...) per-token losses (0 where ignored);
    "sum"; "mean" over the tokens that are not ignored (as ``F.cross_entropy``).
    """
    check_loss_args(target, logits_shard.shape[:-1], label_smoothing, reduction, "logits_shard")
    if not logits_shard.is_floating_point():
        raise ValueError(f"logits_shard dtype ({logits_shard.dtype}) must be floating point")
    if logits_shard.dim() == 0 or logits_shard.shape[-1] == 0:
        raise ValueError(f"logits_shard shape {tuple(logits_shard.shape)}: its last dimension (this rank's vocabulary "
                         "columns) must be >= 1")
    consistency.agree(tp_group, "vocab_parallel_cross_entropy", **{"logits_shard.shape": logits_shard.shape,
                                                                   "logits_shard.dtype": logits_shard.dtype})
    loss = VocabParallelCrossEntropyFunction.apply(logits_shard, target.long(), tp_group, float(label_smoothing),
                                                   ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)
