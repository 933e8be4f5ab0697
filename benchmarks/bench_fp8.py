"""FP8 training (``training.precision fp8``): numerics and bytes on the CPU, GEMM and step speed on a GPU.

    python benchmarks/bench_fp8.py [--quick] [--steps 60]     # CPU: loss curves, all-gather bytes, planner table
    python benchmarks/bench_fp8.py --device cuda              # one GPU: FP8 vs bf16 GEMMs, one training step

CPU (default; FP8 GEMMs there are ``torch._scaled_mm``'s emulation: slow, so no speed is claimed):
  (a) numerics: a small Llama (hidden 64, ffn 128, 4 layers, 4 heads / 2 KV heads, vocab 258: every TP2
      shard a multiple of 16, as FP8 GEMMs need) trained ``--steps`` steps (default 60, ``--quick`` 15) on
      byte-level text (this repo's README.md, documents packed into rows of 64 tokens; 2 micro-batches of
      4 rows a step; AdamW lr 1e-2 → 1e-3, clipping 1.0) in fp32, bf16 (fp32 masters) and fp8 with each
      recipe (current, delayed, rowwise; ``fp8.layers all``: every decoder-layer TP linear), all at the
      one layout TP2 with sequence parallelism on 2 gloo ranks (``RankPool``, 1 thread each), so the FP8
      all-gathers run too. Same seed, same data, same initial weights; ``fp8.learn false`` (its timing
      of each linear after step 0 would write this machine's planner cache). Reported: each run's per-step
      loss, each FP8 recipe's largest relative distance to bf16 over the steps (|l − l_bf16| / l_bf16)
      next to bf16's largest relative distance to fp32 (the band tests/test_fp8_train.py allows twice
      of), the last-10-step mean loss, and the guardrail's worst saturation / underflow shares.
  (b) bytes: the SP all-gather of the column-parallel linears (qkv, gate_up) per micro-batch, computed
      from the shapes (bf16: 2·m·k bytes per linear, the gathered tensor; FP8: m·k) and measured from the
      ``all_gather`` spans' ``bytes`` of a ``CommTrace`` (TPKERNELS_BACKEND=gemm_comm=collective, so each
      gather is one span), forward and backward apart, on a ``ColumnParallelLinear`` of the model's shape
      at TP2; and the whole training step's all-gather bytes (every TP linear, the LM head's input too)
      from the trainer's own per-step trace, per micro-batch.
  (c) the planner's per-linear FP8 choice (``fp8_layer_choices``, ``format_choices``) for Llama-3-8B and
      Llama-3-70B on the H200 preset at TP8 with SP, 8192 tokens a micro-batch (printed; in the CSV).
  Writes results/fp8_cpu.csv (long form: section, run, step, layer, value, ...) and fp8_cpu.png (the loss
  curves and the per-step relative distances).

CUDA (``--device cuda``, for gpu_check.sh; < 60 s):
  GEMMs: at Llama-3-8B's per-rank shapes at TP1 and Llama-3-70B's at TP8 (M = 8192 tokens; k, n per rank
  from the planner's ``fp8_layer_choices``): bf16 ``torch.matmul`` vs ``fp8_gemm`` (``torch._scaled_mm``,
  per-tensor scales, bf16 out) on operands cast beforehand; the forward again with the casts included
  (``Fp8State.cast`` of x and W, current recipe: amax, scale, clamp, convert), without and with the
  guardrail's counting (two more passes; on in training by default); and the backward GEMMs (dX = dY·W,
  dW = dYᵀ·X in fp32 out, as the FP8 weight format runs them, on the FP8 transposes). CUDA events around each
  call, the median of ``--reps``. Printed: TFLOP/s, the measured gains, the planner's predicted gain
  (H200 preset, no SP: the GEMMs alone, and with its cast model) and the target, FP8 forward GEMM ≥ 1.5×
  bf16 on these GEMM-bound shapes (≥ ~800 FLOP per bf16 byte moved, the least being 70B's out projection,
  against the H200's ridge points of ~206 bf16 and ~412 FP8). Writes fp8_gemm_cuda.csv.
  Step: one training step on one GPU of a small-but-real Llama (hidden 2048, ffn 5632, 4 layers, 16/8
  heads, vocab 32000, 2 × 2048 tokens) in bf16 vs fp8 (``fp8.layers all``, current, ``fp8.learn false``):
  two warm-up steps each, then ``--rounds`` interleaved rounds of ``Trainer.train_step`` (synchronised),
  the median; target ≥ 1.25×. Writes fp8_train_cuda.csv.

The floor (per linear, m tokens, k in, n out per rank):
  GEMMs   3 · 2mkn FLOPs (forward, input gradient, weight gradient) at the FP8 peak instead of bf16's
          (H200: 1979 vs 989 dense TFLOP/s): at most 2× on a GEMM-bound linear;
  casts   ~5 bytes per element of x, W and dY (read 2 + write 1 for the cast, read 1 + write 1 for the FP8
          transpose the backward GEMMs take), ~5(mk + nk + mn) bytes at HBM bandwidth that bf16 does not
          move (amax fused into the pass: delayed scaling; current scaling reads the tensor once more);
  comm    the SP all-gather of a column-parallel input moves m·k bytes instead of 2·m·k: half.

Results go to benchmarks/results/ ($OUT instead, if set). Must not import tpkernels.testing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS_DIR, print_table, pyplot, run_metadata, time_ms, write_csv

README = str(HERE.parent / "README.md")
TP = 2  # the CPU layout: TP2 + SP on 2 gloo ranks
RECIPES = ("current", "delayed", "rowwise")
RUNS = {"fp32": {"training.precision": "fp32"}, "bf16": {"training.precision": "bf16"},
        **{f"fp8 {r}": {"training.precision": "fp8", "fp8.layers": "all", "fp8.recipe": r, "fp8.learn": False}
           for r in RECIPES}}
CPU_MODEL = {"model.name": "Llama-2-7B", "model.layers": 4, "model.hidden": 64, "model.ffn": 128, "model.heads": 4,
             "model.kv_heads": 2, "model.vocab": 258}
CPU_DATA = {"data.source": README, "data.seq_length": 64, "parallel.micro_batch_size": 4,
            "parallel.num_microbatches": 2}
GPU_MODEL = {"model.name": "Llama-2-7B", "model.layers": 4, "model.hidden": 2048, "model.ffn": 5632,
             "model.heads": 16, "model.kv_heads": 8, "model.vocab": 32000, "data.source": "random",
             "data.seq_length": 2048, "parallel.micro_batch_size": 2, "parallel.num_microbatches": 1}
GPU_LABEL = "Llama h{hidden} ffn{ffn} L{layers} {heads}/{kv_heads} heads vocab {vocab}".format(
    **{k[len("model."):]: v for k, v in GPU_MODEL.items() if k.startswith("model.") and k != "model.name"})
FORCE_COLLECTIVE = "gemm_comm=collective"  # one all_gather span per gather (the ring would chunk it)


# ---- CPU (a): loss curves at TP2 + SP --------------------------------------------------------------

def train_config(run: str, steps: int, tp: int = TP):
    from tpkernels.train import TrainConfig

    values = {**CPU_MODEL, **CPU_DATA, "training.steps": steps, "optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3,
              "optimizer.warmup_steps": 5, "optimizer.clip_grad": 1.0, "logging.progress": False, **RUNS[run]}
    if tp > 1:
        values.update({"parallel.tp": tp, "parallel.sequence_parallel": True})
    return TrainConfig.from_values(values)


def _gathered(tr) -> int:
    return int(sum(s.args.get("bytes", 0) for s in tr.spans if s.name == "all_gather"))


def _train_worker(rank: int, world: int, run: str, steps: int) -> dict:
    """One run on this rank: per-step losses, all-gather bytes of each step's forward + backward, fp8 counts."""
    os.environ["TPKERNELS_BACKEND"] = FORCE_COLLECTIVE
    warnings.filterwarnings("ignore")
    from tpkernels.train import Trainer

    t = Trainer(train_config(run, steps, world))
    gathered = []
    inner = t.forward_backward

    def traced(batch):
        loss, tr, secs = inner(batch)
        gathered.append(_gathered(tr))
        return loss, tr, secs

    t.forward_backward = traced
    t0 = time.perf_counter()
    history = t.train()
    return {"loss": [h["loss"] for h in history], "gathered": gathered, "seconds": time.perf_counter() - t0,
            "saturated": max((h.get("fp8/saturated") or 0.0) for h in history),
            "underflow": max((h.get("fp8/underflow") or 0.0) for h in history),
            "fp8_linears": history[-1].get("fp8/linears", 0)}


