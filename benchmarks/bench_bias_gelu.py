"""Fused bias+GeLU vs PyTorch eager vs torch.compile, forward and forward+backward.

    python benchmarks/bench_bias_gelu.py [--sizes 1 16 64] [--device cpu|cuda] [--reps N]

Sizes are millions of elements of x, laid out (rows, 4096) like an MLP's hidden activation.
fp32 on the CPU; bf16 and fp32 on a GPU. Every variant runs in the same process on the same
inputs. "GB/s" counts the bytes the fused kernel must move (its floor), for every variant, so
the column compares time on one scale: forward reads x and writes y (2 tensors), forward+
backward adds reading grad and x and writing grad_x (5 tensors in all). "copy%" is that over
the copy bandwidth measured in this run (read + write of a tensor of the same size).
Writes benchmarks/results/bias_gelu_<device>.csv and a PNG plot ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS_DIR, copy_bandwidth_gbs, device_slug, print_table, pyplot, run_metadata,  # noqa: E402
                    time_ms, write_csv)

import tpkernels  # noqa: E402
from tpkernels import backends  # noqa: E402

COLS = 4096


def eager(x, b):
    return F.gelu(x + b)


def variants(device: torch.device) -> dict:
    compiled = torch.compile(eager)
    v = {"eager": eager, "torch.compile": compiled}
    if device.type == "cuda":
        for name in ("cuda", "triton"):
            if backends.why_not(name, "bias_gelu", device) is None:
                v[f"ours ({name})"] = functools.partial(tpkernels.bias_gelu, backend=name)
    else:
        v[f"ours ({backends.select('bias_gelu', device)})"] = tpkernels.bias_gelu
    return v


def bench(device: torch.device, sizes_m: list[int], dtypes: list[torch.dtype], reps: int) -> list[dict]:
    meta = run_metadata(device)
    rows = []
    for dtype in dtypes:
        for size_m in sizes_m:
            numel = size_m * (1 << 20)
            n_rows = numel // COLS
            copy_gbs = copy_bandwidth_gbs(numel, dtype, device, reps)
            x = torch.randn(n_rows, COLS, device=device).to(dtype)
            b = torch.randn(COLS, device=device).to(dtype)
            g = torch.randn(n_rows, COLS, device=device).to(dtype)
            xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
            elem = x.element_size()
            for name, fn in variants(device).items():
                def fwd():
                    with torch.no_grad():
                        return fn(x, b)

                def fwd_bwd():
                    xg.grad = bg.grad = None
                    fn(xg, bg).backward(g)

                for mode, call, tensors in (("forward", fwd, 2), ("forward+backward", fwd_bwd, 5)):
                    ms = time_ms(call, device, reps)
                    gbs = tensors * numel * elem / ms / 1e6
                    rows.append({**meta, "dtype": str(dtype).replace("torch.", ""), "elements_M": size_m,
                                 "mode": mode, "variant": name, "ms": round(ms, 3), "GB/s": round(gbs, 1),
                                 "copy_GB/s": round(copy_gbs, 1), "copy%": round(100 * gbs / copy_gbs, 1)})
            del x, g, xg, bg
    # Speed-up of ours over eager and compile, per (dtype, size, mode).
    for r in rows:
        same = [o for o in rows if (o["dtype"], o["elements_M"], o["mode"]) == (r["dtype"], r["elements_M"], r["mode"])]
        ref = {o["variant"]: o["ms"] for o in same}
        r["vs_eager"] = round(ref["eager"] / r["ms"], 2)
        r["vs_compile"] = round(ref["torch.compile"] / r["ms"], 2)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    keys = sorted({(r["dtype"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (dtype, mode) in zip(axes[0], keys):
        sel = [r for r in rows if (r["dtype"], r["mode"]) == (dtype, mode)]
        names = list(dict.fromkeys(r["variant"] for r in sel))
        sizes = sorted({r["elements_M"] for r in sel})
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = [next(r["GB/s"] for r in sel if r["variant"] == name and r["elements_M"] == s) for s in sizes]
            ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=name)
        ax.axhline(sel[0]["copy_GB/s"], color="k", ls="--", lw=1, label="copy bandwidth")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s}M" for s in sizes])
        ax.set_title(f"bias+GeLU {mode}, {dtype}")
        ax.set_ylabel("effective GB/s (fused floor bytes / time)")
        ax.legend(fontsize=7)
    fig.suptitle(rows[0]["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="millions of elements")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (CPU; default by size)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtypes = [torch.bfloat16, torch.float32] if device.type == "cuda" else [torch.float32]
    reps = args.reps or (7 if max(args.sizes) <= 16 else 5)
    rows = bench(device, args.sizes, dtypes, reps)
    print(f"\nbias+GeLU on {rows[0]['device']} (torch {rows[0]['torch']}, triton {rows[0]['triton']}), "
          f"x: (rows, {COLS})")
    print_table(rows, ["dtype", "elements_M", "mode", "variant", "ms", "GB/s", "copy%", "vs_eager", "vs_compile"])
    name = f"bias_gelu_{device_slug(device)}"
    print(f"wrote {write_csv(name, rows)}")
    plot(rows, RESULTS_DIR / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
