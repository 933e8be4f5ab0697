"""The LM head GEMM and the (vocabulary-parallel) cross-entropy, chunk by chunk over tokens, so that
the (tokens, vocab / TP) logits never exist: only one chunk's (chunk, vocab / TP) logits at a time.

    loss = linear_cross_entropy(hidden, weight, target, tp_group=tp)   # = vocab_parallel_cross_entropy(hidden @ weight.T, ...)

For each chunk of tokens c (the gradients of the summed per-token losses are made in the same
pass, as Liger-Kernel does; with ``reduction="none"`` the backward redoes the chunk loop with the
upstream per-token weights instead):

    z = h_c @ Wᵀ                       (chunk, V/P) in the GEMM dtype, statistics in fp32
    m, Σexp, z_target, Σz per row      one pass over z (Triton on GPUs); the ranks combine them in
                                       two all-reduces of a few floats per token (max, then sums)
    loss_c = lse − (1−ε)·z_target − ε/V·Σz + z_loss·lse²
    dz = softmax·(1 + 2·z_loss·lse) − ε/V − (1−ε)·onehot      written over z, in place
    dh_c = dz @ W,  dW += dzᵀ @ h_c    (dW accumulated in fp32 for 16-bit weights)

dh is summed over the TP group at the end (one all-reduce, as a column-parallel LM head's
backward does), so the input gradient is that of the replicated hidden state.

Memory beyond inputs and gradients: one chunk's logits (chunk × V/P) plus O(tokens) statistics.
The default chunk makes the logits chunk as large as the hidden state (chunk · V/P ≈ tokens · h),
but at least MIN_CHUNK_TOKENS rows: thinner GEMMs lose more time than the memory saves (measured
on the CPU, h = 512, V = 32000, 1024 tokens: 16-row chunks take 2.0× the time of 512-row ones).
Neither Liger-Kernel (not vocabulary-parallel) nor Megatron (materialises the logits shard) has this.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels.conventions import IGNORE_INDEX
from tpkernels import backends
from tpkernels.dtypes import widen
from tpkernels.functional.vocab_parallel import check_loss_args, out_of_range_targets, target_range_error
from tpkernels.kernels import reference
from tpkernels.parallel import consistency
from tpkernels.parallel.groups import group_by_name, group_rank_size

OP = "linear_cross_entropy"


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    return backends.triton_dtype_limits(device, dtype) if impl == "triton" else None


backends.register_op(OP, ("triton", "reference"), check=_impl_limits)


def _ce_kernels(name: str):
    if name == "triton":
        from tpkernels.kernels.triton import cross_entropy as tk  # noqa: PLC0415  (triton import is slow)

        return tk.ce_stats, tk.ce_grad_
    return reference.ce_stats, reference.ce_grad_


MIN_CHUNK_TOKENS = 512  # GEMM rows per chunk below which the GEMMs lose efficiency (CPU and GPU alike)


def default_chunk_size(tokens: int, hidden: int, vocab_local: int) -> int:
    """Tokens per chunk: the logits chunk about as large as the hidden state, at least
    MIN_CHUNK_TOKENS rows (and at most all of them)."""
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, math.ceil(tokens * hidden / max(vocab_local, 1)))))


def _all_reduce(t: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def real_vocab(vocab_size: int, v_local: int, world: int) -> int:
    """The vocabulary the loss runs over: ``vocab_size`` (0: every row of every shard)."""
    return vocab_size or v_local * world


def _chunk_pass(hidden: Tensor, weight: Tensor, target: Tensor, group, chunk: int, ignore_index: int,
                smoothing: float, z_loss: float, row_weights: Tensor | None, want_grads: bool, name: str,
                vocab_size: int = 0, reduce_grad: bool = True):
    """The chunk loop. hidden (n, h), weight (V/P, h), target (n,) int64; row_weights (n,) fp32 or None
    (unit weights); vocab_size: the real vocabulary (0: all V rows), the rows past it being padding;
    reduce_grad: sum dh over the group (False: this shard's partial dh, for a caller that reduces it).
    Returns (per-token losses (n,) fp32 or None, dh (n, h) or None, dW (V/P, h) or None)."""
    rank, world = group_rank_size(group)
    n, v_local = hidden.shape[0], weight.shape[0]
    vocab, lo = real_vocab(vocab_size, v_local, world), rank * v_local
    # padding rows never enter the GEMM: their logits are not masked, they do not exist (and get dW = 0)
    n_real = max(0, min(v_local, vocab - lo))
    w_real = weight[:n_real]
    stats_fn, grad_fn = _ce_kernels(name)  # name: "triton" or "reference"
    stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    losses = torch.empty(n, dtype=stat_dtype, device=hidden.device)
    dh = torch.empty_like(hidden) if want_grads else None
    dw = None
    valid = target != ignore_index
    for c0 in range(0, n, chunk):
        h_c, t_c = hidden[c0:c0 + chunk], target[c0:c0 + chunk]
        z = h_c @ w_real.t()  # (c, V/P): the only logits that exist
        if n_real:
            st = stats_fn(z, t_c, lo)  # (4, c): a pivot m, Σ exp(z − m), target logit, Σ z
        else:  # a shard of padding only: it adds nothing to any sum
            st = torch.zeros(4, z.shape[0], dtype=stat_dtype, device=z.device)
            st[0] = -math.inf
        m = _all_reduce(st[0].clone(), group, dist.ReduceOp.MAX)
        sums = torch.stack([st[1] * (st[0] - m).exp(), st[2], st[3]])
        _all_reduce(sums, group)
        lse = m + sums[0].log()
        loss = lse - (1.0 - smoothing) * sums[1] - smoothing / vocab * sums[2] + z_loss * lse * lse
        v_c = valid[c0:c0 + chunk]
        losses[c0:c0 + chunk] = torch.where(v_c, loss, torch.zeros_like(loss))
        if want_grads:
            scale = v_c.to(stat_dtype) if row_weights is None else row_weights[c0:c0 + chunk] * v_c
            if not n_real:
                dh[c0:c0 + chunk] = 0
                continue
            dz = grad_fn(z, t_c, lo, lse.contiguous(), scale.to(stat_dtype).contiguous(), vocab, smoothing, z_loss)
            torch.matmul(dz, w_real, out=dh[c0:c0 + chunk])
            if dw is None:
                dw = widen(dz.t() @ h_c)
            elif dw.dtype == dz.dtype:
                dw.addmm_(dz.t(), h_c)  # accumulate in place: no weight-sized temporary per chunk
            else:
                dw.add_(dz.t() @ h_c)
    if want_grads:
        if world > 1 and reduce_grad:  # the replicated hidden state's gradient: every vocabulary shard contributes
            dh_wide = widen(dh)
            dist.all_reduce(dh_wide, group=group)
            dh = dh_wide.to(hidden.dtype) if dh_wide is not dh else dh
        full = torch.zeros_like(weight)
        if dw is not None:
            full[:n_real] = dw
        dw = full
    return losses, dh, dw


def _check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    bad = out_of_range_targets(target, vocab, ignore_index)
    if bool(bad.any()):
        raise target_range_error(target, bad, vocab, ignore_index)


# ---- torch.library registration: opaque to torch.compile (collectives and host checks inside) ----
# The forward returns the reduced loss and, for "mean"/"sum" when a gradient is wanted, the
# gradients of the summed losses (made in the same pass), which the backward scales; for "none"
# the backward op redoes the chunk loop with the upstream per-token weights.

@torch.library.custom_op("tpkernels::linear_cross_entropy_forward", mutates_args=())
def _forward_op(hidden: Tensor, weight: Tensor, target: Tensor, group_name: str, chunk: int, ignore_index: int,
                smoothing: float, z_loss: float, reduction: str, want_grads: bool,
                backend: str, vocab_size: int, reduce_grad: bool, check_targets: bool) -> tuple[Tensor, Tensor, Tensor,
                                                                                                 Tensor]:
    group = group_by_name(group_name)
    if check_targets:
        _check_targets(target, real_vocab(vocab_size, weight.shape[0], group_rank_size(group)[1]), ignore_index)
    eager = want_grads and reduction != "none"
    losses, dh, dw = _chunk_pass(hidden, weight, target, group, chunk, ignore_index, smoothing, z_loss, None, eager,
                                 backend, vocab_size, reduce_grad)
    count = (target != ignore_index).sum()
    loss = losses if reduction == "none" else (losses.sum() if reduction == "sum" else
                                               losses.sum() / count.clamp(min=1))
    return loss, (dh if eager else hidden.new_empty(0)), (dw if eager else weight.new_empty(0)), count


@_forward_op.register_fake
def _(hidden, weight, target, group_name, chunk, ignore_index, smoothing, z_loss, reduction, want_grads, backend,
      vocab_size, reduce_grad, check_targets):
    stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=stat)
    eager = want_grads and reduction != "none"
    return (loss, hidden.new_empty(hidden.shape if eager else (0,)), weight.new_empty(weight.shape if eager else (0,)),
            target.new_empty((), dtype=torch.int64))


@torch.library.custom_op("tpkernels::linear_cross_entropy_backward", mutates_args=())
def _backward_op(hidden: Tensor, weight: Tensor, target: Tensor, row_weights: Tensor, group_name: str, chunk: int,
                 ignore_index: int, smoothing: float, z_loss: float, backend: str,
                 vocab_size: int, reduce_grad: bool) -> tuple[Tensor, Tensor]:
    _, dh, dw = _chunk_pass(hidden, weight, target, group_by_name(group_name), chunk, ignore_index, smoothing, z_loss,
                            row_weights, True, backend, vocab_size, reduce_grad)
    return dh, dw


@_backward_op.register_fake
def _(hidden, weight, target, row_weights, group_name, chunk, ignore_index, smoothing, z_loss, backend, vocab_size,
      reduce_grad):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    (hidden, weight, target, group_name, chunk, ignore_index, smoothing, z_loss, reduction, want_grads, backend,
     vocab_size, reduce_grad, _check) = inputs
    _, dh, dw, count = output
    ctx.reduction = reduction
    if reduction != "none":
        ctx.save_for_backward(dh, dw, count)
    else:
        ctx.save_for_backward(hidden, weight, target)
        ctx.args = (group_name, chunk, ignore_index, smoothing, z_loss, backend, vocab_size, reduce_grad)


def _backward(ctx, g, *_):
    if ctx.reduction != "none":
        dh, dw, count = ctx.saved_tensors
        scale = g if ctx.reduction == "sum" else g / count.clamp(min=1)
        dh, dw = dh * scale.to(dh.dtype), dw * scale.to(dw.dtype)
    else:
        hidden, weight, target = ctx.saved_tensors
        dh, dw = _backward_op(hidden, weight, target, g.contiguous(), *ctx.args)
    need = ctx.needs_input_grad
    return (dh if need[0] else None, dw if need[1] else None) + (None,) * 12


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *, tp_group=None,
                         chunk_size: int | None = None, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                         reduction: str = "mean", z_loss: float = 0.0, vocab_size: int | None = None,
                         reduce_input_grad: bool = True, backend: str | None = None,
                         check_targets: bool = True) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` without the logits (see the module docstring).

    Args:
        hidden: (..., h), the final hidden states, the same on every rank of ``tp_group``.
        weight: (V/P, h), this rank's rows [r·V/P, (r+1)·V/P) of the LM head (all of it without TP).
        target: (...) int ids in [0, V) or ``ignore_index``.
        tp_group: the tensor-parallel group over which the vocabulary is split (None: one rank).
        chunk_size: tokens per chunk (default: the logits chunk about as large as ``hidden``, at least
           512 tokens).
        label_smoothing, ignore_index, reduction ("mean" over non-ignored tokens, "sum", "none"):
           as ``F.cross_entropy``.
        z_loss: coefficient of the PaLM z-loss, z_loss · logsumexp(z)², added per token.
        vocab_size: the real vocabulary V when the head is padded (to a multiple of TP and of the
           GEMM tile): rows [V, P·V/P) of the sharded weight are padding, left out of the loss (their
           logits are never formed; their weight gradient is 0). Default: no padding.
        reduce_input_grad: False leaves hidden's gradient as this rank's partial sum (the caller
           reduces it: under sequence parallelism the all-gather of the hidden state before the head
           reduce-scatters it in backward, half the bytes of an all-reduce followed by a split).
        backend: "triton" or "reference" for the per-chunk loss kernels.
        check_targets: check that every target is in range (one host read of the device's verdict);
           False when the caller checked them already (the models check a step's targets once, on
           the host, before any micro-batch runs).

    Returns:
        The loss (a scalar, or (...) per token with ``reduction="none"``), fp32 (fp64 for fp64 inputs).
        Gradients reach hidden (summed over the TP group) and weight.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab / tensor_parallel_size, {hidden.shape[-1] if hidden.dim() else '?'}), "
                         f"got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})")
    check_loss_args(target, hidden.shape[:-1], label_smoothing, reduction, "hidden")
    if not isinstance(z_loss, (int, float)) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"z_loss ({z_loss!r}) must be a finite number >= 0")
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
    if chunk_size is None:
        chunk_size = default_chunk_size(h2.shape[0], h2.shape[1], weight.shape[0])
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive integer")
    world = group_rank_size(tp_group)[1]
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                   or not 1 <= vocab_size <= weight.shape[0] * world):
        raise ValueError(f"vocab_size ({vocab_size!r}) must be an integer in [1, weight rows × tensor_parallel_size "
                         f"({weight.shape[0]} × {world} = {weight.shape[0] * world})]")
    consistency.agree(tp_group, OP, **{"hidden.shape": hidden.shape, "hidden.dtype": hidden.dtype,
                                       "weight.shape": weight.shape, "chunk_size": chunk_size})
    name = backends.select(OP, hidden.device, backend, dtype=hidden.dtype)
    want_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _, _ = _forward_op(h2, weight, t1, "" if tp_group is None else tp_group.group_name, chunk_size,
                                ignore_index, float(label_smoothing), float(z_loss), reduction, want_grads, name,
                                vocab_size or 0, bool(reduce_input_grad), bool(check_targets))
    return loss.view(target.shape) if reduction == "none" else loss


__all__ = ["default_chunk_size", "linear_cross_entropy"]
