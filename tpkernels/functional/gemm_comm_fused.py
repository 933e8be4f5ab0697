"""The ``fused`` algorithm of the GEMM-communication ops: Triton kernels over symmetric memory.

    all_gather_matmul      this rank's shard goes into its symmetric buffer; after a barrier a side
                           stream pulls the peers' shards chunk by chunk with the copy engine
                           (rank+1 first) and raises one signal per (source rank, chunk); the
                           persistent GEMM (:mod:`~tpkernels.kernels.triton.ag_matmul`) starts on
                           its own shard and waits on each chunk's signal before loading it.
    matmul_reduce_scatter  the GEMM (:mod:`~tpkernels.kernels.triton.matmul_signal`) writes float32
                           partial tiles into this rank's symmetric buffer, destination rank+1
                           first, and signals each tile; a reducer
                           (:mod:`~tpkernels.kernels.triton.tile_reduce`) on a side stream, on a
                           few SMs, pulls this rank's rows from every peer as they are signalled
                           ("pull"; "push": the epilogue stores into the destination's buffer).
    matmul_all_reduce      the same GEMM over all rows; one-shot (every rank reduces every tile:
                           small outputs) or two-shot (each rank reduces 1/world of the tiles, then
                           copies the others' reduced tiles: large outputs).

Every op ends with a barrier of the group, so no rank rewrites a buffer a peer still reads; the
all-gather also starts with one (the shards must be in place). Signals carry the arena's call
counter, so back-to-back calls need no reset; a wait that gives up raises
:class:`~tpkernels.parallel.symmetric_memory.SignalTimeoutError` naming the rank and chunk, and
the kernel poisons what it could not compute with NaN.

Each op is written once, as a generator of one rank's steps that yields at the points where the
ranks must line up (BARRIER) or where an emulated rank must let the others launch their producers
before it launches a consumer (PHASE). :func:`run_rank` drives it for a real rank (a barrier is
torch's stream-ordered symmetric-memory barrier); :mod:`tpkernels.functional.virtual_tp` drives
world_size of them in lockstep on one device.

Inputs are 2-D row blocks (rows, K) with last-dim stride 1; the public ops of
:mod:`tpkernels.functional.gemm_comm` reshape N-D tensors and check dtype (bf16/fp16) and
K, N (multiples of 16) before they come here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from tpkernels import env_vars
from tpkernels._extension import extension
from tpkernels.parallel.symmetric_memory import align, max_spins, symmetric_arena

BARRIER, PHASE = "barrier", "phase"
# all-reduce: one-shot up to this many output elements (every rank reads all partials: cheap while
# latency dominates), two-shot above
ONE_SHOT_MAX_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class FusedOptions:
    """How the fused path runs; each field left None takes its ``TPKERNELS_*`` variable, read when the
    call resolves it (:meth:`resolved`), else its default (:mod:`tpkernels.env_vars`).

    ag_chunks: chunks per source shard of the all-gather: finer chunks let the GEMM start sooner,
        each costs one copy launch and one signal (default 4).
    reducer_programs: SMs left to the reducers of reduce-scatter / all-reduce, the GEMM gets the
        rest: ~16 SMs of loads saturate one H100's NVLink (450 GB/s at roughly 30 GB/s per SM).
    copy: who moves the all-gather's chunks: "engine" (cudaMemcpyAsync on a side stream: no SM taken
        from the GEMM; torch's and Kraken's choice) or "kernel" (csrc/comm/peer_copy.cu on a few
        SMs, one launch for every chunk).
    reducer: "triton" (kernels/triton/tile_reduce.py) or "cuda" (csrc/comm/tile_reduce.cu);
        benchmarks/bench_gemm_comm.py measures both movers on a GPU.
    rs_mode: reduce-scatter partials "pull" (kept local, the reducers read them over NVLink) or
        "push" (the GEMM epilogue stores them into the destination rank's buffer).
    signal_spins: reads a signal wait makes before it gives up (default ~30 s of polling on a GPU).
    barrier_timeout_s: seconds a symmetric-memory barrier waits for its peers."""

    ag_chunks: int | None = None
    reducer_programs: int | None = None
    copy: str | None = None
    reducer: str | None = None
    rs_mode: str | None = None
    signal_spins: int | None = None
    barrier_timeout_s: float | None = None

    def resolved(self, device: torch.device) -> "FusedOptions":
        """Every field set: the call's value, else the environment's now, else the default; checked."""
        env = {"ag_chunks": "TPKERNELS_FUSED_AG_CHUNKS", "reducer_programs": "TPKERNELS_FUSED_REDUCER_PROGRAMS",
               "copy": "TPKERNELS_FUSED_AG_COPY", "reducer": "TPKERNELS_FUSED_REDUCER", "rs_mode": "TPKERNELS_FUSED_RS",
               "barrier_timeout_s": "TPKERNELS_BARRIER_TIMEOUT_S"}
        values = {f: getattr(self, f) if getattr(self, f) is not None else env_vars.read(var) for f, var in env.items()}
        values["signal_spins"] = self.signal_spins if self.signal_spins is not None else max_spins(device)
        for f in ("ag_chunks", "reducer_programs", "signal_spins"):
            if not isinstance(values[f], int) or isinstance(values[f], bool) or values[f] < 1:
                raise ValueError(f"{f} ({values[f]!r}) must be a positive integer")
        if not values["barrier_timeout_s"] > 0:
            raise ValueError(f"barrier_timeout_s ({values['barrier_timeout_s']!r}) must be > 0")
        values["copy"], values["reducer"], values["rs_mode"] = check_movers(values["copy"], values["reducer"], device,
                                                                            values["rs_mode"])
        return FusedOptions(**values)

    def replace(self, **changes) -> "FusedOptions":
        return dataclasses.replace(self, **changes)


def kernel_config(device: torch.device) -> tuple:
    from tpkernels.kernels.triton.ag_matmul import CONFIGS, INTERPRETER_CONFIG  # noqa: PLC0415

    if device.type != "cuda":
        return INTERPRETER_CONFIG
    major, minor = torch.cuda.get_device_capability(device)
    return CONFIGS.get(10 * major, CONFIGS[80])


def signal_set(signals: torch.Tensor, index: int, value: int) -> None:
    """signals[index] = value on the current stream, ordered after the stream's earlier work (copies).

    On CUDA a stream memory operation (cuStreamWriteValue32, which fences first), not a kernel: the
    GEMM that waits for the signal may hold every SM, and a kernel raising the signal would then
    never be scheduled. The csrc/comm kernel (fence + release store) is the fallback for a torch
    without it; the GEMM then leaves it SMs (see ``signal_needs_sms``)."""
    if signals.device.type != "cuda":
        signals[index] = value
    elif _stream_write_value32() is not None:
        _stream_write_value32()(signals.view(torch.uint32), index, value)
    else:
        extension().comm_signal_set(signals, index, value)


@functools.lru_cache(maxsize=None)
def _stream_write_value32():
    try:
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(_SymmetricMemory, "stream_write_value32", None)


def signal_needs_sms() -> bool:
    return _stream_write_value32() is None


class RealRank:
    """One real rank of ``group``: torch symmetric memory, the current CUDA stream and a side stream;
    ``options`` (:class:`FusedOptions`) resolved for this call."""

    _side_streams: dict = {}

    def __init__(self, group, device: torch.device, options: FusedOptions | None = None):
        import torch.distributed as dist  # noqa: PLC0415

        self.group, self.device = group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.options = (options or FusedOptions()).resolved(device)
        self.config, self.spins = kernel_config(device), self.options.signal_spins
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.copy, self.reducer, self.rs_mode = self.options.copy, self.options.reducer, self.options.rs_mode
        key = device.index
        if key not in self._side_streams:
            self._side_streams[key] = torch.cuda.Stream(device=device, priority=-1)
        self.side_stream = self._side_streams[key]

    def arena(self, use: str, nbytes: int):
        return symmetric_arena(self.group, use, nbytes, self.device)

    def programs(self, with_reducer: bool) -> tuple[int, int]:
        """(GEMM programs, reducer programs): the GEMM leaves the reducer its SMs, so both run at once."""
        red = min(self.options.reducer_programs, max(1, self.sms // 4))
        return (self.sms - red, red) if with_reducer else (self.sms, 0)

    def fork(self) -> None:
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side_stream)

    def side(self):
        return torch.cuda.stream(self.side_stream)

    def lost(self, src: int, chunk: int) -> bool:
        return False


def check_movers(copy: str, reducer: str, device: torch.device, rs_mode: str = "pull") -> tuple[str, str, str]:
    """(copy, reducer, rs_mode) after validation; the CUDA variants need a CUDA device and tpkernels._C built
    with CUDA."""
    if copy not in ("engine", "kernel"):
        raise ValueError(f"copy ({copy!r}, TPKERNELS_FUSED_AG_COPY) must be 'engine' or 'kernel'")
    if reducer not in ("triton", "cuda"):
        raise ValueError(f"reducer ({reducer!r}, TPKERNELS_FUSED_REDUCER) must be 'triton' or 'cuda'")
    if "kernel" == copy or "cuda" == reducer:
        ext = extension()
        if device.type != "cuda" or ext is None or not hasattr(ext, "comm_pull_chunks"):
            raise ValueError(f"copy={copy!r} / reducer={reducer!r} run the CUDA kernels of csrc/comm: they need a "
                             "CUDA device and tpkernels._C built with CUDA")
    if rs_mode not in ("pull", "push"):
        raise ValueError(f"rs_mode ({rs_mode!r}, TPKERNELS_FUSED_RS) must be 'pull' or 'push'")
    if rs_mode == "push" and reducer == "cuda":
        raise ValueError("rs_mode='push' needs reducer='triton' (the CUDA reducer reads the pull layout only)")
    return copy, reducer, rs_mode


def run_rank(ctx: RealRank, steps):
    """Drive one real rank's steps: BARRIER is the arena's barrier (with the call's timeout), PHASE
    nothing. Returns the result, after raising any signal timeout the kernels recorded (those
    already finished)."""
    arena = None
    try:
        while True:
            kind, arena = next(steps)
            if kind == BARRIER:
                arena.barrier(ctx.options.barrier_timeout_s)
    except StopIteration as stop:
        if arena is not None:
            arena.err.check()
        return stop.value


def ag_steps(ctx, a: torch.Tensor, bs, return_a: bool = True, chunks: int | None = None):
    """One rank of the fused all-gather + GEMM. a: (m, K), bs: [(K, N_j)]. Returns (a_full (world·m, K)
    or None, [(world·m, N_j)])."""
    from tpkernels.kernels.triton.ag_matmul import ag_matmul, rows_per_chunk  # noqa: PLC0415

    rank, world, (m, K) = ctx.rank, ctx.world, a.shape
    chunks = chunks or ctx.options.ag_chunks
    shard_bytes, sig_bytes = align(m * K * a.element_size()), align(4 * world * chunks)
    arena = ctx.arena("all_gather_matmul", shard_bytes + 2 * sig_bytes)
    arena.err.check()
    epoch = arena.next_epoch()
    arena.local(0, (m, K), a.dtype).copy_(a)
    signals = arena.local(shard_bytes, (world * chunks,), torch.int32)
    arena.err.describe = lambda code: (
        f"all_gather_matmul on rank {rank}: rank {(code - 1) // chunks} never signalled chunk {(code - 1) % chunks} "
        f"of its shard (call {epoch}; gave up after {ctx.spins} reads)")
    yield BARRIER, arena  # every rank's shard is in its buffer
    a_full = torch.empty((world * m, K), dtype=a.dtype, device=a.device)
    a_full[rank * m:(rank + 1) * m].copy_(a)
    chunk_rows = rows_per_chunk(m, chunks, ctx.config[0])
    ctx.fork()
    with ctx.side():
        if ctx.copy == "kernel":  # one launch; the last block of each chunk raises its signal
            counters = arena.local(shard_bytes + sig_bytes, (world * chunks,), torch.int32)
            per_chunk = max(1, 2 * ctx.options.reducer_programs // max(1, (world - 1) * -(-m // chunk_rows)))
            extension().comm_pull_chunks(a_full, arena.table(0), rank, world, m, chunk_rows, chunks, signals,
                                         counters, epoch, per_chunk)
        else:
            for step in range(1, world):
                src = (rank + step) % world
                peer = arena.peer(src, 0, (m, K), a.dtype)
                for c, r0 in enumerate(range(0, m, chunk_rows)):
                    r1 = min(m, r0 + chunk_rows)
                    a_full[src * m + r0:src * m + r1].copy_(peer[r0:r1])
                    if not ctx.lost(src, c):
                        signal_set(signals, src * chunks + c, epoch)
    gemm_programs, _ = ctx.programs(with_reducer=ctx.copy == "kernel" or (a.is_cuda and signal_needs_sms()))
    outs = []
    for b in bs:
        out = torch.empty((world * m, b.shape[1]), dtype=a.dtype, device=a.device)
        ag_matmul(a_full, b, out, signals, arena.err.tensor, epoch=epoch, max_spins=ctx.spins, m=m, rank=rank,
                  world=world, chunks=chunks, chunk_rows=chunk_rows, config=ctx.config, programs=gemm_programs)
        outs.append(out)
    ctx.join()
    yield BARRIER, arena  # no rank rewrites its shard while a peer still pulls it
    return (a_full if return_a else None), outs


def reduce_describe(op: str, rank: int, n_sigs: int, tiles_m: int, tiles_n: int, epoch: int, spins: int):
    """The message of a reducer's timeout code 1 + src·n_sigs + signal (signal = block·tiles + tile)."""
    def describe(code: int) -> str:
        src, sig = divmod(code - 1, n_sigs)
        t = sig % (tiles_m * tiles_n)
        return (f"{op} on rank {rank}: rank {src} never signalled tile {t} (row block {t // tiles_n}, column block "
                f"{t % tiles_n}) of the partial sums this rank reduces (call {epoch}; gave up after {spins} reads)")
    return describe


def rs_steps(ctx, a: torch.Tensor, b: torch.Tensor, reduce_op: str = "sum", side_work=()):
    """One rank of the fused GEMM + reduce-scatter. a: (world·m, K), b: (K, N). Returns (m, N).
    ``side_work`` callables are queued on the compute stream behind the GEMM, so they run while the
    reducer (side stream) is still pulling partials: the column-parallel backward's weight gradient."""
    from tpkernels.kernels.triton.matmul_signal import matmul_signal, tiles  # noqa: PLC0415
    from tpkernels.kernels.triton.tile_reduce import tile_reduce  # noqa: PLC0415

    rank, world, N = ctx.rank, ctx.world, b.shape[1]
    M = a.shape[0]
    m = M // world
    tm, tn = tiles(m, N, ctx.config)
    part_bytes = align(4 * M * N)
    arena = ctx.arena("matmul_reduce_scatter", part_bytes + align(4 * world * tm * tn))
    arena.err.check()
    epoch = arena.next_epoch()
    partial = arena.local(0, (M, N), torch.float32)
    signals = arena.local(part_bytes, (world * tm * tn,), torch.int32)
    arena.err.describe = reduce_describe("matmul_reduce_scatter", rank, world * tm * tn, tm, tn, epoch, ctx.spins)
    out = torch.empty((m, N), dtype=a.dtype, device=a.device)
    acc = torch.empty((m, N), dtype=torch.float32, device=a.device)
    gemm_programs, red_programs = ctx.programs(with_reducer=True)
    push = ctx.rs_mode == "push"
    ctx.fork()  # the reducer may start as soon as the inputs are ready, not after the GEMM
    matmul_signal(a, b, partial, signals, epoch=epoch, m=m, groups=world, first_group=(rank + 1) % world,
                  config=ctx.config, programs=gemm_programs, rank=rank,
                  push_tables=(arena.table(0), arena.table(part_bytes)) if push else None)
    yield PHASE, arena  # emulated ranks: every producer is launched before any consumer
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    with ctx.side():
        if ctx.reducer == "cuda":
            extension().comm_reduce_tiles(out, arena.table(0), arena.table(part_bytes), world, rank * m,
                                          rank * tm * tn, world * tm * tn, ctx.config[0], ctx.config[1], epoch,
                                          ctx.spins, arena.err.tensor, scale, red_programs)
        else:
            tile_reduce(out, acc, arena.table(0), arena.table(part_bytes), arena.table(0), arena.table(0),
                        arena.err.tensor, mode="reduce_scatter", epoch=epoch, max_spins=ctx.spins, rank=rank,
                        world=world, m=m, scale=scale, config=ctx.config, programs=red_programs, push=push)
    for work in side_work:
        work()
    ctx.join()
    yield BARRIER, arena  # no rank's next GEMM overwrites partials a peer still reads
    return out


def all_reduce_variant(rows: int, n: int, variant: str = "auto") -> str:
    if variant not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"variant ({variant!r}) must be 'auto', 'one_shot' or 'two_shot'")
    if variant != "auto":
        return variant
    return "one_shot" if rows * n <= ONE_SHOT_MAX_ELEMENTS else "two_shot"


def ar_steps(ctx, a: torch.Tensor, b: torch.Tensor, reduce_op: str = "sum", variant: str = "auto"):
    """One rank of the fused GEMM + all-reduce. a: (M, K), b: (K, N). Returns (M, N), bitwise the same on
    every rank."""
    from tpkernels.kernels.triton.matmul_signal import matmul_signal, tiles  # noqa: PLC0415
    from tpkernels.kernels.triton.tile_reduce import tile_reduce  # noqa: PLC0415

    rank, world, (M, N) = ctx.rank, ctx.world, (a.shape[0], b.shape[1])
    mode = all_reduce_variant(M, N, variant)
    tm, tn = tiles(M, N, ctx.config)
    part_bytes, sig_bytes, red_bytes = align(4 * M * N), align(4 * tm * tn), align(a.element_size() * M * N)
    arena = ctx.arena("matmul_all_reduce", part_bytes + 2 * sig_bytes + red_bytes)
    arena.err.check()
    epoch = arena.next_epoch()
    partial = arena.local(0, (M, N), torch.float32)
    signals = arena.local(part_bytes, (tm * tn,), torch.int32)
    red_off = part_bytes + sig_bytes
    arena.err.describe = reduce_describe("matmul_all_reduce", rank, tm * tn, tm, tn, epoch, ctx.spins)
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    gemm_programs, red_programs = ctx.programs(with_reducer=True)
    ctx.fork()
    matmul_signal(a, b, partial, signals, epoch=epoch, m=M, groups=1, first_group=0, config=ctx.config,
                  programs=gemm_programs)
    yield PHASE, arena
    tables = (arena.table(0), arena.table(part_bytes), arena.table(red_off), arena.table(red_off + red_bytes))
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    for launch in (("one_shot",) if mode == "one_shot" else ("two_shot_reduce", "two_shot_gather")):
        if launch == "two_shot_gather":
            yield PHASE, arena  # emulated ranks: every owner publishes its tiles before anyone copies them
        with ctx.side():
            if launch == "one_shot" and ctx.reducer == "cuda":
                extension().comm_reduce_tiles(out, tables[0], tables[1], world, 0, 0, tm * tn, ctx.config[0],
                                              ctx.config[1], epoch, ctx.spins, arena.err.tensor, scale, red_programs)
            else:
                tile_reduce(out, out, *tables, arena.err.tensor, mode=launch, epoch=epoch, max_spins=ctx.spins,
                            rank=rank, world=world, m=M, scale=scale, config=ctx.config, programs=red_programs)
    ctx.join()
    yield BARRIER, arena
    return out


__all__ = ["BARRIER", "FusedOptions", "check_movers", "ONE_SHOT_MAX_ELEMENTS", "PHASE", "RealRank", "ag_steps",
           "all_reduce_variant",
           "ar_steps", "kernel_config", "rs_steps", "run_rank", "signal_set"]
