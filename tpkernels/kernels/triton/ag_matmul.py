"""Persistent Triton GEMM that consumes an all-gather as it arrives: C = A_gathered · B.

a: (world·m, K), rank s's shard at rows [s·m, (s+1)·m), filled chunk by chunk while the kernel
runs (by the copy engine or a copy kernel on another stream); signals: (world·chunks,) int32,
signal s·chunks + c raised to ``epoch`` once chunk c of shard s has landed. b: (K, N) any strides;
c: (world·m, N). Shard s is cut into chunks of ``rows_per_chunk`` rows (a multiple of BLOCK_M, so
no tile straddles two chunks); any m works: rows past m are masked, never padded in memory.

Tile order: the programs walk the tiles of this rank's own shard first (already local: no wait),
then shard rank+1, rank+2, ... the order the copies are issued in, so the GEMM of shard s
overlaps the transfer of shard s+1; inside a shard, bands of GROUP_M row blocks for L2 reuse of
B. A program waits (acquire) on a chunk's signal the first time it needs one of its tiles.

Floor per rank: 2·world·m·K·N FLOPs; reads world·m·K + K·N (once per band: ×tiles_m/GROUP_M
from L2) and writes world·m·N elements; the (world−1)·m·K elements of the peers' shards cross
NVLink, hidden when one shard's GEMM (2·m·K·N FLOPs) outlasts one shard's transfer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpkernels.kernels.triton.comm_signals import grouped_tile, tile_matmul, wait_signal

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by SM arch: the usual Hopper and Ampere GEMM
# tiles. Chosen from `aot_check`'s register report (no spills: 243 registers on sm_90, 193 on
# sm_80, with the loads specialized as the JIT does), not yet from GPU timings. The interpreter
# takes small tiles.
CONFIGS = {90: (128, 256, 64, 8, 3), 80: (128, 128, 32, 8, 4)}
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)
GROUP_M = 8


@triton.jit
def _ag_matmul_kernel(a_ptr, b_ptr, c_ptr, sig_ptr, err_ptr, epoch, max_spins, m, N, K, rank, world, chunks,
                      rows_per_chunk, stride_am, stride_bk, stride_bn, stride_cm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    last_sig = -1
    arrived = 1
    for t in range(tl.program_id(0), world * per_shard, tl.num_programs(0)):
        step = t // per_shard
        src = (rank + step) % world
        mb, nb = grouped_tile(t % per_shard, tiles_m, tiles_n, GROUP_M)
        sig = src * chunks + (mb * BLOCK_M) // rows_per_chunk
        if (step > 0) & (sig != last_sig):
            arrived = wait_signal(sig_ptr + sig, epoch, max_spins, err_ptr, sig + 1)
            last_sig = sig
        local_rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tile_matmul(a_ptr, b_ptr, src * m + local_rows % m, cols % N, K, stride_am, stride_bk, stride_bn,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.where(arrived != 0, acc, float("nan"))
        rows = (src * m + local_rows).to(tl.int64)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(local_rows < m)[:, None] & (cols < N)[None, :])


def rows_per_chunk(m: int, chunks: int, block_m: int) -> int:
    """Rows of one chunk of an m-row shard cut into at most ``chunks`` pieces of whole row blocks."""
    blocks = triton.cdiv(max(m, 1), block_m)
    return triton.cdiv(blocks, max(1, min(chunks, blocks))) * block_m


def ag_matmul(a_full, b, out, signals, err, *, epoch: int, max_spins: int, m: int, rank: int, world: int,
              chunks: int, chunk_rows: int, config: tuple, programs: int):
    """Launch on the current stream. a_full: (world·m, K) row-major; b: (K, N); out: (world·m, N) row-major;
    signals: (world·chunks,) int32; err: (1,) int32 error word."""
    block_m, block_n, block_k, warps, stages = config
    K, N = b.shape
    tiles = world * triton.cdiv(m, block_m) * triton.cdiv(N, block_n)
    _ag_matmul_kernel[(max(1, min(programs, tiles)),)](
        a_full, b, out, signals, err, epoch, max_spins, m, N, K, rank, world, chunks, chunk_rows,
        a_full.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return out


def compile_specs(arch: int, full: bool = False):
    block_m, block_n, block_k, warps, stages = CONFIGS.get(arch, CONFIGS[80])
    specs = []
    for dtype in ("fp16", "bf16"):
        p = f"*{dtype}"
        sig = {"a_ptr": p, "b_ptr": p, "c_ptr": p, "sig_ptr": "*i32", "err_ptr": "*i32", "epoch": "i32",
               "max_spins": "i32", "m": "i32", "N": "i32", "K": "i32", "rank": "i32", "world": "i32",
               "chunks": "i32", "rows_per_chunk": "i32", "stride_am": "i32", "stride_bk": "i32",
               "stride_bn": "i32", "stride_cm": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
               "BLOCK_K": "constexpr", "GROUP_M": "constexpr"}
        const = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": GROUP_M}
        # as the JIT specializes them for 16-aligned tensors with K, N multiples of 16 (the op's rule)
        specs.append((_ag_matmul_kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                      ("a_ptr", "b_ptr", "c_ptr", "K", "stride_am", "stride_bn", "stride_cm")))
    return specs


__all__ = ["CONFIGS", "INTERPRETER_CONFIG", "ag_matmul", "compile_specs", "rows_per_chunk"]
