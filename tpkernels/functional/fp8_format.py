"""The FP8 weight format of the TP linears: the casts and FP8 GEMMs that the one communication
schedule (:mod:`tpkernels.functional.tp_linear`) runs for a linear with FP8 on.

Every GEMM is C = A·Bᵀ over FP8 operands quantised along their rows (the non-contracted dim), the
scales undone in the fp32 accumulator (:func:`tpkernels.quant.fp8.fp8_gemm`, ``torch._scaled_mm``):
    forward       y  = x · Wᵀ        A = x (E4M3),   B = W (E4M3)
    input grad    dx = dy · W        A = dy (grad format, E5M2 by default), B = Wᵀ
    weight grad   dW = dyᵀ · x       A = dyᵀ, B = xᵀ                        (fp32, cast to W's dtype)
Casts go through the linear's :class:`tpkernels.quant.fp8_state.Fp8Slot` (scales, history, counts:
the run state has one owner). Partial sums that travel between ranks leave the GEMM in fp32.

Tensorwise recipes (current, delayed) quantise each of x, W, dy once, with one scale agreed over the
TP group, and transpose the FP8 bytes for the other GEMMs: ``a`` (x or dy) travels as FP8 bytes
(uint8), so the SP all-gather of the column input and of the row layer's output gradient moves half
of bf16's bytes, ring or collective, and the gathered FP8 input is what the weight gradient reads.
The rowwise recipe re-quantises each operand along the rows it has in that GEMM: ``a`` travels in
16 bits and is cast by the GEMM that receives it (the weight gradient re-quantises the gathered
16-bit input along the other axis, as torchao's rowwise recipe does), with the collective algorithm
(a row's amax is reduced over TP where its elements are split, inside the GEMM call).

Bytes and FLOPs per layer and micro-batch (m tokens, k in, n out per rank): FLOPs 3 · 2mkn, as bf16;
casts read 2 and write 1 byte per element of x (mk), W (nk), dy (mn), plus the FP8 transposes of W
and of dy, x for the weight gradient (1 read + 1 write each): ~ 5(mk + nk + mn) bytes against the
bf16 path's none; the SP all-gather moves (P−1)/P · mk bytes instead of 2(P−1)/P · mk.
"""

from __future__ import annotations

import torch

from tpkernels.conventions import rows
from tpkernels.quant.fp8 import fp8_gemm
from tpkernels.quant.fp8_state import Fp8Slot



class Fp8Operand:
    """``b`` (K, N) of the GEMM-communication ops for tensorwise FP8: B's FP8 bytes as (N, K) with its
    scale; ``a`` arrives as FP8 bytes (uint8) of format ``a_fmt`` with scale ``a_scale``."""

    def __init__(self, b8: torch.Tensor, b_scale: torch.Tensor, a_scale: torch.Tensor, a_dtype: torch.dtype,
                 out_dtype: torch.dtype):
        self.b8, self.b_scale, self.a_scale, self.a_dtype, self.out_dtype = b8, b_scale, a_scale, a_dtype, out_dtype
        self.shape = torch.Size((b8.shape[1], b8.shape[0]))
        self.dtype, self.device = torch.uint8, b8.device

    def dim(self) -> int:
        return 2

    def matmul(self, a: torch.Tensor, out: torch.Tensor | None = None, wide: bool = False) -> torch.Tensor:
        a8 = a.view(self.a_dtype)
        y = fp8_gemm(rows(a8), self.a_scale, self.b8, self.b_scale, torch.float32 if wide else self.out_dtype)
        y = y.view(*a.shape[:-1], self.b8.shape[0])
        return y if out is None else out.copy_(y)


class RowwiseOperand:
    """``b`` (K, N) for the rowwise recipe: B's FP8 (N, K) with its (N, 1) scales; ``a`` arrives in 16
    bits and is cast along its rows here (role ``role`` of the slot; amaxes reduced over TP when a row's
    elements are split over it)."""

    def __init__(self, slot: Fp8Slot, role: str, b8, b_scale, reduce_rows: bool, dtype: torch.dtype):
        self.slot, self.role, self.b8, self.b_scale, self.reduce_rows = slot, role, b8, b_scale, reduce_rows
        self.shape = torch.Size((b8.shape[1], b8.shape[0]))
        self.dtype = self.out_dtype = dtype
        self.device = b8.device

    def dim(self) -> int:
        return 2

    def matmul(self, a: torch.Tensor, out: torch.Tensor | None = None, wide: bool = False) -> torch.Tensor:
        a8, sa = self.slot.cast(self.role, a, reduce_rows=self.reduce_rows)
        y = fp8_gemm(a8, sa, self.b8, self.b_scale, torch.float32 if wide else self.out_dtype)
        y = y.view(*a.shape[:-1], self.b8.shape[0])
        return y if out is None else out.copy_(y)


