"""Context-parallel attention (ring, allgather, a2a) on gloo at CP 2, 3 and 4 against the float64
oracle on the whole sequence: output, log-sum-exp, dQ, dK, dV; causal and not, GQA and MQA,
sliding windows smaller and larger than a chunk, softcap, packed documents whose boundaries fall
inside and across chunks; sequence lengths that are not powers of two."""

from __future__ import annotations

import math

import pytest
import torch

from tpkernels.functional.context_parallel import (
    context_parallel_attention,
    window_sources,
    zigzag_indices,
    zigzag_merge,
    zigzag_split,
)


def oracle(q, k, v, causal, window, softcap, doc):
    """Dense float64 attention with an explicit mask; rows that see nothing give 0 (lse -inf)."""
    b, S, h, d = q.shape
    g = h // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(S)
    diff = i[:, None] - i[None, :]
    ok = torch.ones(S, S, dtype=torch.bool)
    left, right = window
    if causal:
        ok &= diff >= 0
    if left >= 0:
        ok &= diff <= left
    if right >= 0 and not causal:
        ok &= diff >= -right
    ok = ok[None, None].expand(b, h, S, S)
    if doc is not None:
        ok = ok & (doc[:, None, :, None] == doc[:, None, None, :])
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


# (name, batch, chunk L, heads, kv heads, causal, window, softcap, documents)
CASES = [
    ("causal-gqa", 2, 5, 4, 2, True, (-1, -1), 0.0, False),
    ("full-mqa", 1, 3, 4, 1, False, (-1, -1), 0.0, False),
    ("window-inside-a-chunk", 2, 6, 4, 2, True, (3, 0), 0.0, False),
    ("window-across-chunks", 1, 4, 2, 2, True, (9, 0), 0.0, False),
    ("softcap", 1, 5, 4, 4, True, (-1, -1), 7.0, False),
    ("documents", 2, 5, 4, 2, True, (-1, -1), 0.0, True),
    ("documents-full", 1, 4, 4, 2, False, (-1, -1), 0.0, True),
    ("noncausal-window", 1, 4, 4, 4, False, (3, 2), 0.0, False),
    ("many-heads-gqa", 1, 3, 24, 12, True, (-1, -1), 0.0, False),  # heads every CP size divides (a2a)
    ("many-heads-window-documents", 1, 4, 12, 12, True, (5, 0), 0.0, True),
]


def _worker(rank, world, algo, seed):

    out = []
    for name, b, L, h, hk, causal, window, softcap, docs in CASES:
        if algo == "a2a" and (h % world or hk % world):
            continue
        S = 2 * L * world
        g = torch.Generator().manual_seed(seed + S)
        q = torch.randn(b, S, h, 8, generator=g, dtype=torch.float64)
        k = torch.randn(b, S, hk, 8, generator=g, dtype=torch.float64)
        v = torch.randn(b, S, hk, 8, generator=g, dtype=torch.float64)
        do = torch.randn(b, S, h, 8, generator=g, dtype=torch.float64)
        doc = None
        if docs:  # starts at random places: some inside a chunk, some on a chunk boundary
            starts = torch.rand(b, S, generator=g) < 0.15
            starts[:, 0] = True
            starts[:, L] = True
            doc = starts.long().cumsum(1)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        o_ref, lse_ref = oracle(qr, kr, vr, causal, window, softcap, doc)
        o_ref.backward(do)
        ql, kl, vl = (zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v))
        o, lse = context_parallel_attention(ql, kl, vl, None, algo=algo, causal=causal, window=window,
                                            softcap=softcap, return_lse=True,
                                            doc_ids=None if doc is None else zigzag_split(doc, world, rank))
        o.backward(zigzag_split(do, world, rank))
        mine = lambda t: zigzag_split(t, world, rank)  # noqa: E731
        finite = torch.isfinite(mine(lse_ref.transpose(1, 2))).transpose(1, 2)
        errs = {
            "o": (o - mine(o_ref)).abs().max().item(),
            "lse": (lse[finite] - mine(lse_ref.transpose(1, 2)).transpose(1, 2)[finite]).abs().max().item(),
            "dq": (ql.grad - mine(qr.grad)).abs().max().item(),
            "dk": (kl.grad - mine(kr.grad)).abs().max().item(),
            "dv": (vl.grad - mine(vr.grad)).abs().max().item(),
        }
        out.append((name, errs))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algo", ["ring", "allgather", "a2a"])
def test_context_parallel_attention_equals_the_whole_sequence(rank_pool, world, algo, fresh_seed):
    results = rank_pool(world).run(_worker, algo, fresh_seed % 10_000, timeout=240)
    checked = 0
    for rank, cases in enumerate(results):
        for name, errs in cases:
            for what, e in errs.items():
                assert e < 1e-9, (rank, algo, world, name, what, e)  # float64 both sides
            checked += 1
    want = [c for c in CASES if algo != "a2a" or (c[3] % world == 0 and c[4] % world == 0)]
    assert checked == world * len(want) and len(want) >= 2


