"""Context-parallel attention (ring, allgather, a2a) on gloo at CP 2, 3 and 4 against the float64
oracle on the whole sequence: output, log-sum-exp, dQ, dK, dV; causal and not, GQA and MQA,
sliding windows smaller than a chunk, across several chunks and no-op ones (Mistral's 4096),
softcap, packed documents of uneven length (given as global host ``cu_seqlens`` or as device
``doc_ids``) with boundaries inside chunks, exactly on chunk edges, a single-token document and
documents spanning chunks and ranks; sequence lengths that are not powers of two. Memory: a CP2
packed-document step with a window allocates no (S/CP)² tensor, and its peak live bytes grow
linearly with S. The ring backward posts each dK/dV hop before the next block's computation."""

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


# (name, batch, chunk L, heads, kv heads, causal, window, softcap, documents: None, "ids" or "cu")
CASES = [
    ("causal-gqa", 2, 5, 4, 2, True, (-1, -1), 0.0, None),
    ("full-mqa", 1, 3, 4, 1, False, (-1, -1), 0.0, None),
    ("window-inside-a-chunk", 2, 6, 4, 2, True, (3, 0), 0.0, None),
    ("window-across-chunks", 1, 4, 2, 2, True, (9, 0), 0.0, None),
    ("no-op-window", 1, 4, 4, 2, True, (4096, 0), 0.0, None),  # Mistral's window at a short sequence
    ("softcap", 1, 5, 4, 4, True, (-1, -1), 7.0, None),
    ("documents-ids", 2, 5, 4, 2, True, (-1, -1), 0.0, "ids"),
    ("documents", 2, 7, 4, 2, True, (-1, -1), 0.0, "cu"),
    ("documents-full", 1, 4, 4, 2, False, (-1, -1), 0.0, "cu"),
    ("documents-window-in-chunk", 2, 6, 4, 2, True, (2, 0), 0.0, "cu"),
    ("documents-window-across", 2, 5, 4, 1, True, (12, 0), 0.0, "cu"),
    ("documents-no-op-window", 1, 5, 4, 2, True, (4096, 0), 0.0, "cu"),
    ("documents-softcap", 2, 5, 4, 2, True, (-1, -1), 5.0, "cu"),
    ("documents-noncausal-window", 1, 5, 4, 2, False, (4, 3), 0.0, "cu"),
    ("noncausal-window", 1, 4, 4, 4, False, (3, 2), 0.0, None),
    ("many-heads-gqa", 1, 3, 24, 12, True, (-1, -1), 0.0, None),  # heads every CP size divides (a2a)
    ("many-heads-window-documents", 1, 4, 12, 12, True, (5, 0), 0.0, "ids"),
    ("many-heads-noncausal-documents", 2, 4, 12, 6, False, (3, 6), 3.0, "cu"),
]


def documents(b: int, S: int, L: int, g: torch.Generator) -> torch.Tensor:
    """(b, S) document ids of uneven length: random starts, a start exactly on a chunk edge (L), a
    single-token document, and one long document over several chunks (and ranks); rows differ."""
    starts = torch.rand(b, S, generator=g) < 0.15
    starts[:, 0] = True
    starts[:, L] = True
    one = L + L // 2
    starts[:, one:one + 2] = True  # the token at `one` is a document of its own
    if S > 4 * L:
        starts[0, 2 * L + 1:S - L] = False  # row 0: from inside chunk 2 to the last chunk
    return starts.long().cumsum(1)


