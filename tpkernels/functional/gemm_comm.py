"""GEMMs fused with tensor-parallel communication: all-gather → matmul and matmul → reduce-scatter.

Signatures mirror torch's symmetric-memory ops (``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``) so users can switch, and run on any torch.distributed backend
(NCCL, gloo):

    a_full, [y1, y2] = all_gather_matmul(a_shard, [w1, w2], group, gather_dim=0)
    y_shard = matmul_reduce_scatter(a, b, group, scatter_dim=0, reduce_op="sum")
    y = matmul_all_reduce(a, b, group)          # the row-parallel layer without SP

Algorithms (``algo=``):
  "collective"  one all-gather / reduce-scatter collective plus one matmul: the baseline.
  "ring"        the communication is cut into world_size chunks that travel around the ring with
                async P2P (batch_isend_irecv) while the previous chunk is multiplied; double
                buffered. NCCL runs P2P on its own stream, gloo on its own threads, so the
                transfer of chunk i+1 overlaps the GEMM of chunk i.
  "fused"       Triton kernels over torch symmetric memory that overlap inside one GEMM launch:
                the GEMM waits on per-chunk signals of the copy engine's pulls (all-gather) or
                raises per-tile signals that a reducer on a few SMs follows (reduce-scatter,
                all-reduce); see :mod:`tpkernels.functional.gemm_comm_fused`. CUDA tensors in
                bfloat16/float16 with K and N multiples of 16 on an NCCL group; anything else is
                refused with the reason (``backends.why_not``).
  "auto"        no choice: ``TPKERNELS_BACKEND`` (``all_gather_matmul=ring``, ``gemm_comm=fused``,
                ...) if it names one, else plain matmul for one rank; on CUDA, fused when it can
                run, every rank of the group has peer access (NVLink) and the per-rank GEMM is at
                least FUSED_MIN_FLOPS; else ring when the per-rank GEMM is large enough to hide the
                extra per-step latency, collective otherwise (everyone regresses on small problems:
                see ANCHORS.md). The rule is :mod:`tpkernels.backends`'s: an explicit ``algo``
                beats the environment.

``overlap=False`` runs the side work (weight-gradient GEMMs of the TP layers) after the
transfer instead of during it: the plain, serial form, with the collective algorithm.

Work floor (per rank, P ranks, a_shard (m, K), b (K, N)): all_gather_matmul moves (P−1)·m·K
elements in and computes 2·P·m·K·N FLOPs; matmul_reduce_scatter on a (P·m, K) moves (P−1)·m·N
partial sums and computes 2·P·m·K·N FLOPs. The ring hides the transfer when one chunk's
GEMM (2·m·K·N FLOPs) takes longer than one chunk's transfer.

Reduce-scatter partial sums are accumulated (and, in the ring, sent) in the accumulation dtype of
``tpkernels.dtypes`` (fp32 for 16-bit inputs, else the input dtype); the result is cast back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from tpkernels import backends
from tpkernels.parallel import consistency
from tpkernels.parallel.collectives import all_gather_into, reduce_scatter_into
from tpkernels.parallel.groups import global_rank, group_rank_size
from tpkernels.parallel.trace import CommSpan, gemm_span
from tpkernels.functional.quantized_weight import is_operand, matmul as _mm, out_dtype as _out_dtype

ALGOS = ("auto", "collective", "ring", "fused")
FAMILY = "gemm_comm"
# FLOPs of one chunk's GEMM (this rank's GEMM / world size) from which "auto" picks the ring:
# below, one collective beats world_size small steps. CPU: from benchmarks/bench_tp.py on the
# 2-core development VM (gloo): at 6.7e7 per chunk the collective wins; from ~3e8 up the two are
# within run-to-run noise of each other (the VM has no idle core for the overlap to use). CUDA:
# not measured here yet; set from the published fallbacks of Triton-distributed and torch
# async-TP (plain path under ~100 GFLOP per GEMM on 8 GPUs).
RING_MIN_CHUNK_FLOPS = {"cpu": 1e8, "cuda": 1.5e10}
# FLOPs of this rank's GEMM from which "auto" picks the fused kernels (CUDA, NVLink). Not measured
# here yet (no multi-GPU machine): the published crossovers of Flux, torch async-TP and
# Triton-distributed put the fused path ahead from a few 1e10 FLOP per rank on 8 NVLink GPUs.
FUSED_MIN_FLOPS = 5e10
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _fused_limits(impl: str, device: torch.device, dtype, k: int | None = None, n: int | None = None,
                  group=None, quantized: bool = False, **_) -> str | None:
    """Why ``fused`` cannot run this call (None when it can); other algorithms have no limits."""
    if impl != "fused":
        return None
    if quantized:
        return ("the fused kernels read a 16-bit weight tensor; a quantised (NF4 / int8) or FP8 weight runs the ring "
                "or collective algorithm around its own GEMM")
    if device.type != "cuda":
        return (f"the fused GEMM-communication kernels need CUDA tensors and torch symmetric memory, got a "
                f"{device.type} tensor (on the CPU they run only in the virtual-TP harness, "
                "tpkernels.functional.virtual_tp, under TRITON_INTERPRET=1)")
    if dtype is not None and dtype not in FUSED_DTYPES:
        return f"the fused kernels take bfloat16 and float16, got {dtype}"
    for name, v in (("K", k), ("N", n)):
        if v is not None and v % 16:
            return f"the fused kernels need {name} a multiple of 16, got {name} = {v}"
    err = backends.triton_unavailable(device)
    if err:
        return err
    from tpkernels.parallel.symmetric_memory import symmetric_memory_unavailable  # noqa: PLC0415

    return symmetric_memory_unavailable(group)


@functools.lru_cache(maxsize=None)
def _peer_access(world: int) -> bool:
    """Every pair of the first ``world`` visible GPUs can address each other (NVLink or PCIe P2P): the
    group lives on one node, with one GPU per rank."""
    if torch.cuda.device_count() < world:
        return False
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(world) for j in range(world) if i != j)


def _auto(device: torch.device, dtype, flops: float = 0.0, world: int = 1, **context) -> str:
    if (device.type == "cuda" and world > 1 and flops >= FUSED_MIN_FLOPS and _peer_access(world)
            and _fused_limits("fused", device, dtype, **context) is None):
        return "fused"
    threshold = RING_MIN_CHUNK_FLOPS.get(device.type, RING_MIN_CHUNK_FLOPS["cuda"])
    return "ring" if flops / max(world, 1) >= threshold else "collective"


def _auto_all_reduce(device: torch.device, dtype, flops: float = 0.0, world: int = 1, **context) -> str:
    # the ring form overlaps only its reduce-scatter half: never worth it over one all-reduce by default
    return "fused" if _auto(device, dtype, flops, world, **context) == "fused" else "collective"


_AUTO_DOC = {"cpu": f"auto: ring from {RING_MIN_CHUNK_FLOPS['cpu']:.2g} FLOP per chunk, else collective",
             "cuda": f"auto: fused from {FUSED_MIN_FLOPS:.2g} FLOP per rank with peer access, else ring from "
                     f"{RING_MIN_CHUNK_FLOPS['cuda']:.2g} FLOP per chunk, else collective"}
for _op in ("all_gather_matmul", "matmul_reduce_scatter"):
    backends.register_op(_op, ("collective", "ring", "fused"), family=FAMILY, check=_fused_limits, default=_auto,
                         default_doc=_AUTO_DOC)
backends.register_op("matmul_all_reduce", ("collective", "ring", "fused"), family=FAMILY, check=_fused_limits,
                     default=_auto_all_reduce,
                     default_doc={"cpu": "collective", "cuda": f"auto: fused from {FUSED_MIN_FLOPS:.2g} FLOP per "
                                                               "rank with peer access, else collective"})

_POISON = False


@contextlib.contextmanager
def poison_receive_buffers(enabled: bool = True):
    """Fill every receive buffer with NaN before data lands in it (tests: an op that reads a buffer
    before its transfer completes then produces NaN instead of stale-but-plausible numbers)."""
    global _POISON
    prev, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = prev


def _empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
    if _POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def check_algo(algo: str, overlap: bool = True) -> None:
    if algo not in ALGOS:
        raise ValueError(f"algo ({algo!r}) must be one of {', '.join(ALGOS)}")
    if not overlap and algo in ("ring", "fused"):
        raise ValueError(f"algo ({algo!r}) overlaps communication by construction; overlap=False (the serial form) "
                         "needs algo 'auto' or 'collective'")


def choose_algo(op: str, algo: str, world_size: int, flops_per_rank: float, device: torch.device,
                overlap: bool = True, dtype: torch.dtype | None = None, k: int | None = None, n: int | None = None,
                group=None, quantized: bool = False) -> str:
    """The algorithm ``op`` runs: "local" for one rank, else by the dispatch rule of
    :mod:`tpkernels.backends` (``algo`` unless "auto", then ``TPKERNELS_BACKEND``, then by size).
    ``dtype``, ``k``, ``n`` (the GEMM's inner and output widths), ``group`` and ``quantized`` (the weight
    is a quantised operand) decide whether ``fused`` can run."""
    check_algo(algo, overlap)
    if not overlap:
        algo = "collective"
    if world_size == 1:
        return "local"
    return backends.select(op, device, None if algo == "auto" else algo, dtype=dtype, flops=flops_per_rank,
                           world=world_size, k=k, n=n, group=group, quantized=quantized)


def _resolve(op: str, algo: str, world: int, flops: float, device: torch.device,
             overlap: bool = True, **context) -> tuple[str, Exception | None]:
    """(algorithm, None), or ("invalid", the error) to raise once the ranks have compared notes."""
    try:
        return choose_algo(op, algo, world, flops, device, overlap, **context), None
    except (ValueError, backends.BackendUnavailableError) as e:
        return "invalid", e


def _check_a(a: torch.Tensor, dim: int, what: str, dim_name: str) -> int:
    if a.dim() < 2:
        raise ValueError(f"{what} must have at least 2 dims (..., K), got shape {tuple(a.shape)}")
    d = dim % a.dim() if -a.dim() <= dim < a.dim() else None
    if d is None or d == a.dim() - 1:
        raise ValueError(f"{dim_name} ({dim}) must name a dim of {what} other than the last (K) one; "
                         f"{what} has shape {tuple(a.shape)}")
    return d


def _check_b(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if b.dim() != 2 or b.shape[0] != a.shape[-1]:
        raise ValueError(f"{name} must be (K, N) with K = {a.shape[-1]} (the last dim of A), got shape {tuple(b.shape)}")
    if b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"{name} ({b.dtype}, {b.device}) must match A ({a.dtype}, {a.device})")


def _fused(op: str, make_steps, group, device, options, nbytes: int):
    """Run one real rank's steps of a fused op (``make_steps(ctx)``) with the call's options, traced."""
    from tpkernels.functional.gemm_comm_fused import RealRank, run_rank  # noqa: PLC0415

    span = CommSpan(f"fused {op}", device.type, bytes=nbytes)
    ctx = RealRank(group, device, options)
    out = run_rank(ctx, make_steps(ctx))
    span.done()
    return out


def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], group=None, gather_dim: int = 0,
                      algo: str = "auto", return_a: bool = True,
                      on_chunk: Callable[[int, torch.Tensor], None] | None = None, options=None):
    """All-gather ``a_shard`` along ``gather_dim`` over ``group`` and multiply by each ``b`` in ``bs``.
    ``options``: a :class:`~tpkernels.functional.gemm_comm_fused.FusedOptions` for ``algo="fused"``
    (None: the fused variables of :mod:`tpkernels.env_vars` as they are at this call).

    a_shard: (..., m, ..., K), the same shape on every rank; bs: list of (K, N_j).
    Returns ``(a_full or None, [a_full @ b for b in bs])``; a_full has P·m rows along gather_dim,
    rank r's shard at rows [r·m, (r+1)·m). ``on_chunk(src, chunk)`` (optional) is called for each
    shard once it is available, chunk laid out with gather_dim first: work placed there overlaps
    the transfer of the next chunk (the row-parallel backward computes its weight gradient so).
    """
    rank, world = group_rank_size(group)
    flops = 2.0 * a_shard.numel() * sum(b.shape[-1] for b in bs) * world
    how, err = _resolve("all_gather_matmul", algo, world, flops, a_shard.device, dtype=a_shard.dtype,
                        k=a_shard.shape[-1], n=min((b.shape[-1] for b in bs), default=16), group=group,
                        quantized=any(is_operand(b) for b in bs))
    # before any check that can fail on some ranks only: the others would wait in the transfer
    consistency.agree(group, "all_gather_matmul", **{"a_shard.shape": a_shard.shape, "a_shard.dtype": a_shard.dtype,
                                                     "gather_dim": gather_dim, "algo": how, "return_a": return_a},
                      **{f"bs[{j}].shape": b.shape for j, b in enumerate(bs)},
                      **{f"bs[{j}].dtype": b.dtype for j, b in enumerate(bs)})
    if err is not None:
        raise err
    gd = _check_a(a_shard, gather_dim, "a_shard", "gather_dim")
    for j, b in enumerate(bs):
        _check_b(a_shard, b, f"bs[{j}]")
    a = a_shard.movedim(gd, 0).contiguous()
    m = a.shape[0]
    if how == "local":
        with gemm_span("matmul", a.device.type):
            outs = [_mm(a, b) for b in bs]
        if on_chunk:
            on_chunk(0, a)
        return (a_shard if return_a else None), [o.movedim(0, gd) for o in outs]

    full_shape = (world * m,) + tuple(a.shape[1:])
    if how == "fused":
        from tpkernels.functional.gemm_comm_fused import ag_steps  # noqa: PLC0415  (Triton kernels: imported on use)

        rows = a.reshape(-1, a.shape[-1])
        a_full, outs = _fused("all_gather_matmul", lambda ctx: ag_steps(ctx, rows, bs, return_a=True), group,
                              a.device, options, a.numel() * a.element_size() * world)
        a_full = a_full.view(full_shape)
        outs = [o.view(full_shape[:-1] + (o.shape[1],)) for o in outs]
        if on_chunk:
            for src in range(world):
                on_chunk(src, a_full[src * m:(src + 1) * m])
        return (a_full.movedim(0, gd) if return_a else None), [o.movedim(0, gd) for o in outs]
    outs = [torch.empty(full_shape[:-1] + (b.shape[1],), dtype=_out_dtype(a, b), device=a.device) for b in bs]
    if how == "collective":
        a_full = _empty(full_shape, a)
        span = CommSpan("all_gather", a.device.type, bytes=a.numel() * a.element_size() * world)
        all_gather_into(a_full, a, group)
        span.done()
        with gemm_span("matmul", a.device.type):
            for b, out in zip(bs, outs):
                _mm(a_full, b, out=out)
        if on_chunk:
            for src in range(world):
                on_chunk(src, a_full[src * m:(src + 1) * m])
    else:
        a_full = _empty(full_shape, a) if return_a else None
        if a_full is not None:
            a_full[rank * m:(rank + 1) * m].copy_(a)
        bufs = None if return_a else [_empty(a.shape, a), _empty(a.shape, a)]
        nxt_peer, prv_peer = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
        cur = a
        for step in range(world):
            src = (rank - step) % world
            reqs = None
            if step < world - 1:
                nsrc = (rank - step - 1) % world
                nxt = a_full[nsrc * m:(nsrc + 1) * m] if return_a else bufs[step % 2]
                span = CommSpan("ring all_gather chunk", a.device.type, step=step, src=nsrc)
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, nxt_peer, group),
                                               dist.P2POp(dist.irecv, nxt, prv_peer, group)])
            with gemm_span("matmul chunk", a.device.type, step=step, src=src):
                for b, out in zip(bs, outs):
                    _mm(cur, b, out=out[src * m:(src + 1) * m])
            if on_chunk:
                on_chunk(src, cur)
            if reqs is not None:
                for r in reqs:
                    r.wait()
                span.done()
                cur = nxt
    return (a_full.movedim(0, gd) if return_a else None), [o.movedim(0, gd) for o in outs]


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group=None, scatter_dim: int = 0,
                          reduce_op: str = "sum", algo: str = "auto",
                          side_work: Sequence[Callable[[], None]] = (), overlap: bool = True,
                          options=None) -> torch.Tensor:
    """This rank's shard of ``reduce_scatter(a @ b)`` along ``scatter_dim`` (``options``: as
    :func:`all_gather_matmul`'s).

    a: (..., M, ..., K) with M divisible by the group size P; b: (K, N). Returns (..., M/P, ..., N):
    rank r gets rows [r·M/P, (r+1)·M/P) of the sum (or mean, ``reduce_op="avg"``) over ranks.
    ``side_work`` callables run while transfers are in flight, one per ring step (all of them
    during the collective's transfer; after it with ``overlap=False``); the column-parallel
    backward puts its weight-gradient chunks there.
    """
    rank, world = group_rank_size(group)
    how, err = _resolve("matmul_reduce_scatter", algo, world, 2.0 * a.numel() * b.shape[-1], a.device, overlap,
                        dtype=a.dtype, k=a.shape[-1], n=b.shape[-1], group=group, quantized=is_operand(b))
    consistency.agree(group, "matmul_reduce_scatter", **{"a.shape": a.shape, "a.dtype": a.dtype, "b.shape": b.shape,
                                                         "b.dtype": b.dtype, "scatter_dim": scatter_dim,
                                                         "reduce_op": reduce_op, "algo": how})
    if err is not None:
        raise err
    sd = _check_a(a, scatter_dim, "a", "scatter_dim")
    _check_b(a, b, "b")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op ({reduce_op!r}) must be 'sum' or 'avg'")
    M = a.shape[sd]
    if M % world:
        raise ValueError(f"a.shape[{scatter_dim}] ({M}) must be divisible by the group size ({world})")
    # rows of the scatter dim first, contiguous: torch.matmul folds a contiguous (m, ..., K) operand into
    # one 2-D GEMM, but a strided view (sequence-major of a batch-major tensor) becomes a bmm over an
    # expanded copy of b per row: 2-4x slower on CPU (measured: the TP2xPP2 zero-bubble step doubled)
    am = a.movedim(sd, 0).contiguous()
    m = M // world

    def partial(d: int, step: int) -> torch.Tensor:
        with gemm_span("matmul chunk", a.device.type, step=step, dst=d):
            return _mm(am[d * m:(d + 1) * m], b, wide=True)

    if how == "local":
        with gemm_span("matmul", a.device.type):
            out = _mm(am, b)
        for work in side_work:
            work()
        return out.movedim(0, sd)
    if how == "fused":
        from tpkernels.functional.gemm_comm_fused import rs_steps  # noqa: PLC0415

        rows = am.view(-1, am.shape[-1])
        # side work is queued behind the GEMM, while the reducer still pulls partials on its stream
        out = _fused("matmul_reduce_scatter", lambda ctx: rs_steps(ctx, rows, b, reduce_op, side_work), group,
                     a.device, options, rows.shape[0] * b.shape[1] * 4)
        return out.view((m,) + tuple(am.shape[1:-1]) + (b.shape[1],)).movedim(0, sd)
    if how == "collective":
        with gemm_span("matmul", a.device.type):
            full = _mm(am, b, wide=True)
        acc = _empty((m,) + tuple(full.shape[1:]), full)
        span = CommSpan("reduce_scatter", a.device.type, bytes=full.numel() * full.element_size())
        handle = reduce_scatter_into(acc, full, group, async_op=True)
        if not overlap:
            handle.wait()
        for work in side_work:
            work()
        handle.wait()
        span.done()
    else:
        nxt_peer, prv_peer = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
        acc = partial((rank - 1) % world, 0)
        bufs = [_empty(acc.shape, acc), _empty(acc.shape, acc)]
        for step in range(world - 1):
            recv = bufs[step % 2]
            span = CommSpan("ring reduce_scatter chunk", a.device.type, step=step)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, acc, nxt_peer, group),
                                           dist.P2POp(dist.irecv, recv, prv_peer, group)])
            mine = partial((rank - step - 2) % world, step + 1)  # overlaps the transfer
            if step < len(side_work):
                side_work[step]()
            for r in reqs:
                r.wait()
            span.done()
            acc = recv.add_(mine)
        for work in side_work[world - 1:]:
            work()
    if reduce_op == "avg":
        acc = acc / world
    return acc.to(_out_dtype(a, b)).movedim(0, sd)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, group=None, reduce_op: str = "sum", algo: str = "auto",
                      variant: str = "auto", options=None) -> torch.Tensor:
    """``all_reduce(a @ b)`` over ``group``: the row-parallel layer without sequence parallelism
    (``options``: as :func:`all_gather_matmul`'s).

    a: (..., K), b: (K, N). Returns (..., N), the same on every rank: the sum (or mean,
    ``reduce_op="avg"``) over ranks, accumulated in float32 for 16-bit inputs. ``algo``:
    "collective" (GEMM, then one all-reduce), "ring" (the ring GEMM + reduce-scatter over the rows,
    padded to a multiple of the group size, then one all-gather), "fused" (the GEMM publishes tiles
    that a reducer follows; ``variant`` "one_shot", "two_shot" or "auto": one-shot for small
    outputs), "auto".
    """
    rank, world = group_rank_size(group)
    how, err = _resolve("matmul_all_reduce", algo, world, 2.0 * a.numel() * b.shape[-1], a.device,
                        dtype=a.dtype, k=a.shape[-1], n=b.shape[-1], group=group, quantized=is_operand(b))
    consistency.agree(group, "matmul_all_reduce", **{"a.shape": a.shape, "a.dtype": a.dtype, "b.shape": b.shape,
                                                     "b.dtype": b.dtype, "reduce_op": reduce_op, "algo": how,
                                                     "variant": variant})
    if err is not None:
        raise err
    if a.dim() < 1:
        raise ValueError(f"a must have at least 1 dim (..., K), got shape {tuple(a.shape)}")
    _check_b(a, b, "b")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op ({reduce_op!r}) must be 'sum' or 'avg'")
    if how == "local":
        with gemm_span("matmul", a.device.type):
            return _mm(a, b)
    out_shape = tuple(a.shape[:-1]) + (b.shape[1],)
    if how == "fused":
        from tpkernels.functional.gemm_comm_fused import ar_steps  # noqa: PLC0415

        rows = a.contiguous().view(-1, a.shape[-1])
        out = _fused("matmul_all_reduce", lambda ctx: ar_steps(ctx, rows, b, reduce_op, variant), group, a.device,
                     options, rows.shape[0] * b.shape[1] * 4)
        return out.view(out_shape)
    if how == "ring":
        rows = a.reshape(-1, a.shape[-1])
        pad = (-rows.shape[0]) % world
        if pad:  # zero rows give zero partial sums
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        shard = matmul_reduce_scatter(rows, b, group, scatter_dim=0, reduce_op=reduce_op, algo="ring")
        full = torch.empty((rows.shape[0], b.shape[1]), dtype=_out_dtype(a, b), device=a.device)
        span = CommSpan("all_gather", a.device.type, bytes=full.numel() * full.element_size())
        all_gather_into(full, shard, group)
        span.done()
        return full[:rows.shape[0] - pad].view(out_shape)
    with gemm_span("matmul", a.device.type):
        y = _mm(a, b, wide=True)
    span = CommSpan("all_reduce", a.device.type, bytes=y.numel() * y.element_size())
    dist.all_reduce(y, group=group)
    span.done()
    if reduce_op == "avg":
        y = y / world
    return y.to(_out_dtype(a, b))
