"""The planner's predicted step time against `tpkernels train`'s measured one, on this machine.

    python benchmarks/planner_vs_trainer.py [--steps 6] [--layers 4] [--hidden 512] [--seq 256]

For TP ∈ {1, 2, 4} × PP ∈ {1, 2} × schedule ∈ {1f1b, zb-h1} (the schedule only with PP > 1), DP 1:
  measured   ``Trainer`` (what ``tpkernels train --nproc N`` runs): median step time (forward,
             backward, optimizer) of the steps after the first two, on N = TP·PP gloo ranks of one
             thread each (NCCL, one GPU per rank, when N GPUs are visible);
  predicted  ``tpkernels plan --measure``: this machine's rates (one rank's GEMM, copy, attention,
             elementwise, optimizer, loss and op-dispatch rates, gloo's all-reduce bandwidth and
             latency, a pairwise exchange), measured right before each layout's run (a shared
             machine's speed drifts by tens of percent over minutes), then the planner's estimate
             of that layout with the ranks sharing the cores.
Prints each layout's error (+ = predicted faster than measured) and whether the measured best layout
is among the planner's top 3. Writes benchmarks/results/planner_vs_trainer_<device>.csv
($OUT instead, if set). The target is ±15% per layout.

    python benchmarks/planner_vs_trainer.py --world 4 --fit-from 3 [--passes 2]

One world of 4 ranks and its nine layouts (TP × PP × DP = 4, both schedules with PP), one global
batch: what autotune chooses among. The planner's corrections (tpkernels.planner.fit) are fitted on
the 3 layouts an autotuned run tries first (the planner's fastest of each family: TP, PP, pure DP),
and every other layout is predicted again with them. Target: each of the other six within ±20% of its measured step, and
autotune's pick (the fastest measured of the three) the fastest of all nine or within 5% of it.
Writes planner_vs_trainer_world4_<device>.csv. ``--passes 2`` runs the nine twice, interleaved, and
averages each layout's measured and predicted step (its spread between passes is a column).

    python benchmarks/planner_vs_trainer.py --refit-csv benchmarks/results/planner_vs_trainer_world4_cpu.csv

Refits a saved run (its uncorrected compute and communication per layout) without training again,
and rewrites its refit columns.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402

from tpkernels.parallel import ParallelConfig  # noqa: E402
from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: E402
from tpkernels.planner import ClusterSpec, ModelConfig, TrainingSetup, calibrated_for, estimate, gpu_preset  # noqa: E402
from tpkernels.planner.fit import components  # noqa: E402
from tpkernels.planner.measure import calibrate, measure  # noqa: E402

LAYOUTS = [(tp, pp, sched) for pp in (1, 2) for tp in (1, 2, 4) for sched in (("1f1b", "zb-h1") if pp > 1 else ("1f1b",))]


def world_layouts(world: int) -> list[tuple[int, int, str]]:
    """Every (TP, PP, schedule) of one world size (DP = the rest), PP's two schedules each."""
    return [(tp, pp, sched) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if world % (tp * pp) == 0
            for sched in (("1f1b", "zb-h1") if pp > 1 else ("1f1b",))]


def train_worker(rank: int, world: int, cfg: dict) -> float:
    from tpkernels.train import TrainConfig, Trainer  # noqa: PLC0415

    history = Trainer(TrainConfig.from_values(cfg)).train()
    times = [h["step_s"] for h in history[2:]]
    return statistics.median(times)


