"""Triton rotary position embedding (GPU, and CPU under ``TRITON_INTERPRET=1``).

Views seen by the kernel: x (tokens, heads, head_dim) with any token and head strides and a unit
feature stride (q and k straight from a packed QKV projection); out likewise (may be x itself:
in place); cos, sin (max_positions, r/2) fp32, contiguous; positions (tokens,) int64. One program
rotates BLOCK_T tokens × all heads: the cos/sin row of a token is loaded once for its heads.

    half-split (NeoX / Llama):  out[i] = x[i]·c − x[i+r/2]·s,  out[i+r/2] = x[i+r/2]·c + x[i]·s
    interleaved (GPT-J):        out[2i] = x[2i]·c − x[2i+1]·s, out[2i+1] = x[2i+1]·c + x[2i]·s
    backward: the same with −s (the inverse rotation); features past r are copied.

Floor (b bytes per element): read x, write out: 2b·tokens·heads·head_dim, plus 8 bytes of
cos/sin per token and rotary pair (cached across heads).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

TILE_ELEMENTS = 4096


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, T, H, stride_xt, stride_xh, stride_ot, stride_oh,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, CONJ: tl.constexpr,
                   COPY_REST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    t_ok = t < T
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    cs_mask = t_ok[:, None] & (i[None, :] < HALF)
    c = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=cs_mask, other=1.0)[:, None, :]
    s = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=cs_mask, other=0.0)[:, None, :]
    if CONJ:
        s = -s
    t64 = t.to(tl.int64)[:, None, None]
    hh = h[None, :, None]
    mask = t_ok[:, None, None] & (hh < H) & (i[None, None, :] < HALF)
    if INTERLEAVED:
        i1 = 2 * i[None, None, :]
        i2 = i1 + 1
    else:
        i1 = i[None, None, :]
        i2 = i1 + HALF
    xb = x_ptr + t64 * stride_xt + hh * stride_xh
    ob = out_ptr + t64 * stride_ot + hh * stride_oh
    x1 = tl.load(xb + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ob + i1, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(ob + i2, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_REST:  # partial rotary: the features past 2·HALF pass through
        j = 2 * HALF + tl.arange(0, BLOCK_REST)[None, None, :]
        rest_mask = t_ok[:, None, None] & (hh < H) & (j < HEAD_DIM)
        tl.store(ob + j, tl.load(xb + j, mask=rest_mask, other=0.0), mask=rest_mask)


def blocks_for(tokens: int, heads: int, half: int, head_dim: int) -> dict:
    block_h, block_r = triton.next_power_of_2(max(heads, 1)), triton.next_power_of_2(max(half, 1))
    block_t = max(1, min(TILE_ELEMENTS // (2 * block_h * block_r), triton.next_power_of_2(max(tokens, 1))))
    rest = head_dim - 2 * half
    return dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_R=block_r,
                BLOCK_REST=triton.next_power_of_2(max(rest, 1)), COPY_REST=rest > 0)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool, conjugate: bool,
           out: Tensor) -> Tensor:
    """x, out: (tokens, heads, head_dim), unit feature stride; cos, sin: (max_positions, half) fp32;
    positions: (tokens,) int64 -> out."""
    tokens, heads, head_dim = x.shape
    half = cos.shape[-1]
    if x.numel() == 0:
        return out
    meta = blocks_for(tokens, heads, half, head_dim)
    _rotary_kernel[(triton.cdiv(tokens, meta["BLOCK_T"]),)](
        x, out, cos, sin, positions, tokens, heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HALF=half, HEAD_DIM=head_dim, INTERLEAVED=interleaved, CONJ=conjugate, **meta, num_warps=4)
    return out


def compile_specs(arch: int, full: bool = False):
    """Llama/Qwen/Mistral shapes (head dims 64 and 128, 8 and 32 heads per rank), both layouts, forward
    and backward, a partial-rotary case; bf16 and fp16 (fp32 at one shape)."""
    specs = []
    cases = [(128, 64, 32, "bf16"), (128, 64, 8, "fp16"), (64, 32, 16, "bf16"), (128, 32, 8, "bf16"),
             (128, 64, 32, "fp32")]
    for n, (head_dim, half, heads, dtype) in enumerate(cases):
        for interleaved in ((False, True) if full or n < 2 else (False,)):
            for conj in (False, True):
                meta = blocks_for(4096, heads, half, head_dim)
                const = dict(HALF=half, HEAD_DIM=head_dim, INTERLEAVED=interleaved, CONJ=conj, **meta)
                p = f"*{dtype}"
                sig = {"x_ptr": p, "out_ptr": p, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "T": "i32",
                       "H": "i32", "stride_xt": "i32", "stride_xh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                       **{k: "constexpr" for k in const}}
                specs.append((_rotary_kernel, sig, const, {"num_warps": 4}))
    return specs


__all__ = ["blocks_for", "compile_specs", "rotary"]
