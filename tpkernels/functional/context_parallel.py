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

With ``ring``, a sliding window that leaves blocks out switches to direct sends: each rank's K/V go
only to the ranks whose queries the window reaches (a window within a chunk: the two zigzag
neighbours), so blocks wholly outside the window are never sent nor computed.

Blocks are computed by the attention kernels (Triton on GPUs, the reference on CPUs) where the
mask is plain: with the zigzag layout every pair of chunks is diagonal (the causal kernel), wholly
in the past (the full kernel) or wholly in the future (skipped, never computed). A sliding window
or packed documents (``doc_ids``: equal ids attend to each other) need a per-pair mask: those
blocks go through masked fp32 math (O(L²) scores per block; context_parallel_blocks.py).

The op is registered with ``torch.library`` (``tpkernels::cp_attention_forward`` / ``_backward``,
fake implementations and autograd): torch.compile sees one opaque op, collectives inside. Files:
context_parallel_blocks.py (the layout and one block's math), context_parallel_algos.py (the four
exchanges, forward and backward), this one (the op and its checks).

Cost (ring, one rank, causal, balanced): 2·b·h·d·S²/CP FLOPs forward (half the full matrix over CP
ranks, ×2 for QK and PV); P2P bytes (CP−1)·2·b·2L·hk·d·bytes forward, twice that backward; hidden
behind the block compute when 2L is large enough (the planner models it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels.functional.attention import lse_dtype
from tpkernels.functional.context_parallel_algos import (
    a2a_backward,
    a2a_forward,
    allgather_backward,
    allgather_forward,
    ring_backward,
    ring_forward,
    window_backward,
    window_forward,
    window_sources,
)
from tpkernels.parallel.groups import group_by_name
from tpkernels.functional.context_parallel_blocks import (
    BlockOpts,
    check_zigzag,
    zigzag_indices,
    zigzag_merge,
    zigzag_split,
)

ALGOS = ("ring", "allgather", "a2a")


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----
# The group travels as its name (ops take no ProcessGroup); "" is no group (one rank). ``extras``
# are what the backward of all-gather (the gathered K/V) and a2a (the head-sharded tensors) keep.

class _Call:
    """Everything the forward and backward of one call derive from the op's arguments."""

    def __init__(self, q: Tensor, doc_ids, group_name: str, algo: str, scale: float, causal: bool, left: int,
                 right: int, softcap: float):
        self.group = group_by_name(group_name)
        self.n = dist.get_world_size(self.group) if self.group is not None else 1
        rank = dist.get_rank(self.group) if self.n > 1 else 0
        s_local = q.shape[1]
        seqlen = s_local * self.n
        window = (left, right)
        self.q_idx = zigzag_indices(seqlen, self.n, rank, device=q.device)
        self.doc = None if doc_ids is None else doc_ids.to(torch.int64)
        plain = window == (-1, 0 if causal else -1) and self.doc is None
        self.opts = BlockOpts(scale, causal, window, softcap, s_local // 2, plain)
        self.algo = algo if self.n > 1 else "allgather"  # one rank: local attention, nothing moves
        windowed = left >= 0 or (not causal and right >= 0)
        self.need = window_sources(seqlen, self.n, causal, window) if self.algo == "ring" and windowed else None


@torch.library.custom_op("tpkernels::cp_attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, doc_ids: Optional[Tensor], group_name: str, algo: str,
                scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                want_lse: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    c = _Call(q, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap)
    if c.need is not None:
        return (*window_forward(q, k, v, c.q_idx, c.doc, c.group, c.opts, c.need), [])
    if c.algo == "ring":
        return (*ring_forward(q, k, v, c.q_idx, c.doc, c.group, c.opts), [])
    if c.algo == "a2a":
        return a2a_forward(q, k, v, c.q_idx, c.doc, c.group, c.opts, want_lse)
    return allgather_forward(q, k, v, c.q_idx, c.doc, c.group, c.opts)


@_forward_op.register_fake
def _(q, k, v, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap, want_lse):
    group = group_by_name(group_name)
    n = dist.get_world_size(group) if group is not None else 1
    b, s, h, d = q.shape
    hk, stat = k.shape[2], lse_dtype(q.dtype)
    algo = algo if n > 1 else "allgather"
    lse = q.new_empty((b, h, s), dtype=stat)
    if algo == "ring":
        return q.new_empty(q.shape), lse, []
    if algo == "allgather":
        return q.new_empty(q.shape), lse, [k.new_empty((b, n * s, hk, d)), v.new_empty((b, n * s, hk, d))]
    qn = q.new_empty((b, n * s, h // n, d))
    kn = k.new_empty((b, n * s, hk // n, d))
    return (q.new_empty(q.shape), lse if want_lse else q.new_empty((0,), dtype=stat),
            [qn, kn, kn.new_empty(kn.shape), qn.new_empty(qn.shape), q.new_empty((b, h // n, n * s), dtype=stat)])


@torch.library.custom_op("tpkernels::cp_attention_backward", mutates_args=())
def _backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, extras: list[Tensor],
                 doc_ids: Optional[Tensor], group_name: str, algo: str, scale: float, causal: bool,
                 window_left: int, window_right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    c = _Call(q, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap)
    do = do.contiguous()
    if c.need is not None:
        return window_backward(do, q, k, v, o, lse, c.q_idx, c.doc, c.group, c.opts, c.need)
    if c.algo == "ring":
        return ring_backward(do, q, k, v, o, lse, c.q_idx, c.doc, c.group, c.opts)
    if c.algo == "a2a":
        return a2a_backward(do, extras, c.q_idx, c.doc, c.group, c.opts)
    return allgather_backward(do, q, o, lse, extras, c.q_idx, c.doc, c.group, c.opts)


@_backward_op.register_fake
def _(do, q, k, v, o, lse, extras, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _shape_only(t: Tensor) -> Tensor:
    """A stand-in of ``t``'s shape holding one element: what the backward needs of a tensor it never reads."""
    return t.new_empty(()).expand(t.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, doc_ids, group_name, algo, *args = inputs
    o, lse, extras = output
    if extras:  # all-gather (or one rank) keeps K/V in sequence order, a2a the head-sharded tensors
        k, v = _shape_only(k), _shape_only(v)
    if len(extras) == 5:  # a2a: its backward reads only the head-sharded tensors
        q, o, lse = _shape_only(q), _shape_only(o), _shape_only(lse)
    ctx.has_doc = doc_ids is not None
    ctx.save_for_backward(q, k, v, o, lse, *([doc_ids] if doc_ids is not None else []), *extras)
    args = [group_name, algo, *args]
    ctx.args = tuple(args[:-1])  # group_name, algo, scale, causal, window_left, window_right, softcap


def _backward(ctx, do, _dlse, _dextras):
    q, k, v, o, lse, *rest = ctx.saved_tensors
    doc = rest[0] if ctx.has_doc else None
    extras = list(rest[1:] if ctx.has_doc else rest)
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _backward_op(do, q, k, v, o, lse, extras, doc, *ctx.args)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 9


_forward_op.register_autograd(_backward, setup_context=_setup_context)


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
    if s_local % 2:
        raise ValueError(f"this rank's sequence ({s_local}) must be even: two zigzag chunks")
    if doc_ids is not None and tuple(doc_ids.shape) != (b, s_local):
        raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must be (batch, seq) = {(b, s_local)}")
    if algo == "a2a" and (h % n or hk % n):
        raise ValueError(f"algo 'a2a' needs nheads ({h}) and nheads_kv ({hk}) divisible by cp ({n}); use 'ring' "
                         "or 'allgather'")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = int(window[0]), int(window[1])
    name = group.group_name if distributed and n > 1 else ""
    o, lse, _ = _forward_op(q, k, v, doc_ids, name, algo, float(scale), bool(causal), left,
                            0 if causal else right, float(softcap), bool(return_lse))
    return (o, lse) if return_lse else o


__all__ = ["ALGOS", "check_zigzag", "context_parallel_attention", "window_sources", "zigzag_indices", "zigzag_merge",
           "zigzag_split"]
