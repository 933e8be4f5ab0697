"""The planner against published runs, A100 and H100 side by side.

    python benchmarks/planner_calibration.py [--sweep]

A100: Narayanan et al. 2021, Table 1 (Megatron-LM, GPT 1.7B–1T on 32–3072 A100s).
H100: NVIDIA NeMo 24.12 pre-training (GPT-3, Llama 2, Nemotron on 8–512 DGX-H100 GPUs, FP8).
(tables and their sources: tpkernels/planner/data/; how each row is read: tpkernels/planner/calibration.py)

For each row: the published step time and throughput, the planner's prediction for the published
layout, the error (+ = the planner predicts a faster step than was measured), predicted memory and
bubble, and the rank of the published (TP, PP) among the planner's layouts for that model, GPU
count and batch under the source's fixed choices. --sweep also prints the worst error of each
generation as each fitted constant moves ±20%, to show how much the fit leans on each. Writes
benchmarks/results/planner_calibration.csv and .png ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, write_csv  # noqa: E402

from tpkernels.planner.calibration import (  # noqa: E402
    a100_rows,
    error,
    h100_rows,
    held_out_rows,
    predict,
    rank_of_published,
    search,
)
from tpkernels.planner.efficiency import A100_CALIBRATED, H100_CALIBRATED  # noqa: E402
from tpkernels.planner.memory import GIB  # noqa: E402

FITTED = {"A100": (A100_CALIBRATED, ("gemm", "elementwise_traffic", "p2p_latency_s", "link")),
          "H100": (H100_CALIBRATED, ("gemm_fp8", "attention", "elementwise_traffic", "tp_overlap"))}


def rows_of(gen: str):
    return a100_rows() if gen == "A100" else h100_rows()


def report_row(gen: str, r, with_rank: bool = True) -> dict:
    est = predict(r)
    rank = best = None
    if with_rank:
        p = search(r)
        rank, best = rank_of_published(r, p), p.ranked[0] if p.ranked else None
    published_tps = r.training.tokens / r.published_step_s / r.gpus
    return {
        "gpu": gen, "model": r.model, "gpus": r.gpus, "layout": r.layout(),
        "precision": r.training.precision, "schedule": est.time.schedule,
        "published_step_s": round(r.published_step_s, 3), "predicted_step_s": round(est.step_time, 3),
        "published_tokens_per_gpu": round(published_tps), "predicted_tokens_per_gpu":
            round(r.training.tokens / est.step_time / r.gpus),
        "error_pct": round(100 * error(r), 1),
        "memory_gib": round(est.memory.total / GIB, 1), "fits": est.fits,
        "bubble_pct": round(100 * est.bubble_fraction, 1),
        "dp_exposed_pct": round(100 * est.time.dp_exposed / est.step_time, 1),
        "published_rank": rank, "planner_best": best.config.short() if best else None,
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = [report_row(gen, r) for gen in ("A100", "H100") for r in rows_of(gen)]
    print_table(rows, ["gpu", "model", "gpus", "layout", "precision", "published_tokens_per_gpu",
                       "predicted_tokens_per_gpu", "error_pct", "memory_gib", "bubble_pct", "dp_exposed_pct",
                       "published_rank", "planner_best"])
    for gen in ("A100", "H100"):
        errs = [abs(r["error_pct"]) for r in rows if r["gpu"] == gen]
        print(f"{gen}: worst error {max(errs):.1f}%, mean |error| {sum(errs) / len(errs):.1f}% over {len(errs)} rows "
              f"(target ±10%); constants {FITTED[gen][0]}")
    held = [{**report_row("H100", r), "held_out": True} for r in held_out_rows()]
    print("\nheld out of the fit (the constants predate these rows): NeMo's CP2 rows, Megatron-Bridge 25.11, "
          "torchtitan (bf16 eager / FP8 compiled, H100 at 500 W)")
    print_table(held, ["gpu", "model", "gpus", "layout", "precision", "published_tokens_per_gpu", "predicted_tokens_per_gpu",
                       "error_pct", "memory_gib", "published_rank", "planner_best"])
    rows = [{**r, "held_out": False} for r in rows] + held
    path = write_csv("planner_calibration", rows)
    print(f"wrote {path}")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
        for ax, gen in zip(axes, ("A100", "H100")):
            sub = [r for r in rows if r["gpu"] == gen and not r["held_out"]]
            x = range(len(sub))
            ax.bar([i - 0.2 for i in x], [r["published_tokens_per_gpu"] for r in sub], 0.4, label="published")
            ax.bar([i + 0.2 for i in x], [r["predicted_tokens_per_gpu"] for r in sub], 0.4, label="tpkernels plan")
            for i, r in zip(x, sub):
                ax.annotate(f"{r['error_pct']:+.0f}%", (i, max(r["published_tokens_per_gpu"],
                                                                r["predicted_tokens_per_gpu"])),
                            ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(x), [r["model"] for r in sub], rotation=45, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("tokens/s per GPU")
            ax.set_title({"A100": "A100: Narayanan et al. 2021, Table 1",
                          "H100": "H100: NeMo 24.12 pre-training (FP8)"}[gen])
            ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "planner_calibration.png", dpi=120)
    except ImportError:
        pass
    if args.sweep:
        print("\nworst error when one fitted constant moves (others fixed):")
        for gen, (eff, names) in FITTED.items():
            for name in names:
                base = getattr(eff, name)
                cells = []
                for f in (-0.2, -0.1, 0.1, 0.2):
                    moved = eff.replace(**{name: base * (1 + f)})
                    cells.append(f"{f:+.0%}: {100 * max(abs(error(r, moved)) for r in rows_of(gen)):.1f}%")
                print(f"  {gen} {name:20} " + "  ".join(cells))


if __name__ == "__main__":
    main()
