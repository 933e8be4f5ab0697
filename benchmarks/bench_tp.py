"""Tensor-parallel MLP block (column → GeLU → row, sequence parallel), forward + backward:
tpkernels (ring overlap and plain collectives) vs torch DTensor TP (ColwiseParallel/RowwiseParallel
with Shard(0) input/output layouts, i.e. Megatron-style sequence parallelism), same shapes, same run.

    python benchmarks/bench_tp.py [--tp 2 4] [--tokens 2048] [--hidden 1024] [--reps 5]

CPU: gloo ranks on this machine, one thread each (the CPU figures are only meaningful as ratios).
GPUs: NCCL over the visible GPUs when there are at least 2. Prints a table, writes
benchmarks/results/tp_mlp_<device>.csv ($OUT instead, if set). "hidden" is the share of the
ring's communication wall time during which a GEMM chunk was running (from CommTrace).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, run_metadata, write_csv  # noqa: E402


def _bench_rank(rank, world, tokens, hidden, ffn, reps, device_type):
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from tpkernels.nn import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415
    from tpkernels.parallel.trace import CommTrace  # noqa: PLC0415

    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(hidden, ffn).to(dev, dtype), nn.Linear(ffn, hidden).to(dev, dtype)
    x_local = torch.randn(tokens // world, 1, hidden, device=dev, dtype=dtype)
    dy_local = torch.randn_like(x_local)

    def ours(ring: bool):
        # compare the algorithms themselves, not the auto rule: ring (overlapped) vs the serial collective form
        kw = dict(sequence_parallel=True, algo="ring") if ring else dict(sequence_parallel=True, overlap_comm=False)
        c1 = ColumnParallelLinear.from_linear(fc1, None, **kw)
        c2 = RowParallelLinear.from_linear(fc2, None, **kw)

        def step():
            x = x_local.clone().requires_grad_()
            c2(F.gelu(c1(x))).backward(dy_local)
        return step

    def dtensor():
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.tensor import Shard  # noqa: PLC0415
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x)))

        mlp = MLP().to(dev, dtype)
        mlp.load_state_dict({"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "fc2.weight": fc2.weight,
                             "fc2.bias": fc2.bias})
        mesh = init_device_mesh(device_type, (world,))
        parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(input_layouts=Shard(0)),
                                       "fc2": RowwiseParallel(output_layouts=Shard(0))})

        def step():
            x = x_local.clone().requires_grad_()
            mlp(x).backward(dy_local)
        return step

    out = {}
    for name, make in (("ours ring", lambda: ours(True)), ("ours collective", lambda: ours(False)),
                       ("DTensor TP", dtensor)):
        step = make()
        for _ in range(2):
            step()
        times = []
        for _ in range(reps):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
        if name == "ours ring":
            with CommTrace() as tr:
                step()
                sync()
            out["hidden"] = tr.hidden_comm_fraction()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from tpkernels.parallel.local_ranks import RankPool  # noqa: PLC0415

    gpus = torch.cuda.device_count()
    device_type = "cuda" if gpus >= 2 else "cpu"
    meta = run_metadata(torch.device(device_type))
    rows = []
    for tp in args.tp:
        if device_type == "cuda" and tp > gpus:
            continue
        with RankPool(tp, backend="nccl" if device_type == "cuda" else "gloo", timeout=600) as pool:
            per_rank = pool.run(_bench_rank, args.tokens, args.hidden, 4 * args.hidden, args.reps, device_type)
        slowest = {k: max(r[k] for r in per_rank) for k in ("ours ring", "ours collective", "DTensor TP")}
        hidden = statistics.mean(r["hidden"] for r in per_rank)
        rows.append({
            "tp": tp, "tokens": args.tokens, "hidden": args.hidden, "ffn": 4 * args.hidden,
            "ours_ring_ms": round(1e3 * slowest["ours ring"], 2),
            "ours_collective_ms": round(1e3 * slowest["ours collective"], 2),
            "dtensor_ms": round(1e3 * slowest["DTensor TP"], 2),
            "ring_vs_dtensor": round(slowest["DTensor TP"] / slowest["ours ring"], 2),
            "collective_vs_dtensor": round(slowest["DTensor TP"] / slowest["ours collective"], 2),
            "ring_comm_hidden_pct": round(100 * hidden, 1), **meta,
        })
    print_table(rows, ["tp", "tokens", "hidden", "ours_ring_ms", "ours_collective_ms", "dtensor_ms", "ring_vs_dtensor",
                       "collective_vs_dtensor", "ring_comm_hidden_pct"])
    print("ratios > 1: ours is faster than DTensor TP (forward + backward of the MLP block, slowest rank, median)")
    path = write_csv(f"tp_mlp_{device_type}", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
