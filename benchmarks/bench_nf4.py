"""nf4_linear vs dequantise-then-matmul vs the unquantised GEMM, at Llama projection shapes.

    python benchmarks/bench_nf4.py [--device cpu|cuda] [--tokens M ...] [--reps N] [--threads T]

Per shape (M tokens, N out, K in) and pass (forward y = x·Wᵀ; input gradient dx = dy·W):
  * ``nf4`` ours: the CPU's C++ path (panels of the NF4 weight dequantised into a small buffer, then
    the ATen GEMM) or the GPU's Triton GEMM (dequantised in registers);
  * ``dequant+mm``: what a user would otherwise write (and our reference backend does): dequantise
    the whole weight (``tpkernels.quant.dequantize_nf4``, the bitsandbytes values) then matmul;
  * ``dense``: the plain GEMM on an unquantised weight of the activation dtype (fp32 on the CPU,
    bf16 cuBLAS on a GPU): the floor the dequantisation should approach.
Ratios are ``time / dense``. On the GPU, TFLOP/s count 2·M·N·K, and GB/s the bytes each pass must
move (activations once + the 0.516 B/param NF4 weight; the dense GEMM: a 2 B/param weight), the
Triton timings use ``triton.testing.do_bench`` (median). Writes benchmarks/results/nf4_<device>.csv
($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, print_table, run_metadata, time_ms, write_csv  # noqa: E402

import tpkernels  # noqa: E402
from tpkernels.functional.nf4_linear import nf4_linear_bwd, nf4_linear_bytes, nf4_linear_fwd  # noqa: E402
from tpkernels.quant import dequantize_nf4, nf4_bytes_per_param, quantize_nf4  # noqa: E402

# Llama-2-7B / Llama-3-8B projections (N, K): q/o (4096, 4096), fused gate+up (2·11008, 4096), down (4096, 11008)
SHAPES = {"q_proj 4096x4096": (4096, 4096), "gate_up 22016x4096": (22016, 4096), "down 4096x11008": (4096, 11008)}


def bench(device: torch.device, tokens: list[int], reps: int, shapes: dict) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "cpp"
    meta = run_metadata(device)
    rows = []
    for name, (n, k) in shapes.items():
        w = (0.02 * torch.randn(n, k, device=device)).to(dtype)
        q = quantize_nf4(w)
        parts = (q.packed, q.absmax_q, q.absmax_scale, q.absmax_offset)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            dy = torch.randn(m, n, device=device, dtype=dtype)
            runs = {
                ("forward", "nf4"): lambda: nf4_linear_fwd(x, *parts, n, backend=backend),
                ("forward", "dequant+mm"): lambda: x @ dequantize_nf4(q, dtype).T,
                ("forward", "dense"): lambda: x @ w.T,
                ("input grad", "nf4"): lambda: nf4_linear_bwd(dy, *parts, k, backend=backend),
                ("input grad", "dequant+mm"): lambda: dy @ dequantize_nf4(q, dtype),
                ("input grad", "dense"): lambda: dy @ w,
            }
            times = {key: time_ms(fn, device, reps) for key, fn in runs.items()}
            flops = 2 * m * n * k
            for (pas, variant), ms in times.items():
                el = x.element_size()
                moved = nf4_linear_bytes(m, n, k, el) if variant != "dense" else el * (m * k + m * n + n * k)
                rows.append({**meta, "shape": name, "M": m, "N": n, "K": k, "pass": pas, "variant": variant,
                             "ms": round(ms, 3), "vs_dense": round(ms / times[(pas, "dense")], 2),
                             "TFLOP/s": round(flops / ms / 1e9, 2), "GB/s": round(moved / ms / 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="M values (default: 1 16 256 on the CPU; 16 2048 8192 on a GPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="one small shape (1024x1024), for a quick check")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or ([1, 16, 256] if device.type == "cpu" else [16, 2048, 8192])
    shapes = {"1024x1024": (1024, 1024)} if args.small else SHAPES
    rows = bench(device, tokens, args.reps, shapes)
    print(f"nf4_linear on {rows[0]['device']} ({tpkernels.__name__}; NF4 = {nf4_bytes_per_param():.4f} B/param)")
    print_table(rows, ["shape", "M", "pass", "variant", "ms", "vs_dense", "TFLOP/s", "GB/s"])
    print("wrote", write_csv(f"nf4_{device_slug(device)}", rows))


if __name__ == "__main__":
    main()
