"""Triton MoE token permutation (GPU, and CPU under ``TRITON_INTERPRET=1``): row gathers both ways.

Views (see functional/moe_permute.py): src/x (T, H), sorted rows y (N, H), all with last-dim stride 1;
index (N,) int64 source row of each sorted row; pos (T, k) int64 sorted row of each slot, -1 = dropped;
weights (T, k) contiguous float. Math in fp32.

    gather_rows:   out[i] = scale[i] · src[index[i]]          permute forward; unpermute's dy
    combine_rows:  out[t] = Σ_j w[t, j] · y[pos[t, j]]          unpermute forward; permute's dx
    combine_wgrad: dw[t, j] = dout[t] · y[pos[t, j]]            unpermute's d weights

The combine reads each token's k rows through ``pos`` instead of scattering sorted rows with atomics:
every output row is written by one program, so results are deterministic and need no zeroed buffer.

Floors (b bytes per element, N kept rows, int64 maps): gather reads and writes N·H·b (+ 8N index,
+ 4N scale); combine reads N·H·b + 8T·k (+ 4T·k weights), writes T·H·b; wgrad reads T·H·b + N·H·b +
8T·k, writes 4T·k. No FLOPs to speak of (2·N·H multiply-adds): pure bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Elements per program: 2048 (8 KiB of fp32 per loaded tile). The combine holds an fp32 accumulator and a
# 64-bit row address per loaded row; at 4096 elements over 4 warps it spilled (255 registers on sm_80).
TILE_ELEMENTS = 2048
BLOCK_H_CHOICES = (16, 32, 64, 128, 256)
NUM_WARPS = 4


@triton.jit
def _moe_gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, out_ptr, N, H, stride_src, stride_out,
                            HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mrow = rm < N
    mask = mrow[:, None] & (rh[None, :] < H)
    src_rows = tl.load(idx_ptr + rm, mask=mrow, other=0).to(tl.int64)
    v = tl.load(src_ptr + src_rows[:, None] * stride_src + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr + rm, mask=mrow, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_out + rh[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_combine_rows_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, T, H, K, stride_y, stride_out,
                             HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mt = rt < T
    mh = rh < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(K):
        p = tl.load(pos_ptr + rt.to(tl.int64) * K + j, mask=mt, other=-1)
        ok = p >= 0
        v = tl.load(y_ptr + tl.maximum(p, 0).to(tl.int64)[:, None] * stride_y + rh[None, :],
                    mask=ok[:, None] & mh[None, :], other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + rt.to(tl.int64) * K + j, mask=ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_out + rh[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mh[None, :])


@triton.jit
def _moe_combine_wgrad_kernel(dout_ptr, y_ptr, pos_ptr, dw_ptr, S, H, K, stride_d, stride_y,
                              BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    rs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # slots t·K + j
    ms = rs < S
    p = tl.load(pos_ptr + rs, mask=ms, other=-1)
    ok = p >= 0
    tok = (rs // K).to(tl.int64)
    rows = tl.maximum(p, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        m = ok[:, None] & (rh[None, :] < H)
        d = tl.load(dout_ptr + tok[:, None] * stride_d + rh[None, :], mask=m, other=0.0).to(tl.float32)
        v = tl.load(y_ptr + rows[:, None] * stride_y + rh[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(d * v, axis=1)
    tl.store(dw_ptr + rs, acc, mask=ms)


def tile_for(h: int) -> tuple[int, int]:
    """(rows, columns) of one program's tile for rows of length h."""
    block_h = min(max(triton.next_power_of_2(max(h, 1)), BLOCK_H_CHOICES[0]), BLOCK_H_CHOICES[-1])
    return TILE_ELEMENTS // block_h, block_h


