"""Expert-parallel token dispatch and combine: ``all_to_all_single`` with per-rank counts, chunked so
that the expert GEMMs of one chunk run while the next chunk is in flight, forward and backward.

    y_sorted = dispatch_combine(x_sorted, counts, expert_fn, ep_group, num_local_experts=L, chunks=2)

x_sorted (N, H): this rank's token copies grouped by GLOBAL expert id (``moe_permute.permute``'s
output); counts (E,) int64, E = P·L for an EP group of P ranks: experts r·L … (r+1)·L − 1 live on EP
rank r, so the rows for rank r are one contiguous block of x_sorted. ``expert_fn(rows (M, H),
local_counts (L,)) -> (M, H_out)`` runs this rank's L experts over rows grouped by local expert (a
grouped GEMM, an MLP per row, ...). Returns (N, H_out): row i is expert_fn's result for row i of
x_sorted, computed on the rank that owns its expert. ``group=None`` or a group of one rank:
``expert_fn(x_sorted, counts)`` (no expert parallelism).

Protocol (P ranks, this rank r):
  1. counts exchange: one ``all_to_all_single`` of counts viewed (P, L) (row d → rank d), plus one
     flag per rank saying whether its counts were valid, so that a bad input raises on every rank.
     One device→host read of the split sizes (the only host sync of the op).
  2. dispatch: the block of rows for rank d travels to rank d (``all_to_all_single`` with split
     sizes). The receiver gets them source-major (every source's rows, each grouped by expert) and
     regroups them expert-major by one gather (an index computed from the counts: no loop over
     experts), so each local expert's rows are contiguous.
  3. expert_fn on the regrouped rows.
  4. combine: the results go back by the reverse ``all_to_all_single`` (split sizes swapped) and land
     in x_sorted's order.
Backward: the output gradient takes the dispatch path (step 2), expert_fn's backward runs, and the
input gradient takes the combine path (step 4): the same schedule with the directions swapped.

Chunking (``chunks = C > 1``): the rows each rank sends to each destination are cut into C
contiguous pieces (``[c·n//C, (c+1)·n//C)`` of the n rows for that destination, so every chunk holds
a slice of every destination's rows and any n works, 0 included); chunk c is one all-to-all. The
schedule posts chunk c+1's dispatch (``async_op=True``) BEFORE running expert_fn on chunk c, and posts
chunk c's combine before expert_fn of chunk c+1; the backward posts chunk c+1's gradient dispatch
before expert_fn's backward of chunk c, and chunk c's gradient return before the backward of chunk
c+1. On NCCL the transfers run on NCCL's stream while the GEMMs run on the current one; on gloo on
gloo's threads. Every transfer and every expert_fn call is recorded in the communication trace
(:mod:`tpkernels.parallel.trace`), so ``hidden_comm_fraction()`` and the trainer's comm/compute split
see them. The receiver knows each chunk's per-(source, expert) counts from the exchanged counts and
the cut rule, so chunking costs no extra metadata.

Results: for a row-wise expert_fn (an MLP per row, a grouped GEMM) every output row and every input
gradient row is the same computation at any ``chunks`` (bit for bit, given row-invariant GEMMs);
weight gradients are sums over chunks (accumulated in float32 for 16-bit weights).

Autograd: the forward runs expert_fn per chunk on leaves cut from the graph (rows that require grad
when x_sorted does), and one autograd node (:class:`_DispatchCombineFunction`) takes x_sorted and the
tensors that expert_fn differentiates (the leaf tensors requiring grad found in expert_fn's graph, after any
``params`` given). Its backward runs the chunked schedule above with
``torch.autograd.grad`` per chunk and returns the gradients of x_sorted and of every param, so
``loss.backward()``, ``torch.autograd.grad`` and gradient hooks see ordinary gradients. A non-leaf
tensor requiring grad that expert_fn reads (a weight cast outside it, say) is differentiated through
once per chunk, unless it is passed in ``params``. Double backward is not supported.

Every rank of the group must call with the same H, dtype, L, chunks, grad mode and H_out (with
``TPKERNELS_CHECK_RANKS=1`` a mismatch is named instead of hanging).

torch.compile: the op is a graph break (``torch.compiler.disable``): its split sizes are data read on
the host, its transfers are async work handles and it takes a Python callable, none of which traces
(traced, AOT autograd failed on the received rows). An expert_fn compiled on its own still compiles.
Not a torch.library op for the same reasons.

Cost per rank per layer: the dispatch sends and the combine receives its T·k token copies of H
elements (2·T·k·H·dtype bytes, less the copies kept on this rank), the backward the same again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from tpkernels.dtypes import accumulation_dtype
from tpkernels.functional.gemm_comm import _empty
from tpkernels.parallel import consistency
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.trace import CommSpan, gemm_span

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# bits of the per-rank validity flag sent beside the counts
_BAD_SUM, _BAD_NEGATIVE = 1, 2


def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for each (s, n) of ``starts`` / ``lengths`` (1-D int64, host)."""
    total = int(lengths.sum())
    before = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(starts - before, lengths,
                                                                             output_size=total)


