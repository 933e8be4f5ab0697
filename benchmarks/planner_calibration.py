"""Leave-one-source-out calibration of the planner against published training runs.

    python benchmarks/planner_calibration.py [--sources a,b] [--data benchmarks/data]
    python benchmarks/planner_calibration.py --held-out     # only the rows no fit ever sees

The tables are in benchmarks/data/ (one CSV per source, provenance in each header and in
sources.md; how a row becomes a planner question: tpkernels/planner/calibration.py). For each source
in turn, the shared constants (calibration.FITTED: the GEMM ceilings in bf16/fp16 and FP8, the
attention core's share of the peak, the memory-bound kernels' bytes per stored activation byte) are
fitted on all the other sources, and the held-out source's rows are predicted with them: the error
of every row (+ = the planner predicts a faster step than was measured), the mean |error| and the
worst per source and per GPU generation. A last fit on all sources gives the constants the package
ships (efficiency.CALIBRATED), whose in-sample errors are listed too, apart. The rows in
benchmarks/data/held_out/ (the mixture-of-experts runs) are in no fit: they are predicted with the
shipped constants and listed last, with what their step time is made of.

Writes benchmarks/results/planner_calibration.csv (one line per row and fit), .png and
planner_calibration_held_out.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, write_csv  # noqa: E402

from tpkernels.planner.calibration import FITTED, error, fit_constants, held_out_rows, predict, sources  # noqa: E402
from tpkernels.planner.efficiency import CALIBRATED_ALL  # noqa: E402


def report(rows, eff, fit: str) -> list[dict]:
    out = []
    for r in rows:
        est = predict(r, eff)
        out.append({"fit": fit, "source": r.source, "generation": r.generation, "gpu": r.gpu, "row": r.label,
                    "layout": r.layout(), "precision": r.training.precision, "recompute": r.config.recompute,
                    "published_step_s": round(r.published_step_s, 4), "predicted_step_s": round(est.step_time, 4),
                    "error_pct": round(100 * error(r, eff), 1),
                    "tp_exposed_pct": round(100 * est.time.tp_exposed / est.step_time, 1),
                    "bubble_pct": round(100 * est.bubble_fraction, 1),
                    "date": datetime.date.today().isoformat()})
    return out


def held_out_report(rows) -> list[dict]:
    """The rows no fit sees, predicted with the shipped constants, and what their step is made of."""
    out = report(rows, CALIBRATED_ALL, "held out of every fit (shipped constants)")
    for line, r in zip(out, rows):
        t = predict(r, CALIBRATED_ALL).time
        line.update({f"{k}_pct": round(100 * getattr(t, k) / t.total, 1)
                     for k in ("gemm", "elementwise", "ep_exposed", "bubble", "dp_exposed")})
    return out


def summary(lines: list[dict], key: str) -> list[dict]:
    out = []
    for k in sorted({x[key] for x in lines}):
        errs = [abs(x["error_pct"]) for x in lines if x[key] == k]
        worst = max((x for x in lines if x[key] == k), key=lambda x: abs(x["error_pct"]))
        out.append({key: k, "rows": len(errs), "mean_abs_error_pct": round(sum(errs) / len(errs), 1),
                    "worst_error_pct": worst["error_pct"], "worst_row": worst["row"],
                    "within_15pct": sum(e <= 15 for e in errs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="", help="comma-separated source names to hold out (default: each)")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data", help="folder of the tables (default: benchmarks/data)")
    ap.add_argument("--held-out", action="store_true", help="only predict the rows held out of every fit "
                                                           "(benchmarks/data/held_out/)")
    args = ap.parse_args()
    if not args.data.is_dir():
        raise SystemExit(f"--data ({args.data}) must be a folder of calibration tables (*.csv)")
    held_rows = held_out_report(held_out_rows(args.data))
    held_cols = ["row", "layout", "precision", "published_step_s", "predicted_step_s", "error_pct", "gemm_pct",
                 "elementwise_pct", "ep_exposed_pct", "bubble_pct", "dp_exposed_pct"]
    if args.held_out:
        print("rows held out of every fit (benchmarks/data/held_out), predicted with the shipped constants:")
        print_table(held_rows, held_cols)
        print(f"mean |error| {sum(abs(x['error_pct']) for x in held_rows) / max(1, len(held_rows)):.1f}%")
        path = write_csv("planner_calibration_held_out", held_rows)
        print(f"wrote {path}")
        return
    by_source = sources(args.data)
    held = [s for s in args.sources.split(",") if s] or list(by_source)
    unknown = [s for s in held if s not in by_source]
    if unknown:
        raise SystemExit(f"--sources: {unknown} not among {sorted(by_source)}")
    lines, fits = [], []
    for name in held:
        train = [rows for other, rows in by_source.items() if other != name]
        eff = fit_constants(train, CALIBRATED_ALL)
        fits.append({"held_out": name, **{c: round(getattr(eff, c), 3) for c in FITTED}})
        lines += report(by_source[name], eff, f"without {name}")
    print("constants fitted without each source:")
    print_table(fits, ["held_out", *FITTED])
    print("\nheld-out rows (each predicted by the fit on the other sources):")
    print_table(lines, ["source", "gpu", "row", "layout", "precision", "recompute", "published_step_s",
                        "predicted_step_s", "error_pct", "tp_exposed_pct", "bubble_pct"])
    print("\nper held-out source:")
    print_table(summary(lines, "source"), ["source", "rows", "mean_abs_error_pct", "worst_error_pct",
                                           "within_15pct", "worst_row"])
    print("\nper GPU generation (held-out rows):")
    print_table(summary(lines, "generation"), ["generation", "rows", "mean_abs_error_pct", "worst_error_pct",
                                               "within_15pct", "worst_row"])
    everything = [r for rows in by_source.values() for r in rows]
    shipped = report(everything, CALIBRATED_ALL, "all sources (shipped constants, in-sample)")
    print(f"\nshipped constants (efficiency.CALIBRATED_ALL), in-sample: "
          + ", ".join(f"{c} {getattr(CALIBRATED_ALL, c):g}" for c in FITTED))
    print_table(summary(shipped, "source"), ["source", "rows", "mean_abs_error_pct", "worst_error_pct",
                                             "within_15pct", "worst_row"])
    if held_rows:
        print("\nrows held out of every fit (benchmarks/data/held_out), predicted with the shipped constants:")
        print_table(held_rows, held_cols)
        print(f"wrote {write_csv('planner_calibration_held_out', held_rows)}")
    path = write_csv("planner_calibration", lines + shipped)
    print(f"wrote {path}")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: CSV only")
        return
    names = sorted({x["source"] for x in lines})
    fig, ax = plt.subplots(figsize=(max(8, 0.25 * len(lines)), 4.5))
    x = 0
    for i, name in enumerate(names):
        sub = [r for r in lines if r["source"] == name]
        ax.bar(range(x, x + len(sub)), [r["error_pct"] for r in sub], color=f"C{i}", label=name)
        x += len(sub) + 1
    ax.axhspan(-15, 15, color="0.9", zorder=0)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_ylabel("held-out error, % (+ = predicted faster)")
    ax.set_xticks([])
    ax.set_title("tpkernels plan, leave-one-source-out (grey: ±15%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = (Path(path).parent if path else RESULTS_DIR) / "planner_calibration.png"
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
