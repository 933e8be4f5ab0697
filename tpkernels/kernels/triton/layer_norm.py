"""Triton LayerNorm with the fused residual add (GPU, and CPU under ``TRITON_INTERPRET=1``).

    forward:  h = x (+ residual, stored: the residual stream);  mean = Σh / N
              rstd = rsqrt(Σ(h − mean)² / N + eps);  y = (h − mean) · rstd · weight (+ bias)
    backward: x̂ = (h − mean) · rstd;  g = dy · weight
              dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)) (+ dh)
              dweight = Σ_rows dy · x̂;  dbias = Σ_rows dy

Views seen by the kernels (the launchers flatten leading dims first): x, residual, dy, dh: (M, N)
with last-dim stride 1, any row stride; weight, bias (N,); y, h, dx (M, N) contiguous; mean, rstd
(M,) fp32. A program holds whole rows (BLOCK_N >= N, N <= MAX_N; RMSNorm's tiles, see tile_for):
one read of every input, one write of every output; the variance is the two-pass one on the row in
registers (no Σh² − N·mean² cancellation). Statistics in fp32. The backward saves no normalised
output: it recomputes x̂ from h, mean and rstd (8 bytes a row).

Floors per row of N elements (b bytes per element):
    forward   bytes 2b·N (4b·N with the residual: x, residual read; h, y written) + 8 (mean, rstd)
              + weight/bias once per program; FLOPs 8·N (residual add, Σh, centre, square and Σ,
              · rstd, · weight, + bias)
    backward  bytes 3b·N (4b·N with dh: dy, h, dh read; dx written) + 8, plus programs · N · 8 bytes
              of fp32 dweight / dbias partial sums, reduced in a fixed order afterwards (no atomics:
              deterministic); FLOPs 15·N (centre, · rstd, g, Σg, g · x̂ and Σ, the dx combination (4),
              + dh, dy · x̂ and Σ, Σdy)
At 1–2 FLOPs per byte in bf16 both are memory-bound on sm_80/sm_90 (their balance: ~10 (A100) and
~20 (H100) fp32 FLOPs per byte of HBM), so the time floor is the bytes over the copy bandwidth, e.g.
GPT-2 XL's (8192 tokens, 1600) in bf16 with the residual: 105 MB forward, 24 µs at the 4.3 TB/s
measured on one H200; the backward with dh moves as many bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tpkernels.kernels.triton.occupancy import program_target
from tpkernels.kernels.triton.rms_norm import MAX_N, prenorm_rows
from tpkernels.kernels.triton.rms_norm import tile_for as _rms_tile_for


@triton.jit
def _layer_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, M, N, stride_xm, stride_rm,
                           eps, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    mask_n = rn < N
    mask = (rm[:, None] < M) & mask_n[None, :]
    rows = rm.to(tl.int64)[:, None]  # int64: M·stride can pass 2^31
    h = prenorm_rows(x_ptr, r_ptr, h_ptr, rows, rn, mask, N, stride_xm, stride_rm, HAS_RESIDUAL)
    mean = tl.sum(h, axis=1) / N
    xc = tl.where(mask, h - mean[:, None], 0.0)  # masked lanes would add mean² to the variance
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    w = tl.load(w_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rm, mean, mask=rm < M)
    tl.store(rstd_ptr + rm, rstd, mask=rm < M)


@triton.jit
def _layer_norm_bwd_kernel(dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dh_ptr, dx_ptr, partial_ptr, M, N, stride_dym,
                           stride_hm, stride_dhm, rows_per_program,
                           HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rn = tl.arange(0, BLOCK_N)
    mask_n = rn < N
    w = tl.load(w_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    row0 = pid * rows_per_program
    for m0 in range(row0, row0 + rows_per_program, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask = (rm[:, None] < M) & mask_n[None, :]
        rows = rm.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + rows * stride_dym + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + rows * stride_hm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rm, mask=rm < M, other=0.0)
        rstd = tl.load(rstd_ptr + rm, mask=rm < M, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]  # masked lanes hold dy = 0
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = rstd[:, None] * (g - c2[:, None] - xhat * c1[:, None])
        if HAS_DH:
            dx += tl.load(dh_ptr + rows * stride_dhm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows * N + rn[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_w += tl.sum(dy * xhat, axis=0)
        acc_b += tl.sum(dy, axis=0)
    tl.store(partial_ptr + pid * N + rn, acc_w, mask=mask_n)
    tl.store(partial_ptr + (tl.num_programs(0) + pid) * N + rn, acc_b, mask=mask_n)


def tile_for(n: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of ``n`` elements: RMSNorm's tiles, but the forward runs
    16 warps (8 elements of a tile per thread) from 512 columns: at 8 warps ptxas spills 8 bytes in some
    residual / bias / dtype variants at 512–1024 columns (``aot_check --full``), GPT-2 small's width among
    them; 16 warps need 32–64 registers and spill in none."""
    block_m, block_n, warps = _rms_tile_for(n, backward)
    if not backward and block_n >= 512:
        warps = 16
    return block_m, block_n, warps


