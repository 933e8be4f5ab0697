"""A frozen, quantised weight of a TP linear (QLoRA's base): this rank's shard, stored as NF4 or int8
pieces, and the two GEMMs a frozen weight needs.

    qw = QuantizedWeight("nf4", (out_local, in_local), torch.bfloat16, device)
    qw.load_(w_shard, row_splits=[q_rows, k_rows, v_rows])  # quantised piece by piece; w_shard can be freed
    y = qw.forward_gemm(x)        # x (..., in_local) -> (..., out_local) = x · Wᵀ
    dx = qw.input_grad(dy)        # dy (..., out_local) -> (..., in_local) = dy · W
    qw.operand(transposed=True)   # Wᵀ as the ``b`` of the GEMM-communication ops (ring / collective)

Pieces: one per Hugging Face tensor the shard is made of (the fused q/k/v shard holds rows of q_proj,
k_proj and v_proj; gate/up rows of gate_proj and up_proj), each quantised as a tensor of its own, so
a one-process model quantises every Hugging Face tensor exactly as bitsandbytes does (the same
bytes), and a TP rank its rectangle of each: a block never straddles a TP split or two tensors. A
piece whose element count is not a multiple of 64 ends in a short block (its row-major flatten is
cut into 64s; a block may span two rows of the same piece, never two ranks). The double
quantisation's statistics (the mean absmax, one scale per 256 blocks) are per piece, so the bytes
depend on the TP size: each layout re-quantises from the full-precision checkpoint, never slices a
quantised weight.

The GEMMs run the ``nf4_linear`` op per piece (its kernels dequantise in registers or in small
panels; the dispatch rule picks them) and concatenate (forward) or sum (input gradient) over the
pieces. int8 (per output row absmax) dequantises panels of ``INT8_PANEL_ROWS`` rows into the
activation dtype and calls the ATen GEMM (no kernel of its own: the panel bounds the transient to
a few MB and the GEMM is cuBLAS / oneDNN's). The buffers are non-persistent: they follow
``module.to(device)`` but are not in ``state_dict`` (checkpoints re-quantise from the base).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpkernels.dtypes import widen
from tpkernels.functional.nf4_linear import nf4_linear_bwd, nf4_linear_fwd
from tpkernels.quant.nf4 import BLOCK, Int8Weight, NF4Weight, dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4

FORMATS = ("nf4", "int8")
INT8_PANEL_ROWS = 1024  # rows of an int8 weight dequantised at a time (transient: 1024 · in · 2 bytes)
_NF4_FIELDS = ("packed", "absmax_q", "absmax_scale", "absmax_offset")


class QuantizedWeight(nn.Module):
    """shape (out, in): the local shard's; dtype: the activations' (and of what ``dequantize`` returns)."""

    def __init__(self, fmt: str, shape: tuple[int, int], dtype: torch.dtype, device=None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"quant ({fmt!r}) must be one of {', '.join(FORMATS)}")
        self.fmt, self.shape, self.dtype = fmt, tuple(int(s) for s in shape), dtype
        self.quant_device = torch.device(device) if device is not None else torch.device("cpu")
        self.rows: list[int] = []  # rows of each piece, in order

    @property
    def loaded(self) -> bool:
        return bool(self.rows)

    @property
    def device(self) -> torch.device:
        for b in self.buffers():
            return b.device
        return self.quant_device

    @torch.no_grad()
    def load_(self, w: Tensor, row_splits: list[int] | None = None) -> "QuantizedWeight":
        """Quantise ``w`` (this shard, (out, in), any float dtype) piece by piece along its rows;
        the caller may free ``w`` afterwards (nothing here keeps a reference)."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"weight shape {tuple(w.shape)} must be the layer's shard shape {self.shape}")
        splits = list(row_splits) if row_splits else [self.shape[0]]
        if sum(splits) != self.shape[0] or min(splits) < 1:
            raise ValueError(f"row_splits {splits} must be positive and sum to the shard's rows ({self.shape[0]})")
        for name in list(self._buffers):
            del self._buffers[name]
        w = w.to(self.quant_device)
        for i, piece in enumerate(w.split(splits, dim=0)):
            if self.fmt == "nf4":
                q = quantize_nf4(piece)
                for f in _NF4_FIELDS:
                    self.register_buffer(f"p{i}_{f}", getattr(q, f), persistent=False)
            else:
                q = quantize_int8(piece)
                self.register_buffer(f"p{i}_data", q.data, persistent=False)
                self.register_buffer(f"p{i}_absmax", q.absmax, persistent=False)
        self.rows = splits
        return self

    def pieces(self) -> list[NF4Weight | Int8Weight]:
        if not self.loaded:
            raise RuntimeError("the quantised weight was never loaded (load the model's weights first: from_hf, "
                               "load_hf_ or init_weights_)")
        out = []
        for i, n in enumerate(self.rows):
            if self.fmt == "nf4":
                out.append(NF4Weight(*(getattr(self, f"p{i}_{f}") for f in _NF4_FIELDS), (n, self.shape[1]),
                                     self.dtype))
            else:
                out.append(Int8Weight(getattr(self, f"p{i}_data"), getattr(self, f"p{i}_absmax"), self.dtype))
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The (out, in) weight this shard holds, in ``dtype`` (default: the layer's)."""
        deq = dequantize_nf4 if self.fmt == "nf4" else dequantize_int8
        return torch.cat([deq(q, dtype or self.dtype) for q in self.pieces()])

    # ---- the two GEMMs (no autograd: called inside the TP linears' autograd functions) ----
    def forward_gemm(self, x: Tensor) -> Tensor:
        """x (..., in) -> x · Wᵀ (..., out), x's dtype."""
        outs = [self._fwd(x, q) for q in self.pieces()]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def input_grad(self, dy: Tensor) -> Tensor:
        """dy (..., out) -> dy · W (..., in), dy's dtype."""
        dx = None
        for q, d in zip(self.pieces(), dy.split(self.rows, dim=-1)):
            part = self._bwd(d, q)
            dx = part if dx is None else dx.add_(part)
        return dx

    def _fwd(self, x: Tensor, q) -> Tensor:
        if self.fmt == "nf4":
            return nf4_linear_fwd(x, q.packed, q.absmax_q, q.absmax_scale, q.absmax_offset, q.shape[0])
        n = q.data.shape[0]
        out = x.new_empty((*x.shape[:-1], n))
        for r in range(0, n, INT8_PANEL_ROWS):
            panel = Int8Weight(q.data[r:r + INT8_PANEL_ROWS], q.absmax[r:r + INT8_PANEL_ROWS], x.dtype)
            out[..., r:r + INT8_PANEL_ROWS] = torch.matmul(x, dequantize_int8(panel).t())
        return out

    def _bwd(self, dy: Tensor, q) -> Tensor:
        k = self.shape[1]
        if self.fmt == "nf4":
            return nf4_linear_bwd(dy.contiguous(), q.packed, q.absmax_q, q.absmax_scale, q.absmax_offset, k)
        dx = None
        for r in range(0, q.data.shape[0], INT8_PANEL_ROWS):
            panel = Int8Weight(q.data[r:r + INT8_PANEL_ROWS], q.absmax[r:r + INT8_PANEL_ROWS], dy.dtype)
            part = torch.matmul(dy[..., r:r + INT8_PANEL_ROWS], dequantize_int8(panel))
            dx = part if dx is None else dx.add_(part)
        return dx

    def operand(self, transposed: bool) -> "QuantizedOperand":
        return QuantizedOperand(self, transposed)

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={self.shape}, pieces={self.rows}, {self.nbytes} bytes"


class QuantizedOperand:
    """The ``b`` of :mod:`tpkernels.functional.gemm_comm` for a quantised weight W (out, in):
    ``transposed`` is Wᵀ (K = in, N = out: the forward), else W (K = out, N = in: the input gradient).
    ``a @ b`` is ``b.matmul(a)``; it has a shape, a dtype and a device like a tensor, nothing else."""

    def __init__(self, qw: QuantizedWeight, transposed: bool):
        self.qw, self.transposed = qw, transposed
        out, inp = qw.shape
        self.shape = torch.Size((inp, out) if transposed else (out, inp))
        self.dtype, self.device = qw.dtype, qw.device

    def dim(self) -> int:
        return 2

    def matmul(self, a: Tensor, out: Tensor | None = None, wide: bool = False) -> Tensor:
        """``a @ self``; ``wide``: in the accumulation dtype (the kernels write a's dtype: widened after)."""
        y = self.qw.forward_gemm(a) if self.transposed else self.qw.input_grad(a)
        if wide:
            y = widen(y)
        if out is None:
            return y
        return out.copy_(y)


def is_operand(b) -> bool:
    """``b`` is a weight operand object (QuantizedOperand, the FP8 format's operands), not a tensor: it has
    ``shape``, ``dtype`` (what ``a`` must be), ``device``, ``matmul(a, out, wide)`` and maybe ``out_dtype``."""
    return not isinstance(b, Tensor) and hasattr(b, "matmul")


def out_dtype(a: Tensor, b) -> torch.dtype:
    """The dtype of ``a @ b``: an operand's ``out_dtype`` (FP8 bytes in, 16-bit out), else a's."""
    return getattr(b, "out_dtype", a.dtype)


def matmul(a: Tensor, b, out: Tensor | None = None, wide: bool = False) -> Tensor:
    """``a @ b`` for a tensor or an operand ``b`` (the TP linears' and GEMM-communication ops' one GEMM
    call); ``wide``: the result in the accumulation dtype (partial sums that travel between ranks: an FP8
    operand's GEMM writes fp32 directly, a 16-bit GEMM's output is widened)."""
    if is_operand(b):
        return b.matmul(a, out, wide=wide)
    if wide:
        y = widen(torch.matmul(a, b))
        return y if out is None else out.copy_(y)
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def triton_shape_problem(in_features: int, layer: str = "layer") -> str | None:
    """Why the CUDA (Triton) NF4 kernels cannot take a layer whose shard has ``in_features`` columns
    (None when they can): the GEMM steps K one NF4 block (64) per row at a time. The CPU kernels
    take any shape."""
    if in_features % BLOCK:
        return (f"{layer}: in_features per rank ({in_features}) must be a multiple of {BLOCK} for the CUDA NF4 "
                f"kernels (one NF4 block per row per K step); choose a tensor_parallel_size that keeps it so, or "
                "model.quant int8")
    return None


__all__ = ["FORMATS", "QuantizedOperand", "QuantizedWeight", "is_operand", "matmul", "out_dtype",
           "triton_shape_problem"]
