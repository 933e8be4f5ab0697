"""The four ways context-parallel attention moves K/V over the CP group, each as an explicit forward
and backward (no autograd inside: the registered op in tpkernels.functional.context_parallel
wires them to autograd, which keeps them opaque to torch.compile).

Shapes: q (b, 2L, h, d), k/v (b, 2L, hk, d) this rank's zigzag share; q_idx (2L,) its global
positions; doc (b, 2L) int64 document ids or None; o like q; lse (b, h, 2L) fp32 (fp64 for fp64).

* ring: K/V (KV heads only) pass around the ring by ``batch_isend_irecv``, the next block in
  flight while the held one is computed; the backward passes K/V and the fp32 dK/dV accumulators
  the same way (one extra hop brings each rank's home).
* window: a window that leaves blocks out: each rank sends its K/V only to the ranks whose queries
  reach it (for a window within a chunk, the two zigzag neighbours), all at once; the backward
  sends them again (windows make them small) and returns the dK/dV straight to their owners.
* allgather: gather K/V (rank-major, kept for the backward), attention of this rank's two halves
  against the keys in sequence order; the backward reduce-scatters dK/dV.
* a2a: all-to-all to head-sharded, whole-sequence attention on h/cp heads, all-to-all back; the
  head-sharded q/k/v/o/lse are kept for the backward, which runs the same exchanges in reverse.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels.functional.attention import attention_bwd, attention_fwd
from tpkernels.functional.context_parallel_blocks import (
    BlockOpts,
    accumulate_block,
    acc_dtype,
    block_bwd,
    block_fwd,
    empty_out,
    nothing_visible,
    zigzag_indices,
)
from tpkernels.parallel.mappings import all_gather_dim, reduce_scatter_dim
from tpkernels.parallel.trace import CommSpan, gemm_span


# ---- point-to-point ----

def _exchange(tensors: list[Tensor], nxt: int, prv: int, group, name: str = "cp ring K/V"):
    """Post sends of ``tensors`` to ``nxt`` and receives of the same shapes from ``prv``; returns
    (works, received buffers). The transfer is a span of an active CommTrace (the trainer's
    comm/compute ratio counts it) from posting to :func:`_wait`."""
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors] + \
        [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    span = CommSpan(name, tensors[0].device.type, bytes=sum(t.numel() * t.element_size() for t in tensors))
    return (dist.batch_isend_irecv(ops), span), bufs


def _direct(sends: list[tuple[int, list[Tensor]]], recvs: list[tuple[int, list[Tensor]]], group, name: str,
            device_type: str):
    """Post every send (group rank, tensors) and receive (group rank, like-shaped templates) at once;
    returns the works and the received buffers by peer."""
    ops, got = [], {}
    for peer, ts in sends:
        ops += [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group) for t in ts]
    for peer, like in recvs:
        got[peer] = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, peer), group) for b in got[peer]]
    span = CommSpan(name, device_type, bytes=sum(t.numel() * t.element_size() for _, ts in sends for t in ts))
    return ((dist.batch_isend_irecv(ops) if ops else []), span), got


def _wait(works) -> None:
    reqs, span = works
    for w in reqs:
        w.wait()
    span.done()


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(cp rank, cp size, global rank of the next, of the previous)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    return r, n, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


# ---- ring ----

def ring_forward(q, k, v, q_idx, doc, group, opts: BlockOpts) -> tuple[Tensor, Tensor]:
    r, n, nxt, prv = _ring_peers(group)
    out, lse = empty_out(q)
    cur = [k, v, q_idx] + ([doc] if doc is not None else [])
    for step in range(n):
        pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None  # the next block in flight
        with gemm_span("cp attention block", q.device.type, step=step):
            accumulate_block(out, lse, q, cur[0], cur[1], q_idx, cur[2], doc, cur[3] if doc is not None else None,
                             opts)
        if pending is not None:
            _wait(pending[0])
            cur = pending[1]
    return out.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, q_idx, doc, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    r, n, nxt, prv = _ring_peers(group)
    a = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=a, device=q.device)
    cur = [k, v, q_idx] + ([doc] if doc is not None else [])
    acc = [torch.zeros(k.shape, dtype=a, device=k.device), torch.zeros(v.shape, dtype=a, device=v.device)]
    for step in range(n):
        pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None
        with gemm_span("cp attention block backward", q.device.type, step=step):
            g = block_bwd(do, q, cur[0], cur[1], o, lse, q_idx, cur[2], doc, cur[3] if doc is not None else None,
                          opts)
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
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


# ---- window: only the blocks it reaches ----

@functools.lru_cache(maxsize=256)
def window_sources(seqlen: int, cp: int, causal: bool, window: tuple[int, int]) -> tuple[tuple[int, ...], ...] | None:
    """For each CP rank, the other ranks whose K/V block any of its queries can see under the
    window (decided from positions alone; documents only remove more), or None when every rank
    needs every block (then the ring is the better schedule). Cached: every layer asks the same."""
    L = seqlen // (2 * cp)
    halves = [(zigzag_indices(seqlen, cp, r)[:L], zigzag_indices(seqlen, cp, r)[L:]) for r in range(cp)]

    def sees(r: int, j: int) -> bool:  # per chunk pair: a rank's two chunks lie far apart
        return any(not nothing_visible(qa, kb, causal, window) for qa in halves[r] for kb in halves[j])

    need = tuple(tuple(j for j in range(cp) if j != r and sees(r, j)) for r in range(cp))
    return None if all(len(x) == cp - 1 for x in need) else need


def _window_blocks(q, k, v, doc, group, need, name: str):
    """Send this rank's K/V (and documents) to the ranks that read it; receive the blocks it reads."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    mine = [k, v] + ([doc] if doc is not None else [])
    readers = [d for d in range(n) if r in need[d]]
    works, got = _direct([(d, mine) for d in readers], [(j, mine) for j in need[r]], group, name, q.device.type)
    return works, got, readers


