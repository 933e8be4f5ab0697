"""Column- and row-parallel linears with FP8 GEMMs (forward, input gradient, weight gradient), the
TP communication around them as in :mod:`tpkernels.functional.tp_linear`, and the SP all-gather of
the column input in FP8.

Every GEMM is C = A·Bᵀ over FP8 operands quantised along their rows (the non-contracted dim), the
scales undone in the fp32 accumulator (``torch._scaled_mm``, :func:`tpkernels.quant.fp8.fp8_gemm`):
    forward       y  = x · Wᵀ        A = x (E4M3),   B = W (E4M3)
    input grad    dx = dy · W        A = dy (grad format, E5M2 by default), B = Wᵀ
    weight grad   dW = dyᵀ · x       A = dyᵀ, B = xᵀ                        (fp32 out, cast to W's dtype)
Tensorwise recipes (current, delayed) quantise each of x, W, dy once, with one scale agreed over the
TP group, and transpose the FP8 bytes for the other GEMMs; the rowwise recipe re-quantises each
operand along the rows it has in that GEMM.

Communication (TP group of P ranks, SP: the sequence split over it):
  column, SP   forward: x quantised on its shard (the scale's amax MAX-reduced over TP), the FP8 bytes
               all-gathered (half of bf16's) by ``all_gather_matmul`` (ring: chunk i+1 travels while
               chunk i is multiplied); the gathered FP8 input is what the weight gradient reads (half
               the saved bytes of bf16). backward: dx = matmul_reduce_scatter(dy, Wᵀ): fp32 partials.
  row, SP      forward: y = matmul_reduce_scatter(x8, Wᵀ) in bf16/fp32 (a sum stays in high precision,
               as TransformerEngine's); backward: dy quantised on its shard and all-gathered in FP8.
  no SP        the all-reduce of the row output / column input gradient in fp32, the GEMMs in FP8.
  rowwise      gathers 16-bit values (one collective: per-token scales would have to travel with every
               ring chunk) and casts after the gather; the gathered 16-bit input is kept, since the
               weight gradient re-quantises it along the other axis (as torchao's rowwise recipe does);
               the row layer's output gradient is gathered in 16 bits for the same reason.
The fused GEMM-comm kernels read 16-bit operands: "auto" picks ring or collective here.

Bytes and FLOPs per layer and micro-batch (m tokens, k in, n out per rank): FLOPs 3 · 2mkn, as bf16;
casts read 2 and write 1 byte per element of x (mk), W (nk), dy (mn), plus the FP8 transposes of x, W
and dy for the backward GEMMs (1 read + 1 write each): ~ 5(mk + nk + mn) bytes against the bf16 path's
none; the SP all-gather moves (P−1)/P · mk bytes instead of 2(P−1)/P · mk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpkernels.functional.gemm_comm import all_gather_matmul, check_algo, matmul_all_reduce, matmul_reduce_scatter
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.mappings import all_gather_dim, all_reduce, reduce_scatter_dim
from tpkernels.quant.fp8 import CastStats, ScaleState, cast_to_fp8, fp8_dtype, fp8_gemm, group_size, scale_from_amax

GRAD_FORMATS = ("e5m2", "e4m3")


@dataclass(frozen=True)
class Fp8Options:
    """recipe: current | delayed | rowwise; history / reduction: delayed's amax window and its
    reduction (max | most_recent); grad_format: the output gradient's (e5m2, or e4m3 with its scale);
    margin: powers of two of headroom below the format's max."""

    recipe: str = "current"
    history: int = 16
    reduction: str = "max"
    grad_format: str = "e5m2"
    margin: int = 0

    def check(self) -> None:
        if self.grad_format not in GRAD_FORMATS:
            raise ValueError(f"fp8.grad_format ({self.grad_format!r}) must be one of {', '.join(GRAD_FORMATS)}")
        ScaleState(self.recipe, "e4m3", history=self.history, reduction=self.reduction)


