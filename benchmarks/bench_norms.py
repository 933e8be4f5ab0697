"""LayerNorm (GPT-2) vs eager PyTorch vs torch.compile, forward and forward+backward, at GPT-2 widths.

    python benchmarks/bench_norms.py [--rows 4096] [--hidden 768 1600] [--device cpu|cuda] [--reps N] [--threads T]

Cases per hidden size: ``layer_norm`` alone (eager: ``F.layer_norm``, ATen's fused kernel) and
``layer_norm + residual`` as a GPT-2 block runs it (eager: ``h = x + residual`` then ``F.layer_norm``;
ours: one fused pass each way). "torch.compile" compiles the same eager function. Weight and bias
always (GPT-2's ln_1 / ln_2 / ln_f). fp32 on the CPU, bf16 on a GPU. "GB/s" counts the bytes each
op must move (its floor: what the fused kernel reads and writes once; forward 2b per element, 4b with
the residual; backward 3b, 4b with the residual stream's gradient), for every variant, so the column
compares times on one scale; "copy%" is that over the copy bandwidth measured in the same run. All
variants run side by side in one process, same shapes, same inputs; on the CPU their calls are
interleaved (one call of each per round, the median of --reps rounds). Writes
benchmarks/results/norms_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, device_slug, print_table, run_metadata, time_ms, write_csv  # noqa: E402

import tpkernels  # noqa: E402

EPS = 1e-5  # GPT-2's layer_norm_epsilon


def ln_eager(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def ln_res_eager(x, w, b, res):
    h = x + res
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h


def ln_ours(x, w, b):
    return tpkernels.layer_norm(x, w, b, EPS)


def ln_res_ours(x, w, b, res):
    return tpkernels.layer_norm(x, w, b, EPS, residual=res)


def cases(device, dtype, rows, hidden):
    """name -> (floor bytes fwd, floor bytes fwd+bwd, {variant: (fwd fn, fwd+bwd fn)})."""
    el = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    res, dy, dh = torch.randn_like(x), torch.randn_like(x), torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    b = (0.1 * torch.randn(hidden, device=device)).to(dtype)

    def fb_plain(fn):
        def run():
            xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
            fn(xs, ws, bs).backward(dy)
        return run

    def fb_res(fn):
        def run():
            xs, ws, bs, rs = (t.detach().requires_grad_() for t in (x, w, b, res))
            torch.autograd.backward(list(fn(xs, ws, bs, rs)), [dy, dh])
        return run

    out = {}
    comp = torch.compile(ln_eager)
    out[f"layer_norm {rows}x{hidden}"] = (2 * el * x.numel(), 5 * el * x.numel(), {
        "ours": (lambda: ln_ours(x, w, b), fb_plain(ln_ours)),
        "eager (F.layer_norm)": (lambda: ln_eager(x, w, b), fb_plain(ln_eager)),
        "torch.compile": (lambda: comp(x, w, b), fb_plain(comp))})
    comp_res = torch.compile(ln_res_eager)
    out[f"layer_norm + residual {rows}x{hidden}"] = (4 * el * x.numel(), 8 * el * x.numel(), {
        "ours": (lambda: ln_res_ours(x, w, b, res), fb_res(ln_res_ours)),
        "eager (add + F.layer_norm)": (lambda: ln_res_eager(x, w, b, res), fb_res(ln_res_eager)),
        "torch.compile": (lambda: comp_res(x, w, b, res), fb_res(comp_res))})
    return out


def _interleaved_ms(fns: dict, reps: int, warmup: int = 3) -> dict:
    """CPU: median wall time (ms) of each of ``fns`` (key -> (fn, grad enabled)), their calls interleaved
    (one call of each per round), so a slow phase of a shared machine falls on every variant alike."""
    for fn, grad in fns.values():
        with torch.set_grad_enabled(grad):
            for _ in range(warmup):
                fn()
    times: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, (fn, grad) in fns.items():
            with torch.set_grad_enabled(grad):
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench(device: torch.device, rows: int, hiddens: list[int], reps: int) -> tuple[list[dict], float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = run_metadata(device)
    copy = copy_bandwidth_gbs(rows * max(hiddens), dtype, device, reps)  # the CPU's: per case, below
    out = []
    for hidden in hiddens:
        for name, (fwd_bytes, fb_bytes, variants) in cases(device, dtype, rows, hidden).items():
            runs = {(v, mode): (fn, mode != "forward") for v, (fwd, fb) in variants.items()
                    for mode, fn in (("forward", fwd), ("forward+backward", fb))}
            if device.type == "cpu":  # the copy bandwidth interleaved too: the same phases of the machine
                src = torch.randn(rows, hidden, dtype=dtype)
                dst = torch.empty_like(src)
                times = _interleaved_ms({**runs, "copy": (lambda: dst.copy_(src), False)}, reps)
                copy = 2 * src.numel() * src.element_size() / times.pop("copy") / 1e6
            else:
                times = {}
                for key, (fn, grad) in runs.items():
                    with torch.set_grad_enabled(grad):
                        times[key] = time_ms(fn, device, reps)
            rows_here = []
            for variant in variants:
                for mode, nbytes in (("forward", fwd_bytes), ("forward+backward", fb_bytes)):
                    ms = times[(variant, mode)]
                    gbs = nbytes / ms / 1e6
                    rows_here.append({**meta, "op": name, "mode": mode, "variant": variant, "ms": round(ms, 3),
                                      "GBps": round(gbs, 1), "copy_pct": round(100 * gbs / copy, 1),
                                      "copy_GBps": round(copy, 1)})
            for r in rows_here:
                ours = next(x["ms"] for x in rows_here if x["mode"] == r["mode"] and x["variant"] == "ours")
                r["ours_speedup"] = round(r["ms"] / ours, 2)
            out += rows_here
    return out, copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=None, help="tokens (default 8192 on a GPU, 4096 on the CPU)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[768, 1600], help="GPT-2 small and XL by default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: torch's). On a shared machine whose other core is busy, 2-thread "
                         "timings round up to the scheduler's 4 ms ticks: --threads 1 measures the kernels")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = args.rows or (8192 if device.type == "cuda" else 4096)
    table, copy = bench(device, rows, args.hidden, args.reps)
    where = "per case, interleaved" if device.type == "cpu" else f"{copy:.1f} GB/s"
    print(f"{table[0]['device']}, {rows} rows, copy bandwidth {where}")
    print_table(table, ["op", "mode", "variant", "ms", "GBps", "copy_pct", "copy_GBps", "ours_speedup"])
    suffix = f"_{args.threads}t" if args.threads and device.type == "cpu" else ""
    print(f"wrote {write_csv(f'norms_{device_slug(device)}{suffix}', table)}")


if __name__ == "__main__":
    main()