def window_forward(q, k, v, q_idx, doc, group, opts: BlockOpts, need) -> tuple[Tensor, Tensor]:
    r, n = dist.get_rank(group), dist.get_world_size(group)
    seqlen = q.shape[1] * n
    works, got, _ = _window_blocks(q, k, v, doc, group, need, "cp window K/V")
    out, lse = empty_out(q)
    with gemm_span("cp attention block", q.device.type, src=r):  # its own block while the others travel
        accumulate_block(out, lse, q, k, v, q_idx, q_idx, doc, doc, opts)
    _wait(works)
    for j in need[r]:
        kj, vj, *dj = got[j]
        with gemm_span("cp attention block", q.device.type, src=j):
            accumulate_block(out, lse, q, kj, vj, q_idx, zigzag_indices(seqlen, n, j, q.device), doc,
                             dj[0] if dj else None, opts)
    return out.to(q.dtype), lse


def window_backward(do, q, k, v, o, lse, q_idx, doc, group, opts: BlockOpts, need) -> tuple[Tensor, Tensor, Tensor]:
    r, n = dist.get_rank(group), dist.get_world_size(group)
    seqlen = q.shape[1] * n
    works, got, readers = _window_blocks(q, k, v, doc, group, need, "cp window K/V")
    a = acc_dtype(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=a, device=t.device) for t in (q, k, v))
    g = block_bwd(do, q, k, v, o, lse, q_idx, q_idx, doc, doc, opts)
    if g is not None:
        dq += g[0]
        dk += g[1]
        dv += g[2]
    _wait(works)
    back = []
    for j in need[r]:
        kj, vj, *dj = got[j]
        g = block_bwd(do, q, kj, vj, o, lse, q_idx, zigzag_indices(seqlen, n, j, q.device), doc,
                      dj[0] if dj else None, opts)
        if g is None:  # documents hid the whole block: its owner still waits for a (zero) gradient
            g = (None, torch.zeros(kj.shape, dtype=a, device=kj.device), torch.zeros(vj.shape, dtype=a,
                                                                                     device=vj.device))
        else:
            dq += g[0]
        back.append((j, [g[1], g[2]]))
    works, got = _direct(back, [(d, [dk, dv]) for d in readers], group, "cp window dK/dV", q.device.type)
    _wait(works)
    for d in readers:
        dk += got[d][0]
        dv += got[d][1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- all-gather ----

def _masked(opts: BlockOpts) -> BlockOpts:
    return BlockOpts(opts.scale, opts.causal, opts.window, opts.softcap, opts.L, False)


def _kernel_path(opts: BlockOpts, doc) -> bool:
    """The keys in sequence order with one kernel call per zigzag half: exact for bottom-right
    aligned causal masks (with a left window too) and for full attention; documents or a right
    window need the masked math."""
    left, right = opts.window
    return doc is None and (opts.causal or (left < 0 and right < 0))


def _halves(q, q_idx, keys: int, opts: BlockOpts):
    """(query rows, key count) of this rank's two zigzag halves against keys in sequence order."""
    L = opts.L
    for a in (0, 1):
        yield slice(a * L, (a + 1) * L), (int(q_idx[a * L]) + L if opts.causal else keys)


def allgather_forward(q, k, v, q_idx, doc, group, opts: BlockOpts) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o, lse, [gathered k, gathered v] in sequence order)."""
    n = dist.get_world_size(group) if group is not None else 1
    k_idx = all_gather_dim(q_idx, 0, group) if n > 1 else q_idx
    kk = all_gather_dim(k, 1, group) if n > 1 else k
    vv = all_gather_dim(v, 1, group) if n > 1 else v
    perm = torch.argsort(k_idx)  # rank-major zigzag shares -> sequence order
    kn, vn = kk.index_select(1, perm), vv.index_select(1, perm)
    if not _kernel_path(opts, doc):
        k_doc = (all_gather_dim(doc, 1, group) if n > 1 else doc).index_select(1, perm) if doc is not None else None
        res = block_fwd(q, kn, vn, q_idx, k_idx[perm], doc, k_doc, _masked(opts))
        out, lse = res if res is not None else empty_out(q)
        return out.to(q.dtype), lse, [kn, vn]
    left, right = opts.window
    outs, lses = [], []
    for rows, end in _halves(q, q_idx, kn.shape[1], opts):
        o, lse = attention_fwd(q[:, rows], kn[:, :end], vn[:, :end], opts.scale, opts.causal,
                               window=(left, 0 if opts.causal else right), softcap=opts.softcap)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 2), [kn, vn]


def allgather_backward(do, q, o, lse, saved, q_idx, doc, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    n = dist.get_world_size(group) if group is not None else 1
    kn, vn = saved
    k_idx = all_gather_dim(q_idx, 0, group) if n > 1 else q_idx
    perm = torch.argsort(k_idx)
    if not _kernel_path(opts, doc):
        k_doc = (all_gather_dim(doc, 1, group) if n > 1 else doc).index_select(1, perm) if doc is not None else None
        g = block_bwd(do, q, kn, vn, o, lse, q_idx, k_idx[perm], doc, k_doc, _masked(opts))
        a = acc_dtype(q)
        dq, dkn, dvn = g if g is not None else (torch.zeros(q.shape, dtype=a, device=q.device),
                                                torch.zeros(kn.shape, dtype=a, device=q.device),
                                                torch.zeros(vn.shape, dtype=a, device=q.device))
        dq = dq.to(q.dtype)
    else:
        left, right = opts.window
        a = acc_dtype(q)
        dq = torch.empty_like(q)
        dkn = torch.zeros(kn.shape, dtype=a, device=kn.device)
        dvn = torch.zeros(vn.shape, dtype=a, device=vn.device)
        for rows, end in _halves(q, q_idx, kn.shape[1], opts):
            g = attention_bwd(do[:, rows].contiguous(), q[:, rows], kn[:, :end], vn[:, :end], o[:, rows].contiguous(),
                              lse[:, :, rows].contiguous(), opts.scale, opts.causal,
                              window=(left, 0 if opts.causal else right), softcap=opts.softcap)
            dq[:, rows] = g[0]
            dkn[:, :end] += g[1].to(a)
            dvn[:, :end] += g[2].to(a)
    # back to rank-major order, then each rank keeps the sum of its own keys' gradients
    dkk = torch.empty_like(dkn).index_copy_(1, perm, dkn)
    dvv = torch.empty_like(dvn).index_copy_(1, perm, dvn)
    if n > 1:
        dkk, dvv = reduce_scatter_dim(dkk, 1, group), reduce_scatter_dim(dvv, 1, group)
    return dq, dkk.to(kn.dtype), dvv.to(vn.dtype)


# ---- all-to-all (Ulysses) ----

def _all_to_all(send: Tensor, group) -> Tensor:
    recv = torch.empty_like(send)
    span = CommSpan("cp all_to_all", send.device.type, bytes=send.numel() * send.element_size())
    dist.all_to_all_single(recv, send, group=group)
    span.done()
    return recv


def a2a(x: Tensor, group, to_heads: bool) -> Tensor:
    """(b, s_local, h, d) sequence-sharded ↔ (b, cp·s_local, h/cp, d) head-sharded (rank-major along
    the sequence)."""
    n = dist.get_world_size(group)
    if to_heads:  # split heads into n groups, send group j to rank j, receive every rank's sequence
        b, s, h, d = x.shape
        send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (n, b, s, h/n, d)
        return _all_to_all(send, group).permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)
    b, ns, hn, d = x.shape
    s = ns // n
    send = x.reshape(b, n, s, hn, d).permute(1, 0, 2, 3, 4).contiguous()  # (n, b, s, h/n, d)
    return _all_to_all(send, group).permute(1, 2, 0, 3, 4).reshape(b, s, n * hn, d)


def _lse_back(lse_h: Tensor, group) -> Tensor:
    """(b, h/cp, cp·2L) head-sharded lse -> (b, h, 2L) of this rank's tokens."""
    x = lse_h.transpose(1, 2)[..., None]  # (b, cp·2L, h/cp, 1)
    return a2a(x.contiguous(), group, False)[..., 0].transpose(1, 2)