def gather_rows(src: Tensor, index: Tensor, scale: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """src (T, H), index (N,) int64, scale (N,) or None -> out (N, H) in src's dtype."""
    src = src if src.stride(-1) == 1 else src.contiguous()
    n, h = index.shape[0], src.shape[1]
    out = torch.empty(n, h, dtype=src.dtype, device=src.device) if out is None else out
    if n and h:
        bm, bh = tile_for(h)
        scale_arg = scale.contiguous() if scale is not None else index
        _moe_gather_rows_kernel[(triton.cdiv(n, bm), triton.cdiv(h, bh))](
            src, index.contiguous(), scale_arg, out, n, h, src.stride(0), out.stride(0), HAS_SCALE=scale is not None,
            BLOCK_M=bm, BLOCK_H=bh, num_warps=NUM_WARPS)
    return out


def combine_rows(y: Tensor, pos: Tensor, weights: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """y (N, H), pos (T, k) int64, weights (T, k) or None -> out (T, H) in y's dtype."""
    y = y if y.stride(-1) == 1 else y.contiguous()
    t, k = pos.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device) if out is None else out
    if t and h:
        bm, bh = tile_for(h)
        w_arg = weights.contiguous() if weights is not None else pos
        _moe_combine_rows_kernel[(triton.cdiv(t, bm), triton.cdiv(h, bh))](
            y, pos.contiguous(), w_arg, out, t, h, k, y.stride(0), out.stride(0), HAS_W=weights is not None,
            BLOCK_T=bm, BLOCK_H=bh, num_warps=NUM_WARPS)
    return out


WGRAD_BLOCK_S = 32  # slots per program; each walks its slots' rows in BLOCK_H-wide strips
WGRAD_BLOCK_H = (16, 64)  # the strip width's range: 32 × 128 strips of two operands spilled on sm_80


def combine_wgrad(dout: Tensor, y: Tensor, pos: Tensor, out: Tensor | None = None) -> Tensor:
    """dout (T, H), y (N, H), pos (T, k) -> dw (T, k) float32."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    s, h = pos.numel(), y.shape[1]
    out = torch.empty(pos.shape, dtype=torch.float32, device=y.device) if out is None else out
    if s:
        bh = min(max(triton.next_power_of_2(max(h, 1)), WGRAD_BLOCK_H[0]), WGRAD_BLOCK_H[1])
        _moe_combine_wgrad_kernel[(triton.cdiv(s, WGRAD_BLOCK_S),)](
            dout, y, pos.contiguous(), out, s, h, pos.shape[1], dout.stride(0), y.stride(0), BLOCK_S=WGRAD_BLOCK_S,
            BLOCK_H=bh, num_warps=NUM_WARPS)
    return out


def compile_specs(arch: int, full: bool = False):
    """As the JIT specializes them for 16-aligned rows (H and the row strides multiples of 16: hidden sizes
    of real models); odd H compiles the same code with scalar loads."""
    specs = []
    for dtype in ("fp32", "fp16", "bf16"):
        p = f"*{dtype}"
        # every tile shape in bf16 (the training dtype); the other dtypes change only the element width
        block_hs = BLOCK_H_CHOICES if full or dtype == "bf16" else (BLOCK_H_CHOICES[-1],)
        for bh in block_hs:
            const = {"BLOCK_M": TILE_ELEMENTS // bh, "BLOCK_H": bh}
            # the scaled / weighted variant at every shape (it holds more registers); the plain one at the widest
            for has in (False, True) if full or bh == block_hs[-1] else (True,):
                specs.append((_moe_gather_rows_kernel,
                              {"src_ptr": p, "idx_ptr": "*i64", "scale_ptr": "*fp32", "out_ptr": p, "N": "i32",
                               "H": "i32", "stride_src": "i32", "stride_out": "i32", "HAS_SCALE": "constexpr",
                               "BLOCK_M": "constexpr", "BLOCK_H": "constexpr"},
                              {**const, "HAS_SCALE": has}, {"num_warps": NUM_WARPS},
                              ("src_ptr", "out_ptr", "H", "stride_src", "stride_out")))
                specs.append((_moe_combine_rows_kernel,
                              {"y_ptr": p, "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": p, "T": "i32", "H": "i32",
                               "K": "i32", "stride_y": "i32", "stride_out": "i32", "HAS_W": "constexpr",
                               "BLOCK_T": "constexpr", "BLOCK_H": "constexpr"},
                              {"BLOCK_T": const["BLOCK_M"], "BLOCK_H": bh, "HAS_W": has}, {"num_warps": NUM_WARPS},
                              ("y_ptr", "out_ptr", "H", "stride_y", "stride_out")))
        for bh in WGRAD_BLOCK_H:
            specs.append((_moe_combine_wgrad_kernel,
                          {"dout_ptr": p, "y_ptr": p, "pos_ptr": "*i64", "dw_ptr": "*fp32", "S": "i32", "H": "i32",
                           "K": "i32", "stride_d": "i32", "stride_y": "i32", "BLOCK_S": "constexpr",
                           "BLOCK_H": "constexpr"},
                          {"BLOCK_S": WGRAD_BLOCK_S, "BLOCK_H": bh}, {"num_warps": NUM_WARPS},
                          ("dout_ptr", "y_ptr", "H", "stride_d", "stride_y")))
    return specs


__all__ = ["combine_rows", "combine_wgrad", "compile_specs", "gather_rows", "tile_for"]
