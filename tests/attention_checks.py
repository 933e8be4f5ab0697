"""Shared checks of attention kernels against the float64 oracle (FlashAttention tolerance rule).

Every check draws fresh random inputs, poisons the output buffers with NaN where the caller can
hand them over, and compares the output, the log-sum-exp and all three gradients (with a
gradient flowing into the lse too) against ``attention_naive`` in float64, with two low-precision
evaluations in the input dtype as the tolerance rule's yardstick: the textbook math (autograd through
softmax) and the same math with FlashAttention's backward (``oracle_blocked``).
"""

from __future__ import annotations

import math

import torch

from tpkernels.functional.attention import canonical_window
from tpkernels.kernels.reference import attention_naive, visible, window_bounds
from tpkernels.testing.tolerance import assert_fa_close

def make_qkv(shape_q, shape_kv, dtype, device, requires_grad=True):
    q = torch.randn(shape_q, dtype=torch.float64).to(dtype).to(device)
    k = torch.randn(shape_kv, dtype=torch.float64).to(dtype).to(device)
    v = torch.randn(shape_kv, dtype=torch.float64).to(dtype).to(device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def oracle(q, k, v, do, dlse, scale, causal, dtype, window=(-1, -1), softcap=0.0):
    """(o, lse, dq, dk, dv) of the naive math in ``dtype``, computed on q's device, returned on the CPU.
    q: (b, sq, h, d)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    o, lse = attention_naive(*leaves, scale, causal, window=window, softcap=softcap)
    grads = torch.autograd.grad([o, lse], leaves, [do.detach().to(dtype), dlse.detach().to(lse.device, lse.dtype)])
    return tuple(t.detach().cpu() for t in (o, lse, *grads))


def oracle_blocked(q, k, v, do, dlse, scale, causal, dtype, window=(-1, -1), softcap=0.0):
    """``oracle``'s (o, lse, dq, dk, dv) in ``dtype`` with the backward written as FlashAttention's:
    dS = P∘(dP − δ) with dP = dO·Vᵀ and δ = rowsum(dO∘O) − dlse. The textbook backward (autograd through
    softmax: P·dP − P·Σ(P·dP)) cancels exactly with one key, so alone it is no yardstick there (see
    tpkernels/testing/tolerance.py). q (b, sq, h, d), k/v (b, sk, hk, d)."""
    q, k, v, do = (t.detach().to(dtype) for t in (q, k, v, do))
    o, lse = attention_naive(q, k, v, scale, causal, window=window, softcap=softcap)
    group = q.shape[2] // k.shape[2]
    kr, vr = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))  # (b, h, sk, d)
    qh, doh, oh = q.transpose(1, 2), do.transpose(1, 2), o.transpose(1, 2)  # (b, h, sq, d)
    s = torch.matmul(qh, kr.transpose(-1, -2)) * scale  # (b, h, sq, sk)
    t = torch.tanh(s / softcap) if softcap > 0 else None
    s = softcap * t if t is not None else s
    keep = visible(0, q.shape[1], q.shape[1], k.shape[1], *window_bounds(causal, window), q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])  # masked: exp(-inf) = 0
    delta = (doh * oh).sum(-1) - dlse.to(q.device, dtype)  # (b, h, sq)
    ds = p * (torch.matmul(doh, vr.transpose(-1, -2)) - delta[..., None])
    if t is not None:  # d(softcap·tanh(u/softcap))/du = 1 − tanh²
        ds = ds * (1 - t * t)
    b, h, sk = q.shape[0], q.shape[2], k.shape[1]

    def per_kv_head(g):  # (b, h, sk, d) -> (b, sk, hk, d): the group's query heads summed
        return g.reshape(b, h // group, group, sk, -1).sum(2).transpose(1, 2)

    dq = (torch.matmul(ds, kr) * scale).transpose(1, 2)
    dk = per_kv_head(torch.matmul(ds.transpose(-1, -2), qh) * scale)
    dv = per_kv_head(torch.matmul(p.transpose(-1, -2), doh))
    return tuple(t.detach().cpu() for t in (o, lse, dq, dk, dv))


def lse_cotangent(lse_shape, seen_mask):
    """A random gradient for the lse, 0 where the row sees no key (its lse is -inf there)."""
    g = torch.randn(lse_shape, dtype=torch.float64)
    return torch.where(seen_mask, g, torch.zeros_like(g))


def _floor_ulps(dtype) -> float:
    # In fp32 (and fp64) the floor decides where both low-precision evaluations are lucky (their errors are
    # one sample each of the roundoff). The one-key case, where the textbook backward cancels exactly, is
    # oracle_blocked's to measure, not the floor's (a fixed floor of 32 ulps at the output's scale once
    # failed a correct kernel there: FA2's dS subtracts dot products √d times larger than dq). 32 ulps
    # (3.8e-6) still catches any real bug (errors of 1e-3 and up). In 16-bit dtypes ref_lp's own error
    # dominates.
    return 32.0 if dtype in (torch.float32, torch.float64) else 8.0


def compare(ours, ref64, ref_lp, names=("out", "lse", "dq", "dk", "dv"), ulps=None):
    """ours/ref64: (o, lse, dq, dk, dv) tuples; ref_lp: one such tuple or a list of them (low-precision
    evaluations: the rule's yardstick is their largest error). lse rows that are -inf must match exactly.
    ``ulps``: the floor in units of the dtype's last place (default: the dtype's usual floor)."""
    ulps = ulps if ulps is not None else _floor_ulps(ours[0].dtype)
    evals = ref_lp if isinstance(ref_lp, list) else [ref_lp]
    for i, (name, a, r64) in enumerate(zip(names, ours, ref64)):
        a, rlp = a.detach().cpu(), [e[i] for e in evals]
        if name == "lse":
            inf = torch.isinf(r64)
            assert torch.equal(torch.isinf(a), inf), "lse: -inf rows (queries that see no key) differ"
            assert bool((a[inf] < 0).all()), "lse: rows that see no key must be -inf"
            a, r64, rlp = a[~inf], r64[~inf], [r[~inf] for r in rlp]
            # the lse is fp32 whatever the input dtype: compare at fp32's floor
            assert_fa_close(a.float(), r64, rlp, name=name, ulps=ulps)
            continue
        assert_fa_close(a, r64, rlp, grad=name.startswith("d"), name=name, ulps=ulps)


def rows_that_see_a_key(sq, sk, causal, window=(-1, -1)):
    """(sq,) bool: the query rows whose mask leaves at least one key."""
    keep = visible(0, sq, sq, sk, *window_bounds(causal, window), "cpu")
    return torch.ones(sq, dtype=torch.bool) if keep is None else keep.any(-1)


def check_dense(run, b, sq, sk, h, hk, d, causal, dtype, device, scale=None, lse_grad=True, window=(-1, -1),
                softcap=0.0, canonical=False, score_floor=False):
    """run(q, k, v, do, dlse, scale, causal, window, softcap) -> (o, lse, dq, dk, dv) for dense (b, s, h, d)
    inputs. ``lse_grad=False``: the lse's cotangent is zero (the usual training case). ``canonical``: ``run``
    normalises the window as flash-attn does (the public API), so the oracle gets the normalised one.
    ``score_floor``: scores far from O(1) (a large ``scale``): P = exp(s − lse) carries a relative
    error of about |s|·eps whatever the summation order, so the floor grows to max|s| ulps, times
    √(keys or queries) for the gradients' sums over them (random signs: dK sums dS·q over the queries;
    a CI run saw 300 ulps of dk against a 260-ulp floor at 65 queries)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q, k, v = make_qkv((b, sq, h, d), (b, sk, hk, d), dtype, device)
    do = torch.randn((b, sq, h, d), dtype=torch.float64).to(dtype).to(device)
    ref_window = canonical_window(window, causal, sk) if canonical else window
    seen = rows_that_see_a_key(sq, sk, causal, ref_window)
    dlse = lse_cotangent((b, h, sq), seen.expand(b, h, sq)).to(device)
    if not lse_grad:
        dlse = torch.zeros_like(dlse)
    ours = run(q, k, v, do, dlse, scale, causal, window, softcap)
    ref64 = oracle(q, k, v, do, dlse, scale, causal, torch.float64, ref_window, softcap)
    ref_lp = [oracle(q, k, v, do, dlse, scale, causal, dtype, ref_window, softcap),
              oracle_blocked(q, k, v, do, dlse, scale, causal, dtype, ref_window, softcap)]
    ulps = None
    if score_floor:
        top = (scale * torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(),
                                    k.double().cpu().repeat_interleave(h // hk, dim=2))).abs().max().item()
        ulps = _floor_ulps(dtype) + top * math.sqrt(max(sq, sk))
    compare(ours, ref64, ref_lp, ulps=ulps)
    return ours


def random_lengths(n, lo=1, hi=70):
    """n odd-leaning random lengths in [lo, hi]."""
    return [int(x) for x in torch.randint(lo, hi + 1, (n,))]


def cu_seqlens(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def check_varlen(run_varlen, run_dense, lens_q, lens_k, h, hk, d, causal, dtype, device, window=(-1, -1),
                 softcap=0.0):
    """Packed sequences against the oracle per sequence, and equal to ``run_dense`` on each sequence alone
    up to rounding (16 ulps of the largest value: the CPU path batches the documents of one length, whose
    matmuls round differently; a leak across sequences would be O(1)).

    run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, do, dlse, scale, causal, window, softcap)
    -> (o, lse (h, total), dq, dk, dv). The window is taken as given (no normalisation)."""
    scale = 1.0 / math.sqrt(d)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = make_qkv((tq, h, d), (tk, hk, d), dtype, device)
    do = torch.randn((tq, h, d), dtype=torch.float64).to(dtype).to(device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    seen = torch.cat([rows_that_see_a_key(lq, lk, causal, window) for lq, lk in zip(lens_q, lens_k)]) if tq else \
        torch.zeros(0, dtype=torch.bool)
    seen = seen & torch.tensor([lk > 0 for lq, lk in zip(lens_q, lens_k) for _ in range(lq)], dtype=torch.bool)
    dlse = lse_cotangent((h, tq), seen[None, :].expand(h, tq)).to(device)
    ours = run_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), do, dlse, scale, causal, window, softcap)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        mine = (ours[0][qs], ours[1][:, qs], ours[2][qs], ours[3][ks], ours[4][ks])
        if lq == 0:
            continue
        if lk == 0:  # no key at all: output 0, lse -inf, no gradient
            assert bool((mine[0] == 0).all()) and bool(torch.isinf(mine[1]).all()) and bool((mine[2] == 0).all())
            continue
        args = [t[None] for t in (q[qs], k[ks], v[ks], do[qs])] + [dlse[None, :, qs]]
        ref64 = oracle(*args, scale, causal, torch.float64, window, softcap)
        per_seq = tuple(t[0] for t in ref64)  # the batch of one sequence unwrapped
        per_lp = [tuple(t[0] for t in ev(*args, scale, causal, dtype, window, softcap)) for ev in (oracle, oracle_blocked)]
        compare(mine, per_seq, per_lp)
        alone = run_dense(*args[:3], args[3], args[4], scale, causal, window, softcap)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), mine, alone):
            b = b[0]
            same = torch.equal(torch.isinf(a), torch.isinf(b)) and torch.allclose(
                torch.nan_to_num(a.float(), neginf=0.0), torch.nan_to_num(b.float(), neginf=0.0),
                rtol=0, atol=16 * torch.finfo(dtype).eps * max(1.0, b[~torch.isinf(b)].abs().max().item()))
            assert same, f"sequence {i} ({lq} queries, {lk} keys): varlen {name} differs from the sequence run alone"
    return ours