class Fp8LinearState:
    """One TP linear's FP8 state: the scale state of its input (x), weight (w) and output gradient
    (dy), their cast counts, and whether FP8 is on (the guardrail turns it off at a step boundary)."""

    def __init__(self, options: Fp8Options, group, column: bool):
        options.check()
        kw = dict(history=options.history, reduction=options.reduction, margin=options.margin, group=group)
        # rows that span the TP ranks need their rowwise amax reduced: the row layer's x and W, the column
        # layer's dy (its output features are split)
        self.x = ScaleState(options.recipe, "e4m3", rows_span_group=not column, **kw)
        self.w = ScaleState(options.recipe, "e4m3", rows_span_group=not column, **kw)
        self.dy = ScaleState(options.recipe, options.grad_format, rows_span_group=column, **kw)
        self.options, self.group, self.column, self.enabled = options, group, column, True

    @property
    def rowwise(self) -> bool:
        return self.options.recipe == "rowwise"

    def take_stats(self) -> dict[str, CastStats]:
        return {"x": self.x.take_stats(), "w": self.w.take_stats(), "dy": self.dy.take_stats()}


class Fp8Operand:
    """``b`` of the GEMM-communication ops: B (N, K) in FP8 with its scale; ``a`` arrives as FP8 bytes
    (uint8, scale ``a_scale``, format ``a_fmt``). ``a @ b`` is a·Bᵀ in ``out_dtype``."""

    def __init__(self, b8: torch.Tensor, b_scale: torch.Tensor, a_scale: torch.Tensor, a_fmt: str,
                 out_dtype: torch.dtype):
        self.b8, self.b_scale, self.a_scale, self.a_fmt, self.out_dtype = b8, b_scale, a_scale, a_fmt, out_dtype
        self.shape = torch.Size((b8.shape[1], b8.shape[0]))
        self.dtype, self.device = torch.uint8, b8.device

    def dim(self) -> int:
        return 2

    def matmul(self, a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        a8 = a.view(fp8_dtype(self.a_fmt))
        y = fp8_gemm(a8.reshape(-1, a8.shape[-1]), self.a_scale, self.b8, self.b_scale, self.out_dtype)
        y = y.view(*a.shape[:-1], self.b8.shape[0])
        return y if out is None else out.copy_(y)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _bytes(t8: torch.Tensor) -> torch.Tensor:
    return t8.view(torch.uint8)


def _rowcast(t: torch.Tensor, fmt: str, stats: CastStats | None, group=None, reduce: bool = False):
    """Rowwise FP8 of a 2-D ``t`` along its rows ((rows, 1) scales), amaxes MAX-reduced over ``group`` when
    ``reduce`` (its rows span the group's ranks)."""
    amax = t.detach().abs().float().amax(1, keepdim=True)
    if reduce and group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = scale_from_amax(amax, fmt)
    return cast_to_fp8(t, scale, fmt, stats=stats, check=False), scale


def _wgrad(st: Fp8LinearState, dy2, x2, dy8, sdy, x8, sx, weight):
    """dW = dyᵀ·x in FP8 (tensorwise: the transposed FP8 bytes; rowwise: re-quantised along the token
    rows of dyᵀ and xᵀ), fp32 accumulation, in the weight's dtype."""
    if st.rowwise:
        a8, sa = _rowcast(dy2.t().contiguous(), st.dy.fmt, st.dy.live_stats)
        b8, sb = _rowcast(x2.t().contiguous(), "e4m3", st.x.live_stats)
    else:
        a8, sa, b8, sb = dy8.t().contiguous(), sdy, x8.t().contiguous(), sx
    return fp8_gemm(a8, sa, b8, sb, torch.float32).to(weight.dtype)


def _wt8(st: Fp8LinearState, weight, w8, sw, group=None, reduce: bool = False):
    """Wᵀ (K, N) in FP8 for the input gradient, with its scale."""
    if st.rowwise:
        return _rowcast(weight.detach().t().contiguous(), "e4m3", st.w.live_stats, group, reduce)
    return w8.t().contiguous(), sw


class Fp8ColumnParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, st: Fp8LinearState, group, sequence_parallel, seq_dim, algo, overlap):
        ctx.st, ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.overlap = st, group, sequence_parallel, seq_dim, algo, \
            overlap
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        out = x.dtype
        w8, sw = st.w.cast(weight.detach(), "weight")
        rank, world = group_rank_size(group)
        if sequence_parallel and world > 1 and not st.rowwise:
            x8, sx = st.x.cast(x, "input")  # scale agreed over TP: every rank's chunks dequantise alike
            x_full_b, (y,) = all_gather_matmul(_bytes(x8), [Fp8Operand(w8, sw, sx, "e4m3", out)], group,
                                               gather_dim=seq_dim, algo=algo if overlap else "collective")
            x_full8 = x_full_b.view(x8.dtype)
        else:
            x_full = all_gather_dim(x, seq_dim, group) if sequence_parallel and world > 1 else x
            x_full8, sx = st.x.cast(_rows(x_full), "input")
            y = fp8_gemm(x_full8, sx, w8, sw, out).view(*x_full.shape[:-1], w8.shape[0])
            x_full8 = x_full8.view(*x_full.shape)
        # rowwise keeps the 16-bit (gathered) input: its weight gradient re-quantises it along the tokens;
        # a frozen weight (LoRA's base) keeps no input at all
        wg = ctx.needs_input_grad[1]
        ctx.save_for_backward(x_full8 if wg else None, sx, w8, sw, weight, x_full if st.rowwise and wg else None)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        st, (x_full8, sx, w8, sw, weight, x_hp), dy = ctx.st, ctx.saved_tensors, dy.contiguous()
        dy2 = _rows(dy)
        dy8, sdy = st.dy.cast(dy2, "output gradient")
        _, world = group_rank_size(ctx.group)
        # a column shard's Wᵀ rows (its input features) span the ranks' output rows: reduced over TP
        wt8, swt = _wt8(st, weight, w8, sw, ctx.group, reduce=True)
        dx = None
        if ctx.needs_input_grad[0]:
            if ctx.sp and world > 1 and not st.rowwise:
                dx = matmul_reduce_scatter(_bytes(dy8).view(*dy.shape), Fp8Operand(wt8, swt, sdy, st.dy.fmt, dy.dtype),
                                           ctx.group, scatter_dim=ctx.seq_dim, algo=ctx.algo, overlap=ctx.overlap)
            elif ctx.sp and world > 1:  # rowwise: the row scales do not follow the chunks (module docstring)
                dx = fp8_gemm(dy8, sdy, wt8, swt, torch.float32).view(*dy.shape[:-1], wt8.shape[0])
                dx = reduce_scatter_dim(dx, ctx.seq_dim, ctx.group).to(dy.dtype)
            else:
                dx = fp8_gemm(dy8, sdy, wt8, swt, torch.float32).view(*dy.shape[:-1], wt8.shape[0])
                if world > 1:
                    dist.all_reduce(dx, group=ctx.group)
                dx = dx.to(dy.dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            x2 = _rows(x_full8)
            dw = _wgrad(st, dy2, _rows(x_hp) if st.rowwise else None, dy8, sdy, x2, sx, weight)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None


class Fp8RowParallelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, st: Fp8LinearState, group, sequence_parallel, seq_dim, algo, overlap):
        ctx.st, ctx.group, ctx.sp, ctx.seq_dim, ctx.algo, ctx.overlap = st, group, sequence_parallel, seq_dim, algo, \
            overlap
        ctx.has_bias = bias is not None
        out = x.dtype
        w8, sw = st.w.cast(weight.detach(), "weight")
        x8, sx = st.x.cast(_rows(x), "input")
        x8 = x8.view(x.shape)
        _, world = group_rank_size(group)
        if st.rowwise:  # row scales do not follow the ring's chunks: the whole local product, then the sum
            y = fp8_gemm(_rows(x8), sx, w8, sw, torch.float32).view(*x.shape[:-1], w8.shape[0])
            if sequence_parallel and world > 1:
                y = reduce_scatter_dim(y, seq_dim, group)
            elif world > 1:
                dist.all_reduce(y, group=group)
            y = y.to(out)
        else:
            op = Fp8Operand(w8, sw, sx, "e4m3", out)
            if sequence_parallel:
                y = matmul_reduce_scatter(_bytes(x8), op, group, scatter_dim=seq_dim, algo=algo, overlap=overlap)
            else:
                y = matmul_all_reduce(_bytes(x8), op, group, algo=algo if overlap else "collective")
        wg = ctx.needs_input_grad[1]  # x8: what the weight gradient reads (a frozen weight keeps no input)
        ctx.save_for_backward(x8 if wg else None, sx, w8, sw, weight, x if st.rowwise and wg else None)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        st, (x8, sx, w8, sw, weight, x_hp), dy = ctx.st, ctx.saved_tensors, dy.contiguous()
        _, world = group_rank_size(ctx.group)
        wt8, swt = _wt8(st, weight, w8, sw)  # a row shard's Wᵀ rows are whole on this rank
        db = None
        if ctx.sp and world > 1:
            if st.rowwise:
                dy_full = all_gather_dim(dy, ctx.seq_dim, ctx.group)
                dy8, sdy = st.dy.cast(_rows(dy_full), "output gradient")
                dx = fp8_gemm(dy8, sdy, wt8, swt, dy.dtype).view(*dy_full.shape[:-1], wt8.shape[0])
            else:
                dy8_shard, sdy = st.dy.cast(dy, "output gradient")  # scale agreed over TP, then gathered in FP8
                full_b, (dx,) = all_gather_matmul(_bytes(dy8_shard), [Fp8Operand(wt8, swt, sdy, st.dy.fmt, dy.dtype)],
                                                  ctx.group, gather_dim=ctx.seq_dim,
                                                  algo=ctx.algo if ctx.overlap else "collective")
                dy_full = None
                dy8 = _rows(full_b.view(dy8_shard.dtype))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = all_reduce(_rows(dy).sum(0), ctx.group)
        else:
            dy_full = dy
            dy8, sdy = st.dy.cast(_rows(dy), "output gradient")
            dx = fp8_gemm(dy8, sdy, wt8, swt, dy.dtype).view(*dy.shape[:-1], wt8.shape[0])
            db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dy_hp = _rows(dy_full) if st.rowwise else None
            dw = _wgrad(st, dy_hp, _rows(x_hp) if st.rowwise else None, dy8, sdy, _rows(x8), sx, weight)
        return dx if ctx.needs_input_grad[0] else None, dw, db, None, None, None, None, None, None