def train_config(args, tp: int, pp: int, schedule: str, dp: int = 1) -> dict:
    return {"model": {"name": "Llama-2-7B", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                      "kv_heads": args.heads, "ffn": args.ffn, "vocab": args.vocab},
            "parallel": {"tp": tp, "pp": pp, "dp": dp, "sequence_parallel": tp > 1, "schedule": schedule,
                         "micro_batch_size": args.mbs, "num_microbatches": args.microbatches // dp},
            "data": {"seq_length": args.seq},
            "training": {"steps": args.steps, "precision": "fp32" if not torch.cuda.is_available() else "bf16"},
            "logging": {"progress": False, "log_every": 10**6}}


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmarked model and batch (shared with contended_collectives.py)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step at DP1 (÷ DP otherwise)")


def model_and_batch(args) -> tuple[ModelConfig, TrainingSetup]:
    spec = ModelConfig("llama", args.layers, args.hidden, args.heads, args.ffn, args.vocab, num_kv_heads=args.heads,
                       max_position_embeddings=args.seq, name="bench-llama")
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    return spec, TrainingSetup(args.mbs * args.microbatches, args.seq, precision=precision, overlap_grad_reduce=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    add_model_arguments(ap)
    ap.add_argument("--world", type=int, default=None, help="one world size and all its layouts (DP = the rest)")
    ap.add_argument("--fit-from", type=int, default=0, help="fit the planner's corrections on the K layouts it "
                                                             "predicts fastest, re-predict the others (with --world)")
    ap.add_argument("--passes", type=int, default=1, help="run every layout this many times, interleaved, and "
                                                          "average (the machine's speed drifts)")
    ap.add_argument("--refit-csv", type=Path, default=None, help="refit a saved --world run's CSV (its fit_compute_s, "
                                                                 "fit_comm_s, measured_s) without training again")
    args = ap.parse_args()
    if args.refit_csv:
        rows = list(csv.DictReader(args.refit_csv.open()))
        refit(args.fit_from or 3, rows)
        with args.refit_csv.open("w", newline="") as f:  # the refit columns, now from the current fit
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"rewrote {args.refit_csv}")
        return
    on_gpu = torch.cuda.is_available()
    spec, train = model_and_batch(args)
    rows = []
    layouts = world_layouts(args.world) if args.world else LAYOUTS
    # passes interleave (every layout once, then again): a drift of the machine's speed within the run
    # then reaches every layout instead of the ones measured last
    for tp, pp, sched in [x for _ in range(args.passes) for x in layouts]:
        world = args.world or tp * pp
        dp = world // (tp * pp)
        if on_gpu and torch.cuda.device_count() < world:
            continue
        meas = measure(spec, train, micro_batch_size=args.mbs, ranks=world)
        print("measured here: " + meas.describe())
        cluster, eff, _ = calibrate(ClusterSpec(gpu_preset("A100-80GB"), gpus_per_node=world, nodes=1),
                                    calibrated_for(gpu_preset("A100-80GB")), meas)
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=args.mbs, num_microbatches=args.microbatches // dp,
                             sequence_parallel=tp > 1,
                             schedule=sched if pp > 1 else None)
        est = estimate(spec, train, cluster, cfg, eff)
        results = run_on_ranks(train_worker, world, train_config(args, tp, pp, sched, dp),
                               backend="nccl" if on_gpu else "gloo", timeout=1800)
        measured = max(results)
        t = est.time
        rows.append({"layout": f"TP{tp} PP{pp} DP{dp}", "schedule": sched if pp > 1 else "-", "ranks": world,
                     "measured_s": round(measured, 4), "predicted_s": round(est.step_time, 4),
                     "error_pct": round(100 * (measured / est.step_time - 1), 1),
                     "pred_gemm_s": round(t.gemm, 4), "pred_elementwise_s": round(t.elementwise, 4),
                     "pred_tp_exposed_s": round(t.tp_exposed, 4), "pred_p2p_s": round(t.p2p, 4),
                     "pred_bubble_s": round(t.bubble, 4), "pred_optimizer_s": round(t.optimizer, 4),
                     # what fit.fit() takes (uncorrected compute, exposed communication, kernels): refits from the CSV
                     **dict(zip(("fit_compute_s", "fit_comm_s", "fit_ops"),
                                (round(x, 5) for x in components(t, eff)))),
                     "device": meas.device_name, "date": datetime.date.today().isoformat()})
        print(f"  {rows[-1]['layout']} {rows[-1]['schedule']}: measured {measured:.3f} s, predicted "
              f"{est.step_time:.3f} s", flush=True)
    if args.passes > 1:
        rows = merge_passes(rows)
    print_table(rows, ["layout", "schedule", "ranks", "measured_s", "predicted_s", "error_pct", "pred_gemm_s",
                       "pred_elementwise_s", "pred_tp_exposed_s", "pred_p2p_s", "pred_bubble_s"])
    best = min(rows, key=lambda r: r["measured_s"])
    top3 = sorted(rows, key=lambda r: r["predicted_s"])[:3]
    agree = best in top3
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"\nworst error {worst:.1f}% (target ±15%); measured best {best['layout']} {best['schedule']} is "
          f"{'' if agree else 'NOT '}in the predicted top 3 ({', '.join(r['layout'] + ' ' + r['schedule'] for r in top3)})")
    device = "gpu" if on_gpu else "cpu"
    if args.fit_from:
        refit(args.fit_from, rows)
    name = f"planner_vs_trainer_world{args.world}_{device}" if args.world else f"planner_vs_trainer_{device}"
    print(f"wrote {write_csv(name, rows)}")


