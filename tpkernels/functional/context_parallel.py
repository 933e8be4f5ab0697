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
  with their log-sum-exp in fp32. Backward passes K/V around the ring the same way and the fp32
  dK/dV accumulators one block behind them, each hop posted before the next block's computation
  (one extra hop brings each rank's dK/dV home). Memory per rank: two K/V blocks.
* ``allgather`` (Llama 3's CP): all-gather K/V once, then local attention; backward
  reduce-scatters dK/dV. Simpler, S·hk·d more memory; wins at small CP.
* ``a2a`` (DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded, full-sequence
  attention on H/CP heads, all-to-all back. Needs heads and KV heads divisible by CP.

With ``ring``, a sliding window that leaves blocks out switches to direct sends: each rank's K/V go
only to the ranks whose queries the window reaches (a window within a chunk: the two zigzag
neighbours), so blocks wholly outside the window are never sent nor computed.

Every block runs the attention kernels (Triton on GPUs, the reference on CPUs), whatever the mask:
causal or full, sliding windows as kernel arguments (offset between zigzag chunks included) and
packed documents as varlen calls with ``cu_seqlens`` per document. Which calls a block needs is
planned on the host from the global document boundaries (context_parallel_plan.py); no tensor of
S² or (S/CP)² elements per head exists. A window that reaches the whole sequence is no window.

The op is registered with ``torch.library`` (``tpkernels::cp_attention_forward`` / ``_backward``,
fake implementations and autograd): torch.compile sees one opaque op, collectives inside. The
autograd context records the algorithm the forward ran, which decides what it saved. Files:
context_parallel_plan.py (the host plan of kernel calls), context_parallel_blocks.py (the layout
and running the calls), context_parallel_algos.py (the four exchanges, forward and backward), this
one (the op and its checks).

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
from tpkernels.functional.context_parallel_blocks import (
    BlockOpts,
    check_zigzag,
    zigzag_indices,
    zigzag_merge,
    zigzag_split,
)
from tpkernels.functional.context_parallel_plan import geometry, rows_from_cu_seqlens, rows_from_ids
from tpkernels.kernels.window import no_op_window
from tpkernels.parallel import control
from tpkernels.parallel.groups import group_by_name

ALGOS = ("ring", "allgather", "a2a")


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----
# The group travels as its name (ops take no ProcessGroup); "" is no group (one rank). ``extras``
# are what the backward of all-gather (the gathered K/V) and a2a (the head-sharded tensors) keep.
# ``cu_seqlens`` is a host tensor (the global documents); ``doc_ids`` a device one (see the op).

def _resolve(group_name: str, algo: str, s_local: int, causal: bool, left: int, right: int):
    """(group, cp size, global seqlen, window (no-op sides -1, causal right 0), the algorithm that runs:
    ring, window (ring with a window that leaves blocks out), allgather (also one rank) or a2a)."""
    group = group_by_name(group_name)
    n = dist.get_world_size(group) if group is not None else 1
    seqlen = s_local * n
    window = no_op_window((left, right), causal, seqlen)
    if n == 1:
        return group, n, seqlen, window, "allgather"  # one rank: local attention, nothing moves
    if algo == "ring" and window != (-1, 0 if causal else -1) and window_sources(seqlen, n, causal, window):
        return group, n, seqlen, window, "window"
    return group, n, seqlen, window, algo


class _Call:
    """Everything the forward and backward of one call derive from the op's arguments."""

    def __init__(self, q: Tensor, cu_seqlens, doc_ids, group_name: str, algo: str, scale: float, causal: bool,
                 left: int, right: int, softcap: float):
        self.group, self.n, seqlen, window, self.algo = _resolve(group_name, algo, q.shape[1], causal, left, right)
        rank = dist.get_rank(self.group) if self.n > 1 else 0
        b = q.shape[0]
        if cu_seqlens is not None:
            rows = rows_from_cu_seqlens(cu_seqlens, b, seqlen)
        elif doc_ids is not None:  # one host copy (and a gather of the shares over the group)
            every = control.all_gather_ints(doc_ids, self.group) if self.n > 1 else doc_ids.cpu()[None]
            rows = rows_from_ids(zigzag_merge(list(every), dim=1))
        else:
            rows = None
        self.geo = geometry(seqlen, self.n, rank, window, rows, b, q.device)
        self.opts = BlockOpts(scale, softcap)
        self.need = window_sources(seqlen, self.n, causal, window) if self.algo == "window" else None


@torch.library.custom_op("tpkernels::cp_attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], doc_ids: Optional[Tensor],
                group_name: str, algo: str, scale: float, causal: bool, window_left: int, window_right: int,
                softcap: float, want_lse: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    c = _Call(q, cu_seqlens, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap)
    if c.algo == "window":
        return (*window_forward(q, k, v, c.geo, c.group, c.opts, c.need), [])
    if c.algo == "ring":
        return (*ring_forward(q, k, v, c.geo, c.group, c.opts), [])
    if c.algo == "a2a":
        return a2a_forward(q, k, v, c.geo, c.group, c.opts, want_lse)
    return allgather_forward(q, k, v, c.geo, c.group, c.opts)


@_forward_op.register_fake
def _(q, k, v, cu_seqlens, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap, want_lse):
    _, n, _, _, algo = _resolve(group_name, algo, q.shape[1], causal, window_left, window_right)
    b, s, h, d = q.shape
    hk, stat = k.shape[2], lse_dtype(q.dtype)
    lse = q.new_empty((b, h, s), dtype=stat)
    if algo in ("ring", "window"):
        return q.new_empty(q.shape), lse, []
    if algo == "allgather":
        return q.new_empty(q.shape), lse, [k.new_empty((b, n * s, hk, d)), v.new_empty((b, n * s, hk, d))]
    qn = q.new_empty((b, n * s, h // n, d))
    kn = k.new_empty((b, n * s, hk // n, d))
    return (q.new_empty(q.shape), lse if want_lse else q.new_empty((0,), dtype=stat),
            [qn, kn, kn.new_empty(kn.shape), qn.new_empty(qn.shape), q.new_empty((b, h // n, n * s), dtype=stat)])


@torch.library.custom_op("tpkernels::cp_attention_backward", mutates_args=())
def _backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, extras: list[Tensor],
                 cu_seqlens: Optional[Tensor], doc_ids: Optional[Tensor], group_name: str, algo: str, scale: float,
                 causal: bool, window_left: int, window_right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    c = _Call(q, cu_seqlens, doc_ids, group_name, algo, scale, causal, window_left, window_right, softcap)
    do = do.contiguous()
    if c.algo == "window":
        return window_backward(do, q, k, v, o, lse, c.geo, c.group, c.opts, c.need)
    if c.algo == "ring":
        return ring_backward(do, q, k, v, o, lse, c.geo, c.group, c.opts)
    if c.algo == "a2a":
        return a2a_backward(do, extras, c.geo, c.group, c.opts)
    return allgather_backward(do, q, o, lse, extras, c.geo, c.group, c.opts)


@_backward_op.register_fake
def _(do, q, k, v, o, lse, extras, cu_seqlens, doc_ids, group_name, algo, scale, causal, window_left, window_right,
      softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _shape_only(t: Tensor) -> Tensor:
    """A stand-in of ``t``'s shape holding one element: what the backward needs of a tensor it never reads."""
    return t.new_empty(()).expand(t.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, doc_ids, group_name, algo, scale, causal, left, right, softcap, _want_lse = inputs
    o, lse, extras = output
    ctx.algo = _resolve(group_name, algo, q.shape[1], causal, left, right)[4]  # what the forward ran
    if ctx.algo in ("allgather", "a2a"):  # they keep K/V in sequence order, or the head-sharded tensors
        k, v = _shape_only(k), _shape_only(v)
    if ctx.algo == "a2a":  # its backward reads only the head-sharded tensors
        q, o, lse = _shape_only(q), _shape_only(o), _shape_only(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, doc_ids, *extras)
    ctx.args = (group_name, ctx.algo, scale, causal, left, right, softcap)


def _backward(ctx, do, _dlse, _dextras):
    q, k, v, o, lse, cu_seqlens, doc_ids, *extras = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _backward_op(do, q, k, v, o, lse, list(extras), cu_seqlens, doc_ids, *ctx.args)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 10


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ---- the op ----

def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group, *, algo: str = "ring", causal: bool = True,
                               softmax_scale: float | None = None, window: tuple[int, int] = (-1, -1),
                               softcap: float = 0.0, cu_seqlens: Tensor | None = None, doc_ids: Tensor | None = None,
                               return_lse: bool = False):
    """Attention of this CP rank's queries over the whole sequence held by the CP ``group``.

    q: (batch, 2L, nheads, headdim), k/v: (batch, 2L, nheads_kv, headdim): this rank's zigzag share
    (:func:`zigzag_split`) of a sequence of S = 2L·CP tokens. window: (left, right) in tokens, -1
    for no bound (causal sets right to 0; a side reaching the whole sequence is none). softcap: 0
    for none. Packed documents (tokens attend within their document only), one of:

    * cu_seqlens: (documents + 1,) int host (CPU) tensor, the same on every rank: the global
      documents' boundaries over the flattened batch (row i is tokens [i·S, (i+1)·S); every row
      start is a boundary), flash-attn's varlen convention for the whole sequences. Read on the
      host; the plan it gives is cached, so layers that pass the same boundaries plan once.
    * doc_ids: (batch, 2L) int, this rank's share of each token's document id (documents are
      contiguous runs of one id). Costs one host copy and a gather over the group per call (forward
      and backward): prefer ``cu_seqlens``.

    Returns o like q (and lse (batch, nheads, 2L) fp32, the global log-sum-exp, with ``return_lse``).
    Differentiable in q, k, v. A group of one rank (or None without torch.distributed) is plain
    attention on the local sequence. Memory: O(S/CP) per head on every path (no score matrix).
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
    if cu_seqlens is not None and doc_ids is not None:
        raise ValueError("give cu_seqlens or doc_ids, not both")
    if doc_ids is not None and tuple(doc_ids.shape) != (b, s_local):
        raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must be (batch, seq) = {(b, s_local)}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (documents + 1,), got {cu_seqlens.dtype} shape "
                         f"{tuple(cu_seqlens.shape)}")
    if algo == "a2a" and (h % n or hk % n):
        raise ValueError(f"algo 'a2a' needs nheads ({h}) and nheads_kv ({hk}) divisible by cp ({n}); use 'ring' "
                         "or 'allgather'")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = int(window[0]), int(window[1])
    name = group.group_name if distributed and n > 1 else ""
    if cu_seqlens is not None and cu_seqlens.device.type != "cpu":
        cu_seqlens = cu_seqlens.cpu()  # one host copy: pass host boundaries to avoid it
    o, lse, _ = _forward_op(q, k, v, cu_seqlens, doc_ids, name, algo, float(scale), bool(causal), left,
                            0 if causal else right, float(softcap), bool(return_lse))
    return (o, lse) if return_lse else o


__all__ = ["ALGOS", "check_zigzag", "context_parallel_attention", "window_sources", "zigzag_indices", "zigzag_merge",
           "zigzag_split"]
