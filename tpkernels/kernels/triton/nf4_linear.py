"""Triton GEMMs over an NF4 weight, dequantised in registers (GPU, and CPU under ``TRITON_INTERPRET=1``).

    forward:         y  = x · Wᵀ     x (M, K), W (N, K) in NF4, y (M, N)
    input gradient:  dx = dy · W     dy (M, N), dx (M, K)          (no weight gradient: W is frozen)

W's layout is tpkernels/quant/nf4.py's (bitsandbytes'): the row-major flatten in blocks of 64 with one
8-bit absmax code each (dynamic map, one fp32 scale per 256 blocks, one fp32 offset), two 4-bit codes
per byte, even index in the high nibble. The kernels take K a multiple of 64, so that every block lies
in one row of W and a 64-wide K step of the loop is exactly one block per row: a program loads for
each of its rows of W 32 packed bytes, one absmax code, its map value and its scale, splits the
nibbles, looks the 16 NF4 levels up, scales them and feeds the tile to ``tl.dot`` in the
activations' dtype (fp16 / bf16; fp32 as exact IEEE products), accumulating in fp32. Other K raise
in the launcher (the C++ and reference backends take any shape).

Tiles: the forward's dot is x (BLOCK_M tokens × 64) · Wᵀ (64 × BLOCK_N), the token dim on the M side
(wgmma on sm_90 needs BLOCK_M ≥ 64 per warpgroup); programs walk bands of GROUP_M row blocks so the
NF4 tiles of a band stay in L2. The input gradient's dot is dy (BLOCK_M × BLOCK_N) · W (BLOCK_N × 64):
one 64-wide column block of dx per program, the loop over N.

Floors (b bytes per activation element; w = 0.5 + 1/64 + 1/16384 ≈ 0.516 bytes per weight):
    FLOPs   2·M·N·K for each of the two GEMMs (the dequantisation, ~6 integer / fp32 operations per
            weight per program that loads it, runs on the CUDA cores beside the tensor cores)
    bytes   forward M·K·b + w·N·K + M·N·b; input gradient M·N·b + w·N·K + M·K·b
            (a bf16 weight would be 2·N·K: 3.9× the weight traffic)
At M ≥ 2048 tokens both are compute-bound on H100/H200 (e.g. M = 4096, N = K = 8192 bf16: 550 GFLOP
over 168 MB, 3300 FLOP per byte against a balance of ~300), so the floor is the bf16 GEMM's time
(~0.7 ms at the 790 TFLOP/s measured on an H200); the dequantisation is repeated once per
BLOCK_M-token tile, N·K·⌈M/BLOCK_M⌉ weights, ~6/(2·BLOCK_M) CUDA-core operations per tensor FLOP
(2.3% at BLOCK_M = 128, but CUDA cores run ~15× slower than the tensor cores: ~35% of the dot time
unless it overlaps the dots of the other warps). At small M (decoding, LoRA micro-batches of a few
rows) the weight bytes dominate and 0.516 bytes per weight is the 3.9× smaller floor than bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tpkernels.kernels.triton.comm_signals import grouped_tile

QBLOCK = tl.constexpr(64)  # values per NF4 absmax block: one K step of the loop
ABSMAX_BLOCK = tl.constexpr(256)  # block absmax per fp32 scale
GROUP_M = 8

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by SM arch and by M: 64-token tiles at 4 warps (one
# warpgroup) for short inputs, 128 at 8 warps from 128 tokens on. Chosen from `aot_check`'s report
# (wgmma on sm_90, no spills), not from GPU timings yet: on sm_80 a 64×128 tile at 4 warps spilled
# 360 B inside the loop (the fp32 dequantised 128×64 weight tile next to the accumulator, 255 registers).
FWD_CONFIGS = {90: ((64, 128, 4, 3), (128, 128, 8, 3)), 80: ((64, 64, 4, 3), (128, 128, 8, 3))}
# the input gradient: (BLOCK_M, BLOCK_N = the reduction step over N, num_warps, num_stages)
BWD_CONFIGS = {90: ((64, 64, 4, 3), (128, 64, 8, 3)), 80: ((64, 64, 4, 3), (128, 64, 8, 3))}
INTERPRETER_CONFIG = (16, 16, 1, 1)


@triton.jit
def _nf4_tile(packed_ptr, absq_ptr, scale_ptr, code_ptr, dmap_ptr, offset, rn, mask_n, kb, K,
              BLOCK_N: tl.constexpr):
    """W[rn, 64·kb : 64·kb + 64] as fp32 (BLOCK_N, 64); rows outside mask_n are 0."""
    rows = rn.to(tl.int64)
    byte = tl.load(packed_ptr + rows[:, None] * (K // 2) + kb * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :],
                   mask=mask_n[:, None], other=0).to(tl.int32)
    idx = tl.reshape(tl.join(byte >> 4, byte & 0xF), [BLOCK_N, QBLOCK])  # even k: high nibble
    level = tl.load(code_ptr + idx)
    blk = rows * (K // QBLOCK) + kb
    q = tl.load(absq_ptr + blk, mask=mask_n, other=0).to(tl.int32)
    absmax = tl.load(dmap_ptr + q) * tl.load(scale_ptr + blk // ABSMAX_BLOCK, mask=mask_n, other=0.0) + offset
    return tl.where(mask_n[:, None], level * absmax[:, None], 0.0)


@triton.jit
def _nf4_linear_fwd_kernel(x_ptr, packed_ptr, absq_ptr, scale_ptr, offset_ptr, code_ptr, dmap_ptr, y_ptr, M, N, K,
                           stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                           IEEE: tl.constexpr):
    mb, nb = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offset = tl.load(offset_ptr)
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    rk = tl.arange(0, QBLOCK)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, K // QBLOCK):
        x = tl.load(x_rows + kb * QBLOCK, mask=mask_m[:, None], other=0.0)
        w = _nf4_tile(packed_ptr, absq_ptr, scale_ptr, code_ptr, dmap_ptr, offset, rn, mask_n, kb, K, BLOCK_N)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nf4_linear_bwd_kernel(dy_ptr, packed_ptr, absq_ptr, scale_ptr, offset_ptr, code_ptr, dmap_ptr, dx_ptr, M, N, K,
                           stride_dym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                           IEEE: tl.constexpr):
    mb, kb = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), K // QBLOCK, GROUP_M)
    offset = tl.load(offset_ptr)
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    dy_rows = dy_ptr + rm.to(tl.int64)[:, None] * stride_dym
    acc = tl.zeros([BLOCK_M, QBLOCK], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        dy = tl.load(dy_rows + rn[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        w = _nf4_tile(packed_ptr, absq_ptr, scale_ptr, code_ptr, dmap_ptr, offset, rn, mask_n, kb, K, BLOCK_N)
        if IEEE:
            acc += tl.dot(dy, w, input_precision="ieee")
        else:
            acc += tl.dot(dy, w.to(dy.dtype))
    rk = kb * QBLOCK + tl.arange(0, QBLOCK)
    tl.store(dx_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def _config(table: dict, m: int, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    major = torch.cuda.get_device_capability(device)[0]
    small, large = table.get(major * 10, table[80])
    return small if m <= small[0] else large


def nf4_linear_fwd(x: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor, code: Tensor,
                   dmap: Tensor, n: int, out: Tensor | None = None) -> Tensor:
    """x (M, K), last-dim stride 1, K % 64 == 0; the NF4 parts of a (n, K) weight (offset: a
    one-element fp32 tensor, read by the kernel: no host sync) -> y (M, n), x's dtype."""
    m, k = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    block_m, block_n, warps, stages = _config(FWD_CONFIGS, m, x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _nf4_linear_fwd_kernel[grid](x, packed, absmax_q, absmax_scale, offset, code, dmap, y, m, n, k, x.stride(0),
                                 BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=GROUP_M, IEEE=x.dtype == torch.float32,
                                 num_warps=warps, num_stages=stages)
    return y


def nf4_linear_bwd(dy: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor, code: Tensor,
                   dmap: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """dy (M, N), last-dim stride 1; the NF4 parts of an (N, k) weight, k % 64 == 0 -> dx (M, k), dy's dtype."""
    m, n = dy.shape
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device) if out is None else out
    if m == 0:
        return dx
    block_m, block_n, warps, stages = _config(BWD_CONFIGS, m, dy.device)
    grid = (triton.cdiv(m, block_m) * (k // QBLOCK.value),)
    _nf4_linear_bwd_kernel[grid](dy, packed, absmax_q, absmax_scale, offset, code, dmap, dx, m, n, k, dy.stride(0),
                                 BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=GROUP_M, IEEE=dy.dtype == torch.float32,
                                 num_warps=warps, num_stages=stages)
    return dx


def compile_specs(arch: int, full: bool = False):
    """Every shipped config of both kernels in fp16 and bf16 (the dtypes of the GPU path's dots; fp32
    runs exact IEEE products, a correctness path with FMA dots, not in the wgmma rule), specialized
    as the JIT does for 16-aligned tensors with K and N multiples of 16."""
    specs = []
    for kernel, table, names in ((_nf4_linear_fwd_kernel, FWD_CONFIGS, ("x_ptr", "y_ptr", "stride_xm")),
                                 (_nf4_linear_bwd_kernel, BWD_CONFIGS, ("dy_ptr", "dx_ptr", "stride_dym"))):
        for block_m, block_n, warps, stages in table.get(arch, table[80]):
            for dtype in ("fp16", "bf16"):
                p = f"*{dtype}"
                sig = {names[0]: p, "packed_ptr": "*u8", "absq_ptr": "*u8", "scale_ptr": "*fp32",
                       "offset_ptr": "*fp32", "code_ptr": "*fp32", "dmap_ptr": "*fp32", names[1]: p, "M": "i32",
                       "N": "i32", "K": "i32", names[2]: "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "GROUP_M": "constexpr",
                       "IEEE": "constexpr"}
                const = {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": GROUP_M, "IEEE": False}
                specs.append((kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                              (names[0], names[1], "packed_ptr", "absq_ptr", "scale_ptr", "code_ptr", "dmap_ptr",
                               "N", "K", names[2])))
    return specs


__all__ = ["BWD_CONFIGS", "FWD_CONFIGS", "INTERPRETER_CONFIG", "QBLOCK", "compile_specs", "nf4_linear_bwd",
           "nf4_linear_fwd"]
