"""The planner's GEMM model against measured GEMMs, shape by shape.

    python benchmarks/planner_gemm_shapes.py                    # on a GPU: time every shape (~20 s)
    python benchmarks/planner_gemm_shapes.py --dry-run --gpu H200   # anywhere: the shapes and predictions

The shapes are the ones a training step runs: every linear GEMM (forward, input gradient, weight
gradient) of Llama-3-8B and Llama-3-70B on one TP rank at TP 1, 2, 4 and 8 and 2,048 / 8,192 tokens
per micro-batch, and squares from 256 to 16,384 (the same aspect, growing). Each is timed as
torch.matmul in bf16 (CUDA events, median) and predicted by the planner's GEMM model
(tpkernels/planner/gemm_model.py) on the preset of this GPU (H100 → H100-SXM, H200, A100 → A100-80GB;
--gpu to choose).

What is compared is the shape dependence, not the ceiling: the model's ``gemm`` constant is what
GEMMs sustain inside whole training steps (fitted on published runs, below a lone GEMM's rate:
efficiency.py), so the prediction here uses the share of the peak the largest square measured as
its ceiling and keeps every shape term (wave quantization, short k, the memory roof, the launch cost)
as shipped. Error = measured time / predicted time − 1 (+: the model is optimistic). Also reported:
whether the measured efficiency, like the model's (tests/test_planner_gemm_model.py), never drops as
a square grows.

Writes benchmarks/results/planner_gemm_shapes_<gpu>.csv and .png ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, device_label, print_table, pyplot, run_metadata, time_ms, write_csv  # noqa: E402

from tpkernels.planner import gpu_preset, model_preset  # noqa: E402
from tpkernels.planner.efficiency import CALIBRATED_ALL  # noqa: E402
from tpkernels.planner.gemm_model import achieved_efficiency, gemm_time  # noqa: E402
from tpkernels.planner.measure import preset_for_device  # noqa: E402
from tpkernels.planner.step_time import _linear_shapes  # noqa: E402

LINEARS = ("qkv", "proj", "up", "down")
SQUARES = (256, 512, 1024, 2048, 4096, 8192, 16384)


def shapes(quick: bool) -> list[dict]:
    """(m, n, k) of the step's GEMMs and the squares; ``quick``: Llama-3-8B at 8,192 tokens only."""
    out = []
    models = ("Llama-3-8B",) if quick else ("Llama-3-8B", "Llama-3-70B")
    for name in models:
        model = model_preset(name)
        for tp in (1, 2, 4, 8):
            for tokens in ((8192,) if quick else (2048, 8192)):
                for linear, (k, n) in zip(LINEARS, _linear_shapes(model, tp)):
                    k, n = int(k), int(n)
                    # y = x·W, dX = dY·Wᵀ, dW = Xᵀ·dY (gemm_model.linear_time)
                    for gemm, (mm, nn, kk) in (("fwd", (tokens, n, k)), ("dgrad", (tokens, k, n)),
                                               ("wgrad", (k, n, tokens))):
                        out.append({"case": f"{name} TP{tp} {tokens} tok {linear} {gemm}", "m": mm, "n": nn, "k": kk})
    out += [{"case": f"square {s}", "m": s, "n": s, "k": s} for s in SQUARES]
    return out


