"""Persistent Triton GEMM that publishes each output tile as soon as it is written: the producer
half of GEMM + reduce-scatter and GEMM + all-reduce.

a: (groups·m, K) with any row stride; b: (K, N) any strides; p: (groups·m, N) float32 partial
sums, this rank's symmetric buffer (peers read it); signals: (groups·tiles_m·tiles_n,) int32 in
the same symmetric buffer, tile (g, mb, nb) at g·tiles_m·tiles_n + mb·tiles_n + nb raised to
``epoch`` after the tile is stored. For reduce-scatter the groups are the destination ranks
(group g = rank g's rows, m = M / world) and the walk starts at group ``first_group`` = rank+1,
so the ranks' GEMMs feed different destinations at any moment and this rank's own rows come
last; for all-reduce there is one group (m = M).

Partials are stored in float32 (the package's accumulation policy: the reduction over ranks adds
float32, as the ring and the collective do). Default ("pull", the local stack): they stay in this
rank's buffer and the reducers pull them. ``PUSH``: the epilogue stores each tile straight into
the destination rank's buffer (this rank's slot of it) and raises the destination's signal, so the
reducer reads only local memory; remote stores in the epilogue stall the GEMM on NVLink latency on
Hopper (Flux measured that), which is why both exist and the benchmark compares them.

Floor per rank: 2·M·K·N FLOPs; reads M·K + K·N, writes 4·M·N bytes of partials locally.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpkernels.kernels.triton.ag_matmul import CONFIGS, GROUP_M, INTERPRETER_CONFIG
from tpkernels.kernels.triton.comm_signals import grouped_tile, raise_signal, tile_matmul


@triton.jit
def _matmul_signal_kernel(a_ptr, b_ptr, p_ptr, sig_ptr, p_table, sig_table, epoch, m, N, K, groups, first_group,
                          rank, stride_am, stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PUSH: tl.constexpr):
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_m * tiles_n
    for t in range(tl.program_id(0), groups * per_group, tl.num_programs(0)):
        g = (first_group + t // per_group) % groups
        mb, nb = grouped_tile(t % per_group, tiles_m, tiles_n, GROUP_M)
        local_rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tile_matmul(a_ptr, b_ptr, g * m + local_rows % m, cols % N, K, stride_am, stride_bk, stride_bn,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        ok = (local_rows < m)[:, None] & (cols < N)[None, :]
        if PUSH:  # into rank g's buffer, in this rank's slot; rank g's signal
            rows = (rank * m + local_rows).to(tl.int64)
            tl.store(tl.load(p_table + g).to(tl.pointer_type(tl.float32)) + rows[:, None] * N + cols[None, :], acc,
                     mask=ok)
            raise_signal(tl.load(sig_table + g).to(tl.pointer_type(tl.int32)) + rank * per_group + mb * tiles_n + nb,
                         epoch)
        else:
            rows = (g * m + local_rows).to(tl.int64)
            tl.store(p_ptr + rows[:, None] * N + cols[None, :], acc, mask=ok)
            raise_signal(sig_ptr + g * per_group + mb * tiles_n + nb, epoch)


def tiles(m: int, n: int, config: tuple) -> tuple[int, int]:
    """(tiles_m, tiles_n) of one group of m rows and n columns."""
    return triton.cdiv(max(m, 1), config[0]), triton.cdiv(n, config[1])


def matmul_signal(a, b, partial, signals, *, epoch: int, m: int, groups: int, first_group: int, config: tuple,
                  programs: int, push_tables=None, rank: int = 0):
    """Launch on the current stream. a: (groups·m, K), last-dim stride 1; b: (K, N); partial: (groups·m, N)
    float32 contiguous; signals: (groups·tiles_m·tiles_n,) int32. ``push_tables`` = (partial table,
    signal table), (world,) int64: store tile (g, ·) into rank g's partials at rows rank·m + ·
    and raise rank g's signal rank·tiles + · instead (the "push" reduce-scatter)."""
    block_m, block_n, block_k, warps, stages = config
    K, N = b.shape
    tm, tn = tiles(m, N, config)
    p_table, sig_table = push_tables if push_tables is not None else (signals, signals)  # unread without PUSH
    _matmul_signal_kernel[(max(1, min(programs, groups * tm * tn)),)](
        a, b, partial, signals, p_table, sig_table, epoch, m, N, K, groups, first_group, rank, a.stride(0),
        b.stride(0), b.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
        PUSH=push_tables is not None, num_warps=warps, num_stages=stages)
    return partial


def compile_specs(arch: int, full: bool = False):
    block_m, block_n, block_k, warps, stages = CONFIGS.get(arch, CONFIGS[80])
    specs = []
    for dtype, push in (("fp16", False), ("bf16", False), ("bf16", True)):
        p = f"*{dtype}"
        sig = {"a_ptr": p, "b_ptr": p, "p_ptr": "*fp32", "sig_ptr": "*i32", "p_table": "*i64", "sig_table": "*i64",
               "epoch": "i32", "m": "i32", "N": "i32", "K": "i32", "groups": "i32", "first_group": "i32",
               "rank": "i32", "stride_am": "i32", "stride_bk": "i32", "stride_bn": "i32", "BLOCK_M": "constexpr",
               "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "PUSH": "constexpr"}
        const = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": GROUP_M, "PUSH": push}
        # as the JIT specializes them for 16-aligned tensors with K, N multiples of 16 (the op's rule)
        specs.append((_matmul_signal_kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                      ("a_ptr", "b_ptr", "p_ptr", "N", "K", "stride_am", "stride_bn")))
    return specs


__all__ = ["INTERPRETER_CONFIG", "compile_specs", "matmul_signal", "tiles"]
