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
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402

from tpkernels.parallel import ParallelConfig  # noqa: E402
from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: E402
from tpkernels.planner import ClusterSpec, ModelConfig, TrainingSetup, calibrated_for, estimate, gpu_preset  # noqa: E402
from tpkernels.planner.measure import calibrate, measure  # noqa: E402

LAYOUTS = [(tp, pp, sched) for pp in (1, 2) for tp in (1, 2, 4) for sched in (("1f1b", "zb-h1") if pp > 1 else ("1f1b",))]


def train_worker(rank: int, world: int, cfg: dict) -> float:
    from tpkernels.train import TrainConfig, Trainer  # noqa: PLC0415

    history = Trainer(TrainConfig.from_values(cfg)).train()
    times = [h["step_s"] for h in history[2:]]
    return statistics.median(times)


def train_config(args, tp: int, pp: int, schedule: str) -> dict:
    return {"model": {"name": "Llama-2-7B", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                      "kv_heads": args.heads, "ffn": args.ffn, "vocab": args.vocab},
            "parallel": {"tp": tp, "pp": pp, "dp": 1, "sequence_parallel": tp > 1, "schedule": schedule,
                         "micro_batch_size": args.mbs, "num_microbatches": args.microbatches},
            "data": {"seq_length": args.seq},
            "training": {"steps": args.steps, "precision": "fp32" if not torch.cuda.is_available() else "bf16"},
            "logging": {"progress": False, "log_every": 10**6}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    spec = ModelConfig("llama", args.layers, args.hidden, args.heads, args.ffn, args.vocab, num_kv_heads=args.heads,
                       max_position_embeddings=args.seq, name="bench-llama")
    train = TrainingSetup(args.mbs * args.microbatches, args.seq, precision="bf16" if on_gpu else "fp32",
                          overlap_grad_reduce=True)
    rows = []
    for tp, pp, sched in LAYOUTS:
        world = tp * pp
        if on_gpu and torch.cuda.device_count() < world:
            continue
        meas = measure(spec, train, micro_batch_size=args.mbs)
        print("measured here: " + meas.describe())
        cluster, eff, _ = calibrate(ClusterSpec(gpu_preset("A100-80GB"), gpus_per_node=world, nodes=1),
                                    calibrated_for(gpu_preset("A100-80GB")), meas)
        cfg = ParallelConfig(tp, pp, 1, 1, args.mbs, args.microbatches, sequence_parallel=tp > 1,
                             schedule=sched if pp > 1 else None)
        est = estimate(spec, train, cluster, cfg, eff)
        results = run_on_ranks(train_worker, world, train_config(args, tp, pp, sched),
                               backend="nccl" if on_gpu else "gloo", timeout=1800)
        measured = max(results)
        t = est.time
        rows.append({"layout": f"TP{tp} PP{pp}", "schedule": sched if pp > 1 else "-", "ranks": world,
                     "measured_s": round(measured, 4), "predicted_s": round(est.step_time, 4),
                     "error_pct": round(100 * (measured / est.step_time - 1), 1),
                     "pred_gemm_s": round(t.gemm, 4), "pred_elementwise_s": round(t.elementwise, 4),
                     "pred_tp_exposed_s": round(t.tp_exposed, 4), "pred_p2p_s": round(t.p2p, 4),
                     "pred_bubble_s": round(t.bubble, 4), "pred_optimizer_s": round(t.optimizer, 4),
                     "device": meas.device_name, "date": datetime.date.today().isoformat()})
        print(f"  {rows[-1]['layout']} {rows[-1]['schedule']}: measured {measured:.3f} s, predicted "
              f"{est.step_time:.3f} s", flush=True)
    print_table(rows, ["layout", "schedule", "ranks", "measured_s", "predicted_s", "error_pct", "pred_gemm_s",
                       "pred_elementwise_s", "pred_tp_exposed_s", "pred_p2p_s", "pred_bubble_s"])
    best = min(rows, key=lambda r: r["measured_s"])
    top3 = sorted(rows, key=lambda r: r["predicted_s"])[:3]
    agree = best in top3
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"\nworst error {worst:.1f}% (target ±15%); measured best {best['layout']} {best['schedule']} is "
          f"{'' if agree else 'NOT '}in the predicted top 3 ({', '.join(r['layout'] + ' ' + r['schedule'] for r in top3)})")
    device = "gpu" if on_gpu else "cpu"
    print(f"wrote {write_csv(f'planner_vs_trainer_{device}', rows)}")


if __name__ == "__main__":
    main()