# ---- CPU (b): the column-parallel linears' SP all-gather, one layer ---------------------------------

def column_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of the CPU model's column-parallel linears (whole, before the TP split)."""
    h, heads, kv, ffn = (CPU_MODEL[k] for k in ("model.hidden", "model.heads", "model.kv_heads", "model.ffn"))
    d = h // heads
    return {"qkv": (h, (heads + 2 * kv) * d), "gate_up": (h, 2 * ffn)}


def _gather_worker(rank: int, world: int) -> dict:
    """All-gather bytes of one forward and one backward of a ColumnParallelLinear (SP) per linear and run."""
    os.environ["TPKERNELS_BACKEND"] = FORCE_COLLECTIVE
    from tpkernels.nn import ColumnParallelLinear
    from tpkernels.quant.fp8_state import Fp8Recipe
    from tpkernels.parallel.trace import CommTrace

    rows, seq = CPU_DATA["parallel.micro_batch_size"], CPU_DATA["data.seq_length"]
    out = {}
    for name, (k, n) in column_shapes().items():
        for run in ("bf16", *(f"fp8 {r}" for r in RECIPES)):
            torch.manual_seed(0)
            layer = ColumnParallelLinear(k, n, False, None, sequence_parallel=True, sequence_dim=1,
                                         dtype=torch.bfloat16)
            if run != "bf16":
                layer.enable_fp8(Fp8Recipe(run.split()[1]))
            x = torch.randn(rows, seq // world, k, dtype=torch.bfloat16, requires_grad=True)
            with CommTrace() as fwd:
                y = layer(x)
            with CommTrace() as bwd:
                y.backward(torch.randn_like(y))
            out[(name, run)] = (_gathered(fwd), _gathered(bwd))
    return out


# ---- (c): the planner's per-linear choice -----------------------------------------------------------

def planner_tables(print_them: bool = True) -> list[dict]:
    from tpkernels.description import model_preset
    from tpkernels.planner.fp8_choice import format_choices, fp8_layer_choices
    from tpkernels.planner.hardware import gpu_preset

    gpu, rows = gpu_preset("H200"), []
    for name in ("Llama-3-8B", "Llama-3-70B"):
        choices = fp8_layer_choices(model_preset(name), tp=8, sequence_parallel=True, tokens=8192, gpu=gpu)
        if print_them:
            print(f"\nplanner: {name} on H200 (preset), TP8 + SP, 8192 tokens a micro-batch: per linear of a layer")
            print(format_choices(choices))
        for c in choices:
            rows.append({"section": "planner H200 TP8 SP 8192 tokens", "run": name, "step": "", "layer": c.name,
                         "value": round(c.gain, 3), "unit": "predicted fp8 gain", "reference": "bf16",
                         "reference_value": round(1e3 * c.bf16_s, 4),
                         "relative": f"fp8 {1e3 * c.fp8_s:.4f} ms (casts {1e3 * c.cast_s:.4f}, comm "
                                     f"{1e3 * c.fp8_comm_s:.4f} vs {1e3 * c.bf16_comm_s:.4f}); "
                                     f"{'fp8' if c.chosen else 'bf16'}"})
    return rows


# ---- CPU driver ----------------------------------------------------------------------------------------

def rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def run_cpu(a) -> None:
    from tpkernels.parallel.local_ranks import RankPool

    meta = run_metadata(torch.device("cpu"))
    layout = f"TP{TP} SP ({TP} gloo ranks, 1 thread each)"
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    with RankPool(TP, threads_per_rank=1, timeout=600) as pool:
        for run in RUNS:
            t1 = time.perf_counter()
            runs[run] = pool.run(_train_worker, run, a.steps, timeout=600)[0]
            print(f"{run}: {a.steps} steps in {time.perf_counter() - t1:.0f} s; loss {runs[run]['loss'][0]:.3f} -> "
                  f"{runs[run]['loss'][-1]:.3f}", flush=True)
        layer_bytes = pool.run(_gather_worker, timeout=300)[0]
    rows = []
    # (a) the loss curves
    bf16, fp32 = runs["bf16"]["loss"], runs["fp32"]["loss"]
    for run, r in runs.items():
        ref = fp32 if run == "bf16" else bf16 if run != "fp32" else None
        dist = rel(r["loss"], ref) if ref else [math.nan] * len(r["loss"])
        for i, (loss, d) in enumerate(zip(r["loss"], dist)):
            rows.append({"section": "loss", "run": run, "step": i, "layer": "", "value": round(loss, 5),
                         "unit": "loss", "reference": "" if ref is None else ("fp32" if run == "bf16" else "bf16"),
                         "reference_value": "" if ref is None else round(ref[i], 5),
                         "relative": "" if ref is None else round(d, 5)})
    summary = []
    band = max(rel(bf16, fp32))
    for run, r in runs.items():
        ref_name = "fp32" if run == "bf16" else "bf16" if run != "fp32" else ""
        gap = max(rel(r["loss"], fp32 if run == "bf16" else bf16)) if ref_name else math.nan
        last = statistics.fmean(r["loss"][-10:])
        summary.append({"run": run, "vs": ref_name or "-", "max_rel_dist": "-" if math.isnan(gap) else f"{gap:.4f}",
                        "x_band": "-" if math.isnan(gap) or run == "bf16" else f"{gap / band:.2f}",
                        "first": f"{r['loss'][0]:.3f}", "last10_mean": f"{last:.4f}",
                        "last10_vs_bf16": f"{last / statistics.fmean(bf16[-10:]):.4f}",
                        "saturated_max": f"{r['saturated']:.2e}" if run.startswith("fp8") else "-",
                        "underflow_max": f"{r['underflow']:.2e}" if run.startswith("fp8") else "-",
                        "fp8_linears": r["fp8_linears"] or "-", "seconds": f"{r['seconds']:.0f}"})
        rows.append({"section": "loss summary", "run": run, "step": a.steps, "layer": "",
                     "value": round(last, 5), "unit": "mean loss of the last 10 steps", "reference": ref_name,
                     "reference_value": round(band, 5) if ref_name == "bf16" else "",
                     "relative": "" if math.isnan(gap) else round(gap, 5)})
    # (b) bytes: the column linears, computed and measured; the whole step, measured
    m = CPU_DATA["parallel.micro_batch_size"] * CPU_DATA["data.seq_length"]
    byte_rows = []
    for name, (k, n) in column_shapes().items():
        bf16_fwd = layer_bytes[(name, "bf16")][0]
        for run in ("bf16", *(f"fp8 {r}" for r in RECIPES)):
            fwd, bwd = layer_bytes[(name, run)]
            computed = (2 if run == "bf16" else 1) * m * k
            byte_rows.append({"layer": name, "GEMM m×k×n/TP": f"{m}×{k}×{n // TP}", "run": run, "computed": computed,
                              "measured fwd": fwd, "measured bwd": bwd, "fwd vs bf16": f"{fwd / bf16_fwd:.2f}",
                              "(fwd+bwd) vs bf16": f"{(fwd + bwd) / bf16_fwd:.2f}"})
            rows.append({"section": "column SP all-gather bytes per micro-batch", "run": run, "step": "",
                         "layer": name, "value": fwd + bwd, "unit": "bytes measured (forward + backward)",
                         "reference": "computed", "reference_value": computed,
                         "relative": round((fwd + bwd) / bf16_fwd, 4)})
    micro = CPU_DATA["parallel.num_microbatches"]
    step_bf16 = statistics.median(runs["bf16"]["gathered"]) / micro
    step_rows = []
    for run, r in runs.items():
        per_micro = statistics.median(r["gathered"]) / micro
        step_rows.append({"run": run, "all-gather bytes/micro-batch": int(per_micro),
                          "vs bf16": f"{per_micro / step_bf16:.3f}"})
        rows.append({"section": "training step all-gather bytes per micro-batch", "run": run, "step": "", "layer": "",
                     "value": int(per_micro), "unit": "bytes measured (every all_gather span, median step / 2)",
                     "reference": "bf16", "reference_value": int(step_bf16), "relative": round(per_micro / step_bf16, 4)})
    rows += planner_tables(print_them=False)
    for r in rows:
        r.update({"layout": layout, "model": "Llama h64 ffn128 L4 4/2 heads vocab 258", "tokens_per_step":
                  m * micro, "steps": a.steps, **meta})
    # print
    print(f"\nFP8 numerics, {meta['device']}, torch {meta['torch']}; {layout}; Llama hidden 64, ffn 128, 4 layers, "
          f"4/2 heads, vocab 258; README.md bytes, {micro} x {CPU_DATA['parallel.micro_batch_size']} x "
          f"{CPU_DATA['data.seq_length']} tokens a step; {a.steps} steps; {time.perf_counter() - t0:.0f} s in all")
    print_table(summary, list(summary[0]))
    print(f"band: bf16's largest relative distance to fp32 = {band:.4f}; x_band = an FP8 recipe's distance to bf16 "
          "over it (tests/test_fp8_train.py allows 2)")
    print(f"\nSP all-gather of the column-parallel linears, one micro-batch ({m} tokens) at TP{TP}, bytes of the "
          "gathered tensor (CommTrace 'all_gather' spans; computed: bf16 2·m·k, FP8 m·k)")
    print_table(byte_rows, list(byte_rows[0]))
    print("\nwhole training step (every TP linear's gathers and the LM head's), per micro-batch")
    print_table(step_rows, list(step_rows[0]))
    planner_tables()
    print(f"\nwrote {write_csv('fp8_cpu', rows)}")
    plot(runs, band, a)


def plot(runs: dict, band: float, a) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"fp32": ("k", "-"), "bf16": ("tab:blue", "-"), "fp8 current": ("tab:orange", "--"),
              "fp8 delayed": ("tab:green", "-."), "fp8 rowwise": ("tab:red", ":")}
    for run, r in runs.items():
        c, ls = styles[run]
        ax1.plot(r["loss"], color=c, linestyle=ls, label=run)
    ax1.set(xlabel="step", ylabel="loss", title=f"loss, TP{TP} SP on 2 gloo ranks ({a.steps} steps)")
    ax1.legend()
    bf16, fp32 = runs["bf16"]["loss"], runs["fp32"]["loss"]
    ax2.plot(rel(bf16, fp32), color="tab:blue", label="bf16 vs fp32")
    for run in (f"fp8 {r}" for r in RECIPES):
        c, ls = styles[run]
        ax2.plot(rel(runs[run]["loss"], bf16), color=c, linestyle=ls, label=f"{run} vs bf16")
    ax2.axhline(band, color="tab:blue", linewidth=0.8, alpha=0.6)
    ax2.axhline(2 * band, color="grey", linewidth=0.8, linestyle="--", label="2 × bf16's max (test band)")
    ax2.set(xlabel="step", ylabel="|loss − reference| / reference", title="relative distance per step")
    ax2.legend(fontsize=8)
    fig.suptitle("FP8 training numerics (CPU, emulated FP8 GEMMs): Llama h64 L4, byte-level README.md")
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "fp8_cpu.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---- CUDA: GEMMs and one training step -----------------------------------------------------------------

