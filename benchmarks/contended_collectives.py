"""What timing the collectives with the plan's ranks computing changes in the planner's prediction.

    python benchmarks/contended_collectives.py [--csv benchmarks/results/planner_vs_trainer_world4_cpu.csv]

With more ranks than cores (4 gloo ranks on a 2-core CPU), a rank that reaches a collective waits
until its peer gets a core back. ``tpkernels plan --measure`` times that (``measure(...,
ranks=N)``: N ranks computing and all-reducing in pairs) and plans with it. This script measures
this machine once, predicts the nine layouts of a saved ``planner_vs_trainer.py --world 4`` run
twice from that one measurement — with the idle 2-rank timing of the collectives (the latency
scaled by the cores' share, as before) and with the contended one — and prints both errors against
the run's measured steps. Writes contended_collectives_<device>.csv ($OUT instead, if set).
Meaningful on a CPU with fewer cores than ranks; elsewhere the two columns are equal.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402
from planner_vs_trainer import add_model_arguments, model_and_batch, world_layouts  # noqa: E402

from tpkernels.parallel import ParallelConfig  # noqa: E402
from tpkernels.planner import ClusterSpec, calibrated_for, estimate, gpu_preset  # noqa: E402
from tpkernels.planner.measure import calibrate, measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=ROOT / "benchmarks/results/planner_vs_trainer_world4_cpu.csv",
                    help="a planner_vs_trainer.py --world 4 run (its measured_s per layout)")
    add_model_arguments(ap)
    args = ap.parse_args()
    measured = {(r["layout"], r["schedule"]): float(r["measured_s"]) for r in csv.DictReader(args.csv.open())}
    world = int(next(iter(csv.DictReader(args.csv.open())))["ranks"])
    spec, train = model_and_batch(args)
    meas = measure(spec, train, micro_batch_size=args.mbs, ranks=world)
    print("measured here: " + meas.describe())
    idle = dataclasses.replace(meas, contended_ranks=0, contended_latency_s=None, contended_busbw_gbs=None)
    base = ClusterSpec(gpu_preset("A100-80GB"), gpus_per_node=world, nodes=1)
    plans = {name: calibrate(base, calibrated_for(base.gpu), m)[:2] for name, m in (("idle", idle), ("contended", meas))}
    rows = []
    for tp, pp, sched in world_layouts(world):
        dp = world // (tp * pp)
        key = (f"TP{tp} PP{pp} DP{dp}", sched if pp > 1 else "-")
        if key not in measured:
            continue
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=args.mbs, num_microbatches=args.microbatches // dp,
                             sequence_parallel=tp > 1,
                             schedule=sched if pp > 1 else None)
        row = {"layout": key[0], "schedule": key[1], "measured_s": measured[key]}
        for name, (cluster, eff) in plans.items():
            t = estimate(spec, train, cluster, cfg, eff).time.total
            row[f"{name}_predicted_s"] = round(t, 4)
            row[f"{name}_error_pct"] = round(100 * (measured[key] / t - 1), 1)
        rows.append(row)
    print_table(rows, list(rows[0]))
    for name in plans:
        worst = max(rows, key=lambda r: abs(r[f"{name}_error_pct"]))
        within = sum(abs(r[f"{name}_error_pct"]) <= 20 for r in rows)
        print(f"{name} timing: worst {worst[f'{name}_error_pct']:+.1f}% ({worst['layout']} {worst['schedule']}), "
              f"{within} of {len(rows)} within ±20%")
    device = "cpu" if meas.device == "cpu" else meas.device_name.replace(" ", "_")
    print(f"wrote {write_csv(f'contended_collectives_{device}', rows)}")


if __name__ == "__main__":
    main()