def _cut(per_expert: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk c of the rows between this rank and peer p is rows [c·n_p//C, (c+1)·n_p//C) of their block
    (n_p = per_expert[p].sum(), rows grouped by expert). per_expert: (P, L) host int64.
    Returns (rows (C, P): rows of chunk c with peer p, counts (C, P, L): of those, rows of each expert)."""
    n = per_expert.sum(1)                                               # (P,)
    c = torch.arange(chunks + 1, dtype=torch.int64)[:, None]
    bounds = (c * n) // chunks                                          # (C+1, P)
    lo, hi = bounds[:-1, :, None], bounds[1:, :, None]                  # (C, P, 1)
    end = torch.cumsum(per_expert, 1)                                   # (P, L)
    start = end - per_expert
    counts = (torch.minimum(end, hi) - torch.maximum(start, lo)).clamp_(min=0)
    return (bounds[1:] - bounds[:-1]), counts


@dataclass
class _Plan:
    """The split sizes and gathers of one call, from the exchanged counts (everything on the host is
    plain ints; index tensors are on x's device)."""

    world: int
    send_rows: list[list[int]]            # [c][d]: rows this rank sends to rank d in chunk c
    recv_rows: list[list[int]]            # [c][s]: rows this rank receives from rank s in chunk c
    send_order: torch.Tensor | None       # (N,): x_sorted rows in chunk-major, destination-major order; None = as is
    regroup: list[torch.Tensor | None]    # [c] (M_c,): received (source-major) rows -> expert-major; None = as is
    ungroup: list[torch.Tensor | None]    # [c] (M_c,): the inverse
    local_counts: list[torch.Tensor]      # [c] (L,) int64 on counts' device: rows of each local expert
    chunk_rows: list[int] = field(default_factory=list)  # [c] rows this rank sends in chunk c

    @property
    def chunks(self) -> int:
        return len(self.send_rows)

    def send_offsets(self) -> list[int]:
        out = [0]
        for n in self.chunk_rows:
            out.append(out[-1] + n)
        return out


def _plan(send: torch.Tensor, recv: torch.Tensor, chunks: int, device: torch.device,
          counts_device: torch.device) -> _Plan:
    """send: (P, L) rows this rank sends for each expert of each rank; recv: (P, L) rows each source sends
    for each local expert (host int64)."""
    P, L = send.shape
    send_rows, _ = _cut(send, chunks)
    recv_rows, recv_cnt = _cut(recv, chunks)                         # (C, P), (C, P, L)
    index_parts: list[torch.Tensor] = []
    send_order = None
    if chunks > 1:  # x_sorted is destination-major; chunk-major order interleaves the destinations' slices
        block_start = torch.cumsum(send.sum(1), 0) - send.sum(1)     # (P,)
        lo = torch.cat([torch.zeros(1, P, dtype=torch.int64), torch.cumsum(send_rows, 0)[:-1]])  # (C, P)
        index_parts.append(_segments((block_start[None] + lo).reshape(-1), send_rows.reshape(-1)))
    need_regroup = L > 1 and P > 1
    for c in range(chunks):
        if need_regroup:
            cnt = recv_cnt[c]                                          # (P, L), source-major in the buffer
            at_src = (torch.cumsum(cnt.reshape(-1), 0) - cnt.reshape(-1)).view(P, L)
            regroup = _segments(at_src.t().reshape(-1), cnt.t().reshape(-1))       # expert-major, then source
            cnt_t = cnt.t().contiguous()
            at_grp = (torch.cumsum(cnt_t.reshape(-1), 0) - cnt_t.reshape(-1)).view(L, P)
            index_parts += [regroup, _segments(at_grp.t().reshape(-1), cnt.reshape(-1))]
    # one host->device copy for every index of the call
    flat = torch.cat(index_parts).to(device, non_blocking=True) if index_parts else None
    pieces = list(flat.split([t.numel() for t in index_parts])) if flat is not None else []
    if chunks > 1:
        send_order = pieces.pop(0)
    regroup, ungroup = [], []
    for c in range(chunks):
        if need_regroup:
            regroup.append(pieces.pop(0))
            ungroup.append(pieces.pop(0))
        else:
            regroup.append(None)
            ungroup.append(None)
    local = recv_cnt.sum(1).to(counts_device)                          # (C, L)
    return _Plan(P, send_rows.tolist(), recv_rows.tolist(), send_order, regroup, ungroup, list(local.unbind(0)),
                 send_rows.sum(1).tolist())


def _exchange_counts(counts: torch.Tensor, n_rows: int, group, rank: int, world: int,
                     num_local_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(send (P, L), recv (P, L)) host int64, after one all-to-all of the counts and each rank's validity
    flag; raises on every rank when any rank's counts are invalid (no rank is left in a transfer)."""
    L = num_local_experts
    c = counts.to(device=device, dtype=torch.int64).reshape(world, L)
    flag = (c.sum() != n_rows).to(torch.int64) * _BAD_SUM + (c < 0).any().to(torch.int64) * _BAD_NEGATIVE
    send = torch.cat([c, flag.expand(world, 1)], 1).contiguous()      # (P, L+1): row d -> rank d
    recv = torch.empty_like(send)
    span = CommSpan("moe counts all_to_all", device.type, bytes=send.numel() * 8)
    _all_to_all(recv, send, None, None, group)
    span.done()
    both = torch.stack([send, recv]).cpu()                            # the op's one host read
    send_h, recv_h = both[0], both[1]
    flags = recv_h[:, L].tolist()                                     # rank s's flag, as s sent it
    for s, f in enumerate(flags):
        if f:
            why = []
            if f & _BAD_SUM:
                why.append("counts must sum to the number of rows of x_sorted")
            if f & _BAD_NEGATIVE:
                why.append("counts must not be negative")
            mine = (f" (here: counts {send_h[:, :L].reshape(-1).tolist()} sum to {int(send_h[:, :L].sum())}, "
                    f"x_sorted has {n_rows} rows)") if s == rank else ""
            raise ValueError(f"dispatch_combine: rank {s} of the expert-parallel group passed invalid counts: "
                             f"{' and '.join(why)}{mine}")
    return send_h[:, :L].contiguous(), recv_h[:, :L].contiguous()


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group, async_op: bool = False):
    """``all_to_all_single`` of model rows (the data plane: tensors already on the model's device)."""
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


class _Transfer:
    """One posted all-to-all of a chunk: its handle and its trace span."""

    __slots__ = ("handle", "span", "out", "inp")

    def __init__(self, name: str, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group, chunk: int):
        self.out, self.inp = out, inp  # the input too: alive (not reused by the allocator) until the transfer is done
        self.span = CommSpan(name, out.device.type, chunk=chunk,
                             bytes=(inp.numel() + out.numel()) * inp.element_size())
        self.handle = _all_to_all(out, inp, out_splits, in_splits, group, async_op=True)

    def wait(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.wait()
            self.handle, self.inp = None, None
            self.span.done()
        return self.out


def _gather(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t if index is None else t.index_select(0, index)


def _scatter_back(buf: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """(N, W) rows in chunk-major order -> x_sorted's order."""
    if order is None:
        return buf
    out = torch.empty_like(buf)
    return out.index_copy_(0, order, buf)


def _run_chunked(plan: _Plan, send_buf: torch.Tensor, group, step, name: str, back_width_dtype=None):
    """The chunked pipeline shared by forward and backward.

    send_buf: (N, W) rows in chunk-major order (chunk c at rows [off_c, off_{c+1})). For each chunk:
    dispatch all-to-all (chunk c+1 posted before ``step`` of chunk c runs), regroup, ``step(c, rows)``
    -> (M_c, W_out) expert-major, ungroup, return all-to-all (posted at once). Returns the (N, W_out)
    returned rows in chunk-major order (None when ``step`` returns None: no return trip)."""
    C, offs = plan.chunks, plan.send_offsets()

    def post(c: int) -> _Transfer:
        out = _empty((sum(plan.recv_rows[c]), send_buf.shape[1]), send_buf)
        return _Transfer(f"moe {name} all_to_all", out, send_buf[offs[c]:offs[c + 1]], plan.recv_rows[c],
                         plan.send_rows[c], group, c)

    inflight = post(0)
    back, returns = None, []
    for c in range(C):
        nxt = post(c + 1) if c + 1 < C else None  # in flight while chunk c computes
        rows = _gather(inflight.wait(), plan.regroup[c])
        out = step(c, rows)
        if out is not None:
            if back is None:
                back = _empty((offs[-1], out.shape[1]), out)
            # the return trip of chunk c travels while chunk c+1 computes
            returns.append(_Transfer(f"moe {name} return all_to_all", back[offs[c]:offs[c + 1]],
                                     _gather(out, plan.ungroup[c]).contiguous(), plan.send_rows[c],
                                     plan.recv_rows[c], group, c))
        inflight = nxt
    for t in returns:
        t.wait()
    return back


class _State:
    """What one call keeps for its backward: the plan, each chunk's cut-off input leaf and output."""

    def __init__(self, plan: _Plan, group, params: Sequence[torch.Tensor]):
        self.plan, self.group, self.params = plan, group, list(params)
        self.leaves: list[torch.Tensor | None] = []
        self.outputs: list[torch.Tensor] = []
        self.y: torch.Tensor | None = None
        self.n_rows = 0


class _DispatchCombineFunction(torch.autograd.Function):
    """The autograd node of one EP call: inputs x_sorted and expert_fn's params, output the combined rows
    computed by the forward schedule; backward = the chunked schedule with the directions swapped."""

    @staticmethod
    def forward(ctx, state: _State, x_sorted, *params):
        ctx.state = state
        return state.y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        st: _State = ctx.state
        plan = st.plan
        # the return trip runs whenever x_sorted required grad in the forward (the same on every rank),
        # not only when this backward asks for it: every rank must post the same transfers
        want_x = bool(st.leaves) and st.leaves[0] is not None
        want_p = [ctx.needs_input_grad[2 + i] for i in range(len(st.params))]
        targets = [p for p, w in zip(st.params, want_p) if w]
        sums: list[torch.Tensor | None] = [None] * len(targets)
        send = _gather(dy.contiguous(), plan.send_order)

        def step(c: int, dy_rows: torch.Tensor):
            y_c, leaf = st.outputs[c], st.leaves[c]
            inputs = ([leaf] if want_x and leaf is not None else []) + targets
            grads = [None] * len(inputs)
            if inputs and y_c.requires_grad:
                with gemm_span("moe expert_fn backward", dy_rows.device.type, chunk=c):
                    # retain_graph: a tensor expert_fn read from outside (a cast weight) is shared by the chunks
                    grads = list(torch.autograd.grad(y_c, inputs, dy_rows.to(y_c.dtype), retain_graph=True,
                                                     allow_unused=True))
            if want_x and leaf is not None:
                dx = grads.pop(0)
                dx_rows = torch.zeros_like(leaf) if dx is None else dx
            else:
                dx_rows = None
            for i, g in enumerate(grads):
                if g is not None:
                    g = g.to(accumulation_dtype(g.dtype))
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
            return dx_rows

        back = _run_chunked(plan, send, st.group, step, "grad")
        dx = None
        if want_x and ctx.needs_input_grad[1]:
            dx = _scatter_back(back, plan.send_order) if back is not None else dy.new_zeros(st.n_rows, 0)
        it = iter(sums)
        out_p = []
        for p, w in zip(st.params, want_p):
            if not w:
                out_p.append(None)
                continue
            g = next(it)
            out_p.append(torch.zeros_like(p) if g is None else g.to(p.dtype))
        return (None, dx, *out_p)


def _find_params(outputs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor | None],
                 given: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """``given``, then the leaf tensors requiring grad that ``outputs``' graphs reach (other than ``leaves``
    and those behind a non-leaf of ``given``: its gradient reaches them through the outer graph once)."""
    given = list(given)
    ours = {id(t) for t in leaves if t is not None}
    found_ids = {id(t) for t in given}
    seen = {id(t.grad_fn) for t in given if t.grad_fn is not None}  # stop at a given non-leaf
    found = []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) not in ours and id(var) not in found_ids:
                found_ids.add(id(var))
                found.append(var)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return given + found


def _check_types(x_sorted, counts) -> None:
    if not isinstance(x_sorted, torch.Tensor):
        raise ValueError(f"x_sorted must be an (N, H) tensor, got a {type(x_sorted).__name__}")
    if not isinstance(counts, torch.Tensor):
        raise ValueError(f"counts must be a 1-D integer tensor (rows per expert), got a {type(counts).__name__}")


def _check(x_sorted: torch.Tensor, counts: torch.Tensor, num_local_experts, chunks, world: int) -> None:
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted must be an (N, H) tensor, got shape {tuple(x_sorted.shape)}")
    if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise ValueError(f"counts must be a 1-D integer tensor (rows per expert), got shape {tuple(counts.shape)} "
                         f"{counts.dtype}")
    if not isinstance(num_local_experts, int) or isinstance(num_local_experts, bool) or num_local_experts < 1:
        raise ValueError(f"num_local_experts ({num_local_experts!r}) must be a positive int")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks ({chunks!r}) must be a positive int")
    if num_local_experts * world != counts.numel():
        raise ValueError(f"num_local_experts ({num_local_experts}) × the expert-parallel group size ({world}) must "
                         f"equal len(counts) ({counts.numel()}): counts has one entry per global expert, and each "
                         "rank of the group holds num_local_experts of them")


def _check_out(y: torch.Tensor, rows: int, chunk: int, width: int | None) -> None:
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != rows:
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"expert_fn must return (M, H_out) for its M = {rows} rows (chunk {chunk}), got {shape}")
    if width is not None and y.shape[1] != width:
        raise ValueError(f"expert_fn returned H_out = {y.shape[1]} for chunk {chunk} but {width} before: every "
                         "call must return the same width")


def dispatch_combine(x_sorted: torch.Tensor, counts: torch.Tensor, expert_fn: ExpertFn, group, *,
                     num_local_experts: int, chunks: int = 1,
                     params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Send each row of ``x_sorted`` to the rank of its expert, run ``expert_fn`` there, bring the results back.

    Args:
      x_sorted: (N, H) float, this rank's token copies grouped by global expert id (N may be 0).
      counts: (E,) int64, rows of each global expert in x_sorted (summing to N); E = P·num_local_experts.
      expert_fn: ``fn(rows (M, H), local_counts (num_local_experts,) int64) -> (M, H_out)``, rows grouped
        by local expert (local expert l of rank r is global expert r·num_local_experts + l); called once
        per chunk (M may be 0). local_counts is on counts' device.
      group: the expert-parallel process group (P ranks); None or one rank: ``expert_fn(x_sorted, counts)``.
      num_local_experts: experts per rank, L.
      chunks: C ≥ 1, the pieces the exchange is cut into for the overlap (see the module docstring).
      params: tensors expert_fn differentiates whose gradients this node returns (a weight cast outside
        expert_fn, say: its cast is then differentiated once, not per chunk); the leaves requiring grad
        that expert_fn's graph reaches otherwise are found and added, so no gradient is lost.
    Returns:
      (N, H_out) in x_sorted's row order, dtype of expert_fn's output.
    """
    op = _UNTRACED[0] if _UNTRACED else _untraced()
    return op(x_sorted, counts, expert_fn, group, num_local_experts=num_local_experts, chunks=chunks, params=params)


_UNTRACED: list = []


def _untraced():
    """The op as a torch.compile graph break (data-dependent split sizes, async collectives and a Python
    callable are never traced). Made on the first call, not at import: ``torch.compiler.disable`` imports
    torch._dynamo (~1 s of start-up), which every process importing tpkernels would otherwise pay."""
    _UNTRACED.append(torch.compiler.disable(_dispatch_combine))
    return _UNTRACED[0]


def _dispatch_combine(x_sorted: torch.Tensor, counts: torch.Tensor, expert_fn: ExpertFn, group, *,
                      num_local_experts: int, chunks: int = 1,
                      params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """dispatch_combine's body (see there)."""
    if group is None:
        rank, world = 0, 1
    else:
        rank, world = group_rank_size(group)  # raises, naming the rank, when it is not in the group
    grad_on = torch.is_grad_enabled()
    _check_types(x_sorted, counts)
    if world > 1:  # before any check that can fail on some ranks only: the others would wait in the transfer
        consistency.agree(group, "dispatch_combine", **{
            "x_sorted.shape[1]": x_sorted.shape[-1] if x_sorted.dim() else 0, "x_sorted.dtype": x_sorted.dtype,
            "len(counts)": counts.numel(), "num_local_experts": num_local_experts, "chunks": chunks,
            "x_sorted.requires_grad": grad_on and x_sorted.requires_grad})
    _check(x_sorted, counts, num_local_experts, chunks, world)
    if world == 1:
        # host counts are checked here; device counts are left to expert_fn (a grouped GEMM checks them),
        # so that a model without expert parallelism pays no host sync for the check
        if counts.device.type == "cpu":
            total = int(counts.sum())
            if total != x_sorted.shape[0] or bool((counts < 0).any()):
                raise ValueError(f"counts must be non-negative and sum to the number of rows of x_sorted "
                                 f"({x_sorted.shape[0]}), got counts summing to {total}: {counts.tolist()}")
        return expert_fn(x_sorted, counts)

    device = x_sorted.device
    send_h, recv_h = _exchange_counts(counts, x_sorted.shape[0], group, rank, world, num_local_experts, device)
    plan = _plan(send_h, recv_h, chunks, device, counts.device)
    x_req = grad_on and x_sorted.requires_grad
    st = _State(plan, group, ())
    st.n_rows = x_sorted.shape[0]
    width: list[int] = []

    def step(c: int, rows: torch.Tensor) -> torch.Tensor:
        leaf = rows.requires_grad_() if x_req else rows  # rows is a fresh buffer (or gather) cut from the graph
        with gemm_span("moe expert_fn", rows.device.type, chunk=c):
            y = expert_fn(leaf, plan.local_counts[c])
        _check_out(y, rows.shape[0], c, width[0] if width else None)
        width.append(y.shape[1])
        st.leaves.append(leaf if x_req else None)
        st.outputs.append(y)
        return y.detach()

    with torch.no_grad():  # the transfers take contiguous rows
        send = _gather(x_sorted.detach(), plan.send_order).contiguous()
    # expert_fn runs under the caller's grad mode; the transfers and gathers never build a graph
    back = _run_chunked(plan, send, group, _grad_mode_step(step, grad_on), "dispatch")
    y = _scatter_back(back, plan.send_order)
    if not any(t.requires_grad for t in st.outputs):
        return y
    st.params = _find_params(st.outputs, st.leaves, params or ())
    st.y = y
    return _DispatchCombineFunction.apply(st, x_sorted, *st.params)


def _grad_mode_step(step, grad_on: bool):
    def run(c, rows):
        with torch.set_grad_enabled(grad_on):
            return step(c, rows)
    return run


__all__ = ["dispatch_combine"]