def cu_seqlens_of(doc: torch.Tensor) -> torch.Tensor:
    """Global boundaries over the flattened batch of (b, S) document ids (host, int32)."""
    b, S = doc.shape
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([idx, torch.tensor([b * S])]).to(torch.int32)


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
        doc = documents(b, S, L, g) if docs else None
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        o_ref, lse_ref = oracle(qr, kr, vr, causal, window, softcap, doc)
        o_ref.backward(do)
        ql, kl, vl = (zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v))
        given = {"ids": dict(doc_ids=None if doc is None else zigzag_split(doc, world, rank)),
                 "cu": dict(cu_seqlens=None if doc is None else cu_seqlens_of(doc))}.get(docs, {})
        o, lse = context_parallel_attention(ql, kl, vl, None, algo=algo, causal=causal, window=window,
                                            softcap=softcap, return_lse=True, **given)
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
    args = (q, k, v, None, None, "", "ring", 8 ** -0.5, True, -1, 0, 0.0, True)
    torch.library.opcheck(torch.ops.tpkernels.cp_attention_forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ---- memory: no (S/CP)² tensor, linear growth ----

def _uneven_cu_seqlens(S: int, g: torch.Generator) -> torch.Tensor:
    """Global boundaries of one row of documents 1 to 3000 tokens long (a packed long-context batch)."""
    cuts = [0]
    while cuts[-1] < S:
        cuts.append(min(S, cuts[-1] + int(torch.randint(1, 3001, (1,), generator=g))))
    return torch.tensor(cuts, dtype=torch.int32)


def _memory_worker(rank, world, seed, window):
    from tpkernels.live_bytes import LiveTensorBytes  # noqa: PLC0415

    out = []
    for S in (16384, 32768):
        g = torch.Generator().manual_seed(seed)
        cu = _uneven_cu_seqlens(S, g)
        q, k, v = (zigzag_split(torch.randn(1, S, h, 16, generator=g), world, rank).requires_grad_() for h in (2, 1, 1))
        with LiveTensorBytes() as mem:
            o = context_parallel_attention(q, k, v, None, cu_seqlens=cu, window=window)
            o.backward(torch.ones_like(o))
        out.append((mem.peak_bytes, mem.largest_elements))
    return out


@pytest.mark.parametrize("window", [(-1, -1), (1500, 0)])
def test_a_cp2_packed_step_holds_linear_memory(rank_pool, fresh_seed, window):
    """Live tensor bytes (every tensor PyTorch ops return, inside the op too) of a CP2 packed-document
    forward + backward at S = 16k and 32k (tiny heads: 2 query, 1 KV, head dim 16): the peak grows at
    most 2.2× when S doubles, beside the per-block working set, which does not grow with S (a few fp32 score
    tiles of the largest block: whether the 16k case needs a whole tile depends on where the random documents
    fall, e.g. 11.1 MB at 16k vs 38.1 MB at 32k for one seed, both holding 1024² tiles at 32k), and no tensor
    holds (S/CP)² elements (no score matrix, no mask of a block)."""
    for (peak16, big16), (peak32, big32) in rank_pool(2).run(_memory_worker, fresh_seed % 1000, window,
                                                              timeout=300):
        tiles = 8 * 4 * max(big16, big32)  # bytes of 8 fp32 tiles of the largest block (P, dS, their halves...)
        assert peak32 <= 2.2 * peak16 + tiles, (peak16, peak32, tiles)
        assert big16 < (16384 // 2) ** 2 and big32 < (32768 // 2) ** 2, (big16, big32)


# ---- the ring backward's overlap ----

def _overlap_worker(rank, world, seed):
    from tpkernels.parallel.trace import CommTrace  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g).requires_grad_() for _ in range(3))
    o = context_parallel_attention(q, k, v, None)
    with CommTrace() as tr:
        o.sum().backward()
    iv = list(zip(tr.spans, tr._resolved()))
    hops = [t for s, t in iv if s.name == "cp ring dK/dV"]
    blocks = [t for s, t in iv if s.name == "cp attention block backward"]
    return [any(a < b0 and b1 <= z for b0, b1 in blocks) for a, z in hops]


def test_the_ring_backward_computes_a_block_while_each_dkdv_hop_travels(rank_pool, fresh_seed):
    """CP3: three dK/dV hops per rank; each but the last (the one home) is posted before the next
    block's backward starts and waited for after it ends."""
    for hidden in rank_pool(3).run(_overlap_worker, fresh_seed % 1000, timeout=120):
        assert hidden == [True, True, False], hidden


# ---- the Triton kernels under the interpreter ----