class Fp8Ops:
    """One call's FP8 casts of a column (``slot.column``) or row-parallel linear's weight ``weight``
    (out, in) 16-bit; ``saved``: what the forward's :meth:`saved` returned (backward)."""

    def __init__(self, slot: Fp8Slot, weight: torch.Tensor, saved: tuple | None):
        self.slot, self.weight, self.rowwise = slot, weight, slot.recipe.rowwise
        self.out_dtype = weight.dtype
        if saved is not None:
            self.w8, self.sw, self.sx = saved if saved else (None, None, None)
        elif self.rowwise:  # W's rows are its output features: split over TP in the row layer's shard
            self.w8, self.sw = slot.cast("w", weight.detach(), reduce_rows=not slot.column)
            self.sx = None
        else:
            self.w8, self.sw = slot.cast("w", weight.detach())
            self.sx = None

    def _operand_a(self, role: str, t: torch.Tensor):
        """(``t`` as the GEMM's ``a``: FP8 bytes, or 16 bits for rowwise (cast by the operand), its scale)."""
        self.out_dtype = t.dtype
        if self.rowwise:
            return t, None
        q, scale = self.slot.cast(role, t)
        return q.view(torch.uint8), scale

    def input(self, x: torch.Tensor) -> torch.Tensor:
        a, self.sx = self._operand_a("x", x)
        return a

    def forward_b(self):
        if self.rowwise:  # x's rows are whole in the column layer, split over TP in the row layer
            return RowwiseOperand(self.slot, "x", self.w8, self.sw, not self.slot.column, self.out_dtype)
        return Fp8Operand(self.w8, self.sw, self.sx, self.slot.dtype("x"), self.out_dtype)

    def saved(self) -> tuple:
        # rowwise re-quantises Wᵀ from the 16-bit weight in backward: nothing of the forward's casts
        return () if self.rowwise else (self.w8, self.sw, self.sx)

    def grad(self, dy: torch.Tensor) -> torch.Tensor:
        g, self.sdy = self._operand_a("dy", dy)
        return g

    def backward_b(self):
        if self.rowwise:  # Wᵀ's rows (input features) and dy's rows (tokens) span the ranks in the column layer
            col = self.slot.column
            wt8, swt = self.slot.cast("w", self.weight.detach().t().contiguous(), reduce_rows=col)
            return RowwiseOperand(self.slot, "dy", wt8, swt, col, self.out_dtype)
        return Fp8Operand(self.w8.t().contiguous(), self.sw, self.sdy, self.slot.dtype("dy"), self.out_dtype)

    def wgrad(self, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """dW = gᵀ·a in fp32 over these rows (tensorwise: the FP8 bytes transposed; rowwise: gᵀ and aᵀ
        re-quantised along their rows, which are whole on this rank)."""
        g2, a2 = rows(g), rows(a)
        if self.rowwise:
            g8, sg = self.slot.cast("dy", g2.t().contiguous())
            a8, sa = self.slot.cast("x", a2.t().contiguous())
            return fp8_gemm(g8, sg, a8, sa, torch.float32)
        g8 = g2.view(self.slot.dtype("dy")).t().contiguous()
        a8 = a2.view(self.slot.dtype("x")).t().contiguous()
        return fp8_gemm(g8, self.sdy, a8, self.sx, torch.float32)


class Fp8Format:
    """FP8 GEMMs for the linear of ``slot`` (:meth:`tpkernels.nn.tensor_parallel._TPLinear.enable_fp8`)."""

    trainable, name = True, "fp8"

    def __init__(self, slot: Fp8Slot):
        self.slot = slot
        # rowwise scales do not follow ring chunks of a row-split operand; its weight gradient needs whole columns
        self.ring = self.wgrad_chunks = not slot.recipe.rowwise

    def bind(self, weight: torch.Tensor, saved: tuple | None = None) -> Fp8Ops:
        return Fp8Ops(self.slot, weight, saved)


__all__ = ["Fp8Format", "Fp8Operand", "Fp8Ops", "RowwiseOperand"]
