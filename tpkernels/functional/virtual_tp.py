"""Virtual tensor parallelism: world_size ranks emulated in one process on one device, running the
fused GEMM-communication kernels unchanged.

Each emulated rank has its own arenas (plain buffers of the device; a "peer" address is another
emulated rank's buffer, see :class:`~tpkernels.parallel.symmetric_memory.VirtualArena`) and, on a
GPU, its own compute and side streams. The harness drives every rank's steps
(:mod:`tpkernels.functional.gemm_comm_fused`) in lockstep: at a PHASE every rank has launched its
producers before any launches a consumer, at a BARRIER every rank's compute stream waits for
every other's. On a GPU the ranks' kernels then run concurrently, as the real ranks' would, so
correctness *and* overlap can be checked and timed on one GPU (with world_size times the work of
one rank on one device). On the CPU, under ``TRITON_INTERPRET=1``, launches run one after another,
so a consumer always finds its signals set: that checks the tile, chunk and signal arithmetic of
every world size without a GPU.

    vtp = VirtualTP(world_size=4, device="cuda")
    a_full, outs = vtp.all_gather_matmul([a0, a1, a2, a3], [b])        # per rank
    shards = vtp.matmul_reduce_scatter([x0, x1, x2, x3], [w0, w1, w2, w3])
    sums = vtp.matmul_all_reduce(xs, ws, variant="two_shot")

``lose_signal=(rank, src, chunk)`` drops one all-gather signal (tests of the timeout error);
``delay=(rank, cycles)`` holds that rank's streams back (GPU: the other ranks' kernels must wait);
``copy="kernel"`` / ``reducer="cuda"`` use the CUDA kernels of ``csrc/comm`` (GPU only);
``rs_mode="push"``: the reduce-scatter GEMM stores into the destination's buffer;
``programs=(gemm, reducer)`` fixes the persistent grids (default: by SM count; 3 and 2 on the CPU).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from tpkernels.functional.gemm_comm_fused import BARRIER, FusedOptions, ag_steps, ar_steps, kernel_config, rs_steps
from tpkernels.parallel.symmetric_memory import VirtualArena, align


class _VirtualRank:
    def __init__(self, vtp: "VirtualTP", rank: int):
        self.vtp, self.rank, self.world, self.device = vtp, rank, vtp.world, vtp.device
        self.options, self.config, self.spins = vtp.options, vtp.config, vtp.spins
        self.copy, self.reducer, self.rs_mode = vtp.copy, vtp.reducer, vtp.rs_mode
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.side_stream = torch.cuda.Stream(device=self.device) if cuda else None

    def arena(self, use: str, nbytes: int) -> VirtualArena:
        return self.vtp.arena(use, nbytes, self.rank)

    def programs(self, with_reducer: bool) -> tuple[int, int]:
        if self.vtp.programs is not None:
            return self.vtp.programs
        if self.device.type != "cuda":
            return 3, 2  # several tiles per program: the persistent loops are exercised
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # all emulated reducers together keep SMs free for the GEMMs (their spinning programs never yield)
        red = max(1, min(self.vtp.options.reducer_programs, sms // (4 * self.world)))
        return (sms - red, red) if with_reducer else (sms, 0)

    def fork(self):
        if self.stream is not None:
            self.side_stream.wait_stream(self.stream)
            if self.vtp.delay is not None and self.vtp.delay[0] == self.rank:
                for s in (self.stream, self.side_stream):  # this rank's copies and GEMM start late
                    with torch.cuda.stream(s):
                        torch.cuda._sleep(self.vtp.delay[1])

    def join(self):
        if self.stream is not None:
            self.stream.wait_stream(self.side_stream)

    def side(self):
        return torch.cuda.stream(self.side_stream) if self.stream is not None else contextlib.nullcontext()

    def main(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def lost(self, src: int, chunk: int) -> bool:
        return self.vtp.lose_signal == (self.rank, src, chunk)


class VirtualTP:
    """world_size emulated ranks on ``device`` (CUDA, or CPU with TRITON_INTERPRET=1)."""

    def __init__(self, world_size: int, device="cuda", lose_signal: tuple[int, int, int] | None = None,
                 copy: str | None = None, reducer: str | None = None, delay: tuple[int, int] | None = None,
                 rs_mode: str | None = None, programs: tuple[int, int] | None = None,
                 options: FusedOptions | None = None):
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        self.world, self.device = world_size, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        given = {k: v for k, v in dict(copy=copy, reducer=reducer, rs_mode=rs_mode).items() if v is not None}
        self.options = (options or FusedOptions()).replace(**given).resolved(self.device)
        self.config, self.spins, self.lose_signal = kernel_config(self.device), self.options.signal_spins, lose_signal
        self.copy, self.reducer, self.rs_mode = self.options.copy, self.options.reducer, self.options.rs_mode
        self.delay, self.programs = delay, programs
        self._arenas: dict[str, list[VirtualArena]] = {}
        self.ranks = [_VirtualRank(self, r) for r in range(world_size)]

    def arena(self, use: str, nbytes: int, rank: int) -> VirtualArena:
        group = self._arenas.get(use)
        if group is None or group[0].nbytes < nbytes:  # rank 0 asks first in every phase
            bufs = [torch.zeros(align(nbytes), dtype=torch.uint8, device=self.device) for _ in range(self.world)]
            group = self._arenas[use] = [VirtualArena(r, bufs) for r in range(self.world)]
        return group[rank]

    def _run(self, make_steps) -> list:
        """Drive one generator of steps per rank in lockstep; returns each rank's result."""
        gens = [make_steps(r, ctx) for r, ctx in enumerate(self.ranks)]
        results: list = [None] * self.world
        live = list(range(self.world))
        arenas = {}
        if self.device.type == "cuda":
            for ctx in self.ranks:
                ctx.stream.wait_stream(torch.cuda.current_stream(self.device))
        while live:
            kinds = {}
            for r in live:
                with self.ranks[r].main():
                    try:
                        kind, arena = next(gens[r])
                        kinds[r] = kind
                        arenas[id(arena)] = arena
                    except StopIteration as stop:
                        results[r] = stop.value
            done = [r for r in live if r not in kinds]
            if done and len(done) != len(live):
                raise RuntimeError(f"emulated ranks {done} finished while {sorted(kinds)} did not: steps out of lockstep")
            live = [r for r in live if r in kinds]
            if self.device.type == "cuda" and BARRIER in kinds.values():
                events = [ctx.stream.record_event() for ctx in self.ranks]
                for ctx in self.ranks:
                    for ev in events:
                        ctx.stream.wait_event(ev)
        if self.device.type == "cuda":
            for ctx in self.ranks:
                torch.cuda.current_stream(self.device).wait_stream(ctx.stream)
            torch.cuda.synchronize(self.device)
        for arena in arenas.values():
            arena.err.check()
        return results

    @staticmethod
    def _per_rank(x, world: int, name: str) -> list:
        xs = list(x) if isinstance(x, (list, tuple)) else [x] * world
        if len(xs) != world:
            raise ValueError(f"{name} has {len(xs)} entries, one per emulated rank ({world}) expected")
        return xs

    def all_gather_matmul(self, shards: Sequence[torch.Tensor], bs: Sequence[torch.Tensor], return_a: bool = True,
                          chunks: int | None = None) -> list:
        """shards: per rank (m, K); bs: [(K, N_j)] shared by every rank. Per rank (a_full, [outs])."""
        shards = self._per_rank(shards, self.world, "shards")
        return self._run(lambda r, ctx: ag_steps(ctx, shards[r], bs, return_a, chunks))

    def matmul_reduce_scatter(self, a: Sequence[torch.Tensor], b, reduce_op: str = "sum", side_work=None) -> list:
        """a: per rank (world·m, K); b: per rank (K, N), or one for all; side_work: per rank, callables run
        on the rank's compute stream while its reducer runs. Per rank (m, N)."""
        a, b = self._per_rank(a, self.world, "a"), self._per_rank(b, self.world, "b")
        side = self._per_rank(side_work if side_work is not None else [()] * self.world, self.world, "side_work")
        return self._run(lambda r, ctx: rs_steps(ctx, a[r], b[r], reduce_op, side[r]))

    def matmul_all_reduce(self, a: Sequence[torch.Tensor], b, reduce_op: str = "sum", variant: str = "auto") -> list:
        """a: per rank (M, K); b: per rank (K, N), or one for all. Per rank (M, N), identical."""
        a, b = self._per_rank(a, self.world, "a"), self._per_rank(b, self.world, "b")
        return self._run(lambda r, ctx: ar_steps(ctx, a[r], b[r], reduce_op, variant))


__all__ = ["VirtualTP"]