def timer(device: torch.device, reps: int):
    """ms of ``fn``: CUDA events around each call, the median of ``reps`` (CPU: perf_counter)."""

    def cuda_ms(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev)

    def cpu_ms(fn) -> float:
        return time_ms(fn, device, reps, warmup=1)

    return cuda_ms if device.type == "cuda" else cpu_ms


def time_linear(m: int, k: int, n: int, device: torch.device, ms_of) -> tuple[dict[str, float], float]:
    """ms of each GEMM of one linear (x: m × k, W: n × k, dY: m × n) in bf16 and FP8, and the FP8 forward's
    relative error against bf16's."""
    from tpkernels.quant.fp8 import fp8_gemm
    from tpkernels.quant.fp8_state import Fp8Guard, Fp8Recipe, Fp8State

    bf16 = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=bf16)
    w = (0.02 * torch.randn(n, k, device=device)).to(bf16)
    dy = (1e-3 * torch.randn(m, n, device=device)).to(bf16)
    # counted: the guardrail's saturation / underflow counts on (training's default)
    plain, counted = (Fp8State(Fp8Recipe(), ["linear"], device, guard=Fp8Guard(steps=s)) for s in (0, 3))
    x8, sx = plain.cast(0, "x", x)
    w8, sw = plain.cast(0, "w", w)
    dy8, sdy = plain.cast(0, "dy", dy)
    wt8, dyt8, xt8 = w8.t().contiguous(), dy8.t().contiguous(), x8.t().contiguous()  # the backward's operands
    ref = torch.matmul(x, w.t()).float()
    err = float((fp8_gemm(x8, sx, w8, sw, bf16).float() - ref).norm() / ref.norm())
    t = {
        "bf16 fwd": ms_of(lambda: torch.matmul(x, w.t())),
        "fp8 fwd": ms_of(lambda: fp8_gemm(x8, sx, w8, sw, bf16)),
        "fp8 fwd+casts": ms_of(lambda: fp8_gemm(*plain.cast(0, "x", x), *plain.cast(0, "w", w), bf16)),
        "fp8 fwd+casts+counts": ms_of(lambda: fp8_gemm(*counted.cast(0, "x", x), *counted.cast(0, "w", w), bf16)),
        "bf16 dgrad": ms_of(lambda: torch.matmul(dy, w)),
        "fp8 dgrad": ms_of(lambda: fp8_gemm(dy8, sdy, wt8, sw, bf16)),
        "bf16 wgrad": ms_of(lambda: torch.matmul(dy.t(), x)),
        "fp8 wgrad": ms_of(lambda: fp8_gemm(dyt8, sdy, xt8, sx, torch.float32)),  # fp32 out, as the FP8 weight format
    }
    return t, err


