"""Attention over a context-parallel (CP) group: the sequence itself is split across ranks.

Layout ("zigzag", load-balanced for causal attention): the global sequence of S tokens is cut into
2·CP chunks of L = S / (2·CP) tokens; CP rank r holds chunks r and 2·CP−1−r, side by side, so
every rank holds one early and one late chunk and does the same causal work. Each rank passes
its own (batch, 2L, heads, dim) q/k/v; :func:`zigzag_indices` gives their global positions
(apply rotary with them), :func:`zigzag_split` cuts a full sequence into a rank's share.

Three algorithms, one op (``algo``):

* ``ring`` (default; Megatron-Core's and the ring-flash-attention family's): each rank keeps its
  queries and passes K/V (KV heads only, GQA) around the ring with ``isend``/``irecv``, computing
  the attention of the block it holds while the next one is in flight; partial outputs are merged
  with their log-sum-exp in fp32. Backward passes K/V and their fp32 dK/dV accumulators around the
  ring the same way (one extra hop brings each rank's dK/dV home). Memory per rank: two K/V blocks.
* ``allgather`` (Llama 3's CP): all-gather K/V once, then local attention with the mask; backward
  reduce-scatters dK/dV. Simpler, S·hk·d more memory; wins at small CP.
* ``a2a`` (DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded, full-sequence
  attention on H/CP heads, all-to-all back. Needs heads and KV heads divisible by CP.

Blocks are computed by the attention kernels (Triton on GPUs, the reference on CPUs) where the
mask is plain: with the zigzag layout every pair of chunks is diagonal (the causal kernel), wholly
in the past (the full kernel) or wholly in the future (skipped, never computed). A sliding window
or packed documents (``doc_ids``: equal ids attend to each other) need a per-pair mask: those
blocks go through the masked fp32 math of :func:`_masked_block_fwd` (O(L²) scores per block), and
blocks wholly outside the window or with no shared document are skipped.

Cost (ring, one rank, causal, balanced): 2·b·h·d·S²/CP FLOPs forward (half the full matrix over CP
ranks, ×2 for QK and PV); P2P bytes (CP−1)·2·b·2L·hk·d·bytes forward, twice that backward; hidden
behind the block compute when 2L is large enough (the planner models it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels.functional.attention import attention_bwd, attention_fwd, flash_attn_func, lse_dtype
from tpkernels.parallel.mappings import all_gather_dim, gather_from_sequence_parallel
from tpkernels.parallel.trace import CommSpan, gemm_span

ALGOS = ("ring", "allgather", "a2a")


# ---- the zigzag layout ----

def zigzag_indices(seqlen: int, cp: int, rank: int, device=None) -> Tensor:
    """Global positions (2L,) of CP rank ``rank``'s tokens: chunks ``rank`` and ``2·cp−1−rank``."""
    check_zigzag(seqlen, cp)
    L = seqlen // (2 * cp)
    a, b = rank * L, (2 * cp - 1 - rank) * L
    return torch.cat([torch.arange(a, a + L, device=device), torch.arange(b, b + L, device=device)])


def check_zigzag(seqlen: int, cp: int) -> None:
    if cp < 1:
        raise ValueError(f"cp ({cp}) must be >= 1")
    if seqlen % (2 * cp) != 0:
        raise ValueError(f"the sequence length ({seqlen}) must be divisible by 2 × cp ({2 * cp}): context "
                         "parallelism splits it into 2·cp equal chunks (two per rank, for load balance)")


