"""Train a small model with pipeline parallelism, compare it with single-process training, and save
the timeline.

    torchrun --nproc-per-node 4 python/pipeline_schedules.py --schedule zb-h1 --gantt pp.png
    python python/pipeline_schedules.py            # one stage, same code path

Every rank builds the same model (same seed), keeps its stages, and runs 3 SGD steps with the chosen
schedule; rank 0 also trains an unsplit copy and checks that the losses agree, then prints the
simulator's predicted bubble next to the measured one.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpkernels.pipeline import PipelineRuntime, chunks_of_rank, simulate, split_layers
from tpkernels.pipeline.simulator import Costs
from tpkernels.pipeline.timeline import bubble_fraction, gather_timeline, plot_gantt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--gantt", default="", help="PNG Gantt chart of the last step")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    rank, p = dist.get_rank(), dist.get_world_size()
    v = 2 if args.schedule == "interleaved" and p > 1 else 1
    m = args.microbatches

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4 * p * v)]
    embed, head = nn.Linear(16, 64), nn.Linear(64, 10)
    dense = copy.deepcopy(nn.Sequential(embed, *layers, head))
    stages = split_layers(layers, p, v, first=embed, last=head)
    mine = chunks_of_rank(stages, rank, p)
    runtime = PipelineRuntime(mine, args.schedule if v > 1 or args.schedule != "interleaved" else "1f1b", m,
                              loss_fn=lambda out, y: F.cross_entropy(out, y))
    opt = torch.optim.SGD([q for c in mine for q in c.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    for step in range(3):
        x, y = torch.randn(4 * m, 16), torch.randint(0, 10, (4 * m,))
        opt.zero_grad()
        loss = runtime.step(x if rank == 0 else None, y if rank == p - 1 else None)
        opt.step()
        if rank == 0:
            ref_opt.zero_grad()
            ref = sum(F.cross_entropy(dense(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m
            ref.backward()
            ref_opt.step()
            assert abs(ref.item() - loss) < 1e-4, (step, ref.item(), loss)
    tl = gather_timeline(runtime.timeline)
    if rank == 0:
        sim = simulate(runtime.schedule, m, v, Costs())
        print(f"{args.schedule} on {p} stage(s), {m} micro-batches: losses match single-process training; "
              f"bubble measured {100 * bubble_fraction(tl):.0f}%, simulated with unit costs "
              f"{100 * sim.bubble_fraction:.0f}%")
        if args.gantt:
            plot_gantt(tl, args.gantt, f"{args.schedule}, {p} stages", sim.bubble_fraction)
    del runtime, opt  # gloo can abort at exit ("terminate called without an active exception") if objects holding the group outlive it
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
