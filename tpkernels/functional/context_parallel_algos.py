"""The four ways context-parallel attention moves K/V over the CP group, each as an explicit forward
and backward (no autograd inside: the registered op in tpkernels.functional.context_parallel
wires them to autograd, which keeps them opaque to torch.compile).

Shapes: q (b, 2L, h, d), k/v (b, 2L, hk, d) this rank's zigzag share; ``geo`` the host plan of
this rank's kernel calls (tpkernels.functional.context_parallel_plan); o like q; lse (b, h, 2L)
fp32 (fp64 for fp64). Only K/V (and dK/dV) travel: every rank knows every block's positions and
documents from the plan.

* ring: K/V (KV heads only) pass around the ring by ``batch_isend_irecv``, the next block in
  flight while the held one is computed. The backward passes K/V the same way and the fp32 dK/dV
  accumulators one step behind: a block's accumulators are posted to the next rank when its
  gradient is added and waited for only after the next block is computed, so both hops hide
  behind a block's backward (one extra hop brings each rank's own home, the one left exposed).
* window: a window that leaves blocks out: each rank sends its K/V only to the ranks whose queries
  reach it (for a window within a chunk, the two zigzag neighbours), all at once; the backward
  sends them again (windows make them small) and returns the dK/dV straight to their owners.
* allgather: gather K/V (rank-major; kept for the backward in sequence order), attention of this
  rank's two chunks against the keys in sequence order; the backward reduce-scatters dK/dV.
* a2a: all-to-all to head-sharded, whole-sequence attention on h/cp heads, all-to-all back; the
  head-sharded q/k/v/o/lse are kept for the backward, which runs the same exchanges in reverse.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels.functional.context_parallel_blocks import BlockOpts, acc_dtype, empty_out, run_backward, run_forward
from tpkernels.functional.context_parallel_plan import Geometry, block_reached
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

def _zeros_like_acc(t: Tensor) -> Tensor:
    return torch.zeros(t.shape, dtype=acc_dtype(t), device=t.device)


def ring_forward(q, k, v, geo: Geometry, group, opts: BlockOpts) -> tuple[Tensor, Tensor]:
    r, n, nxt, prv = _ring_peers(group)
    out, lse = empty_out(q)
    cur = [k, v]
    for step in range(n):
        pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None  # the next block in flight
        with gemm_span("cp attention block", q.device.type, step=step):
            run_forward(out, lse, q, cur[0], cur[1], geo.block((r - step) % n), opts)
        if pending is not None:
            _wait(pending[0])
            cur = pending[1]
    return out.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, geo: Geometry, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    r, n, nxt, prv = _ring_peers(group)
    dq = _zeros_like_acc(q)
    cur = [k, v]
    acc_in_flight = None  # the previous block's dK/dV on their way to the next rank
    for step in range(n):
        pending = _exchange(cur, nxt, prv, group) if step < n - 1 else None
        g = [_zeros_like_acc(k), _zeros_like_acc(v)]
        with gemm_span("cp attention block backward", q.device.type, step=step):
            run_backward(dq, g[0], g[1], do, q, cur[0], cur[1], o, lse, geo.block((r - step) % n), opts)
        if acc_in_flight is not None:  # this block's accumulators, sent by the previous rank a step ago
            _wait(acc_in_flight[0])
            g[0] += acc_in_flight[1][0]
            g[1] += acc_in_flight[1][1]
        acc_in_flight = _exchange(g, nxt, prv, group, "cp ring dK/dV")  # hidden behind the next block
        if pending is not None:
            _wait(pending[0])
            cur = pending[1]
    _wait(acc_in_flight[0])  # after n hops each rank holds its own block's dK/dV
    dk, dv = acc_in_flight[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- window: only the blocks it reaches ----

@functools.lru_cache(maxsize=256)
def window_sources(seqlen: int, cp: int, causal: bool, window: tuple[int, int]) -> tuple[tuple[int, ...], ...] | None:
    """For each CP rank, the other ranks whose K/V block any of its queries can see under the
    window (decided from positions alone; documents only remove more), or None when every rank
    needs every block (then the ring is the better schedule). Cached: every layer asks the same."""
    w = (window[0], 0 if causal else window[1])
    need = tuple(tuple(j for j in range(cp) if j != r and block_reached(seqlen, cp, w, r, j)) for r in range(cp))
    return None if all(len(x) == cp - 1 for x in need) else need


def _window_blocks(q, k, v, group, need, name: str):
    """Send this rank's K/V to the ranks that read it; receive the blocks it reads."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    readers = [d for d in range(n) if r in need[d]]
    works, got = _direct([(d, [k, v]) for d in readers], [(j, [k, v]) for j in need[r]], group, name, q.device.type)
    return works, got, readers