def _triton_worker(rank, world, seed):
    import os  # noqa: PLC0415

    os.environ["TPKERNELS_BACKEND"] = "flash_attn=triton"
    try:
        g = torch.Generator().manual_seed(seed)
        L, b = 4, 2
        S = 2 * L * world
        q, k, v, do = (torch.randn(b, S, h, 16, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
        doc = documents(b, S, L, g)
        out = {}
        for window in ((-1, -1), (3, 0)):
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            o_ref, _ = oracle(qr, kr, vr, True, window, 0.0, doc)
            o_ref.backward(do)
            ql, kl, vl = (zigzag_split(t, world, rank).float().requires_grad_() for t in (q, k, v))
            o = context_parallel_attention(ql, kl, vl, None, window=window, cu_seqlens=cu_seqlens_of(doc))
            o.backward(zigzag_split(do, world, rank).float())
            out[window] = max(float((a.detach().double() - zigzag_split(r, world, rank)).abs().max())
                              for a, r in ((o, o_ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)))
        return out
    finally:
        os.environ.pop("TPKERNELS_BACKEND")


def test_the_triton_kernels_run_the_packed_and_windowed_blocks(rank_pool, fresh_seed):
    """CP2 ring in fp32 through the Triton kernels (interpreter): varlen calls with key-less
    sequences, dense cross-chunk calls with shifted windows; against the float64 oracle."""
    for errs in rank_pool(2).run(_triton_worker, fresh_seed % 1000, timeout=600):
        assert max(errs.values()) < 1e-4, errs


# ---- the host plan ----

def test_a_band_is_exactly_the_window_in_the_kernels_convention(fresh_seed):
    """``band`` trims query and key ranges to the pairs that see each other and gives the kernel's
    bottom-right window over them: the same pairs as the global window, every query and key in use."""
    import random  # noqa: PLC0415

    from tpkernels.kernels.window import band  # noqa: PLC0415

    rng = random.Random(fresh_seed)
    for _ in range(2000):
        qs, ks = rng.randint(0, 30), rng.randint(0, 30)
        qe, ke = qs + rng.randint(1, 20), ks + rng.randint(1, 20)
        left, right = rng.choice([-1, 0, 1, 2, 5, 40]), rng.choice([-1, 0, 1, 3, 40])
        want = {(p, t) for p in range(qs, qe) for t in range(ks, ke)
                if (left < 0 or t >= p - left) and (right < 0 or t <= p + right)}
        b = band(qs, qe, ks, ke, left, right)
        if not want:
            assert b is None
            continue
        m, n = b.qe - b.qs, b.ke - b.ks
        got = {(b.qs + i, b.ks + j) for i in range(m) for j in range(n)
               if (b.left < 0 or j - i - (n - m) >= -b.left) and (b.right < 0 or j - i - (n - m) <= b.right)}
        assert got == want, (qs, qe, ks, ke, left, right, b)
        assert {p for p, _ in got} == set(range(b.qs, b.qe)) and {t for _, t in got} == set(range(b.ks, b.ke))


def test_plain_and_packed_blocks_plan_dense_and_varlen_calls():
    """CP2, chunks of 8: without documents every pair is one dense call (diagonal causal, past full,
    future none); a chunk's own documents become one varlen call; a document that spans two chunks
    gives their cross pair one dense call on its rows."""
    from tpkernels.functional.context_parallel_plan import geometry, rows_from_cu_seqlens  # noqa: PLC0415

    plain = geometry(32, 2, 0, (-1, 0), None, 1, torch.device("cpu"))
    calls = plain.block(1)  # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2: two past pairs for chunk 3
    assert [(c.q_rows, c.k_rows, c.window, c.varlen) for c in calls] == [
        (slice(8, 16), slice(0, 8), (-1, -1), None), (slice(8, 16), slice(8, 16), (-1, -1), None)]
    own = [(c.q_rows, c.k_rows, c.window) for c in plain.block(0)]
    assert own == [(slice(0, 8), slice(0, 8), (-1, 0)), (slice(8, 16), slice(0, 8), (-1, -1)),
                   (slice(8, 16), slice(8, 16), (-1, 0))]
    rows = rows_from_cu_seqlens(torch.tensor([0, 3, 4, 20, 32]), 1, 32)  # a 1-token document, one over chunks 0–2
    packed = geometry(32, 2, 1, (-1, 0), rows, 1, torch.device("cpu"))
    # rank 1 holds chunks 1 [8, 16) (inside one document: dense) and 2 [16, 24) (two documents: varlen)
    own = packed.block(1)
    assert [(c.q_rows, c.k_rows, c.window) for c in own[:2]] == [(slice(0, 8), slice(0, 8), (-1, 0)),
                                                                  (slice(8, 12), slice(0, 8), (-1, -1))]
    assert own[2].k_rows is None and own[2].varlen.cu_q.tolist() == own[2].varlen.cu_k.tolist() == [0, 4, 8]
    cross = [c for c in packed.block(0) if c.q_rows.start < 8]  # chunk 1 [8, 16) against chunk 0 [0, 8)
    assert [(c.q_rows, c.k_rows, c.window) for c in cross] == [(slice(0, 8), slice(4, 8), (-1, -1))]
