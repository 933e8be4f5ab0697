"""FlashAttention benchmark: ours vs torch SDPA's flash (FA2) and cuDNN backends, side by side.

    python benchmarks/bench_attention.py [--headdims 64 128] [--seqlens 512 1024 ... 16384]
                                         [--causal both|true|false] [--modes fwd bwd fwd+bwd]
                                         [--tokens 16384] [--hidden 2048] [--device cuda|cpu]

FlashAttention's grid: batch·seqlen = 16k tokens, hidden 2048 (nheads = 2048 / headdim), bf16 on a
GPU. FLOPs = 4·batch·seqlen²·nheads·headdim for the forward, halved when causal; backward = 2.5x
the forward (FlashAttention's convention), so all providers are scored on one scale. "peak%" is
TFLOP/s over the GPU's dense bf16 peak (planner preset), "vs flash" ours over SDPA's flash backend.
On the CPU (fp32, small sizes) ours runs the reference path and SDPA its CPU kernel: ratios only.
Writes benchmarks/results/attention_<device>.csv and a PNG ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, device_slug, print_table, pyplot, run_metadata, time_ms, write_csv  # noqa: E402

import tpkernels  # noqa: E402

MODES = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(batch: int, seqlen: int, nheads: int, headdim: int, causal: bool, mode: str) -> float:
    fwd = 4.0 * batch * seqlen * seqlen * nheads * headdim / (2.0 if causal else 1.0)
    return fwd * FLOP_FACTOR[mode]


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from tpkernels.planner.hardware import GPU_PRESETS  # noqa: PLC0415
    from tpkernels.planner.measure import _same_gpu  # noqa: PLC0415

    name = torch.cuda.get_device_name(device)
    for spec in GPU_PRESETS.values():
        if _same_gpu(spec, name):
            return spec.peak_tflops_bf16
    return None


def providers(device: torch.device) -> dict:
    """name -> fn(q, k, v, causal) with FlashAttention's (b, s, h, d) layout on input and output.
    SDPA gets its native (b, h, s, d) tensors: the transposes are made once, outside the timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    ours = "ours (triton)" if device.type == "cuda" else "ours (reference)"
    p = {ours: lambda q, k, v, causal: tpkernels.flash_attn_func(q, k, v, causal=causal)}
    if device.type == "cuda":
        p["sdpa flash (FA2)"] = sdpa(SDPBackend.FLASH_ATTENTION)
        p["sdpa cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    else:
        p["sdpa (cpu)"] = sdpa([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return p


def time_provider(fn, q, k, v, causal: bool, mode: str, device, reps: int) -> float:
    """Median ms of one mode. bwd: the backward alone, from a kept forward graph."""
    if mode == "fwd":
        with torch.no_grad():
            return time_ms(lambda: fn(q, k, v, causal), device, reps)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    do = torch.randn_like(out)
    if mode == "bwd":
        return time_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device, reps)
    return time_ms(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do), device, reps)


def bench(device, headdims, seqlens, causals, modes, tokens, hidden, dtype, reps) -> list[dict]:
    meta = run_metadata(device)
    peak = peak_tflops(device)
    provs = providers(device)
    rows = []
    for headdim in headdims:
        nheads = hidden // headdim
        for seqlen in seqlens:
            batch = max(1, tokens // seqlen)
            q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype) for _ in range(3))
            native = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # (b, h, s, d) for SDPA
            for causal in causals:
                for mode in modes:
                    flops = attention_flops(batch, seqlen, nheads, headdim, causal, mode)
                    result = {}
                    for name, fn in provs.items():
                        args = (q, k, v) if name.startswith("ours") else native
                        try:
                            ms = time_provider(fn, *args, causal, mode, device, reps)
                        except RuntimeError as e:  # e.g. a backend that does not take this shape
                            print(f"  {name} skipped at d={headdim} s={seqlen}: {str(e).splitlines()[0][:100]}")
                            ms = math.nan
                        result[name] = ms
                        rows.append({**meta, "dtype": str(dtype).replace("torch.", ""), "headdim": headdim,
                                     "nheads": nheads, "batch": batch, "seqlen": seqlen, "causal": causal,
                                     "mode": mode, "provider": name, "ms": round(ms, 4),
                                     "tflops": float(f"{flops / ms / 1e9:.4g}") if ms == ms else math.nan,
                                     "peak_pct": round(100 * flops / ms / 1e9 / peak, 1) if peak and ms == ms
                                     else ""})
                    # ours row: the first peer's time over ours (> 1: ours is faster)
                    ours, peer = list(provs)[0], list(provs)[1]
                    ratio = result[peer] / result[ours]
                    for r in rows[-len(provs):]:
                        r["ratio_vs_peer"] = round(ratio, 3) if r["provider"] == ours and ratio == ratio else ""
            del q, k, v, native
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["headdim"], r["causal"], r["mode"]) for r in rows}, key=lambda t: (t[2], t[0], t[1]))
    cols = min(4, len(panels))
    nrow = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(4.2 * cols, 3.2 * nrow), squeeze=False)
    for ax, (d, causal, mode) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["headdim"], r["causal"], r["mode"]) == (d, causal, mode)]
        for name in dict.fromkeys(r["provider"] for r in sel):
            pts = [(r["seqlen"], r["tflops"]) for r in sel if r["provider"] == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, d={d}, {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"attention, {rows[0]['device']}, {rows[0]['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--tokens", type=int, help="batch·seqlen (default 16384 on a GPU, 2048 on the CPU)")
    ap.add_argument("--hidden", type=int, help="nheads·headdim (default 2048 on a GPU, 256 on the CPU)")
    ap.add_argument("--reps", type=int, default=5, help="CPU repetitions (GPU: do_bench)")
    ap.add_argument("--name", default=None, help="CSV/PNG name (default attention_<device>)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    seqlens = args.seqlens or ([512, 1024, 2048, 4096, 8192, 16384] if gpu else [128, 256, 512, 1024])
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    tokens = args.tokens or (16384 if gpu else 2048)
    hidden = args.hidden or (2048 if gpu else 256)
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = bench(device, args.headdims, seqlens, causals, args.modes, tokens, hidden, dtype, args.reps)
    print_table(rows, ["headdim", "seqlen", "causal", "mode", "provider", "ms", "tflops", "peak_pct",
                       "ratio_vs_peer"])
    print("ratio_vs_peer: the first peer's time over ours (> 1: ours is faster)")
    name = args.name or f"attention_{device_slug(device)}"
    print(f"wrote {write_csv(name, rows)}")
    plot(rows, RESULTS_DIR / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