def zigzag_split(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's share of a full sequence along ``dim`` (see :func:`zigzag_indices`)."""
    idx = zigzag_indices(x.shape[dim], cp, rank, device=x.device)
    return x.index_select(dim, idx)


def zigzag_merge(parts: list[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's share (rank order), the inverse of :func:`zigzag_split`."""
    cp = len(parts)
    L = parts[0].shape[dim] // 2
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        first, second = p.split(L, dim)
        chunks[r], chunks[2 * cp - 1 - r] = first, second
    return torch.cat(chunks, dim)


# ---- one block: queries of this rank against one K/V block ----

def _visible(q_idx: Tensor, k_idx: Tensor, q_doc: Tensor | None, k_doc: Tensor | None, causal: bool,
             window: tuple[int, int]) -> Tensor:
    """(b or 1, sq, sk) bool: which keys each query sees, from global positions and documents."""
    diff = q_idx[:, None] - k_idx[None, :]  # query position − key position
    ok = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    left, right = window
    if causal:
        ok &= diff >= 0
    if left >= 0:
        ok &= diff <= left
    if right >= 0 and not causal:
        ok &= diff >= -right
    ok = ok[None]
    if q_doc is not None:
        ok = ok & (q_doc[:, :, None] == k_doc[:, None, :])
    return ok


def _nothing_visible(q_idx: Tensor, k_idx: Tensor, causal: bool, window: tuple[int, int]) -> bool:
    """No query can see any key of the block (decided from the index ranges alone)."""
    q0, q1, k0, k1 = int(q_idx.min()), int(q_idx.max()), int(k_idx.min()), int(k_idx.max())
    if causal and k0 > q1:
        return True
    left, right = window
    if left >= 0 and q0 - k1 > left:
        return True
    return right >= 0 and not causal and k0 - q1 > right


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, float64 for float64 inputs (the fp64 oracle stays exact)."""
    return lse_dtype(t.dtype)


def _expand_kv(t: Tensor, h: int) -> Tensor:
    return t.repeat_interleave(h // t.shape[2], dim=2) if t.shape[2] != h else t


def _scores(q: Tensor, k: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(b, h, sq, sk) fp32 scores (softcapped) and tanh of the capped part (for the backward)."""
    a = _acc(q)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(a), _expand_kv(k, q.shape[2]).to(a)) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _masked_block_fwd(q, k, v, mask, scale, softcap) -> tuple[Tensor, Tensor]:
    """(o (b, sq, h, d) fp32, lse (b, h, sq) fp32; -inf where a query sees nothing)."""
    s, _ = _scores(q, k, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).to(p.dtype))
    return o, lse


def _masked_block_bwd(do, q, k, v, o, lse, mask, scale, softcap) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the final o and lse (fp32; dk, dv summed over a KV head's group)."""
    h, hk = q.shape[2], k.shape[2]
    s, t = _scores(q, k, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: lse -inf, p 0
    a = s.dtype
    dof, ve = do.to(a), _expand_kv(v, h).to(a)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, ve)
    delta = (dof * o.to(a)).sum(-1).transpose(1, 2)  # (b, h, sq)
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, h).to(a)) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(a)) * scale
    if hk != h:
        g = h // hk
        dk = dk.reshape(*dk.shape[:2], hk, g, dk.shape[-1]).sum(3)
        dv = dv.reshape(*dv.shape[:2], hk, g, dv.shape[-1]).sum(3)
    return dq, dk, dv


class _Opts:
    """What every block of one call shares."""

    def __init__(self, scale, causal, window, softcap, L, plain):
        self.scale, self.causal, self.window, self.softcap, self.L, self.plain = \
            scale, causal, window, softcap, L, plain


def _pairs(q_idx: Tensor, k_idx: Tensor, o: _Opts):
    """(q rows, k rows, causal) of the kernel calls of one plain block: the zigzag halves of both
    sides, each pair diagonal (causal), past (full) or future (skipped)."""
    L = o.L
    for a in (0, 1):
        qa = int(q_idx[a * L])
        for b in (0, 1):
            kb = int(k_idx[b * L])
            if o.causal and kb > qa:
                continue
            yield slice(a * L, (a + 1) * L), slice(b * L, (b + 1) * L), o.causal and kb == qa


