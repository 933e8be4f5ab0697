"""Triton grouped GEMM over experts (GPU, and CPU under ``TRITON_INTERPRET=1``): one launch for all
local experts, forward (optionally with SwiGLU in the epilogue) and both backward GEMMs.

Views: x (N, K) rows grouped by expert, last-dim stride 1; w (E, K, M) any strides (the backward's dX
reads w[e] transposed through its strides, no copy); counts (E,) int64 on x's device.

Tile schedule (forward and dX). The tile table is built on the device from ``counts`` (no host read):
expert e owns ceil(counts[e] / BLOCK_M) row tiles; tile i of the launch finds its expert and first row
in two int32 tables. The launch has cdiv(N, BLOCK_M) + E row slots (an upper bound of Σ_e
ceil(counts[e] / BLOCK_M)) × cdiv(M, BLOCK_N) column blocks; slots past the last tile exit at once, and
an empty expert owns no tile. Rows past an expert's end are clamped for the loads and masked at the
store, so the K loop runs without row masks and pipelines.

SwiGLU epilogue (``SWIGLU``): w = [W_gate | W_up] (E, H, 2F); each program accumulates the gate tile
(columns n) and the up tile (columns F + n) from the same x tile and writes silu(gate) · up once:
the (N, 2F) pre-activation never reaches memory.

SwiGLU backward epilogue (``_grouped_gemm_dswiglu_kernel``): dh = dY · W_downᵀ per tile, then, from the
recomputed [gate | up] tiles, d[gate | up] and h = silu(gate) · up (dW_down's input) stored once each: dh never
reaches memory and SwiGLU's backward needs no pass of its own.

dW (``_grouped_gemm_wgrad_kernel``): dW_e = X_eᵀ · dY_e, a grouped reduction over each expert's rows:
program (e, k-block, m-block) walks the expert's rows in BLOCK_R steps and stores its (BLOCK_K, BLOCK_N)
tile once (zeros for an empty expert). No atomics: deterministic.

Floors, b bytes per element, N rows, E experts, K in, M out features (F = M/2 for SwiGLU):
    forward:  2·N·K·M FLOPs; reads N·K·b + E·K·M·b, writes N·M·b (SwiGLU: 2·N·K·2F FLOPs,
              reads N·K·b + E·K·2F·b, writes N·F·b: the pre-activation never round-trips, 4·N·F·b saved)
    dX:       2·N·M·K FLOPs; reads N·M·b + E·K·M·b, writes N·K·b
    dW:       2·N·K·M FLOPs; reads N·K·b + N·M·b, writes E·K·M·b
    dSwiGLU:  2·N·H·F FLOPs; reads N·H·b + E·F·H·b + 2·N·F·b (gate, up), writes 2·N·F·b + N·F·b (d gate_up, h)

dW's programs are one per (expert, output tile): an expert holding most rows is computed by its own
tiles_k × tiles_n programs while the others' finish early (no split over rows: that would need a second
pass or atomics). At Mixtral's sizes that is 32 × 224 (dW_gate_up) and 112 × 32 (dW_down) programs per expert,
more than an H100's 132 SMs hold; small experts (narrow FFNs, many experts) are where it shows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per arch and role; "wgrad": (BLOCK_K, BLOCK_N, BLOCK_R, ...),
# its output tile and the rows each step reduces. sm_90: 128×128 tiles over 8 warps (two
# warpgroups of m64 wgmma); the SwiGLU variant holds two accumulators, so half the columns. sm_80: the
# mma.sync shapes with a 32-deep K step (its shared memory holds 4 stages).
CONFIGS = {
    90: {"fwd": (128, 128, 64, 8, 3), "swiglu": (128, 64, 64, 8, 3), "dswiglu": (128, 64, 64, 8, 3),
         "wgrad": (128, 128, 64, 8, 3)},
    80: {"fwd": (128, 128, 32, 8, 4), "swiglu": (128, 64, 32, 8, 4), "dswiglu": (128, 64, 32, 8, 4),
         "wgrad": (128, 128, 32, 8, 4)},
}
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)  # the interpreter runs programs one by one: small tiles, odd shapes


@triton.jit
def _grouped_gemm_fwd_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, K, M, up_off,
                             stride_xm, stride_we, stride_wk, stride_wn, stride_ym,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_STAGES: tl.constexpr, SWIGLU: tl.constexpr):
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e >= 0:
        row0 = tl.load(tile_row_ptr + tl.program_id(0))
        end = tl.load(ends_ptr + e)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < end
        ks = tl.arange(0, BLOCK_K)
        # clamped rows and wrapped columns keep every load in bounds: only the K tail is masked
        a_ptrs = x_ptr + tl.where(in_rows, rows, row0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_e = w_ptr + e.to(tl.int64) * stride_we
        b_ptrs = w_e + ks.to(tl.int64)[:, None] * stride_wk + (cols % M).to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            u_ptrs = b_ptrs + up_off * stride_wn
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
            acc = tl.dot(a, b, acc)
            if SWIGLU:
                u = tl.load(u_ptrs, mask=ks[:, None] < K - k0, other=0.0)
                acc_up = tl.dot(a, u, acc_up)
                u_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        ok = in_rows[:, None] & (cols < M)[None, :]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _grouped_gemm_dswiglu_kernel(dy_ptr, w_ptr, gu_ptr, dgu_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, K, F,
                                 stride_dym, stride_we, stride_wk, stride_wn, stride_gum, stride_dgum, stride_hm,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 NUM_STAGES: tl.constexpr):
    """The expert MLP's backward through its second GEMM, SwiGLU's backward in the epilogue: dh = dY · W_downᵀ
    (a (BLOCK_M, BLOCK_N) tile of it), then with the recomputed gate/up tiles, d[gate | up] and h = silu(gate) · up
    (dW_down's input) written once each; dh itself never reaches memory."""
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e >= 0:
        row0 = tl.load(tile_row_ptr + tl.program_id(0))
        end = tl.load(ends_ptr + e)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < end
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = dy_ptr + tl.where(in_rows, rows, row0).to(tl.int64)[:, None] * stride_dym + ks[None, :]
        b_ptrs = (w_ptr + e.to(tl.int64) * stride_we + ks.to(tl.int64)[:, None] * stride_wk
                  + (cols % F).to(tl.int64)[None, :] * stride_wn)
        dh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
            dh = tl.dot(a, b, dh)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        ok = in_rows[:, None] & (cols < F)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        g = tl.load(gu_ptr + r64 * stride_gum + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r64 * stride_gum + F + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sg = tl.sigmoid(g)
        dg = dh * u * sg * (1.0 + g * (1.0 - sg))
        du = dh * g * sg
        tl.store(dgu_ptr + r64 * stride_dgum + cols[None, :], dg.to(dgu_ptr.dtype.element_ty), mask=ok)
        tl.store(dgu_ptr + r64 * stride_dgum + F + cols[None, :], du.to(dgu_ptr.dtype.element_ty), mask=ok)
        tl.store(h_ptr + r64 * stride_hm + cols[None, :], (g * sg * u).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _grouped_gemm_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, ends_ptr, counts_ptr, K, M, stride_xm, stride_dym,
                               stride_we, stride_wk, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr):
    e = tl.program_id(0)
    tiles_n = tl.cdiv(M, BLOCK_N)
    kb = tl.program_id(1) // tiles_n
    nb = tl.program_id(1) % tiles_n
    end = tl.load(ends_ptr + e)
    count = tl.load(counts_ptr + e)
    start = end - count
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    # X_eᵀ tile (BLOCK_K, BLOCK_R) and dY_e tile (BLOCK_R, BLOCK_N); wrapped k/n keep loads in bounds
    a_ptrs = x_ptr + (start + rr).to(tl.int64)[None, :] * stride_xm + (ks % K)[:, None]
    b_ptrs = dy_ptr + (start + rr).to(tl.int64)[:, None] * stride_dym + (ns % M)[None, :]
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in tl.range(0, count, BLOCK_R, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs, mask=rr[None, :] < count - r0, other=0.0)
        b = tl.load(b_ptrs, mask=rr[:, None] < count - r0, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_R * stride_xm
        b_ptrs += BLOCK_R * stride_dym
    ok = (ks < K)[:, None] & (ns < M)[None, :]
    tl.store(dw_ptr + e.to(tl.int64) * stride_we + ks.to(tl.int64)[:, None] * stride_wk + ns[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=ok)


def _config(device: torch.device, role: str) -> tuple:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    major = torch.cuda.get_device_capability(device)[0]
    return CONFIGS[90 if major >= 9 else 80][role]


def rows_within(counts: Tensor, num_rows: int) -> Tensor:
    """``counts`` cut to the ``num_rows`` rows that exist (negatives as 0, the groups past row N shortened
    or emptied): a device tensor's counts are not read on the host, so the kernels must stay in bounds
    whatever they hold. Device ops only."""
    ends = torch.cumsum(counts.clamp_min(0), 0).clamp_max(num_rows)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def tile_table(counts: Tensor, num_rows: int, block_m: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """(tile_expert, tile_row, ends, slots): per row-tile slot its expert (-1: no tile) and first row (int32),
    each expert's end row, and the slot count cdiv(num_rows, block_m) + E. Device ops only: no host read."""
    e = counts.shape[0]
    slots = triton.cdiv(num_rows, block_m) + e
    n_tiles = (counts + block_m - 1) // block_m
    cum_tiles = torch.cumsum(n_tiles, 0)
    ends = torch.cumsum(counts, 0)
    ids = torch.arange(slots, device=counts.device)
    expert = torch.searchsorted(cum_tiles, ids, right=True)  # E for slots past the last tile
    live = expert < e
    ex = expert.clamp_max(e - 1)
    first_tile = (cum_tiles - n_tiles)[ex]
    row = (ends - counts)[ex] + (ids - first_tile) * block_m
    tile_expert = torch.where(live, expert, -1).to(torch.int32)
    return tile_expert, row.to(torch.int32), ends, slots


def grouped_gemm(x: Tensor, w: Tensor, counts: Tensor, *, trans_w: bool = False, swiglu: bool = False,
                 out: Tensor | None = None) -> Tensor:
    """x (N, K), w (E, K, M) (``trans_w``: (E, M, K) read as (E, K, M)), counts (E,) int64 on x's device
    -> (N, M), or (N, M/2) = silu(gate) · up with ``swiglu``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, k = x.shape
    e = w.shape[0]
    if trans_w:
        m, s_wk, s_wn = w.shape[1], w.stride(2), w.stride(1)
    else:
        m, s_wk, s_wn = w.shape[2], w.stride(1), w.stride(2)
    m_out = m // 2 if swiglu else m
    out = torch.empty(n, m_out, dtype=x.dtype, device=x.device) if out is None else out
    if n == 0 or m_out == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk, warps, stages = _config(x.device, "swiglu" if swiglu else "fwd")
    tile_expert, tile_row, ends, slots = tile_table(rows_within(counts, n), n, bm)
    _grouped_gemm_fwd_kernel[(slots, triton.cdiv(m_out, bn))](
        x, w, out, tile_expert, tile_row, ends, k, m_out, m_out if swiglu else 0, x.stride(0), w.stride(0), s_wk,
        s_wn, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, SWIGLU=swiglu,
        num_warps=warps)
    return out


def grouped_dswiglu(dy: Tensor, w_down: Tensor, gate_up: Tensor, counts: Tensor, out: tuple | None = None
                    ) -> tuple[Tensor, Tensor]:
    """The expert MLP's backward through W_down and SwiGLU: dy (N, H), w_down (E, F, H), gate_up (N, 2F) the
    recomputed first GEMM, counts (E,) -> (d gate_up (N, 2F), h (N, F) = silu(gate) · up)."""
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    n, k = dy.shape
    f = w_down.shape[1]
    dgu, h = out if out is not None else (torch.empty(n, 2 * f, dtype=dy.dtype, device=dy.device),
                                          torch.empty(n, f, dtype=dy.dtype, device=dy.device))
    if n == 0 or f == 0:
        return dgu, h
    bm, bn, bk, warps, stages = _config(dy.device, "dswiglu")
    tile_expert, tile_row, ends, slots = tile_table(rows_within(counts, n), n, bm)
    # W_down (E, F, H) read as (E, H, F): K = H runs along its last dim
    _grouped_gemm_dswiglu_kernel[(slots, triton.cdiv(f, bn))](
        dy, w_down, gate_up, dgu, h, tile_expert, tile_row, ends, k, f, dy.stride(0), w_down.stride(0),
        w_down.stride(2), w_down.stride(1), gate_up.stride(0), dgu.stride(0), h.stride(0), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    return dgu, h


def grouped_wgrad(x: Tensor, dy: Tensor, counts: Tensor, out: Tensor | None = None) -> Tensor:
    """dW_e = x_eᵀ · dy_e: x (N, K), dy (N, M), counts (E,) -> (E, K, M) in x's dtype (zeros for an empty expert)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    e, k, m = counts.shape[0], x.shape[1], dy.shape[1]
    out = torch.empty(e, k, m, dtype=x.dtype, device=x.device) if out is None else out
    if out.numel() == 0:
        return out
    bk, bn, br, warps, stages = _config(x.device, "wgrad")
    counts = rows_within(counts, x.shape[0])
    ends = torch.cumsum(counts, 0)
    _grouped_gemm_wgrad_kernel[(e, triton.cdiv(k, bk) * triton.cdiv(m, bn))](
        x, dy, out, ends, counts, k, m, x.stride(0), dy.stride(0), out.stride(0), out.stride(1), BLOCK_K=bk,
        BLOCK_N=bn, BLOCK_R=br, NUM_STAGES=stages, num_warps=warps)
    return out


def compile_specs(arch: int, full: bool = False):
    configs = CONFIGS.get(arch, CONFIGS[80])
    specs = []
    for dtype in ("fp16", "bf16"):
        p = f"*{dtype}"
        for role, swiglu in (("fwd", False), ("swiglu", True)):
            bm, bn, bk, warps, stages = configs[role]
            sig = {"x_ptr": p, "w_ptr": p, "y_ptr": p, "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
                   "ends_ptr": "*i64", "K": "i32", "M": "i32", "up_off": "i32", "stride_xm": "i32",
                   "stride_we": "i32", "stride_wk": "i32", "stride_wn": "i32", "stride_ym": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "NUM_STAGES": "constexpr",
                   "SWIGLU": "constexpr"}
            const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_STAGES": stages, "SWIGLU": swiglu}
            # the forward reads w[e] row-major (stride_wn = 1); dX reads it transposed (stride_wk = 1)
            specs.append((_grouped_gemm_fwd_kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                          ("x_ptr", "w_ptr", "y_ptr", "K", "stride_xm", "stride_we", "stride_wk", "stride_ym")))
            if not swiglu:
                specs.append((_grouped_gemm_fwd_kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                              ("x_ptr", "w_ptr", "y_ptr", "K", "stride_xm", "stride_we", "stride_wn", "stride_ym")))
        bm, bn, bk, warps, stages = configs["dswiglu"]
        specs.append((_grouped_gemm_dswiglu_kernel,
                      {"dy_ptr": p, "w_ptr": p, "gu_ptr": p, "dgu_ptr": p, "h_ptr": p, "tile_expert_ptr": "*i32",
                       "tile_row_ptr": "*i32", "ends_ptr": "*i64", "K": "i32", "F": "i32", "stride_dym": "i32",
                       "stride_we": "i32", "stride_wk": "i32", "stride_wn": "i32", "stride_gum": "i32",
                       "stride_dgum": "i32", "stride_hm": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                       "BLOCK_K": "constexpr", "NUM_STAGES": "constexpr"},
                      {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_STAGES": stages},
                      {"num_warps": warps, "num_stages": stages},
                      ("dy_ptr", "w_ptr", "gu_ptr", "dgu_ptr", "h_ptr", "K", "F", "stride_dym", "stride_we",
                       "stride_wk", "stride_gum", "stride_dgum", "stride_hm")))
        bk, bn, br, warps, stages = configs["wgrad"]
        specs.append((_grouped_gemm_wgrad_kernel,
                      {"x_ptr": p, "dy_ptr": p, "dw_ptr": p, "ends_ptr": "*i64", "counts_ptr": "*i64", "K": "i32",
                       "M": "i32", "stride_xm": "i32", "stride_dym": "i32", "stride_we": "i32", "stride_wk": "i32",
                       "BLOCK_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr",
                       "NUM_STAGES": "constexpr"},
                      {"BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_R": br, "NUM_STAGES": stages},
                      {"num_warps": warps, "num_stages": stages},
                      ("x_ptr", "dy_ptr", "dw_ptr", "K", "M", "stride_xm", "stride_dym", "stride_we", "stride_wk")))
    return specs


__all__ = ["CONFIGS", "INTERPRETER_CONFIG", "compile_specs", "grouped_dswiglu", "grouped_gemm", "grouped_wgrad",
           "rows_within", "tile_table"]