def measure(m: int, n: int, k: int, reps: int) -> float:
    """Seconds of one bf16 (m × k) · (k × n) on the GPU."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return time_ms(lambda: torch.matmul(a, b), torch.device("cuda"), reps) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default=None, help="planner preset (default: the one of this GPU)")
    ap.add_argument("--dry-run", action="store_true", help="no timing: list the shapes and the model's predictions")
    ap.add_argument("--quick", action="store_true", help="Llama-3-8B at 8,192 tokens and the squares only")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("planner_gemm_shapes.py times GEMMs on a CUDA GPU: none here (use --dry-run to list "
                         "the shapes and the model's predictions)")
    if args.gpu:
        gpu = gpu_preset(args.gpu)
    elif cuda:
        gpu = preset_for_device(torch.cuda.get_device_name())
        if gpu is None:
            raise SystemExit(f"--gpu is needed: no planner preset for {torch.cuda.get_device_name()!r}")
    else:
        gpu = gpu_preset("H100-SXM")
    rows = shapes(args.quick)
    peak = gpu.peak_tflops("bf16") * 1e12
    if cuda:
        for r in rows:
            r["measured_s"] = measure(r["m"], r["n"], r["k"], args.reps)
        big = max(SQUARES)
        ceiling = 2.0 * big ** 3 / (next(r for r in rows if r["case"] == f"square {big}")["measured_s"] * peak)
        # the model's efficiency at the largest square is ceiling × (its shape terms); solve for the ceiling
        shape_terms = achieved_efficiency(big, big, big, gpu, CALIBRATED_ALL.replace(gemm=1.0))
        eff = CALIBRATED_ALL.replace(gemm=ceiling / shape_terms)
    else:
        eff = CALIBRATED_ALL.replace(gemm=0.8)  # a lone GEMM's share (efficiency.py), until a GPU measures it
    label = device_label(torch.device("cuda")) if cuda else f"dry run, {gpu.name} preset"
    for r in rows:
        m, n, k = r["m"], r["n"], r["k"]
        r["predicted_s"] = gemm_time(m, n, k, gpu, eff)
        r["predicted_tflops"] = round(2.0 * m * n * k / r["predicted_s"] / 1e12, 1)
        if cuda:
            r["measured_tflops"] = round(2.0 * m * n * k / r["measured_s"] / 1e12, 1)
            r["error_pct"] = round(100 * (r["measured_s"] / r["predicted_s"] - 1), 1)
    cols = ["case", "m", "n", "k", "predicted_tflops"] + (["measured_tflops", "error_pct"] if cuda else [])
    print(f"{label}: planner preset {gpu.name}, lone-GEMM ceiling {eff.gemm:.3f} of {peak / 1e12:.0f} TFLOP/s")
    print_table(rows, cols)
    meta = run_metadata(torch.device("cuda" if cuda else "cpu"))
    out = [{**{c: r[c] for c in cols}, "gpu_preset": gpu.name, "ceiling": round(eff.gemm, 4), **meta} for r in rows]
    if cuda:
        errs = [abs(r["error_pct"]) for r in rows]
        worst = max(rows, key=lambda r: abs(r["error_pct"]))
        squares = [r["measured_tflops"] for r in rows if r["case"].startswith("square")]
        print(f"mean |error| {sum(errs) / len(errs):.1f}%, worst {worst['error_pct']:+.1f}% ({worst['case']}); "
              f"{sum(e <= 15 for e in errs)} of {len(errs)} within ±15%; measured efficiency never drops as a "
              f"square grows: {all(b >= 0.97 * a for a, b in zip(squares, squares[1:]))}")
    slug = "".join(c if c.isalnum() else "_" for c in (label if cuda else f"dry_{gpu.name}").lower()).strip("_")
    print("wrote", write_csv(f"planner_gemm_shapes_{slug}", out))
    plt = pyplot()
    if cuda and plt is not None:
        fig, ax = plt.subplots(figsize=(6, 5))
        xs = [r["predicted_tflops"] for r in rows]
        ys = [r["measured_tflops"] for r in rows]
        ax.scatter(xs, ys, s=12)
        top = max(xs + ys) * 1.05
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set_xlabel("planner's GEMM model, TFLOP/s")
        ax.set_ylabel("measured torch.matmul bf16, TFLOP/s")
        ax.set_title(f"GEMM model by shape on {label}")
        path = RESULTS_DIR / f"planner_gemm_shapes_{slug}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        print("wrote", path)


if __name__ == "__main__":
    main()