def _block_mask(q_idx, k_idx, q_doc, k_doc, o: _Opts):
    """None when no query of the block sees a key; else the (b or 1, sq, sk) mask, or True for a
    plain block (the kernels mask it themselves)."""
    if _nothing_visible(q_idx, k_idx, o.causal, o.window):
        return None
    if o.plain:
        return True
    mask = _visible(q_idx, k_idx, q_doc, k_doc, o.causal, o.window)
    return mask if bool(mask.any()) else None


def _block_fwd(q, k, v, q_idx, k_idx, q_doc, k_doc, o: _Opts):
    """(o fp32, lse fp32) of queries against one K/V block, or None when nothing is visible."""
    mask = _block_mask(q_idx, k_idx, q_doc, k_doc, o)
    if mask is None:
        return None
    if not o.plain:
        return _masked_block_fwd(q, k, v, mask, o.scale, o.softcap)
    out, lse = _empty_out(q)
    for qs, ks, causal in _pairs(q_idx, k_idx, o):
        ob, lb = attention_fwd(q[:, qs], k[:, ks], v[:, ks], o.scale, causal, softcap=o.softcap)
        _merge_(out[:, qs], lse[:, :, qs], ob.to(out.dtype), lb.to(out.dtype))
    return out, lse


def _empty_out(q: Tensor) -> tuple[Tensor, Tensor]:
    """Accumulators: o (b, sq, h, d) zeros and lse (b, h, sq) -inf, in the accumulation dtype."""
    b, sq, h, d = q.shape
    a = _acc(q)
    return (torch.zeros(b, sq, h, d, dtype=a, device=q.device),
            torch.full((b, h, sq), float("-inf"), dtype=a, device=q.device))


def _block_bwd(do, q, k, v, out, lse, q_idx, k_idx, q_doc, k_doc, o: _Opts):
    """(dq, dk, dv) fp32 of one block, or None when nothing is visible."""
    mask = _block_mask(q_idx, k_idx, q_doc, k_doc, o)
    if mask is None:
        return None
    if not o.plain:
        return _masked_block_bwd(do, q, k, v, out, lse, mask, o.scale, o.softcap)
    a = _acc(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=a, device=t.device) for t in (q, k, v))
    o_cast = out.to(q.dtype)
    lse_k = lse.to(lse_dtype(q.dtype))
    for qs, ks, causal in _pairs(q_idx, k_idx, o):
        g = attention_bwd(do[:, qs].contiguous(), q[:, qs], k[:, ks], v[:, ks], o_cast[:, qs].contiguous(),
                          lse_k[:, :, qs].contiguous(), o.scale, causal, softcap=o.softcap)
        dq[:, qs] += g[0].to(a)
        dk[:, ks] += g[1].to(a)
        dv[:, ks] += g[2].to(a)
    return dq, dk, dv


def _merge_(out: Tensor, lse: Tensor, ob: Tensor, lb: Tensor) -> None:
    """out, lse ← the softmax-weighted union of (out, lse) and (ob, lb), in place, fp32."""
    new = torch.logaddexp(lse, lb)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(lse - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lb - safe).transpose(1, 2)[..., None]
    out.copy_(out * wa + ob * wb)
    lse.copy_(new)


# ---- the ring ----

