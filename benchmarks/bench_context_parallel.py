"""Context parallelism: step time and activation memory per rank against CP = 1 at the same global
sequence, per algorithm, on plain, packed-document and packed-document + sliding-window data; and
the zigzag ring's compute balance on one GPU.

    python benchmarks/bench_context_parallel.py [--mode auto|ranks|virtual] [--seq 8192 16384 32768]
                                                [--cases plain docs docs-window] [--window 4096]
                                                [--cp 2 4] [--algos ring allgather a2a] [--steps 4]

ranks: one training run per (sequence, case, algorithm, CP size) of a small Llama (tpkernels.train,
  the same data and seed), CP ranks as processes: gloo on CPUs (ratios only: two cores run the
  ranks side by side), NCCL on GPUs when there are CP of them. Cases: ``plain`` (uniform tokens,
  one document per row), ``docs`` (``random-documents``: packed documents of 1 to S/2 tokens, the
  CP attention's varlen calls), ``docs-window`` (the same as a Mistral-style model with a
  ``--window`` sliding window: window offsets across the zigzag chunks). Columns: tokens per rank,
  median step time after the first step and its ratio to CP = 1 of the same case, the peak bytes
  of saved activations on the fullest rank and its ratio (target: 1/CP for ring and a2a;
  all-gather keeps the whole sequence's K/V), the GPU allocator's peak when on GPUs, the measured
  comm/compute ratio, and whether the losses equal CP = 1's.
virtual (one device): the attention forward that CP rank r computes, run on one GPU for every
  rank: the zigzag layout (chunks r and 2·CP−1−r; the op's own plan of kernel calls, merged by
  log-sum-exp) and the plain ring (contiguous chunks, rank r computes r + 1 blocks). Efficiency =
  (whole-sequence causal attention time / CP) / the slowest rank's time: 100% is perfect balance
  at the kernel's full speed. The ring-flash-attention family reports 93.6% for zigzag and 68.8%
  for the plain ring on 8×H800 (communication included; here only compute, since one GPU has no
  ring to wait on). Target (gpu_check.sh): zigzag ≥ 90% at CP 8.
Writes benchmarks/results/context_parallel_<mode>[_<cases>]_<device>.csv and a PNG ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, device_slug, print_table, pyplot, run_metadata, time_ms, write_csv  # noqa: E402

MIB = 2**20


# ---- ranks: whole training steps over a real CP group ----

CASES = ("plain", "docs", "docs-window")


def _window_model(args, folder: Path) -> str:
    """A Mistral-style config.json of the benchmark's shape with a ``--window`` sliding window."""
    import transformers  # noqa: PLC0415

    transformers.MistralConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               num_key_value_heads=args.kv_heads, vocab_size=256,
                               max_position_embeddings=max(args.seq), sliding_window=args.window,
                               head_dim=args.hidden // args.heads).save_pretrained(str(folder))
    return str(folder)


def _base(args, seq: int, case: str, folder: Path):
    from tpkernels.train import TrainConfig  # noqa: PLC0415

    gpu = torch.cuda.is_available()
    model = {"name": "Llama-2-7B", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "kv_heads": args.kv_heads, "ffn": 2 * args.hidden, "vocab": 256}
    if case == "docs-window":
        model = {"name": _window_model(args, folder)}
    return TrainConfig.from_values({
        "model": model,
        "data": {"source": "random" if case == "plain" else "random-documents", "seq_length": seq},
        "parallel": {"micro_batch_size": 1, "num_microbatches": 1},
        "training": {"steps": args.steps, "precision": "bf16" if gpu else "fp32"},
        "optimizer": {"lr": 1e-3, "warmup_steps": 1}, "logging": {"progress": False}})


def ranks_mode(args) -> list[dict]:
    import tempfile  # noqa: PLC0415

    from tpkernels.train.activation_memory import measure_training  # noqa: PLC0415
    from tpkernels.train.launch import launch  # noqa: PLC0415

    gpu = torch.cuda.is_available()
    rows = []
    for seq in args.seq:
        for case in args.cases:
            with tempfile.TemporaryDirectory() as tmp:
                rows += _case_rows(args, _base(args, seq, case, Path(tmp)), seq, case, gpu, launch, measure_training)
    return rows


