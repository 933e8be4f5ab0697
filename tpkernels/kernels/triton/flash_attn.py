"""FlashAttention-2 in Triton: forward (online softmax over K/V blocks) and backward (P recomputed
from the saved log-sum-exp; dK/dV and dQ in two kernels, no atomics, so results are deterministic).

Layouts (FlashAttention's): q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k,
nheads_kv, headdim), any strides with a unit last-dim stride (packed QKV views work without a
copy); varlen: q (total_q, nheads, headdim) with cu_seqlens_q (batch + 1,) int32.

* GQA/MQA: query head h reads KV head h // (nheads / nheads_kv). The dK/dV kernel owns one KV
  head and loops over the query heads of its group, so K/V are never repeated and dK/dV are
  reduced over the group in registers (no atomics). When that grid is too small for the GPU
  (TP-sharded GQA leaves one KV head per rank), the group is split over programs that write fp32
  partial sums, added in a fixed order: still deterministic.
* Causal: the query blocks with the most keys are launched first, so the grid's tail is short work.
* Masks are aligned to the bottom-right (FlashAttention >= 2.1): with off = seqlen_k - seqlen_q,
  query i sees key j iff -WIN_LEFT <= j - i - off <= WIN_RIGHT (causal: WIN_RIGHT = 0; a side
  without limit is passed as a bound larger than any distance). A query row that sees no key
  outputs 0 and lse = -inf. Key (or query) blocks outside every row's window are not visited.
* Soft-capping (SOFTCAP): scores s = softcap · tanh(scale · q·k / softcap); the backward multiplies
  dS by 1 − tanh², recomputed with the scores.
* Every K/V loop runs in three phases: the masked blocks where the window starts, the blocks that
  every row of the tile sees entirely (no mask math at all), and the masked blocks on the causal
  diagonal (or the window's end) and the ragged end. The mask costs ALU work on every score, the
  scarce unit next to the tensor cores. (The dK/dV kernel runs the same phases in one loop, the mask
  under a branch that is uniform per block: see _dkdv_q_blocks.)
* On sm_90 every dot of every loop compiles to wgmma (Hopper's warpgroup MMA): its M side (the rows
  of the result) must be a multiple of 64 per warpgroup, so the forward and dQ kernels take
  BLOCK_M ≥ 64 queries and the dK/dV kernel computes with the key block in M (Sᵀ = K·Qᵀ).
  `python -m tpkernels.kernels.triton.aot_check` reports it per config and tests/test_triton_aot.py
  enforces it.
* Head dims that are not a power of two are padded to BLOCK_D inside the kernel (masked loads);
  HEADDIM is a compile-time constant, so the common even case carries no mask.

Floors per (sequence, head) with s_q queries, s_k keys, head dim d, 16-bit data:
  forward  FLOPs 4·s_q·s_k·d (halved when causal; 4·s_q·w·d with a window of w keys), compulsory bytes 2·d·(2·s_q + 2·s_k) + 4·s_q (lse);
  backward FLOPs 2.5x the forward (QK^T recomputed, dV, dP, dQ, dK), compulsory bytes
           2·d·(4·s_q + 4·s_k) + 8·s_q (q, k, v, do read; dq, dk, dv written; lse, delta).
At these sizes attention is compute-bound (intensity ~ s_k/2 FLOP/byte), so kernels are judged in
TFLOP/s against the GPU's dense 16-bit peak: benchmarks/bench_attention.py reports the fraction.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tpkernels import env_vars
from tpkernels.kernels import reference
from tpkernels.kernels.triton.occupancy import program_target

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x·log2 e): exp2 is the hardware unit
AUTOTUNE_ENV = "TPKERNELS_FLASH_AUTOTUNE"  # "0": always the first (default) config, no tuning


# ---------------------------------------------------------------- helpers shared by the kernels

@triton.jit
def _load_tile(base, rows, stride, offs_d, row_ok, d_ok, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """(len(rows), BLOCK_D) tile of a (rows, headdim) matrix; masked lanes read 0."""
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if ROW_MASK:
        if EVEN_D:
            t = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return t


@triton.jit
def _store_tile(base, rows, stride, offs_d, row_ok, d_ok, value, EVEN_D: tl.constexpr):
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if EVEN_D:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _sequence(CU_Q, CU_K, b, SEQ_Q, SEQ_K, VARLEN: tl.constexpr):
    """(q_row0, seqlen_q, k_row0, seqlen_k) of sequence b. Varlen: its first rows in the packed tensors
    (whose batch strides are passed as 0); dense: row 0, the batch stride finds the sequence."""
    if VARLEN:
        q0 = tl.load(CU_Q + b)
        k0 = tl.load(CU_K + b)
        sq = tl.load(CU_Q + b + 1) - q0
        sk = tl.load(CU_K + b + 1) - k0
    else:
        q0 = b * 0
        k0 = b * 0
        sq = SEQ_Q
        sk = SEQ_K
    return q0.to(tl.int64), sq, k0.to(tl.int64), sk


@triton.jit
def _tanh(x):
    """tanh without libdevice (the interpreter has none): a Taylor polynomial near 0, where
    2·sigmoid(2x) − 1 would cancel (relative error < 1e-8 for |x| < 1/4), the sigmoid form beyond."""
    x2 = x * x
    poly = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(x) < 0.25, poly, 2.0 * tl.sigmoid(2.0 * x) - 1.0)


@triton.jit
def _scores(q, k, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """(scores in log2 units (s·scale·log2 e, soft-capped), tanh of the cap or None) of q·kᵀ."""
    s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        t = _tanh(s * cap_in)
        return t * cap_out, t
    return s * qk_scale, s


@triton.jit
def _in_window(rows, cols, off, win_left, win_right, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """Which (row, col) pairs lie inside the window: -win_left <= col - row - off <= win_right (only the
    sides that have a bound are tested)."""
    return _window_ok(cols[None, :] - rows[:, None] - off, win_left, win_right, LEFT, RIGHT)


@triton.jit
def _window_ok(rel, win_left, win_right, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """-win_left <= rel <= win_right, rel = key − query − off, testing only the sides that have a bound."""
    if LEFT and RIGHT:
        ok = (rel <= win_right) & (rel >= -win_left)
    elif RIGHT:
        ok = rel <= win_right
    else:
        ok = rel >= -win_left
    return ok


@triton.jit
def _phases(first, span_all_lo, span_all_hi, last, n, BLOCK: tl.constexpr, RAGGED_OK: tl.constexpr):
    """Split [first, last) ∩ [0, n) into masked [a, b), unmasked [b, c), masked [c, d): a, b and c are
    BLOCK multiples and [b, c) lies inside [span_all_lo, span_all_hi), what every row (or column) of
    the tile sees. The unmasked blocks end below ``n`` unless RAGGED_OK (a ragged last block that
    needs no mask: the dK/dV kernel's query rows past seqlen_q read lse = +inf, so P = 0)."""
    a = (tl.maximum(first, 0) // BLOCK) * BLOCK
    d = tl.minimum(last, n)
    b = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(span_all_lo, 0), BLOCK) * BLOCK, a), d)
    hi = tl.minimum(span_all_hi, n)
    c = (tl.maximum(hi, 0) // BLOCK) * BLOCK
    if RAGGED_OK:
        c = tl.where(span_all_hi >= d, d, c)
    c = tl.maximum(tl.minimum(c, d), b)
    return a, b, c, d


@triton.jit
def _query_block(RIGHT: tl.constexpr):
    """The query block of this program. Causal (a right bound): the last query blocks see the most keys,
    so they are launched first, and the short ones fill the tail of the grid instead of the long ones."""
    if RIGHT:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    return pid_m


# ---------------------------------------------------------------- forward

@triton.jit
def _fwd_kv_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d, d_ok,
                   sq, sk, lo, hi, qk_scale, win_left, win_right, cap_in, cap_out,
                   MASKED: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                   EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [lo, hi). Scores are kept in log2 units (s·scale·log2 e)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < sk
        k = _load_tile(k_base, cols, stride_ks, offs_d, n_ok, d_ok, MASKED, EVEN_D)
        s, _ = _scores(q, k, qk_scale, cap_in, cap_out, SOFTCAP)
        if MASKED:
            ok = n_ok[None, :]
            if LEFT or RIGHT:
                ok = ok & _in_window(offs_m, cols, sk - sq, win_left, win_right, LEFT, RIGHT)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp2 finite
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, cols, stride_vs, offs_d, n_ok, d_ok, MASKED, EVEN_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                      stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                      SEQ_Q, SEQ_K, NHEADS, GROUP, sm_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out, TUNE_SEQ,
                      HEADDIM: tl.constexpr, VARLEN: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                      SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (query block, sequence, head). TUNE_SEQ only keys the autotuner. LEFT / RIGHT:
    the window has a left / right bound (causal: RIGHT with WIN_RIGHT = 0)."""
    EVEN_D: tl.constexpr = HEADDIM == BLOCK_D
    pid_m = _query_block(RIGHT)
    pid_bh = tl.program_id(1)
    b = pid_bh // NHEADS
    h = pid_bh % NHEADS
    hk = h // GROUP
    q0, sq, k0, sk = _sequence(CU_Q, CU_K, b, SEQ_Q, SEQ_K, VARLEN)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + q0 * stride_qs + h * stride_qh
    k_base = K + b64 * stride_kb + k0 * stride_ks + hk * stride_kh
    v_base = V + b64 * stride_vb + k0 * stride_vs + hk * stride_vh
    o_base = O + b64 * stride_ob + q0 * stride_os + h * stride_oh
    l_base = LSE + b64 * stride_lb + q0 + h * stride_lh
    m0 = pid_m * BLOCK_M
    if m0 < sq:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < sq
        d_ok = offs_d < HEADDIM
        q = _load_tile(q_base, offs_m, stride_qs, offs_d, m_ok, d_ok, True, EVEN_D)
        qk_scale = sm_scale * _LOG2E
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # rows m0..m0+BLOCK_M-1 see keys [row + off − WIN_LEFT, row + off + WIN_RIGHT]; every row sees
        # [last row + off − WIN_LEFT, first row + off + WIN_RIGHT] (a side without a bound is BIG)
        off = sk - sq
        a, b_, c, d = _phases(m0 + off - WIN_LEFT, m0 + BLOCK_M - 1 + off - WIN_LEFT, m0 + off + WIN_RIGHT + 1,
                              m0 + BLOCK_M + off + WIN_RIGHT, sk, BLOCK_N, False)
        if LEFT:  # the window's start: masked (without a left bound this phase is empty)
            acc, l_i, m_i = _fwd_kv_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n,
                                           offs_d, d_ok, sq, sk, a, b_, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in,
                                           cap_out, True, LEFT, RIGHT, SOFTCAP, EVEN_D, BLOCK_N)
        acc, l_i, m_i = _fwd_kv_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n,
                                       offs_d, d_ok, sq, sk, b_, c, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out,
                                       False, LEFT, RIGHT, SOFTCAP, EVEN_D, BLOCK_N)
        acc, l_i, m_i = _fwd_kv_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n,
                                       offs_d, d_ok, sq, sk, c, d, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out,
                                       True, LEFT, RIGHT, SOFTCAP, EVEN_D, BLOCK_N)
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) / _LOG2E, float("-inf"))
        _store_tile(o_base, offs_m, stride_os, offs_d, m_ok, d_ok, out.to(O.dtype.element_ty), EVEN_D)
        tl.store(l_base + offs_m, lse, mask=m_ok)


# ---------------------------------------------------------------- backward: delta

@triton.jit
def _flash_bwd_delta_kernel(O, DO, DLSE, DELTA, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                            stride_lb, stride_lh, SEQ, NHEADS,
                            HEADDIM: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """delta = rowsum(O·dO) − dlse, fp32, laid out like the lse. One pass over O and dO: the backward's
    only memory-bound step (2 reads of (rows, d), one fp32 write per row)."""
    EVEN_D: tl.constexpr = HEADDIM == BLOCK_D
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // NHEADS).to(tl.int64)
    h = pid_bh % NHEADS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < SEQ
    d_ok = offs_d < HEADDIM
    o = _load_tile(O + b * stride_ob + h * stride_oh, offs_m, stride_os, offs_d, m_ok, d_ok, True, EVEN_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, m_ok, d_ok, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    l_ptrs = b * stride_lb + h * stride_lh + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + l_ptrs, mask=m_ok, other=0.0)
    tl.store(DELTA + l_ptrs, delta, mask=m_ok)


DELTA_TILE = 4096  # elements of O (and of dO) per program: 8 KB each in 16-bit, 32 fp32 registers per thread


def _delta_rows(headdim: int) -> int:
    return DELTA_TILE // block_d(headdim)


def _delta(o, do, dlse, lse, varlen: bool):
    """delta (fp32, shaped and strided like the contiguous lse) from o, do: (b, s, h, d) or (total, h, d)."""
    delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    if varlen:  # one "sequence" of all tokens; lse is (h, total)
        batch, seq, nheads, d = 1, o.shape[0], o.shape[1], o.shape[2]
        os_, dos = (0, o.stride(0), o.stride(1)), (0, do.stride(0), do.stride(1))
        ls = (0, lse.stride(0))
    else:
        batch, seq, nheads, d = o.shape
        os_, dos = o.stride()[:3], do.stride()[:3]
        ls = (lse.stride(0), lse.stride(1))
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    rows = _delta_rows(d)
    _flash_bwd_delta_kernel[(triton.cdiv(max(seq, 1), rows), batch * nheads)](
        o, do, dlse if dlse is not None else delta, delta, *os_, *dos, *ls, seq, nheads, HEADDIM=d,
        HAS_DLSE=dlse is not None, BLOCK_M=rows, BLOCK_D=block_d(d), num_warps=4)
    return delta


# ---------------------------------------------------------------- backward: dK, dV

@triton.jit
def _dkdv_q_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_os,
                   offs_n, offs_m0, offs_d, d_ok, sq, sk, lo, full_lo, full_hi, hi, qk_scale, win_left, win_right,
                   cap_in, cap_out, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                   EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Accumulate dK (unscaled) and dV of one key block over query blocks [lo, hi) of one head; only
    the blocks outside [full_lo, full_hi) (the window's edges, the causal diagonal) compute the mask.
    Rows past sq read lse = +inf, so their P is exactly 0 without a mask.

    Everything is computed transposed, (keys, queries): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO,
    dK += dSᵀ·Q, so the key block (BLOCK_N ≥ 64 on sm_90) is the M side of all four dots and each one
    compiles to Hopper's wgmma, which needs M a multiple of 64 per warpgroup, while the query block
    (BLOCK_M, as small as 16) is only ever N or K (the Triton Hopper tutorial's backward does the same).

    One loop, the mask under a branch that is uniform across the program, rather than one loop per
    phase as in the forward and dQ kernels: with three copies of this body (each with its own
    software pipeline) ptxas spilled every sm_90 config with a window at head dim 128 (32–360 B)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < sq
        q = _load_tile(q_base, offs_m, stride_qs, offs_d, m_ok, d_ok, True, EVEN_D)
        do = _load_tile(do_base, offs_m, stride_os, offs_d, m_ok, d_ok, True, EVEN_D)
        lse2 = tl.load(l_base + offs_m, mask=m_ok, other=float("inf")) * _LOG2E
        delta = tl.load(d_base + offs_m, mask=m_ok, other=0.0)
        st, tt = _scores(k, q, qk_scale, cap_in, cap_out, SOFTCAP)  # (BLOCK_N, BLOCK_M) = K·Qᵀ
        st = st - lse2[None, :]
        if LEFT or RIGHT:  # the key block's ragged end never needs the mask: see the caller
            if (start_m < full_lo) | (start_m >= full_hi):
                ok = _window_ok(offs_n[:, None] - offs_m[None, :] - (sk - sq), win_left, win_right, LEFT, RIGHT)
                st = tl.where(ok, st, float("-inf"))
        pt = tl.exp2(st)
        dv += tl.dot(pt.to(do.dtype), do)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
                           stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                           stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                           SEQ_Q, SEQ_K, NHEADS_K, GROUP, SPLIT, stride_split, sm_scale, WIN_LEFT, WIN_RIGHT,
                           cap_in, cap_out, TUNE_SEQ,
                           HEADDIM: tl.constexpr, VARLEN: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                           SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """One program per (key block, sequence, KV head, part), looping over GROUP / SPLIT of the query
    heads that share the KV head and over the query blocks that see the key block. dS = P·(dP − delta).
    SPLIT = 1: dK/dV are final. SPLIT > 1 (too few programs to fill the GPU, e.g. TP-sharded GQA with
    one KV head per rank): part p writes fp32 partial sums at DK + p·stride_split, summed afterwards.

    Keys past sk are loaded as zeros and never masked: row j of Pᵀ, dPᵀ and dSᵀ only feeds row j of
    dK and dV, and those rows are not stored."""
    EVEN_D: tl.constexpr = HEADDIM == BLOCK_D
    pid_n = tl.program_id(0)
    pid_bhp = tl.program_id(1)
    part = pid_bhp % SPLIT
    b = pid_bhp // SPLIT // NHEADS_K
    hk = pid_bhp // SPLIT % NHEADS_K
    heads = GROUP // SPLIT
    q0, sq, k0, sk = _sequence(CU_Q, CU_K, b, SEQ_Q, SEQ_K, VARLEN)
    b64 = b.to(tl.int64)
    q_off = b64 * stride_qb + q0 * stride_qs
    o_off = b64 * stride_ob + q0 * stride_os
    l_off = b64 * stride_lb + q0
    k_off = b64 * stride_kb + k0 * stride_ks
    v_off = b64 * stride_vb + k0 * stride_vs
    dk_off = b64 * stride_dkb + k0 * stride_dks + part.to(tl.int64) * stride_split
    dv_off = b64 * stride_dvb + k0 * stride_dvs + part.to(tl.int64) * stride_split
    n0 = pid_n * BLOCK_N
    if n0 < sk:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        n_ok = offs_n < sk
        d_ok = offs_d < HEADDIM
        k = _load_tile(K + k_off + hk * stride_kh, offs_n, stride_ks, offs_d, n_ok, d_ok, True, EVEN_D)
        v = _load_tile(V + v_off + hk * stride_vh, offs_n, stride_vs, offs_d, n_ok, d_ok, True, EVEN_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        qk_scale = sm_scale * _LOG2E
        # query row i sees key j iff j − off − WIN_RIGHT <= i <= j − off + WIN_LEFT: the rows that see some
        # key of [n0, n0 + BLOCK_N), and those that see all of them (a side without a bound is BIG)
        off = sk - sq
        a, b_, c, d = _phases(n0 - off - WIN_RIGHT, n0 + BLOCK_N - 1 - off - WIN_RIGHT, n0 - off + WIN_LEFT + 1,
                              n0 + BLOCK_N - off + WIN_LEFT, sq, BLOCK_M, True)
        for g in range(part * heads, (part + 1) * heads):
            h = hk * GROUP + g
            q_base = Q + q_off + h * stride_qh
            do_base = DO + o_off + h * stride_oh
            l_base = LSE + l_off + h * stride_lh
            d_base = DELTA + l_off + h * stride_lh
            dk, dv = _dkdv_q_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_os, offs_n,
                                    offs_m0, offs_d, d_ok, sq, sk, a, b_, c, d, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in,
                                    cap_out, LEFT, RIGHT, SOFTCAP, EVEN_D, BLOCK_M)
        dk = dk * sm_scale
        _store_tile(DK + dk_off + hk * stride_dkh, offs_n, stride_dks, offs_d, n_ok, d_ok,
                    dk.to(DK.dtype.element_ty), EVEN_D)
        _store_tile(DV + dv_off + hk * stride_dvh, offs_n, stride_dvs, offs_d, n_ok, d_ok,
                    dv.to(DV.dtype.element_ty), EVEN_D)


# ---------------------------------------------------------------- backward: dQ

@triton.jit
def _dq_kv_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d, d_ok,
                  sq, sk, lo, hi, qk_scale, win_left, win_right, cap_in, cap_out,
                  MASKED: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                  EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < sk
        k = _load_tile(k_base, cols, stride_ks, offs_d, n_ok, d_ok, MASKED, EVEN_D)
        v = _load_tile(v_base, cols, stride_vs, offs_d, n_ok, d_ok, MASKED, EVEN_D)
        s, t = _scores(q, k, qk_scale, cap_in, cap_out, SOFTCAP)
        s = s - lse2[:, None]
        if MASKED:
            ok = n_ok[None, :]
            if LEFT or RIGHT:
                ok = ok & _in_window(offs_m, cols, sk - sq, win_left, win_right, LEFT, RIGHT)
            s = tl.where(ok, s, float("-inf"))
        p = tl.exp2(s)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
                         stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                         stride_dqb, stride_dqs, stride_dqh,
                         SEQ_Q, SEQ_K, NHEADS, GROUP, sm_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out, TUNE_SEQ,
                         HEADDIM: tl.constexpr, VARLEN: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                         SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (query block, sequence, head): dQ = scale · Σ_blocks dS·K, P recomputed from lse."""
    EVEN_D: tl.constexpr = HEADDIM == BLOCK_D
    pid_m = _query_block(RIGHT)
    pid_bh = tl.program_id(1)
    b = pid_bh // NHEADS
    h = pid_bh % NHEADS
    hk = h // GROUP
    q0, sq, k0, sk = _sequence(CU_Q, CU_K, b, SEQ_Q, SEQ_K, VARLEN)
    b64 = b.to(tl.int64)
    q_off = b64 * stride_qb + q0 * stride_qs
    o_off = b64 * stride_ob + q0 * stride_os
    l_off = b64 * stride_lb + q0
    k_off = b64 * stride_kb + k0 * stride_ks
    v_off = b64 * stride_vb + k0 * stride_vs
    dq_off = b64 * stride_dqb + q0 * stride_dqs
    m0 = pid_m * BLOCK_M
    if m0 < sq:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < sq
        d_ok = offs_d < HEADDIM
        q = _load_tile(Q + q_off + h * stride_qh, offs_m, stride_qs, offs_d, m_ok, d_ok, True, EVEN_D)
        do = _load_tile(DO + o_off + h * stride_oh, offs_m, stride_os, offs_d, m_ok, d_ok, True, EVEN_D)
        # Rows past sq read lse = +inf: their P is 0, so they add nothing and are not stored.
        lse2 = tl.load(LSE + l_off + h * stride_lh + offs_m, mask=m_ok, other=float("inf")) * _LOG2E
        delta = tl.load(DELTA + l_off + h * stride_lh + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        qk_scale = sm_scale * _LOG2E
        k_base = K + k_off + hk * stride_kh
        v_base = V + v_off + hk * stride_vh
        off = sk - sq  # the key ranges of the forward kernel
        a, b_, c, d = _phases(m0 + off - WIN_LEFT, m0 + BLOCK_M - 1 + off - WIN_LEFT, m0 + off + WIN_RIGHT + 1,
                              m0 + BLOCK_M + off + WIN_RIGHT, sk, BLOCK_N, False)
        if LEFT:
            dq = _dq_kv_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                               d_ok, sq, sk, a, b_, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out, True, LEFT, RIGHT,
                               SOFTCAP, EVEN_D, BLOCK_N)
        dq = _dq_kv_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                           d_ok, sq, sk, b_, c, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out, False, LEFT, RIGHT,
                           SOFTCAP, EVEN_D, BLOCK_N)
        dq = _dq_kv_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                           d_ok, sq, sk, c, d, qk_scale, WIN_LEFT, WIN_RIGHT, cap_in, cap_out, True, LEFT, RIGHT,
                           SOFTCAP, EVEN_D, BLOCK_N)
        dq = dq * sm_scale
        _store_tile(DQ + dq_off + h * stride_dqh, offs_m, stride_dqs, offs_d, m_ok, d_ok,
                    dq.to(DQ.dtype.element_ty), EVEN_D)