def _ring_peers(group) -> tuple[int, int, int, int]:
    """(cp rank, cp size, global rank of the next, of the previous)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    return r, n, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _exchange(tensors: list[Tensor], nxt: int, prv: int, group, name: str = "cp ring K/V"):
    """Post sends of ``tensors`` to ``nxt`` and receives of the same shapes from ``prv``; returns
    (works, received buffers). The transfer is a span of an active CommTrace (the trainer's
    comm/compute ratio counts it) from posting to :func:`_wait`."""
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors] + \
        [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    span = CommSpan(name, tensors[0].device.type, bytes=sum(t.numel() * t.element_size() for t in tensors))
    return (dist.batch_isend_irecv(ops), span), bufs


def _wait(works) -> None:
    reqs, span = works
    for w in reqs:
        w.wait()
    span.done()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_idx, q_doc, group, opts: _Opts):
        r, n, nxt, prv = _ring_peers(group)
        out, lse = _empty_out(q)
        cur = [k, v, q_idx] + ([q_doc] if q_doc is not None else [])
        for step in range(n):
            pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None  # the next block in flight
            kdoc = cur[3] if q_doc is not None else None
            with gemm_span("cp attention block", q.device.type, step=step):
                res = _block_fwd(q, cur[0], cur[1], q_idx, cur[2], q_doc, kdoc, opts)
            if res is not None:
                _merge_(out, lse, *res)
            if pending is not None:
                _wait(pending[0])
                cur = pending[1]
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, q_idx, *([q_doc] if q_doc is not None else []))
        ctx.group, ctx.opts, ctx.has_doc = group, opts, q_doc is not None
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, q_idx, *rest = ctx.saved_tensors
        group, opts = ctx.group, ctx.opts
        doc = rest[0] if ctx.has_doc else None
        r, n, nxt, prv = _ring_peers(group)
        a = _acc(q)
        dq = torch.zeros(q.shape, dtype=a, device=q.device)
        cur = [k, v, q_idx] + ([doc] if doc is not None else [])
        acc = [torch.zeros(k.shape, dtype=a, device=k.device), torch.zeros(v.shape, dtype=a, device=v.device)]
        do = do.contiguous()
        for step in range(n):
            pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None
            kdoc = cur[3] if doc is not None else None
            with gemm_span("cp attention block backward", q.device.type, step=step):
                g = _block_bwd(do, q, cur[0], cur[1], o, lse, q_idx, cur[2], doc, kdoc, opts)
            if g is not None:
                dq += g[0]
                acc[0] += g[1]
                acc[1] += g[2]
            # the accumulators travel with their block; after the last step one more hop brings them home
            works, acc = _exchange(acc, nxt, prv, group, "cp ring dK/dV")
            _wait(works)
            if pending is not None:
                _wait(pending[0])
                cur = pending[1]
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None


# ---- a sliding window: only the blocks it reaches ----

def window_sources(seqlen: int, cp: int, causal: bool, window: tuple[int, int]) -> list[list[int]] | None:
    """For each CP rank, the other ranks whose K/V block any of its queries can see under the
    window (decided from positions alone; documents only remove more), or None when every rank
    needs every block (then the ring is the better schedule)."""
    L = seqlen // (2 * cp)
    halves = [(zigzag_indices(seqlen, cp, r)[:L], zigzag_indices(seqlen, cp, r)[L:]) for r in range(cp)]

    def sees(r: int, j: int) -> bool:  # per chunk pair: a rank's two chunks lie far apart
        return any(not _nothing_visible(qa, kb, causal, window) for qa in halves[r] for kb in halves[j])

    need = [[j for j in range(cp) if j != r and sees(r, j)] for r in range(cp)]
    return None if all(len(x) == cp - 1 for x in need) else need


def _direct(sends: list[tuple[int, list[Tensor]]], recvs: list[tuple[int, list[Tensor]]], group, name: str,
            device_type: str):
    """Post every send (peer, tensors) and receive (peer, like-shaped templates) at once; returns the
    works and the received buffers by peer."""
    ops, got = [], {}
    for peer, ts in sends:
        ops += [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group) for t in ts]
    for peer, like in recvs:
        got[peer] = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, peer), group) for b in got[peer]]
    nbytes = sum(t.numel() * t.element_size() for _, ts in sends for t in ts)
    span = CommSpan(name, device_type, bytes=nbytes)
    return ((dist.batch_isend_irecv(ops) if ops else []), span), got


class _WindowAttention(torch.autograd.Function):
    """Each rank sends its K/V only to the ranks whose queries its window reaches (at most the two
    zigzag neighbours' chunks for a window within a chunk) and computes only those blocks, instead
    of passing every block around the ring. Received blocks are kept for the backward, which sends
    their dK/dV straight back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, q_idx, q_doc, group, opts: _Opts, need: list[list[int]]):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        seqlen = q.shape[1] * n
        mine = [k, v] + ([q_doc] if q_doc is not None else [])
        readers = [d for d in range(n) if r in need[d]]
        works, got = _direct([(d, mine) for d in readers], [(j, mine) for j in need[r]], group, "cp window K/V",
                              q.device.type)
        out, lse = _empty_out(q)
        with gemm_span("cp attention block", q.device.type, src=r):
            res = _block_fwd(q, k, v, q_idx, q_idx, q_doc, q_doc, opts)
        if res is not None:
            _merge_(out, lse, *res)
        _wait(works)
        for j in need[r]:
            kj, vj, *dj = got[j]
            with gemm_span("cp attention block", q.device.type, src=j):
                res = _block_fwd(q, kj, vj, q_idx, zigzag_indices(seqlen, n, j, q.device), q_doc,
                                 dj[0] if dj else None, opts)
            if res is not None:
                _merge_(out, lse, *res)
        o = out.to(q.dtype)
        blocks = [t for j in need[r] for t in got[j]]
        ctx.save_for_backward(q, k, v, o, lse, q_idx, *([q_doc] if q_doc is not None else []), *blocks)
        ctx.group, ctx.opts, ctx.need, ctx.has_doc = group, opts, need, q_doc is not None
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, q_idx, *rest = ctx.saved_tensors
        doc = rest[0] if ctx.has_doc else None
        rest = rest[1:] if ctx.has_doc else rest
        group, opts, need = ctx.group, ctx.opts, ctx.need
        r, n = dist.get_rank(group), dist.get_world_size(group)
        seqlen = q.shape[1] * n
        per = 3 if ctx.has_doc else 2
        a = _acc(q)
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=a, device=q.device)
        dk = torch.zeros(k.shape, dtype=a, device=k.device)
        dv = torch.zeros(v.shape, dtype=a, device=v.device)
        g = _block_bwd(do, q, k, v, o, lse, q_idx, q_idx, doc, doc, opts)
        if g is not None:
            dq += g[0]
            dk += g[1]
            dv += g[2]
        back = []
        for i, j in enumerate(need[r]):
            kj, vj, *dj = rest[i * per:(i + 1) * per]
            g = _block_bwd(do, q, kj, vj, o, lse, q_idx, zigzag_indices(seqlen, n, j, q.device), doc,
                           dj[0] if dj else None, opts)
            if g is None:
                g = (None, torch.zeros_like(kj, dtype=a), torch.zeros_like(vj, dtype=a))
            else:
                dq += g[0]
            back.append((j, [g[1], g[2]]))
        readers = [d for d in range(n) if r in need[d]]
        works, got = _direct(back, [(d, [dk, dv]) for d in readers], group, "cp window dK/dV", q.device.type)
        _wait(works)
        for d in readers:
            dk += got[d][0]
            dv += got[d][1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


# ---- all-gather and all-to-all ----

class _LocalAttention(torch.autograd.Function):
    """Queries of this rank against K/V of given global positions (one block, any mask)."""

    @staticmethod
    def forward(ctx, q, k, v, q_idx, k_idx, q_doc, k_doc, opts: _Opts):
        res = _block_fwd(q, k, v, q_idx, k_idx, q_doc, k_doc, opts)
        out, lse = res if res is not None else _empty_out(q)
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, q_idx, k_idx, *(x for x in (q_doc, k_doc) if x is not None))
        ctx.opts, ctx.has_doc = opts, q_doc is not None
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, q_idx, k_idx, *docs = ctx.saved_tensors
        q_doc, k_doc = docs if ctx.has_doc else (None, None)
        g = _block_bwd(do, q, k, v, o, lse, q_idx, k_idx, q_doc, k_doc, ctx.opts)
        if g is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None, None
        return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    """(b, s_local, h, d) sequence-sharded ↔ (b, cp·s_local, h/cp, d) head-sharded (rank-major along
    the sequence); the backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, not ctx.to_heads), None, None


def _a2a(x: Tensor, group, to_heads: bool) -> Tensor:
    n = dist.get_world_size(group)
    if to_heads:  # split heads into n groups, send group j to rank j, receive every rank's sequence
        b, s, h, d = x.shape
        send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (n, b, s, h/n, d)
        recv = _all_to_all(send, group)
        return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)  # sequence rank-major
    b, ns, hn, d = x.shape
    s = ns // n
    send = x.reshape(b, n, s, hn, d).permute(1, 0, 2, 3, 4).contiguous()  # (n, b, s, h/n, d)
    recv = _all_to_all(send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, n * hn, d)


def _all_to_all(send: Tensor, group) -> Tensor:
    recv = torch.empty_like(send)
    span = CommSpan("cp all_to_all", send.device.type, bytes=send.numel() * send.element_size())
    dist.all_to_all_single(recv, send, group=group)
    span.done()
    return recv


# ---- the op ----

def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group, *, algo: str = "ring", causal: bool = True,
                               softmax_scale: float | None = None, window: tuple[int, int] = (-1, -1),
                               softcap: float = 0.0, doc_ids: Tensor | None = None,
                               return_lse: bool = False):
    """Attention of this CP rank's queries over the whole sequence held by the CP ``group``.

    q: (batch, 2L, nheads, headdim), k/v: (batch, 2L, nheads_kv, headdim): this rank's zigzag share
    (:func:`zigzag_split`) of a sequence of S = 2L·CP tokens. window: (left, right) in tokens, -1
    for no bound (causal sets right to 0). softcap: 0 for none. doc_ids: (batch, 2L) int, this
    rank's share of the packed documents' ids (tokens attend within their document only).
    Returns o like q (and lse (batch, nheads, 2L) fp32, the global log-sum-exp, with ``return_lse``).
    Differentiable in q, k, v. A group of one rank (or None without torch.distributed) is plain
    attention on the local sequence.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo ({algo!r}) must be one of {', '.join(ALGOS)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (batch, seq, heads, dim) "
                         "with the same batch, seq and dim, k and v alike")
    b, s_local, h, d = q.shape
    hk = k.shape[2]
    if h % hk:
        raise ValueError(f"nheads ({h}) must be divisible by nheads_kv ({hk})")
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and group is None:
        group = dist.group.WORLD
    n = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if n > 1 else 0
    if s_local % 2:
        raise ValueError(f"this rank's sequence ({s_local}) must be even: two zigzag chunks")
    if doc_ids is not None and tuple(doc_ids.shape) != (b, s_local):
        raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must be (batch, seq) = {(b, s_local)}")
    if algo == "a2a" and (h % n or hk % n):
        raise ValueError(f"algo 'a2a' needs nheads ({h}) and nheads_kv ({hk}) divisible by cp ({n}); use 'ring' "
                         "or 'allgather'")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = int(window[0]), int(window[1])
    window = (left, 0 if causal else right)
    seqlen = s_local * n
    q_idx = zigzag_indices(seqlen, n, rank, device=q.device)
    doc = None if doc_ids is None else doc_ids.to(torch.int64)
    plain = window == (-1, 0 if causal else -1) and doc is None
    opts = _Opts(scale, causal, window, softcap, s_local // 2, plain)
    windowed = window[0] >= 0 or (not causal and window[1] >= 0)
    need = window_sources(seqlen, n, causal, window) if algo == "ring" and n > 1 and windowed else None
    if need is not None:  # a window that leaves blocks out: send and compute only what it reaches
        o, lse = _WindowAttention.apply(q, k, v, q_idx, doc, group, opts, need)
    elif algo == "ring" and n > 1:
        o, lse = _RingAttention.apply(q, k, v, q_idx, doc, group, opts)
    elif algo == "a2a" and n > 1:  # every rank then holds the whole sequence for h/cp heads
        qh, kh, vh = (_AllToAll.apply(t, group, True) for t in (q, k, v))
        idx = all_gather_dim(q_idx, 0, group)  # the gathered sequence is rank-major zigzag shares
        dd = None if doc is None else all_gather_dim(doc, 1, group)
        o_h, lse_h = _whole_sequence(qh, kh, vh, idx, dd, opts)
        o = _AllToAll.apply(o_h, group, False)
        lse = _lse_back(lse_h, group, n) if return_lse else None
    else:  # allgather (or one rank): this rank's queries against every key
        if n == 1:
            kk, vv, k_idx, k_doc = k, v, q_idx, doc
        else:
            kk = gather_from_sequence_parallel(k, group, dim=1)  # backward: reduce-scatter of dK/dV
            vv = gather_from_sequence_parallel(v, group, dim=1)
            k_idx = all_gather_dim(q_idx, 0, group)
            k_doc = None if doc is None else all_gather_dim(doc, 1, group)
        o, lse = _gathered(q, kk, vv, q_idx, k_idx, doc, k_doc, opts)
    return (o, lse) if return_lse else o


def _natural(k_idx: Tensor) -> Tensor:
    """The permutation that puts gathered (rank-major zigzag) positions in sequence order."""
    return torch.argsort(k_idx)


def _gathered(q, k, v, q_idx, k_idx, q_doc, k_doc, opts: _Opts):
    """This rank's queries (two zigzag halves) against the gathered K/V: with a plain or causal-window
    mask each half is one kernel call on the keys in sequence order up to its end (bottom-right
    aligned causal masks are then exact); documents or a right window: the masked math."""
    causal, (left, right) = opts.causal, opts.window
    if k_doc is not None or not (causal or (left < 0 and right < 0)):
        return _LocalAttention.apply(q, k, v, q_idx, k_idx, q_doc, k_doc, _Opts(
            opts.scale, causal, opts.window, opts.softcap, opts.L, False))
    perm = _natural(k_idx)
    kn, vn = k.index_select(1, perm), v.index_select(1, perm)
    L, outs, lses = opts.L, [], []
    for a in (0, 1):
        end = int(q_idx[a * L]) + L if causal else kn.shape[1]
        o, lse = flash_attn_func(q[:, a * L:(a + 1) * L], kn[:, :end], vn[:, :end], softmax_scale=opts.scale,
                                 causal=causal, window_size=(left, 0 if causal else right), softcap=opts.softcap,
                                 return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _whole_sequence(q, k, v, idx, doc, opts: _Opts):
    """Full-sequence attention (a2a: every position, h/cp heads), put in sequence order for the kernel
    (any window works there) and back; documents: the masked math."""
    if doc is not None:
        return _LocalAttention.apply(q, k, v, idx, idx, doc, doc, _Opts(
            opts.scale, opts.causal, opts.window, opts.softcap, opts.L, False))
    perm = _natural(idx)
    inv = torch.argsort(perm)
    qn, kn, vn = (t.index_select(1, perm) for t in (q, k, v))
    o, lse = flash_attn_func(qn, kn, vn, softmax_scale=opts.scale, causal=opts.causal, window_size=opts.window,
                             softcap=opts.softcap, return_lse=True)
    return o.index_select(1, inv), lse.index_select(2, inv)


def _lse_back(lse_h: Tensor, group, n: int) -> Tensor:
    """(b, h/cp, cp·2L) head-sharded lse -> (b, h, 2L) of this rank's tokens."""
    x = lse_h.transpose(1, 2)[..., None]  # (b, cp·2L, h/cp, 1)
    return _a2a(x.contiguous(), group, False)[..., 0].transpose(1, 2)


__all__ = ["ALGOS", "check_zigzag", "context_parallel_attention", "window_sources", "zigzag_indices", "zigzag_merge",
           "zigzag_split"]