def _case_rows(args, base, seq: int, case: str, gpu: bool, launch, measure_training) -> list[dict]:
    runs = [("-", 1)] + [(a, c) for a in args.algos for c in args.cp if c > 1]
    if gpu:
        runs = [(a, c) for a, c in runs if c <= torch.cuda.device_count()]
    rows, ref = [], None
    for algo, cp in runs:
        if algo == "a2a" and (args.heads % cp or args.kv_heads % cp):
            print(f"skip a2a at CP{cp}: heads {args.heads}/{args.kv_heads} do not divide by {cp}")
            continue
        cfg = base.with_values({"parallel.cp": cp, "parallel.cp_algo": "ring" if algo == "-" else algo})
        out = launch(measure_training, cp, cfg)
        step = max(o["step_s"] for o in out)
        peak = max(o["peak_bytes"] for o in out)
        cuda_peak = max(o["cuda_peak_bytes"] for o in out)
        if ref is None:
            ref = {"step": step, "peak": peak, "cuda": cuda_peak, "losses": out[0]["losses"]}
        same = all(abs(a - b) <= 2e-2 * abs(b) if gpu else abs(a - b) <= 1e-4 * abs(b)
                   for a, b in zip(out[0]["losses"], ref["losses"]))
        rows.append({"seq": seq, "case": case, "algo": algo, "cp": cp, "tokens/rank": seq // cp,
                     "step s": f"{step:.3f}", "time vs CP1": f"{step / ref['step']:.2f}",
                     "saved MiB/rank": f"{peak / MIB:.1f}", "memory vs CP1": f"{peak / ref['peak']:.3f}",
                     "ideal": f"{1 / cp:.3f}", "GPU peak MiB": f"{cuda_peak / MIB:.0f}" if gpu else "-",
                     "comm/compute": f"{100 * max(o['comm_ratio'] for o in out):.0f}%",
                     "losses = CP1": "yes" if same else "NO"})
        print(rows[-1], flush=True)
    return rows


# ---- virtual: one CP rank's attention forward, every rank in turn, on one device ----

def _zigzag_shares(q, k, v, cp: int):
    """Every rank's (q, k, v) share, made before timing (the op receives them so)."""
    from tpkernels.functional.context_parallel import zigzag_split  # noqa: PLC0415

    return [(zigzag_split(q, cp, r), zigzag_split(k, cp, r), zigzag_split(v, cp, r)) for r in range(cp)]


def _rank_forward_zigzag(shares, cp: int, rank: int, scale: float):
    """Rank ``rank``'s forward: its queries against each block in the ring's order (the op's loop)."""
    from tpkernels.functional.context_parallel_blocks import BlockOpts, empty_out, run_forward  # noqa: PLC0415
    from tpkernels.functional.context_parallel_plan import geometry  # noqa: PLC0415

    qr = shares[rank][0]
    geo = geometry(qr.shape[1] * cp, cp, rank, (-1, 0), None, qr.shape[0], qr.device)
    out, lse = empty_out(qr)
    for j in range(cp):
        src = (rank - j) % cp
        run_forward(out, lse, qr, shares[src][1], shares[src][2], geo.block(src), BlockOpts(scale, 0.0))
    return out


def _rank_forward_plain(q, k, v, cp: int, rank: int, scale: float):
    from tpkernels.functional.attention import attention_fwd  # noqa: PLC0415
    from tpkernels.functional.context_parallel_blocks import empty_out, merge_  # noqa: PLC0415

    C = q.shape[1] // cp
    qr = q[:, rank * C:(rank + 1) * C]
    out, lse = empty_out(qr)
    for src in range(rank + 1):  # contiguous chunks: rank r sees r past blocks and its diagonal
        ks = slice(src * C, (src + 1) * C)
        ob, lb = attention_fwd(qr, k[:, ks], v[:, ks], scale, src == rank)
        merge_(out, lse, ob.to(out.dtype), lb.to(out.dtype))
    return out