def test_zigzag_layout_balances_and_inverts():
    S, cp = 30, 3
    idx = [zigzag_indices(S, cp, r) for r in range(cp)]
    assert sorted(torch.cat(idx).tolist()) == list(range(S))
    assert idx[0][:5].tolist() == [0, 1, 2, 3, 4] and idx[0][5:].tolist() == [25, 26, 27, 28, 29]
    # causal work per rank (visible pairs) is equal: the point of the zigzag
    work = [sum(int(i) + 1 for i in ix) for ix in idx]
    assert len(set(work)) == 1, work
    x = torch.randn(2, S, 3)
    assert torch.equal(zigzag_merge([zigzag_split(x, cp, r) for r in range(cp)]), x)


@pytest.mark.parametrize("kwargs, message", [
    (dict(algo="zigzag"), r"algo \('zigzag'\) must be one of ring, allgather, a2a"),
])
def test_bad_arguments_are_named(kwargs, message):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, q, q, None, **kwargs)


def _bad_worker(rank, world, case):
    q = torch.randn(1, 6, 4, 8)
    kv = torch.randn(1, 6, 1 if case == "mqa-a2a" else 4, 8)
    try:
        if case == "mqa-a2a":
            context_parallel_attention(q, kv, kv, None, algo="a2a")
        elif case == "odd-local":
            context_parallel_attention(torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4, 8), None)
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("case, message", [
    ("mqa-a2a", r"algo 'a2a' needs nheads \(4\) and nheads_kv \(1\) divisible by cp \(2\)"),
    ("odd-local", r"this rank's sequence \(5\) must be even"),
])
def test_bad_inputs_are_refused_on_every_rank(rank_pool, case, message):
    import re

    out = rank_pool(2).run(_bad_worker, case, timeout=60)
    assert all(m is not None and re.search(message, m) for m in out), out


def test_a_window_within_a_chunk_needs_only_the_neighbours_blocks():
    # CP4, chunks of 6: rank 0 holds chunks 0 and 7, rank 1 chunks 1 and 6, rank 2 2 and 5, rank 3 3 and 4
    assert window_sources(48, 4, True, (3, 0)) == ((1,), (0, 2), (1, 3), (2,))
    assert window_sources(48, 4, True, (-1, 0)) is None  # causal, no window: every block is needed
    assert window_sources(48, 4, False, (2, 2)) == ((1,), (0, 2), (1, 3), (2,))


def _bytes_worker(rank, world, window, seed):
    from tpkernels.parallel.trace import CommTrace  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=g).requires_grad_() for _ in range(3))
    with CommTrace() as tr:
        o = context_parallel_attention(q, k, v, None, causal=True, window=window)
        o.sum().backward()
    return sum(s.args.get("bytes", 0) for s in tr.spans if s.cat == "comm")


def test_blocks_outside_the_window_are_never_sent(rank_pool, fresh_seed):
    """CP4: with a 3-token window a rank sends its K/V to at most its two neighbours (and their
    dK/dV back) instead of passing every block around the ring."""
    ring = rank_pool(4).run(_bytes_worker, (-1, -1), fresh_seed % 1000, timeout=120)
    windowed = rank_pool(4).run(_bytes_worker, (3, 0), fresh_seed % 1000, timeout=120)
    kv = 2 * 12 * 2 * 8 * 4  # one rank's K and V, fp32
    assert all(r >= 3 * kv for r in ring), ring  # three hops of K/V forward alone
    assert all(0 < w <= 2 * kv + 2 * 2 * kv for w in windowed), windowed  # ≤ 2 readers: K/V there, dK/dV back
    assert sum(windowed) < sum(ring) / 2


def _compiled_worker(rank, world, algo, seed):
    torch.manual_seed(seed + rank)
    q = torch.randn(1, 8, 4, 8, requires_grad=True)
    k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return context_parallel_attention(q, k, v, None, algo=algo).square().sum()

    f(q, k, v).backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v).backward()
    return [float((a - t.grad).abs().max()) for a, t in zip(want, (q, k, v))]


@pytest.mark.parametrize("algo", ["ring", "allgather", "a2a"])
def test_the_registered_op_traces_whole_under_torch_compile(rank_pool, algo, fresh_seed):
    """One opaque op (fake shapes, autograd) with collectives inside: fullgraph compiles, same gradients."""
    for errs in rank_pool(2).run(_compiled_worker, algo, fresh_seed % 1000, timeout=240):
        assert max(errs) < 1e-6, errs


def test_opcheck_on_one_rank(fresh_seed):
    torch.manual_seed(fresh_seed)
    q = torch.randn(2, 6, 4, 8, requires_grad=True)
    k, v = (torch.randn(2, 6, 2, 8, requires_grad=True) for _ in range(2))
    args = (q, k, v, None, "", "ring", 8 ** -0.5, True, -1, 0, 0.0, True)
    torch.library.opcheck(torch.ops.tpkernels.cp_attention_forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
