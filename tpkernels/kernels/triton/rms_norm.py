"""Triton RMSNorm with the fused residual add (GPU, and CPU under ``TRITON_INTERPRET=1``).

    forward:  h = x (+ residual, stored: the residual stream);  rstd = rsqrt(mean(h²) + eps)
              y = h · rstd · weight
    backward: n = h · rstd;  dn = dy · weight;  dx = rstd · (dn − n · mean(dn · n)) (+ dh)
              dweight = Σ_rows dy · n

Views seen by the kernels (the launchers flatten leading dims first): x, residual, dy, dh:
(M, N) with last-dim stride 1, any row stride; weight (N,); y, h, dx (M, N) contiguous; rstd (M,)
fp32. A program holds whole rows (BLOCK_N >= N, N <= MAX_N): one read of every input, one write
of every output. Statistics in fp32. The backward saves no normalised output: it recomputes n
from h and rstd (4 bytes a row).

Floors (b bytes per element): forward reads x (+ residual) and writes y (+ h): 2b·M·N (4b with
the residual); backward reads dy, h (+ dh) and writes dx: 3b·M·N (4b), plus
programs · N · 4 bytes of fp32 dweight partial sums, reduced in a fixed order afterwards (no
atomics: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tpkernels.kernels.triton.occupancy import program_target

# Whole rows live in registers up to here (Llama 3 70B's hidden size). Longer rows run the reference
# path: at 16384 (Llama 3 405B) the backward spills even with 32 warps (64 registers a thread).
MAX_N = 8192
TILE_ELEMENTS = 4096  # rows per program: BLOCK_M = TILE_ELEMENTS / BLOCK_N for short rows


@triton.jit
def prenorm_rows(x_ptr, r_ptr, h_ptr, rows, rn, mask, N, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr):
    """The fp32 input of a norm over a (BLOCK_M, BLOCK_N) tile of rows (``rows`` int64 (BLOCK_M, 1),
    columns ``rn``): x, or with a residual h = x + residual, stored (contiguous, the residual stream)
    and returned as stored, so the statistics are those of the h the backward reads."""
    x = tl.load(x_ptr + rows * stride_xm + rn[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows * stride_rm + rn[None, :], mask=mask, other=0.0)
        h_lp = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows * N + rn[None, :], h_lp, mask=mask)
        h = h_lp.to(tl.float32)
    else:
        h = x.to(tl.float32)
    return h


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, N, stride_xm, stride_rm, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    mask_n = rn < N
    mask = (rm[:, None] < M) & mask_n[None, :]
    rows = rm.to(tl.int64)[:, None]  # int64: M·stride can pass 2^31
    h = prenorm_rows(x_ptr, r_ptr, h_ptr, rows, rn, mask, N, stride_xm, stride_rm, HAS_RESIDUAL)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / N + eps)
    w = tl.load(w_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rm, rstd, mask=rm < M)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, h_ptr, w_ptr, rstd_ptr, dh_ptr, dx_ptr, partial_ptr, M, N, stride_dym, stride_hm,
                         stride_dhm, rows_per_program,
                         HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rn = tl.arange(0, BLOCK_N)
    mask_n = rn < N
    w = tl.load(w_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row0 = pid * rows_per_program
    for m0 in range(row0, row0 + rows_per_program, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask = (rm[:, None] < M) & mask_n[None, :]
        rows = rm.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + rows * stride_dym + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + rows * stride_hm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rm, mask=rm < M, other=0.0)
        n = h * rstd[:, None]
        dn = dy * w[None, :]
        c = tl.sum(dn * n, axis=1) / N
        dx = rstd[:, None] * (dn - n * c[:, None])
        if HAS_DH:
            dx += tl.load(dh_ptr + rows * stride_dhm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows * N + rn[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(dy * n, axis=0)  # masked lanes hold dy = 0
    tl.store(partial_ptr + pid * N + rn, acc, mask=mask_n)


def tile_for(n: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of ``n`` elements: at most 16 elements of a tile per
    thread (8 in the backward below 8192 columns, which keeps more values live per element: dy, h,
    n, dn, dx and the dweight row), so no config spills on sm_80/sm_90 (aot_check)."""
    block_n = max(16, triton.next_power_of_2(max(n, 1)))
    block_m = max(1, TILE_ELEMENTS // block_n)
    if backward:
        return block_m, block_n, 8 if block_n <= 2048 else 16
    return block_m, block_n, 8 if block_n <= 4096 else 16


def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, out: Tensor | None = None,
                 h_out: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """x, residual: (M, N), last-dim stride 1; weight (N,) -> (y, h or None, rstd (M,) fp32)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    h = None if residual is None else (torch.empty((m, n), dtype=x.dtype, device=x.device) if h_out is None else h_out)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, h, rstd
    block_m, block_n, warps = tile_for(n)
    r = residual if residual is not None else x
    _rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
        x, r, weight, y, h if h is not None else y, rstd, m, n, x.stride(0), r.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y, h, rstd


def rms_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None = None,
                 dx_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dy, h, dh: (M, N), last-dim stride 1; weight (N,); rstd (M,) -> (dx (M, N), dweight (N,))."""
    m, n = h.shape
    dx = torch.empty((m, n), dtype=h.dtype, device=h.device) if dx_out is None else dx_out
    if m == 0 or n == 0:
        if dh is not None:
            dx.copy_(dh)
        return dx, torch.zeros_like(weight)
    block_m, block_n, warps = tile_for(n, backward=True)
    rows_per_program = triton.cdiv(triton.cdiv(m, program_target(h.device)), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    partial = torch.empty((programs, n), dtype=torch.float32, device=h.device)
    g = dh if dh is not None else dy
    _rms_norm_bwd_kernel[(programs,)](
        dy, h, weight, rstd, g, dx, partial, m, n, dy.stride(0), h.stride(0), g.stride(0), rows_per_program,
        HAS_DH=dh is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


def compile_specs(arch: int, full: bool = False):
    """Every (kernel, signature, constexprs, options) this module can launch, for AOT compile checks:
    every row block in bf16 (the residual / dh variant alternating), fp32 and fp16 at the extremes;
    ``full``: every combination."""
    specs = []
    for i, block_n in enumerate(16 << k for k in range(10)):  # 16 .. 8192 = MAX_N
        block_m, _, warps = tile_for(block_n)
        bwd_warps = tile_for(block_n, backward=True)[2]
        dtypes = ("bf16", "fp32", "fp16") if full or block_n in (16, MAX_N) else ("bf16",)
        for dtype in dtypes:
            for has in ((False, True) if full else (bool(i % 2),)):
                p = f"*{dtype}"
                const = {"HAS_RESIDUAL": has, "BLOCK_M": block_m, "BLOCK_N": block_n}
                specs.append((_rms_norm_fwd_kernel,
                              {"x_ptr": p, "r_ptr": p, "w_ptr": p, "y_ptr": p, "h_ptr": p, "rstd_ptr": "*fp32",
                               "M": "i32", "N": "i32", "stride_xm": "i32", "stride_rm": "i32", "eps": "fp32",
                               **{k: "constexpr" for k in const}}, const, {"num_warps": warps}))
                const = {"HAS_DH": has, "BLOCK_M": block_m, "BLOCK_N": block_n}
                specs.append((_rms_norm_bwd_kernel,
                              {"dy_ptr": p, "h_ptr": p, "w_ptr": p, "rstd_ptr": "*fp32", "dh_ptr": p, "dx_ptr": p,
                               "partial_ptr": "*fp32", "M": "i32", "N": "i32", "stride_dym": "i32",
                               "stride_hm": "i32", "stride_dhm": "i32", "rows_per_program": "i32",
                               **{k: "constexpr" for k in const}}, const, {"num_warps": bwd_warps}))
    return specs


__all__ = ["MAX_N", "compile_specs", "rms_norm_bwd", "rms_norm_fwd", "tile_for"]