def _sequence_order(q_idx, doc, group):
    idx = all_gather_dim(q_idx, 0, group)  # the gathered sequence is rank-major zigzag shares
    perm = torch.argsort(idx)
    dd = None if doc is None else all_gather_dim(doc, 1, group).index_select(1, perm)
    return perm, idx[perm], dd


def a2a_forward(q, k, v, q_idx, doc, group, opts: BlockOpts, want_lse: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o, lse (empty unless ``want_lse``: it costs one more all-to-all), [qn, kn, vn, on, lse_n]: the
    head-sharded whole-sequence tensors in sequence order, for the backward)."""
    perm, idx, dd = _sequence_order(q_idx, doc, group)
    qn, kn, vn = (a2a(t, group, True).index_select(1, perm) for t in (q, k, v))
    if dd is None:
        on, lse_n = attention_fwd(qn, kn, vn, opts.scale, opts.causal, window=opts.window, softcap=opts.softcap)
    else:
        res = block_fwd(qn, kn, vn, idx, idx, dd, dd, _masked(opts))
        on, lse_n = res if res is not None else empty_out(qn)
        on = on.to(q.dtype)
    inv = torch.argsort(perm)
    o = a2a(on.index_select(1, inv), group, False)
    lse = _lse_back(lse_n.index_select(2, inv), group) if want_lse else lse_n.new_empty(0)
    return o, lse, [qn, kn, vn, on, lse_n]


def a2a_backward(do, saved, q_idx, doc, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    qn, kn, vn, on, lse_n = saved
    perm, idx, dd = _sequence_order(q_idx, doc, group)
    don = a2a(do, group, True).index_select(1, perm)
    if dd is None:
        dqn, dkn, dvn = attention_bwd(don, qn, kn, vn, on, lse_n, opts.scale, opts.causal, window=opts.window,
                                      softcap=opts.softcap)
    else:
        g = block_bwd(don, qn, kn, vn, on, lse_n, idx, idx, dd, dd, _masked(opts))
        a = acc_dtype(qn)
        dqn, dkn, dvn = g if g is not None else (torch.zeros(t.shape, dtype=a, device=t.device) for t in (qn, kn, vn))
    inv = torch.argsort(perm)
    return tuple(a2a(t.to(qn.dtype).index_select(1, inv).contiguous(), group, False) for t in (dqn, dkn, dvn))


__all__ = ["a2a", "a2a_backward", "a2a_forward", "allgather_backward", "allgather_forward", "ring_backward",
           "ring_forward", "window_backward", "window_forward", "window_sources"]
