"""Pipeline schedules: tpkernels vs torch.distributed.pipelining on the same model and micro-batches.

    python benchmarks/bench_pipeline.py [--stages 2 4] [--microbatches 4 8 16] [--layer-ms 10]

The model is a stack of identical layers with a known cost: each layer's forward takes
``layer_ms``, its input-gradient backward as long, its weight gradient as long again (slept, plus
a tiny real Linear so there are real gradients to move). Sleeping instead of computing keeps the
ranks, which share this VM's 2 cores, from slowing each other down, so the measured bubble is
the schedule's. For every (stages, micro-batches): step time (median of ``--reps``), measured
bubble (idle share of all ranks, from our timeline; for torch from step time and the ideal
compute time), the simulator's prediction with the action times and transfer latency measured in
the same run, peak micro-batches holding
activations on a rank. Writes benchmarks/results/pipeline_<device>.csv and a Gantt PNG per
schedule of ours ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, run_metadata, write_csv  # noqa: E402

H = 64
LAYERS_PER_RANK = 4


class _Cost(torch.autograd.Function):
    """Forward sleeps f; backward sleeps b for the input gradient and w for the weight gradient
    (deferred to the W action under zero-bubble schedules)."""

    @staticmethod
    def forward(ctx, x, f, b, w):
        time.sleep(f)
        ctx.b, ctx.w = b, w
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        from tpkernels.functional.weight_grad import active_store  # noqa: PLC0415

        time.sleep(ctx.b)
        store = active_store()
        if store is not None:
            store.defer(lambda w=ctx.w: time.sleep(w))
        else:
            time.sleep(ctx.w)
        return g, None, None, None


class CostLayer(torch.nn.Module):
    def __init__(self, ms: float):
        super().__init__()
        self.fc = torch.nn.Linear(H, H)
        self.s = ms / 1e3

    def forward(self, x):
        # the Linear first: its output requires grad, so every layer's backward runs (also the first's)
        return _Cost.apply(self.fc(x), self.s, self.s, self.s)


def _loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _run_rank(rank, world, m, layer_ms, reps, schedules, out_dir):
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed import pipelining as tpp  # noqa: PLC0415

    from tpkernels.pipeline import PipelineRuntime, chunks_of_rank, simulate, split_layers  # noqa: PLC0415
    from tpkernels.pipeline.simulator import Costs  # noqa: PLC0415
    from tpkernels.pipeline.timeline import bubble_fraction, gather_timeline, plot_gantt, transfer_latency  # noqa: PLC0415,E501

    results = {}
    mb_rows = 2
    x = torch.randn(m * mb_rows, H)
    y = torch.randn(m * mb_rows, H)
    for name, v in schedules:
        if name == "interleaved" and (world == 1 or m % world):
            continue
        torch.manual_seed(0)
        layers = [CostLayer(layer_ms) for _ in range(LAYERS_PER_RANK * world)]
        stages = split_layers(layers, world, v)
        mine = chunks_of_rank(stages, rank, world)
        # ours
        rt = PipelineRuntime(mine, name, m, loss_fn=_loss)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            rt.step(x if rank == 0 else None, y if rank == world - 1 else None, return_loss=False)
            if i:
                times.append(time.perf_counter() - t0)
        tl = gather_timeline(rt.timeline)
        # the simulator's prediction from this run's measured mean action times and transfer latency
        # (what profiling one micro-batch would give)
        mean = {k: statistics.mean(e - s for r in tl for a, s, e in r if a.kind == k) if
                any(a.kind == k for r in tl for a, _, _ in r) else 0.0 for k in "FBW"}
        if not rt.split_backward:  # B measured the whole backward: split it as the layer does (b = w)
            mean["B"], mean["W"] = mean["B"] / 2, mean["B"] / 2
        sim = simulate(rt.schedule, m, v, Costs(mean["F"], mean["B"], mean["W"], transfer_latency(tl, v)))
        measured = bubble_fraction(tl)
        if rank == 0:
            plot_gantt(tl, str(Path(out_dir) / f"pipeline_gantt_{name}_p{world}_m{m}.png"),
                       f"tpkernels {name}, {world} stages, {m} micro-batches", sim.bubble_fraction)
        results[f"ours {name}"] = (statistics.median(times), measured, sim.bubble_fraction, max(sim.peak_inflight))
        # torch.distributed.pipelining on the same chunks
        torch_cls = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B,
                     "interleaved": tpp.ScheduleInterleaved1F1B}.get(name)
        if torch_cls is None:
            continue
        torch.manual_seed(0)
        layers = [CostLayer(layer_ms) for _ in range(LAYERS_PER_RANK * world)]
        stages = split_layers(layers, world, v)
        pst = [tpp.PipelineStage(stages[c * world + rank], c * world + rank, world * v, torch.device("cpu"))
               for c in range(v)]
        sched = torch_cls(pst if v > 1 else pst[0], m, loss_fn=_loss)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y)
            else:
                sched.step()
            if i:
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        ideal = 3 * m * LAYERS_PER_RANK * layer_ms / 1e3  # F + B + W per micro-batch on one rank
        results[f"torch {name}"] = (step, max(0.0, 1 - ideal / step), None, None)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--layer-ms", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from tpkernels.parallel.local_ranks import RankPool  # noqa: PLC0415

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(torch.device("cpu"))
    schedules = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
    rows = []
    for p in args.stages:
        with RankPool(p, timeout=900) as pool:
            for m in args.microbatches:
                res = pool.run(_run_rank, m, args.layer_ms, args.reps, schedules, str(RESULTS_DIR))[0]
                for key, (step, bubble, sim, peak) in res.items():
                    impl, name = key.split(" ", 1)
                    rows.append({
                        "stages": p, "microbatches": m, "schedule": name, "impl": impl,
                        "step_ms": round(1e3 * step, 1), "bubble_pct": round(100 * bubble, 1),
                        "simulated_bubble_pct": "" if sim is None else round(100 * sim, 1),
                        "gap_pp": "" if sim is None else round(100 * (bubble - sim), 1),
                        "peak_inflight": "" if peak is None else peak, **meta,
                    })
    print_table(rows, ["stages", "microbatches", "schedule", "impl", "step_ms", "bubble_pct", "simulated_bubble_pct",
                       "gap_pp", "peak_inflight"])
    print(f"wrote {write_csv('pipeline_cpu', rows)} and Gantt charts pipeline_gantt_*.png")


if __name__ == "__main__":
    main()