# ---------------------------------------------------------------- configs

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The first entry of each list is the default; on a GPU
# the autotuner times the list once per (dtype, head dim, causal, varlen, seqlen bucket). BLOCK_M of
# the dK/dV kernel is the query block of its inner loop, BLOCK_N its key block.
# No GPU was at hand when these were chosen: they were pruned with
# `python -m tpkernels.kernels.triton.aot_check`, which compiles each for sm_80/sm_90 as the JIT
# specializes it (aligned pointers and strides) and reads the TTGIR, PTX and cubin. Rules:
# * sm_90: every dot of every loop is a wgmma, i.e. its M side is ≥ 64 rows per warpgroup: forward
#   and dQ BLOCK_M ≥ 64 (≥ 128 with 8 warps, else both warpgroups compute the same 64-row tile: the
#   report's "replicated"), dK/dV BLOCK_N (keys, the M side of its transposed dots) ≥ 64.
# * no register spills, checked on the lightest and the heaviest variant (no mask; window +
#   soft-cap + varlen) at each head dim of the bucket, with Triton 3.8 (the tests') and, for sm_90
#   dK/dV, 3.6 (the GPU machine's: its ptxas spills other configs); the one exception is
#   AOT_EXCEPTIONS below. Spilling candidates that were dropped, e.g.: dK/dV sm_90 hd128
#   (32, 64, 4, 2) 32–80 B, (64, 64, 8, 2) 344 B, (16, 64, 4, 2) and (32, 64, 8, 2) 16–24 B on 3.6;
#   dK/dV sm_80 hd64 (64, 64, 8, 2) with a window: ptxas fell to 32 registers and 3 KB of stack;
#   forward sm_90 hd96 (128, 128, 8, 2) 8 B; dQ sm_90 hd256 (64, 32, 4, 2) 160 B.
# * every entry fits the arch's shared memory; each list leads with the largest tiles that pass.
CONFIGS = {
    # kernel: {arch major: {head-dim bucket: [configs]}}
    "fwd": {
        9: {64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4)],
            128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)],
            256: [(128, 32, 8, 2), (128, 16, 8, 2), (64, 16, 4, 2)]},
        8: {64: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)],
            128: [(64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 3)],
            256: [(64, 32, 8, 2), (64, 64, 8, 1)]},
    },
    "dkdv": {
        9: {64: [(32, 128, 8, 2), (16, 128, 8, 2), (32, 64, 4, 2)],
            128: [(16, 128, 8, 2), (16, 128, 8, 3)],
            256: [(16, 64, 8, 2)]},  # spills outside the loop: see AOT_EXCEPTIONS
        8: {64: [(16, 128, 8, 2), (16, 64, 4, 2), (32, 64, 4, 1)],
            128: [(32, 64, 8, 2)],
            256: [(32, 32, 8, 2), (16, 32, 4, 1)]},
    },
    "dq": {
        9: {64: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)],
            128: [(128, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3)],
            256: [(128, 16, 8, 2), (64, 32, 8, 2)]},
        8: {64: [(128, 32, 8, 3), (64, 32, 4, 2), (128, 64, 8, 2)],
            128: [(64, 64, 8, 2), (64, 32, 4, 2)],
            256: [(32, 32, 4, 2), (64, 32, 8, 2)]},
    },
}
# Rule breaks that `aot_check` accepts, with the reason ({(rule, kernel, constants): why}; listed in
# docs/kernels.md). An excused spill must stay outside every loop of the SASS (aot_check checks it).
AOT_EXCEPTIONS = {
    ("spill", "_flash_bwd_dkdv_kernel", "arch=sm_90,BLOCK_N=64,BLOCK_D=256"):
        "sm_90 head dim 256 dK/dV: a 64-key block's fp32 dK and dV accumulators take 128 of the 255 "
        "registers a thread may have at 8 warps (at 4 warps they alone need 256; 16 warps cap a thread "
        "at 128 and spill 120+ B in the loop), and wgmma needs M ≥ 64 keys; ptxas saves 2–8 registers "
        "(8–32 B) once before the query loop and restores them after it: no local-memory traffic per "
        "iteration (SASS: no STL/LDL inside a loop).",
}
# Under TRITON_INTERPRET=1 (CPU) programs run one by one in numpy: small tiles, and BLOCK_M != BLOCK_N
# so tests cross the causal diagonal inside a tile.
INTERPRETER_CONFIG = {"fwd": (64, 32, 4, 1), "dkdv": (32, 64, 4, 1), "dq": (64, 32, 4, 1)}
_KERNELS = {}  # filled below: role -> JITFunction