def gemm_rows(device: torch.device, reps: int, tokens: int = 8192, models=(("Llama-3-8B", 1), ("Llama-3-70B", 8)),
              target: float = 1.5) -> list[dict]:
    from tpkernels.description import model_preset
    from tpkernels.planner.fp8_choice import fp8_layer_choices
    from tpkernels.planner.hardware import gpu_preset

    ms_of = timer(device, reps)
    rows = []
    for model_name, tp in models:
        choices = fp8_layer_choices(model_preset(model_name), tp=tp, sequence_parallel=False, tokens=tokens,
                                    gpu=gpu_preset("H200"))
        for c in choices:
            m, k, n = c.m, c.k, c.n
            t, err = time_linear(m, k, n, device, ms_of)
            flop = 2.0 * m * k * n
            g16 = t["bf16 fwd"] + t["bf16 dgrad"] + t["bf16 wgrad"]
            g8 = t["fp8 fwd"] + t["fp8 dgrad"] + t["fp8 wgrad"]
            pred_gemm = (c.bf16_s - c.bf16_comm_s) / (c.fp8_s - c.fp8_comm_s - c.cast_s)
            gain = t["bf16 fwd"] / t["fp8 fwd"]
            rows.append({
                "model": model_name, "tp": tp, "layer": c.name, "M": m, "K": k, "N": n,
                "bf16_fwd_ms": round(t["bf16 fwd"], 4), "fp8_fwd_ms": round(t["fp8 fwd"], 4),
                "bf16_TFLOPs": round(flop / t["bf16 fwd"] / 1e9, 1), "fp8_TFLOPs": round(flop / t["fp8 fwd"] / 1e9, 1),
                "fwd_gain": round(gain, 3),
                "fwd_gain_with_casts": round(t["bf16 fwd"] / t["fp8 fwd+casts"], 3),
                "fwd_gain_with_casts_counted": round(t["bf16 fwd"] / t["fp8 fwd+casts+counts"], 3),
                "dgrad_gain": round(t["bf16 dgrad"] / t["fp8 dgrad"], 3),
                "wgrad_gain": round(t["bf16 wgrad"] / t["fp8 wgrad"], 3),
                "gemms3_gain": round(g16 / g8, 3), "predicted_gemm_gain": round(pred_gemm, 3),
                "predicted_gain_with_casts": round(c.gain, 3), "fp8_rel_err": f"{err:.3f}",
                "target": f">= {target}", "met": "yes" if gain >= target else "no"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def gpu_step_rows(rounds: int) -> list[dict]:
    from tpkernels.train import TrainConfig, Trainer

    def make(precision: str) -> Trainer:
        values = {**GPU_MODEL, "training.precision": precision, "training.steps": 1000, "optimizer.warmup_steps": 0,
                  "logging.progress": False}
        if precision == "fp8":
            values.update({"fp8.layers": "all", "fp8.recipe": "current", "fp8.learn": False})
        return Trainer(TrainConfig.from_values(values))

    variants = {"bf16": make("bf16"), "fp8": make("fp8")}
    for t in variants.values():  # warm-up: Triton compiles, first-touch allocations
        for _ in range(2):
            t.train_step()
        t.model.check_inputs = False
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, t in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.train_step()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    tokens = GPU_MODEL["parallel.micro_batch_size"] * GPU_MODEL["data.seq_length"]
    return [{"run": name, "step_ms": round(1e3 * med[name], 2), "tokens_per_s": round(tokens / med[name]),
             "gain_vs_bf16": round(med["bf16"] / med[name], 3), "target": ">= 1.25" if name == "fp8" else "",
             "met": ("yes" if med["bf16"] / med[name] >= 1.25 else "no") if name == "fp8" else "",
             "last_loss": round(variants[name].history[-1]["loss"], 4),
             "fp8_linears": variants[name].history[-1].get("fp8/linears", ""),
             "model": GPU_LABEL, "tokens": tokens, "rounds": rounds}
            for name in variants]


def run_cuda(a) -> None:
    device = torch.device("cuda")
    meta = run_metadata(device)
    t0 = time.perf_counter()
    rows = [{**r, **meta} for r in gemm_rows(device, a.reps)]
    print(f"FP8 (torch._scaled_mm, per-tensor scales, bf16 out) vs bf16 torch.matmul, {meta['device']}, torch "
          f"{meta['torch']}; M = 8192 tokens; median of {a.reps} (CUDA events); {time.perf_counter() - t0:.0f} s")
    print_table(rows, ["model", "tp", "layer", "M", "K", "N", "bf16_TFLOPs", "fp8_TFLOPs", "fwd_gain",
                       "fwd_gain_with_casts", "fwd_gain_with_casts_counted", "gemms3_gain", "predicted_gemm_gain",
                       "predicted_gain_with_casts", "fp8_rel_err", "target", "met"])
    print("fwd_gain: the forward GEMM on FP8 operands cast beforehand; with_casts: + the current-scaling casts of x "
          "and W (counted: + the guardrail's saturation/underflow counts); gemms3: forward + input-gradient + "
          "weight-gradient GEMMs; predicted: the planner (H200 preset), its GEMMs alone and with its cast model",
          flush=True)
    print(f"wrote {write_csv('fp8_gemm_cuda', rows)}", flush=True)
    planner_tables()
    t1 = time.perf_counter()
    step = [{**r, **meta} for r in gpu_step_rows(a.rounds)]
    print(f"\none training step on one GPU, bf16 (fp32 masters) vs fp8 (fp8.layers all, current scaling), "
          f"{step[0]['model']}, {step[0]['tokens']} tokens; median of {a.rounds} interleaved rounds after 2 warm-up "
          f"steps; {time.perf_counter() - t1:.0f} s")
    print_table(step, ["run", "step_ms", "tokens_per_s", "gain_vs_bf16", "target", "met", "last_loss", "fp8_linears"])
    print(f"wrote {write_csv('fp8_train_cuda', step)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="CPU: 15 steps")
    ap.add_argument("--steps", type=int, default=None, help="CPU: training steps of each run (default 60)")
    ap.add_argument("--reps", type=int, default=20, help="CUDA: timed calls per GEMM")
    ap.add_argument("--rounds", type=int, default=5, help="CUDA: timed training-step rounds")
    a = ap.parse_args()
    a.steps = a.steps or (15 if a.quick else 60)
    warnings.filterwarnings("ignore")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible")
        run_cuda(a)
    else:
        run_cpu(a)


if __name__ == "__main__":
    main()
