"""Triton reducers of signalled float32 partial tiles (:mod:`matmul_signal`), the consumer half of
GEMM + reduce-scatter and GEMM + all-reduce. They run on a side stream with a few programs while
the GEMMs of all ranks still run, and pull each tile from its producer's symmetric buffer over
NVLink once its signal says it is there.

Tables (int64 device tensors of ``world`` addresses, one per rank): ``part_ptrs`` (each rank's
(groups·m, N) float32 partials), ``sig_ptrs`` (each rank's tile signals). Tiles are the GEMM's
(BLOCK_M × BLOCK_N), read in RED_M-row slices to bound registers. Data other ranks wrote is
loaded with ``.cg`` (L2 only): a line left in this SM's L1 by an earlier call must not be read.

MODE 0, reduce-scatter: out (m, N) = scale · Σ_s partial_s[rank·m : (rank+1)·m] (``PUSH``: the
sources stored their partials into this rank's buffer, slot s, so every read is local). Sources are
taken in the order their GEMMs produce this rank's rows (rank−1 first, this rank last; see
:mod:`matmul_signal`), source-major, accumulating in a float32 ``acc`` (m, N), so the reduction
follows the GEMMs instead of waiting for the last one. Reads (world−1)·4·m·N bytes over NVLink.
MODE 1, one-shot all-reduce: out (M, N) = scale · Σ_s partial_s, tile-major, sources in rank
order on every rank (bitwise-identical results everywhere). Reads (world−1)·4·M·N bytes: the
small-M variant.
MODE 2 then MODE 3, two-shot all-reduce, two launches: rank r reduces the tiles t ≡ r (mod world)
as MODE 1, stores them to ``out`` and to its symmetric ``red`` buffer (out dtype) and raises
``red_sig``; then (MODE 3) copies every other tile from its owner's ``red`` once the owner's
signal is up. Two launches, not one, so that emulated ranks run in lockstep. Reads
(world−1)/world · (4 + b)·M·N bytes: the large-M variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpkernels.kernels.triton.ag_matmul import CONFIGS
from tpkernels.kernels.triton.comm_signals import raise_signal, wait_signal

RED_M = 16
NUM_WARPS = 4
MODES = {"reduce_scatter": 0, "one_shot": 1, "two_shot_reduce": 2, "two_shot_gather": 3}


@triton.jit
def _peer(table, r, ty: tl.constexpr):
    return tl.load(table + r).to(tl.pointer_type(ty))


@triton.jit
def _tile_reduce_kernel(out_ptr, acc_ptr, part_ptrs, sig_ptrs, red_ptrs, red_sig_ptrs, err_ptr, epoch, max_spins,
                        rank, world, m, N, scale, stride_out,
                        MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RED_M: tl.constexpr,
                        PUSH: tl.constexpr):
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tiles_m * tiles_n
    n_sigs = n_tiles * world if MODE == 0 else n_tiles
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    sub = tl.arange(0, RED_M)
    if MODE == 0:
        for j in range(world):
            s = (rank - 1 - j + 2 * world) % world
            # pull: source s's buffer, this rank's rows; push: this rank's buffer, source s's slot
            holder = rank if PUSH else s
            block = s if PUSH else rank
            part = _peer(part_ptrs, holder, tl.float32)
            sigs = _peer(sig_ptrs, holder, tl.int32)
            for t in range(pid, n_tiles, nprog):
                sig = block * n_tiles + t
                arrived = wait_signal(sigs + sig, epoch, max_spins, err_ptr, 1 + s * n_sigs + sig)
                cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
                for r0 in range(0, BLOCK_M, RED_M):
                    rows = (t // tiles_n) * BLOCK_M + r0 + sub
                    ok = (rows < m)[:, None] & (cols < N)[None, :]
                    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
                    p = tl.load(part + (block * m + rows).to(tl.int64)[:, None] * N + cols[None, :], mask=ok, other=0.0,
                                cache_modifier=".cg")
                    p = tl.where(arrived != 0, p, float("nan"))
                    if j > 0:
                        p += tl.load(acc_ptr + off, mask=ok, other=0.0)
                    if j == world - 1:
                        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
                                 (p * scale).to(out_ptr.dtype.element_ty), mask=ok)
                    else:
                        tl.store(acc_ptr + off, p, mask=ok)
    elif MODE != 3:
        step = world if MODE == 2 else 1
        first = rank if MODE == 2 else 0
        for t in range(first + pid * step, n_tiles, nprog * step):
            arrived = 1
            for s in range(world):
                arrived = arrived & wait_signal(_peer(sig_ptrs, s, tl.int32) + t, epoch, max_spins, err_ptr,
                                                1 + s * n_sigs + t)
            cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            for r0 in range(0, BLOCK_M, RED_M):
                rows = (t // tiles_n) * BLOCK_M + r0 + sub
                ok = (rows < m)[:, None] & (cols < N)[None, :]
                off = rows.to(tl.int64)[:, None] * N + cols[None, :]
                acc = tl.zeros((RED_M, BLOCK_N), dtype=tl.float32)
                for s in range(world):
                    acc += tl.load(_peer(part_ptrs, s, tl.float32) + off, mask=ok, other=0.0, cache_modifier=".cg")
                acc = tl.where(arrived != 0, acc * scale, float("nan")).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc, mask=ok)
                if MODE == 2:
                    tl.store(_peer(red_ptrs, rank, out_ptr.dtype.element_ty) + off, acc, mask=ok)
            if MODE == 2:
                raise_signal(_peer(red_sig_ptrs, rank, tl.int32) + t, epoch)
    else:
        for t in range(pid, n_tiles, nprog):
            owner = t % world
            if owner != rank:
                arrived = wait_signal(_peer(red_sig_ptrs, owner, tl.int32) + t, epoch, max_spins, err_ptr,
                                      1 + owner * n_sigs + t)
                red = _peer(red_ptrs, owner, out_ptr.dtype.element_ty)
                cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
                for r0 in range(0, BLOCK_M, RED_M):
                    rows = (t // tiles_n) * BLOCK_M + r0 + sub
                    ok = (rows < m)[:, None] & (cols < N)[None, :]
                    v = tl.load(red + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=ok, other=0.0,
                            cache_modifier=".cg")
                    v = tl.where(arrived != 0, v, float("nan"))
                    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], v, mask=ok)


def tile_reduce(out, acc, part_ptrs, sig_ptrs, red_ptrs, red_sig_ptrs, err, *, mode: str, epoch: int,
                max_spins: int, rank: int, world: int, m: int, scale: float, config: tuple, programs: int,
                push: bool = False):
    """Launch on the current stream (a side stream in the fused ops). out: (m, N) (MODE 0) or (M, N)
    view with last-dim stride 1; acc: (m, N) float32 (MODE 0, else any tensor); tables: (world,) int64."""
    block_m, block_n = config[0], config[1]
    N = out.shape[1]
    n_tiles = triton.cdiv(max(m, 1), block_m) * triton.cdiv(N, block_n)
    _tile_reduce_kernel[(max(1, min(programs, n_tiles)),)](
        out, acc, part_ptrs, sig_ptrs, red_ptrs, red_sig_ptrs, err, epoch, max_spins, rank, world, m, N, scale,
        out.stride(0), MODE=MODES[mode], BLOCK_M=block_m, BLOCK_N=block_n, RED_M=min(RED_M, block_m),
        PUSH=push and mode == "reduce_scatter", num_warps=NUM_WARPS)
    return out


def compile_specs(arch: int, full: bool = False):
    block_m, block_n = CONFIGS.get(arch, CONFIGS[80])[:2]
    specs = []
    for dtype in ("fp16", "bf16"):
        for mode, push in [(v, False) for v in MODES.values()] + [(0, True)]:
            sig = {"out_ptr": f"*{dtype}", "acc_ptr": "*fp32", "part_ptrs": "*i64", "sig_ptrs": "*i64",
                   "red_ptrs": "*i64", "red_sig_ptrs": "*i64", "err_ptr": "*i32", "epoch": "i32",
                   "max_spins": "i32", "rank": "i32", "world": "i32", "m": "i32", "N": "i32", "scale": "fp32",
                   "stride_out": "i32", "MODE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                   "RED_M": "constexpr", "PUSH": "constexpr"}
            const = {"MODE": mode, "BLOCK_M": block_m, "BLOCK_N": block_n, "RED_M": RED_M, "PUSH": push}
            specs.append((_tile_reduce_kernel, sig, const, {"num_warps": NUM_WARPS},
                          ("out_ptr", "acc_ptr", "N", "stride_out")))
    return specs


__all__ = ["MODES", "compile_specs", "tile_reduce"]