def block_d(headdim: int) -> int:
    return max(16, triton.next_power_of_2(headdim))


def _headdim_bucket(headdim: int) -> int:
    return 64 if headdim <= 64 else (128 if headdim <= 128 else 256)


def _arch_major(device: torch.device) -> int:
    return 9 if torch.cuda.get_device_capability(device)[0] >= 9 else 8


def configs_for(role: str, headdim: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    if device.type != "cuda":
        return [INTERPRETER_CONFIG[role]]
    return CONFIGS[role][_arch_major(device)][_headdim_bucket(headdim)]


def _group_split(programs: int, group: int, device: torch.device) -> int:
    """How many programs share one KV head's query-head group in the dK/dV kernel: 1 unless the
    grid (``programs`` at 64 keys per program) would leave SMs idle, then the smallest divisor of
    ``group`` that gives two programs per SM."""
    if device.type != "cuda" or group == 1:
        return 1
    target = program_target(device, per_sm=2)
    for split in range(1, group + 1):
        if group % split == 0 and programs * split >= target:
            return split
    return group


def _tune_seq(seqlen: int) -> int:
    """Seqlen bucket that keys the autotuner: tune once per power of two, not once per length."""
    return min(max(triton.next_power_of_2(max(seqlen, 1)), 128), 16384)


_TUNED: dict = {}
AUTOTUNE_DO_BENCH = None  # None: Triton's GPU timer. Tests put a CPU timer here to run the tuner under the interpreter.


def _launch(role: str, grid_of, args: tuple, headdim: int, device: torch.device, consts: dict,
            config: tuple | None = None) -> None:
    """Launch kernel ``role`` with an explicit config, the default one, or the autotuner (GPU)."""
    kernel = _KERNELS[role]
    choices = [config] if config is not None else configs_for(role, headdim, device)
    if len(choices) == 1 or not env_vars.read(AUTOTUNE_ENV):
        bm, bn, warps, stages = choices[0]
        kernel[grid_of({"BLOCK_M": bm, "BLOCK_N": bn})](*args, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                        num_warps=warps, num_stages=stages)
        return
    key = (role, _arch_major(device), _headdim_bucket(headdim))
    tuned = _TUNED.get(key)
    if tuned is None:
        bench = {} if AUTOTUNE_DO_BENCH is None else {"do_bench": AUTOTUNE_DO_BENCH}
        tuned = _TUNED[key] = triton.autotune(
            [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in choices],
            key=["TUNE_SEQ", "HEADDIM", "LEFT", "RIGHT", "SOFTCAP", "VARLEN"], **bench)(kernel)
    tuned[grid_of](*args, **consts)


# ---------------------------------------------------------------- launchers

def _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    """(batch, seq_q, seq_k, nheads, nheads_k, headdim, varlen) of dense or packed inputs."""
    if cu_seqlens_q is not None:
        _, nheads, d = q.shape
        return cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, nheads, k.shape[1], d, True
    batch, seq_q, nheads, d = q.shape
    return batch, seq_q, k.shape[1], nheads, k.shape[2], d, False


def _bsh(t, varlen):
    """(batch, seq, head) strides; batch stride 0 for packed (varlen) tensors."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _lse_strides(lse, varlen):
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _mask_args(causal: bool, window: tuple[int, int], softcap: float, softmax_scale: float, seq_q: int,
               seq_k: int) -> tuple[tuple, dict]:
    """(WIN_LEFT, WIN_RIGHT, cap_in, cap_out) and the LEFT / RIGHT / SOFTCAP constexprs. A side without a
    limit becomes a bound larger than any distance the kernels compute, |j − i − off| plus a tile
    (< seq_q + seq_k + 2·256), so one range formula serves every case."""
    left, right = reference.window_bounds(causal, window)
    big = seq_q + seq_k + 1024
    cap_in, cap_out = (softmax_scale / softcap, softcap * 1.4426950408889634) if softcap > 0 else (0.0, 0.0)
    args = (left if left >= 0 else big, right if right >= 0 else big, cap_in, cap_out)
    return args, dict(LEFT=left >= 0, RIGHT=right >= 0, SOFTCAP=softcap > 0)


def flash_attn_fwd(q, k, v, softmax_scale: float, causal: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, config=None, out=None,
                   lse=None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    """Forward. q: (batch, seqlen_q, nheads, d) or varlen (total_q, nheads, d); k, v likewise with
    nheads_kv; last-dim stride 1. Returns (o: like q; lse: fp32 (batch, nheads, seqlen_q), or
    (nheads, total_q) for varlen), written into ``out``/``lse`` when given (tests poison them).
    ``window`` (left, right), -1 for no limit; ``softcap`` 0 for none (see the module docstring).
    ``config`` (BLOCK_M, BLOCK_N, warps, stages) pins a tile (tests)."""
    batch, seq_q, seq_k, nheads, nheads_k, d, varlen = _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lse_shape = (nheads, q.shape[0]) if varlen else (batch, nheads, seq_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if lse is None else lse
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (q, q)  # unused pointer args when VARLEN is constexpr False
    mask_args, mask_consts = _mask_args(causal, window, softcap, softmax_scale, seq_q, seq_k)
    args = (q, k, v, o, lse, cu_q, cu_k, *_bsh(q, varlen), *_bsh(k, varlen), *_bsh(v, varlen), *_bsh(o, varlen),
            *_lse_strides(lse, varlen), seq_q, seq_k, nheads, nheads // nheads_k, softmax_scale, *mask_args,
            _tune_seq(max(seq_q, seq_k)))
    consts = dict(HEADDIM=d, VARLEN=varlen, BLOCK_D=block_d(d), **mask_consts)
    _launch("fwd", lambda meta: (triton.cdiv(max(seq_q, 1), meta["BLOCK_M"]), batch * nheads), args, d, q.device,
            consts, config)
    return o, lse


def flash_attn_bwd(do, q, k, v, o, lse, softmax_scale: float, causal: bool, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                   dlse=None, config=None, dq=None, dk=None, dv=None, window: tuple[int, int] = (-1, -1),
                   softcap: float = 0.0):
    """Backward. Returns (dq, dk, dv), contiguous, shaped like q, k, v.

    delta = rowsum(dO·O) is one small pass (_flash_bwd_delta_kernel). A gradient ``dlse`` flowing
    into the log-sum-exp folds into it: d lse_i / d s_ij = P_ij, so dS = P·(dP − (delta − dlse)).
    ``config``: {"dkdv": (...), "dq": (...)} pins tiles; ``dq``/``dk``/``dv`` receive the results
    (tests poison them)."""
    batch, seq_q, seq_k, nheads, nheads_k, d, varlen = _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    lse = lse.contiguous()
    if o.stride(-1) != 1:
        o = o.contiguous()
    delta = _delta(o, do, dlse, lse, varlen)
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (q, q)
    common = (*_bsh(q, varlen), *_bsh(k, varlen), *_bsh(v, varlen), *_bsh(do, varlen), *_lse_strides(lse, varlen))
    mask_args, mask_consts = _mask_args(causal, window, softcap, softmax_scale, seq_q, seq_k)
    consts = dict(HEADDIM=d, VARLEN=varlen, BLOCK_D=block_d(d), **mask_consts)
    tune = _tune_seq(max(seq_q, seq_k))
    config = config or {}
    group = nheads // nheads_k
    split = config.get("split") or _group_split(batch * nheads_k * triton.cdiv(max(seq_k, 1), 64), group, q.device)
    if split > 1:  # fp32 partial sums, one slice per part, reduced in a fixed order: still deterministic
        dk_part = torch.empty((split, *k.shape), dtype=torch.float32, device=k.device)
        dv_part = torch.empty((split, *v.shape), dtype=torch.float32, device=v.device)
        dk_w, dv_w, stride_split = dk_part[0], dv_part[0], dk_part.stride(0)
    else:
        dk_w, dv_w, stride_split = dk, dv, 0
    _launch("dkdv", lambda meta: (triton.cdiv(max(seq_k, 1), meta["BLOCK_N"]), batch * nheads_k * split),
            (q, k, v, do, lse, delta, dk_w, dv_w, cu_q, cu_k, *common, *_bsh(dk_w, varlen), *_bsh(dv_w, varlen),
             seq_q, seq_k, nheads_k, group, split, stride_split, softmax_scale, *mask_args, tune), d, q.device,
            consts, config.get("dkdv"))
    if split > 1:
        dk.copy_(dk_part.sum(0))
        dv.copy_(dv_part.sum(0))
    _launch("dq", lambda meta: (triton.cdiv(max(seq_q, 1), meta["BLOCK_M"]), batch * nheads),
            (q, k, v, do, lse, delta, dq, cu_q, cu_k, *common, *_bsh(dq, varlen),
             seq_q, seq_k, nheads, nheads // nheads_k, softmax_scale, *mask_args, tune), d, q.device, consts,
            config.get("dq"))
    return dq, dk, dv


_KERNELS.update(fwd=_flash_fwd_kernel, dkdv=_flash_bwd_dkdv_kernel, dq=_flash_bwd_dq_kernel)


# ---------------------------------------------------------------- ahead-of-time compile checks

_POINTER_ARGS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")


def _signature(kernel, dtype: str, const: dict, varlen: bool, fp32_dkdv: bool = False) -> dict:
    import inspect  # noqa: PLC0415

    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("LSE", "DELTA", "DLSE"):
            sig[name] = "*fp32"
        elif name in ("CU_Q", "CU_K"):
            sig[name] = "*i32" if varlen else f"*{dtype}"
        elif name in ("DK", "DV") and fp32_dkdv:  # the split dK/dV kernel writes fp32 partial sums
            sig[name] = "*fp32"
        elif name in _POINTER_ARGS:
            sig[name] = f"*{dtype}"
        elif name in ("sm_scale", "cap_in", "cap_out"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _divisible(sig: dict) -> tuple:
    """The arguments the JIT specializes as multiples of 16 for the usual tensors (16-byte aligned, head
    dim a multiple of 16): the pointers and the q/k/v/o strides, not the lse's (seqlen_q) nor the lengths."""
    return tuple(n for n, t in sig.items() if t.startswith("*") and n not in ("CU_Q", "CU_K")
                 or n.startswith("stride_") and n not in ("stride_lb", "stride_lh"))


def compile_specs(arch: int, full: bool = False):
    """(kernel, signature, constexprs, options) for every config shipped for ``arch`` (80 or 90).

    Each config is compiled once, with dtype (fp16/bf16), the window mask, soft-capping and varlen
    rotating across the configs of a kernel so every variant is compiled too (the four window sides
    need only four configs per kernel); head dim 96 stands for the padded case. ``full=True`` gives
    the whole cross product (slow: minutes)."""
    major = 9 if arch >= 90 else 8
    specs = []
    for role, kernel in _KERNELS.items():
        i = 0
        for bucket, configs in CONFIGS[role][major].items():
            dims = {64: (64, 32), 128: (128, 96), 256: (256,)}[bucket]
            for bm, bn, warps, stages in configs:
                sides = ((False, False), (False, True), (True, True), (True, False))  # (LEFT, RIGHT)
                variants = ([(dt, w, vl, d, sc) for dt in ("fp16", "bf16") for w in sides
                             for vl in (False, True) for d in dims for sc in (False, True)] if full else
                            [(("fp16", "bf16")[i % 2], sides[i % 4], bool(i // 2 % 2), dims[i % len(dims)],
                              i % 3 == 1)])
                i += 1
                for dtype, (left, right), varlen, d, softcap in variants:
                    const = {"HEADDIM": d, "VARLEN": varlen, "LEFT": left, "RIGHT": right, "SOFTCAP": softcap,
                             "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": block_d(d)}
                    # dK/dV: every other config also as the split variant (fp32 partial sums)
                    for fp32_dkdv in ((False, True) if role == "dkdv" and (full or i % 2) else (False,)):
                        sig = _signature(kernel, dtype, const, varlen, fp32_dkdv)
                        specs.append((kernel, sig, const, {"num_warps": warps, "num_stages": stages},
                                      _divisible(sig)))
    for i, d in enumerate((64, 96, 128, 256)):
        const = {"HEADDIM": d, "HAS_DLSE": bool(i % 2), "BLOCK_M": _delta_rows(d), "BLOCK_D": block_d(d)}
        for dtype in (("fp16", "bf16") if full else (("fp16", "bf16")[i // 2],)):
            sig = _signature(_flash_bwd_delta_kernel, dtype, const, False)
            specs.append((_flash_bwd_delta_kernel, sig, const, {"num_warps": 4}, _divisible(sig)))
    return specs


__all__ = ["AOT_EXCEPTIONS", "AUTOTUNE_ENV", "CONFIGS", "INTERPRETER_CONFIG", "block_d", "compile_specs",
           "configs_for", "flash_attn_bwd", "flash_attn_fwd"]
