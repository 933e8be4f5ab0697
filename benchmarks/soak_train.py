"""Soak: many steps of a tiny model through the whole training job; no NaN, no lost step, flat memory.

    python benchmarks/soak_train.py [--steps 1000] [--nproc 1]

Reports the resident memory (RSS) of rank 0 every 50 steps and the least-squares slope over the
second half of the run (KiB per step; the first half includes the allocator warming up). Writes
benchmarks/results/soak_train.csv ($OUT instead, if set). A benchmark, not a test: it asserts nothing
about time; it fails if a loss is not finite or a step is missing.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402

from tpkernels.train import TrainConfig, Trainer  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def soak(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    trainer = Trainer(cfg)
    samples = []
    t0 = time.perf_counter()
    steps = cfg.training.steps
    while trainer.step_index < steps:
        rec = trainer.train_step()
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss {rec['loss']} at step {rec['step']}")
        if rec["step"] % 50 == 0 or trainer.step_index == steps:
            samples.append({"step": rec["step"], "rss_mib": round(rss_mib(), 1), "loss": round(rec["loss"], 4),
                            "elapsed_s": round(time.perf_counter() - t0, 1)})
    if [h["step"] for h in trainer.history] != list(range(steps)):
        raise RuntimeError("a step is missing")
    return samples


def slope(points: list[dict]) -> float:
    xs, ys = [p["step"] for p in points], [p["rss_mib"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 1024  # KiB per step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--nproc", type=int, default=1)
    args = ap.parse_args()
    cfg = TrainConfig.from_values({
        "model": {"name": "Llama-2-7B", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 300},
        "data": {"seq_length": 64, "source": str(Path(__file__).resolve().parents[1] / "README.md")},
        "parallel": {"micro_batch_size": 2, "num_microbatches": 2, "tp": 2 if args.nproc >= 2 else 1,
                     "sequence_parallel": args.nproc >= 2},
        "training": {"steps": args.steps}, "optimizer": {"lr": 1e-3, "min_lr": 1e-4}, "logging": {"progress": False}})
    if args.nproc > 1:
        from tpkernels.parallel.local_ranks import run_on_ranks

        samples = run_on_ranks(soak, args.nproc, cfg, timeout=3600)[0]
    else:
        samples = soak(0, 1, cfg)
    print_table(samples, list(samples[0]))
    half = [s for s in samples if s["step"] >= args.steps // 2]
    print(f"{args.steps} steps, every loss finite, none missing; RSS slope over the second half: "
          f"{slope(half):.2f} KiB/step (rank 0, {samples[0]['rss_mib']} -> {samples[-1]['rss_mib']} MiB)")
    print("wrote", write_csv("soak_train", samples))


if __name__ == "__main__":
    main()
