"""GEMM + tensor-parallel communication, bf16: the fused kernels (algo="fused") against the ring,
NCCL + cuBLAS (algo="collective") and torch's symmetric-memory fused ops, at Flux's shapes and
Llama-3-70B's TP=8 shapes.

    python benchmarks/bench_gemm_comm.py [--mode auto|virtual|real] [--tp 8] [--shapes flux llama70b]

virtual (one GPU): --tp ranks emulated on one GPU by tpkernels.functional.virtual_tp, every rank's
  kernels at once, so the GPU does tp ranks' work. Columns: the fused op; the same Triton GEMMs
  with their signals already set and nothing moving ("lone", the GEMM-efficiency yardstick);
  cuBLAS for the same GEMMs; the emulated traffic alone (device-to-device copies, or the fp32
  reduction, of what NVLink would carry) and cuBLAS after it ("serial"). "lost" = fused / lone − 1
  (target: within 10% while moving the traffic); "hidden" = share of the traffic's time the fused
  op hid behind its GEMMs.
real (≥ 2 GPUs, NCCL + symmetric memory, one process per GPU): fused (and its other movers: the
  copy kernel, push reduce-scatter, the CUDA reducer), ring and collective, and
  torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter. Target at Flux's
  shapes on 8 NVLink GPUs: fused ≥ 1.3× collective and faster than torch's symm_mem ops.

Needs a GPU: the CPU has no symmetric memory and the interpreter's timings mean nothing (the CPU
checks of these kernels are tests: tests/test_gemm_comm_fused.py). Writes
benchmarks/results/gemm_comm_<mode>_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, device_slug, print_table, pyplot, run_metadata, time_ms, write_csv  # noqa: E402

# (name, op, rows M of the full GEMM, K, N) with the TP split applied by the script:
#   ag: A (M/tp, K) per rank gathered, B (K, N/tp);  rs: A (M, K/tp), B (K/tp, N), rows scattered;
#   ar: A (M, K/tp), B (K/tp, N), all-reduced (the row-parallel layer without SP)
SHAPES = {
    "flux": [("flux AG+GEMM", "ag", 4096, 12288, 49152), ("flux GEMM+RS", "rs", 4096, 49152, 12288)],
    "llama70b": [("70B qkv AG", "ag", 8192, 8192, 10240), ("70B gate_up AG", "ag", 8192, 8192, 57344),
                 ("70B o_proj RS", "rs", 8192, 8192, 8192), ("70B down RS", "rs", 8192, 28672, 8192),
                 ("70B down AR M=256", "ar", 256, 28672, 8192), ("70B down AR M=8192", "ar", 8192, 28672, 8192)],
}


def _rank_shapes(op, M, K, N, tp):
    if op == "ag":
        return M // tp, K, N // tp
    return M, K // tp, N


def _virtual_rows(args):
    from tpkernels.functional.gemm_comm_fused import kernel_config
    from tpkernels.functional.virtual_tp import VirtualTP
    from tpkernels.kernels.triton.ag_matmul import ag_matmul, rows_per_chunk
    from tpkernels.kernels.triton.matmul_signal import matmul_signal, tiles

    dev, tp, dtype = torch.device("cuda"), args.tp, torch.bfloat16
    vtp = VirtualTP(tp, dev, copy=args.copy, reducer=args.reducer, rs_mode=args.rs_mode)
    cfg = kernel_config(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for shape in args.shapes:
        for name, op, M, K, N in SHAPES[shape]:
            m, k, n = _rank_shapes(op, M, K, N, tp)
            flops = 2.0 * (tp * m if op == "ag" else m) * k * n * tp  # all emulated ranks
            b = torch.randn(k, n, device=dev, dtype=dtype) / k ** 0.5
            if op == "ag":
                shards = [torch.randn(m, k, device=dev, dtype=dtype) for _ in range(tp)]
                full = torch.cat(shards)
                outs = [torch.empty(tp * m, n, device=dev, dtype=dtype) for _ in range(tp)]
                sig = torch.ones(tp * 4, dtype=torch.int32, device=dev)
                err = torch.zeros(1, dtype=torch.int32, device=dev)
                cr = rows_per_chunk(m, 4, cfg[0])
                fused = lambda: vtp.all_gather_matmul(shards, [b], return_a=False)  # noqa: E731
                lone = lambda: [ag_matmul(full, b, o, sig, err, epoch=1, max_spins=1, m=m, rank=r, world=tp,  # noqa: E731
                                          chunks=4, chunk_rows=cr, config=cfg, programs=sms)
                                for r, o in enumerate(outs)]
                cublas = lambda: [torch.matmul(full, b, out=o) for o in outs]  # noqa: E731
                bufs = [torch.empty_like(full) for _ in range(tp)]
                traffic = lambda: [bufs[r][s * m:(s + 1) * m].copy_(shards[s])  # noqa: E731
                                   for r in range(tp) for s in range(tp) if s != r]
                moved = (tp - 1) * m * k * 2
            else:
                a = [torch.randn(m, k, device=dev, dtype=dtype) for _ in range(tp)]
                parts = [torch.empty(m, n, device=dev, dtype=torch.float32) for _ in range(tp)]
                tm, tn = tiles(m // tp if op == "rs" else m, n, cfg)
                sigs = [torch.zeros(tp * tm * tn, dtype=torch.int32, device=dev) for _ in range(tp)]
                groups = tp if op == "rs" else 1
                fused = ((lambda: vtp.matmul_reduce_scatter(a, b)) if op == "rs"  # noqa: E731
                         else (lambda: vtp.matmul_all_reduce(a, b)))
                lone = lambda: [matmul_signal(a[r], b, parts[r], sigs[r], epoch=1, m=m // groups, groups=groups,  # noqa: E731
                                              first_group=0, config=cfg, programs=sms) for r in range(tp)]
                cublas = lambda: [torch.matmul(a[r], b) for r in range(tp)]  # noqa: E731
                share = m // tp if op == "rs" else m
                traffic = lambda: [torch.stack([p[r * share % m:r * share % m + share] for p in parts]).sum(0)  # noqa: E731
                                   for r in range(tp)]
                moved = (tp - 1) * share * n * 4
            t = {key: time_ms(fn, dev, reps=args.reps) for key, fn in
                 (("fused", fused), ("lone", lone), ("cublas", cublas), ("traffic", traffic))}
            serial = t["traffic"] + t["cublas"]
            hidden = max(0.0, min(1.0, (t["lone"] + t["traffic"] - t["fused"]) / t["traffic"]))
            rows.append({"shape": name, "op": op, "tp": tp, "m": m, "k": k, "n": n,
                         "fused_ms": round(t["fused"], 3), "lone_gemm_ms": round(t["lone"], 3),
                         "cublas_ms": round(t["cublas"], 3), "traffic_ms": round(t["traffic"], 3),
                         "serial_ms": round(serial, 3), "lost": f"{t['fused'] / t['lone'] - 1:+.1%}",
                         "hidden": f"{hidden:.0%}", "fused_tflops": round(flops / t["fused"] / 1e9, 1),
                         "lone_tflops": round(flops / t["lone"] / 1e9, 1),
                         "cublas_tflops": round(flops / t["cublas"] / 1e9, 1),
                         "traffic_gb": round(tp * moved / 1e9, 3)})
            print_table(rows[-1:], list(rows[-1]))
    return rows


def _real_rank(rank, world, shapes, reps):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory  # noqa: F401 (registers torch.ops.symm_mem)

    from tpkernels._extension import extension
    from tpkernels.functional.gemm_comm import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
    from tpkernels.functional.gemm_comm_fused import FusedOptions

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    symm_ok = hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")
    rows = []
    for shape in shapes:
        for name, op, M, K, N in SHAPES[shape]:
            m, k, n = _rank_shapes(op, M, K, N, world)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) / k ** 0.5
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            fns = {}

            def call(algo, opts=None):
                if op == "ag":
                    return lambda: all_gather_matmul(a, [b], algo=algo, return_a=False, options=opts)
                if op == "rs":
                    return lambda: matmul_reduce_scatter(a, b, algo=algo, options=opts)
                return lambda: matmul_all_reduce(a, b, algo=algo, options=opts)

            # the fused path with each of its movers (explicit options: the call's own settings)
            has_cuda_movers = hasattr(extension(), "comm_pull_chunks")
            fns["fused"] = call("fused")
            if op == "rs":
                fns["fused_push"] = call("fused", FusedOptions(rs_mode="push"))
            if op == "ag" and has_cuda_movers:
                fns["fused_copy_kernel"] = call("fused", FusedOptions(copy="kernel"))
            if op in ("rs", "ar") and has_cuda_movers:
                fns["fused_cuda_reducer"] = call("fused", FusedOptions(reducer="cuda"))
            for algo in ("ring", "collective"):
                if not (op == "ar" and algo == "ring"):
                    fns[algo] = call(algo)
            if symm_ok and op == "ag":
                fns["torch_symm_mem"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group.group_name)
            elif symm_ok and op == "rs":
                fns["torch_symm_mem"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0,
                                                                                               group.group_name)
            t = {}
            for key, fn in fns.items():
                dist.barrier()
                t[key] = time_ms(fn, dev, reps=reps)
            row = {"shape": name, "op": op, "tp": world, "m": m, "k": k, "n": n}
            row.update({f"{key}_ms": round(v, 3) for key, v in t.items()})
            best = min((v, k) for k, v in t.items() if k.startswith("fused"))
            row["best_fused"] = best[1]
            row["fused_vs_collective"] = f"{t['collective'] / best[0]:.2f}x"
            if "torch_symm_mem" in t:
                row["fused_vs_torch"] = f"{t['torch_symm_mem'] / best[0]:.2f}x"
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["auto", "virtual", "real"], default="auto")
    ap.add_argument("--tp", type=int, default=8, help="emulated ranks (virtual mode)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--copy", choices=["engine", "kernel"], default="engine", help="all-gather mover (virtual)")
    ap.add_argument("--reducer", choices=["triton", "cuda"], default="triton", help="reduce kernel (virtual)")
    ap.add_argument("--rs-mode", choices=["pull", "push"], default="pull",
                    help="reduce-scatter partials: kept local and pulled, or pushed by the epilogue (virtual)")
    ap.add_argument("--tag", default="", help="suffix of the CSV name (several runs with different movers)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_comm needs a GPU (symmetric memory, concurrent kernels); the CPU checks of these kernels "
              "are tests/test_gemm_comm_fused.py")
        return 2
    mode = args.mode if args.mode != "auto" else ("real" if torch.cuda.device_count() >= 2 else "virtual")
    dev = torch.device("cuda")
    if mode == "virtual":
        rows = _virtual_rows(args)
    else:
        from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: PLC0415

        rows = run_on_ranks(_real_rank, torch.cuda.device_count(), args.shapes, args.reps, backend="nccl",
                            timeout=900)[0]
    meta = run_metadata(dev)
    for r in rows:
        r.update(meta)
        if mode == "virtual":
            r.update(copy=args.copy, reducer=args.reducer, rs_mode=args.rs_mode)
    print()
    print_table(rows, [c for c in rows[0] if c not in meta])
    name = f"gemm_comm_{mode}_{device_slug(dev)}{'_' + args.tag if args.tag else ''}"
    path = write_csv(name, rows)
    print(f"wrote {path}")
    _plot(rows, name, meta["device"])
    return 0


def _plot(rows, name, device):
    """Bars per shape: every timed column, in ms (shorter is better)."""
    plt = pyplot()
    if plt is None:
        return
    cols = [c for c in rows[0] if c.endswith("_ms")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(cols)
    for i, c in enumerate(cols):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(c) or 0 for r in rows], width, label=c[:-3])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["shape"] for r in rows], rotation=20,
                  ha="right", fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"GEMM + TP communication, bf16, {device}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{name}.png", dpi=120)
    print(f"wrote {RESULTS_DIR / (name + '.png')}")


if __name__ == "__main__":
    sys.exit(main())