def merge_passes(rows: list[dict]) -> list[dict]:
    """One row per layout: the median over passes of each measured and predicted time (and its parts): on a
    loaded machine one pass slowed by another job moves a mean, not a median."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((r["layout"], r["schedule"]), []).append(r)
    out = []
    for group in by.values():
        r = dict(group[0])
        for k, v in r.items():
            if isinstance(v, float) and k != "error_pct":
                r[k] = round(statistics.median(g[k] for g in group), 5)
        r["error_pct"] = round(100 * (r["measured_s"] / r["predicted_s"] - 1), 1)
        r["passes"] = len(group)
        r["measured_spread_pct"] = round(100 * (max(g["measured_s"] for g in group) /
                                                min(g["measured_s"] for g in group) - 1), 1)
        out.append(r)
    return out


def _config_of(row: dict) -> ParallelConfig:
    tp, pp, dp = (int(x) for x in re.fullmatch(r"TP(\d+) PP(\d+) DP(\d+)", row["layout"]).groups())
    return ParallelConfig(tp=tp, pp=pp, dp=dp)


def refit(fit_from: int, rows: list[dict]) -> None:
    """Fit the corrections on the ``fit_from`` layouts an autotuned run tries first; re-predict the rest.
    Uses only the rows' columns (fit_compute_s, fit_comm_s, measured_s): the corrected step is linear
    in them (step_time scales compute and communication, then adds the overhead), so a saved CSV
    refits exactly as a fresh run (``--refit-csv``)."""
    from tpkernels.planner.fit import fit  # noqa: PLC0415

    from tpkernels.train.autotune import diverse_order  # noqa: PLC0415

    order = diverse_order(sorted(range(len(rows)), key=lambda i: float(rows[i]["predicted_s"])),
                          config_of=lambda i: _config_of(rows[i]))
    trials = order[:fit_from]  # what an autotuned run tries first: the fastest of each family
    for r in rows:
        r.update({k: float(r[k]) for k in ("measured_s", "predicted_s", "fit_compute_s", "fit_comm_s")})
        r["fit_ops"] = float(r.get("fit_ops") or 0.0)  # CSVs written before the per-op term: none
    f = fit([(rows[i]["fit_compute_s"], rows[i]["fit_comm_s"], rows[i]["fit_ops"], rows[i]["measured_s"])
             for i in trials])
    print(f"\nfitted on {', '.join(rows[i]['layout'] + ' ' + rows[i]['schedule'] for i in trials)}: {f.describe()}")
    for i, r in enumerate(rows):
        again = f.predict(r["fit_compute_s"], r["fit_comm_s"], r["fit_ops"])
        r.update(fitted_on=i in trials, refit_predicted_s=round(again, 4),
                 refit_error_pct=round(100 * (r["measured_s"] / again - 1), 1))
    others = [r for i, r in enumerate(rows) if i not in trials]
    print_table(rows, ["layout", "schedule", "measured_s", "predicted_s", "error_pct", "fitted_on",
                       "refit_predicted_s", "refit_error_pct"])
    worst = max(abs(r["refit_error_pct"]) for r in others) if others else 0.0
    within = sum(abs(r["refit_error_pct"]) <= 20 for r in others)
    fastest = min(rows, key=lambda r: r["measured_s"])
    pick = min((rows[i] for i in trials), key=lambda r: r["measured_s"])
    gap = pick["measured_s"] / fastest["measured_s"] - 1
    # autotune then tries the refit planner's favourite too, when it is untried and predicted faster
    favourite = min(range(len(rows)), key=lambda i: rows[i]["refit_predicted_s"])
    tried = list(trials) + ([favourite] if favourite not in trials and
                            rows[favourite]["refit_predicted_s"] < 0.95 * pick["measured_s"] else [])
    final = min((rows[i] for i in tried), key=lambda r: r["measured_s"])
    final_gap = final["measured_s"] / fastest["measured_s"] - 1
    print(f"after the fit: {within} of {len(others)} other layouts within ±20% (worst {worst:.1f}%); the best of the "
          f"{fit_from} trials is {pick['layout']} {pick['schedule']}, {100 * gap:.1f}% slower than the fastest measured "
          f"({fastest['layout']} {fastest['schedule']}); with the refit planner's pick tried too, autotune ends on "
          f"{final['layout']} {final['schedule']}, {100 * final_gap:.1f}% slower (target: within 5%)")


if __name__ == "__main__":
    main()
