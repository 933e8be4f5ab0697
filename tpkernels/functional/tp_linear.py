"""Column- and row-parallel linear layers as autograd functions: the one TP communication schedule
of the package, written once over a weight format (:mod:`tpkernels.functional.weight_format`: dense,
NF4 / int8, FP8) that supplies the casts and GEMMs. The TP communication of forward AND backward is
fused into the GEMMs (:mod:`tpkernels.functional.gemm_comm`).

With ``a = ops.input(x)`` and ``g = ops.grad(dy)`` the format's view of x and dy (FP8 bytes, say):
Column-parallel, weight (out/P, in), x: (..., in):
  SP:     forward  a_full, y = all_gather_matmul(a_shard, Wᵀ)    (+ bias shard)
          backward dx_shard = matmul_reduce_scatter(g, W)       dgrad, ring or collective
                   dW = Σ_chunks gᵀ·a_full                      wgrad chunks run while the
                                                                dgrad partial sums travel
  no SP:  forward  y = a · Wᵀ                                   (x replicated)
          backward dx = all_reduce(g · W), async, overlapped with dW = gᵀ·a
Row-parallel, weight (out, in/P), x: (..., in/P):
  SP:     forward  y_shard = matmul_reduce_scatter(a, Wᵀ) + bias
          backward g_full, dx = all_gather_matmul(g_shard, W)   dgrad; each gathered chunk of g
                   feeds its wgrad chunk gᵀ·a while the next chunk travels
                   dbias = all_reduce(Σ dy_shard)               (each rank saw only its tokens)
  no SP:  forward  y = matmul_all_reduce(a, Wᵀ) + bias           (fused on CUDA when auto picks it)
          backward dx = g · W, dW = gᵀ·a (dy is replicated)
Every partial sum that travels between ranks is taken in fp32 for 16-bit and FP8 GEMMs (the
accumulation dtype of :mod:`tpkernels.dtypes`). A weight without a gradient (a frozen LoRA base, a
quantised one) keeps nothing of its input. Weight gradients go through
:class:`tpkernels.functional.weight_grad.WeightGrad` (the format's GEMM, summed in fp32 over chunks):
computed at once, in the shadow of the communication, or, inside a zero-bubble schedule's B
(``defer_weight_grads``), queued with the tensors they need (the gathered input and output gradient)
as one W action.

``algo`` picks the GEMM-comm algorithm by the rule of :mod:`tpkernels.backends` (collective, ring,
or, on CUDA for 16-bit weights, the fused kernels of :mod:`tpkernels.functional.gemm_comm_fused`); a
format whose operands cannot be cut into ring chunks runs the collective. ``overlap`` is its own
flag: False runs every weight-gradient GEMM after the communication it could hide behind (the plain
serial form, for measuring what the overlap buys).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpkernels.conventions import rows as _rows
from tpkernels.functional.gemm_comm import (all_gather_matmul, check_algo, choose_algo, matmul_all_reduce,
                                            matmul_reduce_scatter)
from tpkernels.functional.quantized_weight import QuantizedWeight, matmul as _mm
from tpkernels.functional.weight_format import DENSE, QuantizedFormat
from tpkernels.functional.weight_grad import WeightGrad, graph_anchor, weight_for_graph
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.mappings import all_gather_dim, all_reduce


def _seq_chunks(t: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    return list(t.movedim(dim, 0).chunk(world, dim=0))


class _Call:
    """What one call keeps for its backward besides tensors: the layout and the format."""

    def __init__(self, fmt, group, sp: bool, seq_dim: int, algo: str, overlap: bool):
        self.fmt, self.group, self.sp, self.seq_dim, self.overlap = fmt, group, sp, seq_dim, overlap
        self.algo = algo if fmt.ring else "collective"

    def comm_algo(self) -> str:
        """The algorithm of a forward op (the serial form runs the collective)."""
        return self.algo if self.overlap else "collective"


def _bias_grad(ctx, dy: torch.Tensor, reduce: bool = False):
    """Σ dy over the rows; ``reduce``: summed over the TP group too (under SP each rank saw its tokens only)."""
    if not (ctx.has_bias and ctx.needs_input_grad[2]):
        return None
    db = _rows(dy).sum(0)
    return all_reduce(db, ctx.call.group) if reduce else db


def _weight_grad(ctx, weight, ops) -> WeightGrad:
    needed = ctx.call.fmt.trainable and ctx.needs_input_grad[1]
    return WeightGrad(weight, needed, ctx.split, product=ops.wgrad)


class ColumnParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: _Call, regather_input, split, anchor):
        ctx.call, ctx.split, ctx.has_bias = call, split, bias is not None
        ops = call.fmt.bind(weight)
        a = ops.input(x)
        # a weight without a gradient (a frozen or quantised base) needs no input for its backward
        wgrad = call.fmt.trainable and (ctx.needs_input_grad[1] or split is not None)
        if call.sp:
            keep = wgrad and not regather_input
            a_full, (y,) = all_gather_matmul(a, [ops.forward_b()], call.group, gather_dim=call.seq_dim,
                                             algo=call.comm_algo(), return_a=keep)
            saved, ctx.regather = (a_full if keep else a if wgrad else None), wgrad and not keep
        else:
            y = _mm(a, ops.forward_b())
            saved, ctx.regather = (a if wgrad else None), False
        ctx.save_for_backward(saved, weight, *ops.saved())
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        call = ctx.call
        a_saved, weight, *kept = ctx.saved_tensors
        ops = call.fmt.bind(weight, tuple(kept))
        dy = dy.contiguous()
        g = ops.grad(dy)
        gw = _weight_grad(ctx, weight, ops)
        db = _bias_grad(ctx, dy)
        _, world = group_rank_size(call.group)
        b = ops.backward_b()
        if call.sp:
            a_full = (all_gather_dim(a_saved, call.seq_dim, call.group) if ctx.regather else a_saved) \
                if gw.needed else None
            algo = choose_algo("matmul_reduce_scatter", call.algo, world, 2.0 * dy.numel() * b.shape[1],
                               dy.device, call.overlap, dtype=g.dtype, k=b.shape[0], n=b.shape[1],
                               group=call.group, quantized=not isinstance(b, torch.Tensor))
            if not gw.needed:
                side = []
            elif gw.deferred:  # W later, one GEMM: it owns g and the gathered input
                gw.add(g, a_full)
                side = []
            elif algo == "ring" and call.fmt.wgrad_chunks:  # one wgrad chunk per ring step, while partial sums travel
                gs, xs = _seq_chunks(g, call.seq_dim, world), _seq_chunks(a_full, call.seq_dim, world)
                side = [lambda j=j: gw.add(gs[j], xs[j]) for j in range(world)]
            else:  # one GEMM, during the reduce-scatter
                side = [lambda: gw.add(g, a_full)]
            dx = None
            if ctx.needs_input_grad[0]:
                dx = matmul_reduce_scatter(g, b, call.group, scatter_dim=call.seq_dim,
                                           algo="collective" if algo == "local" else algo, side_work=side,
                                           overlap=call.overlap)
            else:
                for work in side:
                    work()
        else:
            dx, handle = None, None
            if ctx.needs_input_grad[0]:
                dx = _mm(g, b, wide=world > 1)
                if world > 1:  # all-reduce the input gradient (fp32) while the weight gradient is computed
                    handle = dist.all_reduce(dx, group=call.group, async_op=True)
                    if not call.overlap:
                        handle.wait()
            gw.add(g, a_saved)
            if handle is not None:
                handle.wait()
            if dx is not None:
                dx = dx.to(dy.dtype)
        return dx, gw.result(), db, None, None, None, None


class RowParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: _Call, split, anchor):
        ctx.call, ctx.split, ctx.has_bias = call, split, bias is not None
        ops = call.fmt.bind(weight)
        a = ops.input(x)
        wgrad = call.fmt.trainable and (ctx.needs_input_grad[1] or split is not None)
        if call.sp:
            y = matmul_reduce_scatter(a, ops.forward_b(), call.group, scatter_dim=call.seq_dim, algo=call.algo,
                                      overlap=call.overlap)
        else:
            y = matmul_all_reduce(a, ops.forward_b(), call.group, algo=call.comm_algo())
        ctx.save_for_backward(a if wgrad else None, weight, *ops.saved())
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        call = ctx.call
        a, weight, *kept = ctx.saved_tensors
        ops = call.fmt.bind(weight, tuple(kept))
        dy = dy.contiguous()
        g = ops.grad(dy)
        gw = _weight_grad(ctx, weight, ops)
        b = ops.backward_b()
        if call.sp:
            rank, world = group_rank_size(call.group)
            algo = choose_algo("all_gather_matmul", call.algo, world, 2.0 * dy.numel() * b.shape[1] * world,
                               dy.device, call.overlap, dtype=g.dtype, k=b.shape[0], n=b.shape[1],
                               group=call.group, quantized=not isinstance(b, torch.Tensor))
            if algo == "ring" and gw.needed and not gw.deferred and call.fmt.wgrad_chunks:
                # each gathered chunk of g feeds its weight-gradient GEMM while the next travels
                xs = _seq_chunks(a, call.seq_dim, world)
                _, (dx,) = all_gather_matmul(g, [b], call.group, gather_dim=call.seq_dim, algo=algo, return_a=False,
                                             on_chunk=lambda src, chunk: gw.add(chunk, xs[src]))
            else:  # deferred: W owns the gathered g (one GEMM later)
                g_full, (dx,) = all_gather_matmul(g, [b], call.group, gather_dim=call.seq_dim,
                                                  algo="collective" if algo == "local" else algo,
                                                  return_a=gw.needed)
                gw.add(g_full, a)
            db = _bias_grad(ctx, dy, reduce=True)
        else:
            dx = _mm(g, b) if ctx.needs_input_grad[0] else None
            gw.add(g, a)
            db = _bias_grad(ctx, dy)
        return dx if ctx.needs_input_grad[0] else None, gw.result(), db, None, None, None


def _format(weight, weight_format):
    """(the weight tensor autograd sees or None, the format)."""
    if isinstance(weight, QuantizedWeight):
        return None, weight_format or QuantizedFormat(weight)
    return weight, weight_format or DENSE


def column_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0,
                           algo="auto", regather_input=False, overlap=True, weight_format=None):
    """x: (..., in) — with SP this rank's shard of ``sequence_dim``; weight: (out/P, in), a tensor or a
    :class:`QuantizedWeight`; bias: (out/P,); ``weight_format``: how the weight multiplies (default:
    dense for a tensor, its quantised GEMMs for a QuantizedWeight; an ``Fp8Format`` for FP8).
    Returns (..., out/P) over the full sequence, in x's dtype."""
    check_algo(algo, overlap)
    w, fmt = _format(weight, weight_format)
    w, split = weight_for_graph(w) if w is not None and fmt.trainable else (w, None)
    call = _Call(fmt, group, sequence_parallel, sequence_dim, algo, overlap)
    return ColumnParallelLinearFunction.apply(x, w, bias, call, regather_input, split, graph_anchor(split))


def row_parallel_linear(x, weight, bias=None, group=None, sequence_parallel=False, sequence_dim=0, algo="auto",
                        overlap=True, weight_format=None):
    """x: (..., in/P) over the full sequence; weight: (out, in/P), a tensor or a :class:`QuantizedWeight`;
    bias: (out,) replicated; ``weight_format``: as :func:`column_parallel_linear`'s. Returns (..., out):
    with SP this rank's shard of ``sequence_dim``, else the full sum on every rank."""
    check_algo(algo, overlap)
    w, fmt = _format(weight, weight_format)
    w, split = weight_for_graph(w) if w is not None and fmt.trainable else (w, None)
    call = _Call(fmt, group, sequence_parallel, sequence_dim, algo, overlap)
    return RowParallelLinearFunction.apply(x, w, bias, call, split, graph_anchor(split))
