"""How long the planner's search takes: the largest jobs `tpkernels plan` is asked about.

    python benchmarks/bench_planner_search.py [--reps 3]

Each row plans one job from scratch (the bubble cache cleared) and reports the median wall time of
``--reps`` runs, the configurations scored and the layouts that fit. Target: under 5 s for GPT-1T on
1,024 H100s (the planner answers while a user waits). A speed target, so a benchmark, not a test:
CI's shared 2-core machine once took 5.6 s. Writes benchmarks/results/planner_search.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_csv  # noqa: E402

from tpkernels.planner import ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan  # noqa: E402
from tpkernels.planner import pipeline_bubble  # noqa: E402

JOBS = [  # (model, GPU, nodes of 8, global batch, sequence length)
    ("GPT-1T", "H100-SXM", 128, 2048, 2048),
    ("Llama-3-70B", "H100-SXM", 8, 512, 8192),
    ("GPT-3-175B", "A100-80GB", 128, 1536, 2048),
    ("Qwen2.5-72B", "H200", 16, 1024, 4096),
]
TARGET_S = 5.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for model, gpu, nodes, batch, seq in JOBS:
        times = []
        for _ in range(args.reps):
            pipeline_bubble._idle_units.cache_clear()  # every run from scratch, as a fresh `tpkernels plan`
            t0 = time.perf_counter()
            p = plan(model_preset(model), TrainingSetup(global_batch=batch, seq_length=seq),
                     ClusterSpec(gpu_preset(gpu), gpus_per_node=8, nodes=nodes))
            times.append(time.perf_counter() - t0)
        rows.append({"model": model, "gpus": 8 * nodes, "gpu": gpu, "global_batch": batch, "seq": seq,
                     "scored": p.evaluated, "layouts_that_fit": len(p.ranked), "median_s": round(statistics.median(times), 3),
                     "best": p.best.config.short() if p.best else "none"})
    print_table(rows, list(rows[0]))
    worst = rows[0]["median_s"]
    print(f"\nGPT-1T on 1,024 GPUs: {worst:.2f} s (target < {TARGET_S:.0f} s): {'met' if worst < TARGET_S else 'MISSED'}")
    print("wrote", write_csv("planner_search", rows))


if __name__ == "__main__":
    main()
