"""Weight formats of the TP linears: what a format supplies to the one communication schedule of
:mod:`tpkernels.functional.tp_linear` (its casts and its GEMMs), for one call.

The schedule multiplies ``a @ b`` (``tpkernels.functional.quantized_weight.matmul``: a tensor ``b`` or
an operand object with ``matmul``) and moves ``a`` through the GEMM-communication ops; the format says
what ``a`` and ``b`` are:

    ops = fmt.bind(weight)             # forward: the weight's casts for this call (FP8: W quantised once)
    a = ops.input(x)                   # x as the forward GEMM takes it (FP8 tensorwise: FP8 bytes)
    y = a @ ops.forward_b()            # Wᵀ: (K = in, N = out)
    ctx.save_for_backward(..., *ops.saved())
    ops = fmt.bind(weight, saved)      # backward: the same casts, from what the forward saved
    g = ops.grad(dy)                   # dy as the backward GEMMs take it
    dx = g @ ops.backward_b()          # W: (K = out, N = in)
    dW = ops.wgrad(g, a)               # dyᵀ·x in the accumulation dtype (None: the plain GEMM)

Attributes of a format: ``trainable`` (the weight has a gradient; a quantised base does not, and then
nothing of ``a`` is kept), ``ring`` (its operands may be cut into ring chunks; else the schedule runs
the collective algorithm), ``wgrad_chunks`` (dW may be summed over chunks of rows, in the shadow of
communication). Partial sums that travel between ranks come out of ``matmul(..., wide=True)`` in the
accumulation dtype (fp32 for 16-bit and FP8 GEMMs).

Formats: :data:`DENSE` (the weight tensor as it is, 16/32/64-bit), :class:`QuantizedFormat` (NF4 / int8,
a frozen base, the dequantising GEMMs of :mod:`tpkernels.functional.quantized_weight`) and
:class:`tpkernels.functional.fp8_format.Fp8Format` (FP8 GEMMs with scales).
"""

from __future__ import annotations

import torch

from tpkernels.functional.quantized_weight import QuantizedWeight


class DenseOps:
    """A weight tensor as it is: every GEMM a plain matmul."""

    wgrad = None

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward_b(self) -> torch.Tensor:
        return self.weight.t()

    def grad(self, dy: torch.Tensor) -> torch.Tensor:
        return dy

    def backward_b(self) -> torch.Tensor:
        return self.weight

    def saved(self) -> tuple:
        return ()


class DenseFormat:
    trainable, ring, wgrad_chunks, name = True, True, True, "dense"

    def bind(self, weight: torch.Tensor, saved: tuple | None = None) -> DenseOps:
        return DenseOps(weight)


DENSE = DenseFormat()


class QuantizedOps(DenseOps):
    """A frozen NF4 / int8 weight: the dequantising GEMMs as operands; no weight gradient."""

    def __init__(self, qw: QuantizedWeight):
        self.qw = qw

    def forward_b(self):
        return self.qw.operand(transposed=True)

    def backward_b(self):
        return self.qw.operand(transposed=False)


class QuantizedFormat:
    """QLoRA's base: the layer's :class:`QuantizedWeight` (this rank's shard)."""

    trainable, ring, wgrad_chunks = False, True, True

    def __init__(self, qw: QuantizedWeight):
        self.qw, self.name = qw, qw.fmt

    def bind(self, weight, saved: tuple | None = None) -> QuantizedOps:
        return QuantizedOps(self.qw)


__all__ = ["DENSE", "DenseFormat", "DenseOps", "QuantizedFormat", "QuantizedOps"]