def virtual_mode(args) -> list[dict]:
    from tpkernels.functional.attention import attention_fwd  # noqa: PLC0415

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, hk, d = 1, args.heads, args.kv_heads, args.headdim
    rows = []
    S = args.seq[0]
    for cp in args.cp:
        if S % (2 * cp):
            print(f"skip CP{cp}: the sequence ({S}) does not split into {2 * cp} chunks")
            continue
        g = torch.Generator(device=device).manual_seed(cp)
        q = torch.randn(b, S, h, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(b, S, hk, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(b, S, hk, d, device=device, dtype=dtype, generator=g)
        scale = d ** -0.5
        whole = time_ms(lambda: attention_fwd(q, k, v, scale, True), device, args.reps)
        flops = 2.0 * b * S * S * h * d  # causal forward: half of 4·b·S²·h·d
        row = {"cp": cp, "seq": S, "heads": f"{h}/{hk}", "whole ms": f"{whole:.2f}",
               "whole TFLOP/s": f"{flops / whole / 1e9:.3g}"}
        shares = _zigzag_shares(q, k, v, cp)
        runs = {"zigzag": lambda r: _rank_forward_zigzag(shares, cp, r, scale),
                "plain": lambda r: _rank_forward_plain(q, k, v, cp, r, scale)}
        for name, fn in runs.items():
            worst = max(time_ms(lambda r=r: fn(r), device, args.reps) for r in range(cp))
            row[f"{name} slowest ms"] = f"{worst:.2f}"
            row[f"{name} efficiency"] = f"{100 * whole / cp / worst:.1f}%"
        rows.append(row)
    return rows


def plot(rows: list[dict], mode: str, path: Path) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if mode == "ranks":
        for key in sorted({(r["seq"], r["case"], r["algo"]) for r in rows if r["algo"] != "-"}):
            pts = [(1, 1.0, 1.0)] + [(r["cp"], float(r["memory vs CP1"]), float(r["time vs CP1"]))
                                     for r in rows if (r["seq"], r["case"], r["algo"]) == key]
            label = f"{key[0] // 1024}k {key[1]} {key[2]}"
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        cps = sorted({r["cp"] for r in rows})
        axes[0].plot(cps, [1 / c for c in cps], "k--", label="1/CP")
        axes[0].set(xlabel="CP", ylabel="saved activations per rank vs CP1", title="memory")
        axes[1].set(xlabel="CP", ylabel="step time vs CP1", title="step time")
    else:
        cps = [r["cp"] for r in rows]
        for name in ("zigzag", "plain"):
            axes[0].plot(cps, [float(r[f"{name} efficiency"].rstrip("%")) for r in rows], marker="o", label=name)
            axes[1].plot(cps, [float(r[f"{name} slowest ms"]) for r in rows], marker="o", label=name)
        axes[0].axhline(90, color="k", ls="--", label="target 90%")
        axes[0].set(xlabel="CP", ylabel="% of whole-sequence rate / CP", title="balance × kernel speed")
        axes[1].set(xlabel="CP", ylabel="slowest rank, ms", title="forward of one rank")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="auto", choices=("auto", "ranks", "virtual"))
    ap.add_argument("--seq", type=int, nargs="+", default=None,
                    help="global sequences (ranks: 8192; virtual, the first: 32768 GPU, 2048 CPU)")
    ap.add_argument("--cases", nargs="+", default=["plain"], choices=CASES, help="ranks: the data")
    ap.add_argument("--window", type=int, default=4096, help="ranks, docs-window: the sliding window")
    ap.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes (ranks: 2 4; virtual: 2 4 8)")
    ap.add_argument("--algos", nargs="+", default=["ring", "allgather", "a2a"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=None, help="query heads (ranks: 4; virtual: 32)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (ranks: 4; virtual: 8)")
    ap.add_argument("--headdim", type=int, default=128, help="virtual: head dim")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    mode = args.mode if args.mode != "auto" else ("virtual" if gpu and torch.cuda.device_count() < 2 else "ranks")
    if mode == "ranks":
        args.seq, args.cp = args.seq or [8192], args.cp or [2, 4]
        args.heads, args.kv_heads = args.heads or 4, args.kv_heads or 4
        rows = ranks_mode(args)
    else:
        args.seq, args.cp = args.seq or [32768 if gpu else 2048], args.cp or [2, 4, 8]
        args.heads, args.kv_heads = args.heads or 32, args.kv_heads or 8
        if not gpu:
            args.headdim = min(args.headdim, 32)
        rows = virtual_mode(args)
    device = torch.device("cuda" if gpu else "cpu")
    meta = run_metadata(device)
    print(f"{meta['device']}, torch {meta['torch']}: context parallelism, {mode} mode, global sequences {args.seq}")
    print_table(rows, list(rows[0]))
    for r in rows:
        r.update(meta, mode=mode)
    cases = "" if mode == "virtual" or args.cases == ["plain"] else "_" + "-".join(args.cases)
    name = f"context_parallel_{mode}{cases}_{device_slug(device)}"
    print("wrote", write_csv(name, rows))
    plot(rows, mode, RESULTS_DIR / f"{name}.png")


if __name__ == "__main__":
    main()