def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, residual: Tensor | None = None,
                   out: Tensor | None = None, h_out: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """x, residual: (M, N), last-dim stride 1; weight, bias (N,) -> (y, h or None, mean (M,) fp32,
    rstd (M,) fp32)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    h = None if residual is None else (torch.empty((m, n), dtype=x.dtype, device=x.device) if h_out is None else h_out)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, h, mean, rstd
    block_m, block_n, warps = tile_for(n)
    r = residual if residual is not None else x
    _layer_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
        x, r, weight, bias if bias is not None else weight, y, h if h is not None else y, mean, rstd, m, n,
        x.stride(0), r.stride(0), eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps)
    return y, h, mean, rstd


def layer_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, dh: Tensor | None = None,
                   dx_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dy, h, dh: (M, N), last-dim stride 1; weight (N,); mean, rstd (M,) -> (dx (M, N), dweight (N,),
    dbias (N,)), dweight and dbias in the dtype of weight."""
    m, n = h.shape
    dx = torch.empty((m, n), dtype=h.dtype, device=h.device) if dx_out is None else dx_out
    if m == 0 or n == 0:
        if dh is not None:
            dx.copy_(dh)
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    block_m, block_n, warps = tile_for(n, backward=True)
    rows_per_program = triton.cdiv(triton.cdiv(m, program_target(h.device)), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    partial = torch.empty((2, programs, n), dtype=torch.float32, device=h.device)  # dweight rows, dbias rows
    g = dh if dh is not None else dy
    _layer_norm_bwd_kernel[(programs,)](
        dy, h, weight, mean, rstd, g, dx, partial, m, n, dy.stride(0), h.stride(0), g.stride(0), rows_per_program,
        HAS_DH=dh is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx, partial[0].sum(0).to(weight.dtype), partial[1].sum(0).to(weight.dtype)  # two tensors, not views


def compile_specs(arch: int, full: bool = False):
    """Every (kernel, signature, constexprs, options) this module can launch, for AOT compile checks:
    every row block in bf16 (residual + bias + dh, the GPT-2 layer's variant, alternating with none
    of them), fp32 and fp16 at the extremes; ``full``: every combination."""
    specs = []
    for i, block_n in enumerate(16 << k for k in range(10)):  # 16 .. 8192 = MAX_N
        block_m, _, warps = tile_for(block_n)
        bwd_warps = tile_for(block_n, backward=True)[2]
        dtypes = ("bf16", "fp32", "fp16") if full or block_n in (16, MAX_N) else ("bf16",)
        for dtype in dtypes:
            for has, has_bias in ([(a, b) for a in (False, True) for b in (False, True)] if full
                                  else [(bool(i % 2), bool(i % 2))]):
                p = f"*{dtype}"
                const = {"HAS_RESIDUAL": has, "HAS_BIAS": has_bias, "BLOCK_M": block_m, "BLOCK_N": block_n}
                specs.append((_layer_norm_fwd_kernel,
                              {"x_ptr": p, "r_ptr": p, "w_ptr": p, "b_ptr": p, "y_ptr": p, "h_ptr": p,
                               "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
                               "stride_rm": "i32", "eps": "fp32", **{k: "constexpr" for k in const}},
                              const, {"num_warps": warps}))
                if has_bias != has:
                    continue  # the backward has no bias variant: one spec per HAS_DH
                const = {"HAS_DH": has, "BLOCK_M": block_m, "BLOCK_N": block_n}
                specs.append((_layer_norm_bwd_kernel,
                              {"dy_ptr": p, "h_ptr": p, "w_ptr": p, "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                               "dh_ptr": p, "dx_ptr": p, "partial_ptr": "*fp32", "M": "i32", "N": "i32",
                               "stride_dym": "i32", "stride_hm": "i32", "stride_dhm": "i32",
                               "rows_per_program": "i32", **{k: "constexpr" for k in const}},
                              const, {"num_warps": bwd_warps}))
    return specs


__all__ = ["MAX_N", "compile_specs", "layer_norm_bwd", "layer_norm_fwd", "tile_for"]