def window_forward(q, k, v, geo: Geometry, group, opts: BlockOpts, need) -> tuple[Tensor, Tensor]:
    r = dist.get_rank(group)
    works, got, _ = _window_blocks(q, k, v, group, need, "cp window K/V")
    out, lse = empty_out(q)
    with gemm_span("cp attention block", q.device.type, src=r):  # its own block while the others travel
        run_forward(out, lse, q, k, v, geo.block(r), opts)
    _wait(works)
    for j in need[r]:
        with gemm_span("cp attention block", q.device.type, src=j):
            run_forward(out, lse, q, got[j][0], got[j][1], geo.block(j), opts)
    return out.to(q.dtype), lse


def window_backward(do, q, k, v, o, lse, geo: Geometry, group, opts: BlockOpts, need) -> tuple[Tensor, Tensor, Tensor]:
    r = dist.get_rank(group)
    works, got, readers = _window_blocks(q, k, v, group, need, "cp window K/V")
    dq, dk, dv = (_zeros_like_acc(t) for t in (q, k, v))
    run_backward(dq, dk, dv, do, q, k, v, o, lse, geo.block(r), opts)
    _wait(works)
    back = []
    for j in need[r]:
        kj, vj = got[j]
        g = [_zeros_like_acc(kj), _zeros_like_acc(vj)]  # its owner waits for them, zeros included
        run_backward(dq, g[0], g[1], do, q, kj, vj, o, lse, geo.block(j), opts)
        back.append((j, g))
    works, got = _direct(back, [(d, [dk, dv]) for d in readers], group, "cp window dK/dV", q.device.type)
    _wait(works)
    for d in readers:
        dk += got[d][0]
        dv += got[d][1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- all-gather ----

def allgather_forward(q, k, v, geo: Geometry, group, opts: BlockOpts) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o, lse, [gathered k, gathered v] in sequence order)."""
    n = dist.get_world_size(group) if group is not None else 1
    perm = geo.sequence_order()  # rank-major zigzag shares -> sequence order
    kn = (all_gather_dim(k, 1, group) if n > 1 else k).index_select(1, perm)
    vn = (all_gather_dim(v, 1, group) if n > 1 else v).index_select(1, perm)
    out, lse = empty_out(q)
    run_forward(out, lse, q, kn, vn, geo.gathered(), opts)
    return out.to(q.dtype), lse, [kn, vn]


def allgather_backward(do, q, o, lse, saved, geo: Geometry, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    n = dist.get_world_size(group) if group is not None else 1
    kn, vn = saved
    dq, dkn, dvn = (_zeros_like_acc(t) for t in (q, kn, vn))
    run_backward(dq, dkn, dvn, do, q, kn, vn, o, lse, geo.gathered(), opts)
    # back to rank-major order, then each rank keeps the sum of its own keys' gradients
    perm = geo.sequence_order()
    dkk = torch.empty_like(dkn).index_copy_(1, perm, dkn)
    dvv = torch.empty_like(dvn).index_copy_(1, perm, dvn)
    if n > 1:
        dkk, dvv = reduce_scatter_dim(dkk, 1, group), reduce_scatter_dim(dvv, 1, group)
    return dq.to(q.dtype), dkk.to(kn.dtype), dvv.to(vn.dtype)


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


def a2a_forward(q, k, v, geo: Geometry, group, opts: BlockOpts, want_lse: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o, lse (empty unless ``want_lse``: it costs one more all-to-all), [qn, kn, vn, on, lse_n]: the
    head-sharded whole-sequence tensors in sequence order, for the backward)."""
    perm = geo.sequence_order()
    qn, kn, vn = (a2a(t, group, True).index_select(1, perm) for t in (q, k, v))
    on, lse_n = empty_out(qn)
    run_forward(on, lse_n, qn, kn, vn, geo.whole(), opts)
    on = on.to(q.dtype)
    inv = torch.argsort(perm)
    o = a2a(on.index_select(1, inv), group, False)
    lse = _lse_back(lse_n.index_select(2, inv), group) if want_lse else lse_n.new_empty(0)
    return o, lse, [qn, kn, vn, on, lse_n]


def a2a_backward(do, saved, geo: Geometry, group, opts: BlockOpts) -> tuple[Tensor, Tensor, Tensor]:
    qn, kn, vn, on, lse_n = saved
    perm = geo.sequence_order()
    don = a2a(do, group, True).index_select(1, perm)
    dqn, dkn, dvn = (_zeros_like_acc(t) for t in (qn, kn, vn))
    run_backward(dqn, dkn, dvn, don, qn, kn, vn, on, lse_n, geo.whole(), opts)
    inv = torch.argsort(perm)
    return tuple(a2a(t.to(qn.dtype).index_select(1, inv).contiguous(), group, False) for t in (dqn, dkn, dvn))


__all__ = ["a2a", "a2a_backward", "a2a_forward", "allgather_backward", "allgather_forward", "ring_backward",
           "ring_forward", "window_backward", "window_forward", "window_sources"]