def fp8_column_parallel_linear(x, weight, bias, st: Fp8LinearState, group=None, sequence_parallel=False,
                               sequence_dim=0, algo="auto", overlap=True):
    """x: (..., in) — with SP this rank's shard of ``sequence_dim``; weight (out/P, in) 16-bit; st: the
    layer's FP8 state. Returns (..., out/P) over the full sequence, x's dtype."""
    check_algo(algo, overlap)
    return Fp8ColumnParallelLinearFunction.apply(x, weight, bias, st, group, sequence_parallel, sequence_dim, algo,
                                                 overlap)


def fp8_row_parallel_linear(x, weight, bias, st: Fp8LinearState, group=None, sequence_parallel=False, sequence_dim=0,
                            algo="auto", overlap=True):
    """x: (..., in/P) over the full sequence; weight (out, in/P) 16-bit. Returns (..., out): with SP this
    rank's shard of ``sequence_dim``."""
    check_algo(algo, overlap)
    return Fp8RowParallelLinearFunction.apply(x, weight, bias, st, group, sequence_parallel, sequence_dim, algo,
                                              overlap)


__all__ = ["Fp8ColumnParallelLinearFunction", "Fp8LinearState", "Fp8Operand", "Fp8Options",
           "Fp8RowParallelLinearFunction", "fp8_column_parallel_linear", "fp8_row_parallel_linear"]
