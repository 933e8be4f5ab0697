"""Triton kernels of the chunked (vocabulary-parallel) cross-entropy of linear_cross_entropy.

Per row of a logits chunk z (rows, V_local), this rank's vocabulary ids [lo, lo + V_local):

    _ce_stats_kernel   (the row's max m, Σ exp(z − m), the target's logit or 0, Σ z): one pass over the
                       row with the online softmax (the ranks combine these in one all-reduce)
    _ce_grad_kernel    z ← row_scale · (exp(z − lse)·(1 + 2·z_loss·lse) − ε/V − (1−ε)·onehot), in place

Both are memory-bound: the stats pass reads the chunk once, the gradient pass reads and writes it
once (2 + 4 bytes per logit in bf16 with the read-back), so the whole loss costs about 3 logits
passes on top of the two GEMMs, and the logits of one chunk are all that exist at a time.
Math in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 1024


@triton.jit
def _ce_stats_kernel(z_ptr, t_ptr, out_ptr, V, stride_z, lo, ROWS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    t = tl.load(t_ptr + row) - lo
    m = float("-inf")
    s = 0.0
    zs = 0.0
    tz = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(z - m_new), 0.0), 0)
        m = m_new
        zs += tl.sum(tl.where(ok, z, 0.0), 0)
        tz += tl.sum(tl.where((cols == t) & ok, z, 0.0), 0)  # a target past this shard matches no column
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + ROWS + row, s)
    tl.store(out_ptr + 2 * ROWS + row, tz)
    tl.store(out_ptr + 3 * ROWS + row, zs)


@triton.jit
def _ce_grad_kernel(z_ptr, t_ptr, lse_ptr, scale_ptr, V, stride_z, lo, inv_vocab_eps, one_minus_eps, two_z_loss,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    t = tl.load(t_ptr + row) - lo
    lse = tl.load(lse_ptr + row)
    w = tl.load(scale_ptr + row)
    gain = 1.0 + two_z_loss * lse
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) * gain - inv_vocab_eps - tl.where(cols == t, one_minus_eps, 0.0)
        tl.store(base + cols, (g * w).to(z_ptr.dtype.element_ty), mask=ok)


def ce_stats(z: Tensor, target: Tensor, lo: int) -> Tensor:
    """z: (rows, V_local), unit column stride; target: (rows,) int64 -> (4, rows) fp32."""
    import torch  # noqa: PLC0415

    rows = z.shape[0]
    out = torch.empty((4, rows), dtype=torch.float32, device=z.device)
    if rows:
        _ce_stats_kernel[(rows,)](z, target, out, z.shape[1], z.stride(0), lo, rows, BLOCK=BLOCK_V, num_warps=4)
    return out


def ce_grad_(z: Tensor, target: Tensor, lo: int, lse: Tensor, row_scale: Tensor, vocab: int, smoothing: float,
             z_loss: float) -> Tensor:
    """z (rows, V_local) ← its loss gradient, in place (see the module docstring). lse, row_scale: (rows,)."""
    lse, row_scale = lse.float().contiguous(), row_scale.float().contiguous()
    if z.shape[0]:
        _ce_grad_kernel[(z.shape[0],)](z, target, lse, row_scale, z.shape[1], z.stride(0), lo, smoothing / vocab,
                                       1.0 - smoothing, 2.0 * z_loss, BLOCK=BLOCK_V, num_warps=4)
    return z


def compile_specs(arch: int, full: bool = False):
    specs = []
    for dtype in ("bf16", "fp16", "fp32"):
        p = f"*{dtype}"
        const = {"BLOCK": BLOCK_V}
        specs.append((_ce_stats_kernel, {"z_ptr": p, "t_ptr": "*i64", "out_ptr": "*fp32", "V": "i32", "stride_z": "i32",
                                         "lo": "i32", "ROWS": "i32", "BLOCK": "constexpr"}, const, {"num_warps": 4}))
        specs.append((_ce_grad_kernel, {"z_ptr": p, "t_ptr": "*i64", "lse_ptr": "*fp32", "scale_ptr": "*fp32",
                                        "V": "i32", "stride_z": "i32", "lo": "i32", "inv_vocab_eps": "fp32",
                                        "one_minus_eps": "fp32", "two_z_loss": "fp32", "BLOCK": "constexpr"},
                      const, {"num_warps": 4}))
    return specs


__all__ = ["ce_grad_", "ce_stats", "compile_specs"]
