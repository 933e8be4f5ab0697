"""Cross-rank signals for the fused GEMM + communication kernels: a wait with a bounded spin and a
release-ordered raise, as Triton device functions.

A signal is one int32 word. It carries the call counter (the *epoch*) of the workspace it belongs
to: call e raises it to e and waits for ``signal >= e``, so a signal never needs resetting and two
back-to-back calls cannot confuse each other's flags (a word still holding e−1 reads as "not yet").

Ordering: the producer writes its data, joins the block (``debug_barrier``: every thread's stores
happen before the one releasing store) and raises the signal with release semantics at system
scope (peers read it over NVLink); the consumer reads it with acquire semantics before loading the
data it guards. Both are atomics so that the interpreter (``TRITON_INTERPRET=1``) runs the same
code. A wait gives up after ``max_spins`` reads and records ``code`` (which chunk or tile, whose)
in the error word (pinned host memory on a GPU); the host turns it into "rank N never signalled chunk c" and
the kernel poisons what it could not compute with NaN, so a lost signal is neither a hang nor a
silent wrong result.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(noinline=True)
def wait_signal(sig_ptr, epoch, max_spins, err_ptr, code):
    """Spin until ``*sig_ptr >= epoch`` (acquire, system scope) or ``max_spins`` reads; returns 1 when the
    signal arrived, else 0 after recording ``code`` in ``*err_ptr``."""
    v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (v < epoch) & (spins < max_spins):
        v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    arrived = (v >= epoch).to(tl.int32)
    if v < epoch:
        tl.store(err_ptr, code)  # a plain store: atomics on host-mapped memory are not portable
    return arrived


@triton.jit
def raise_signal(sig_ptr, epoch):
    """Publish this block's stores: join the block, then store ``epoch`` with release semantics."""
    tl.debug_barrier()
    tl.atomic_xchg(sig_ptr, epoch, sem="release", scope="sys")


@triton.jit
def tile_matmul(a_ptr, b_ptr, rows, cols, K, stride_am, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr = 3):
    """float32 (BLOCK_M, BLOCK_N) tile of A[rows] · B[:, cols]. ``rows``/``cols`` must be in bounds
    (callers wrap them modulo the extent and mask the store), so only the K tail is masked: the
    loads stay unmasked in the steady state and the loop pipelines."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + ks.to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def grouped_tile(tt, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row block, column block) of tile ``tt`` of a tiles_m × tiles_n grid in GROUP_M-row bands,
    column-major inside a band: consecutive tiles reuse the same B columns while they sit in L2."""
    band = GROUP_M * tiles_n
    first_m = (tt // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    mb = first_m + (tt % band) % rows_in_band
    nb = (tt % band) // rows_in_band
    return mb, nb
