"""QLoRA (NF4 and int8 base) vs LoRA vs full fine-tuning: step time, base weight bytes and peak step memory,
measured side by side in one run, as ratios.

    python benchmarks/bench_qlora.py [--steps 5] [--quick] [--threads 1]     # CPU: one process, then TP2 (SP)
    python benchmarks/bench_qlora.py --device cuda [--quick]                 # one GPU, one process, bf16

The model is a random Hugging Face Llama written with ``transformers`` (``save_pretrained``, fp32
safetensors) and read by every variant through ``model.init_from``, as a user's checkpoint would be:
QLoRA's base is quantised from it as each rank reads its shard (NF4 with double quantisation, or int8
with an absmax per row). CPU default: hidden 512, ffn 1408, 4 layers, 8 heads / 4 KV heads (head dim
64), vocab 2048, so that every TP2 shard is a multiple of 64 wide; 2 rows × 256 tokens of packed random
documents (``data.source random-documents``) a step. ``--quick``: hidden 256, ffn 704, 2 layers, 128
tokens. CUDA: hidden 2048, ffn 5632, 4 layers, 16/8 heads, vocab 32000, 4 × 1024 tokens (``--quick``:
hidden 1024, ffn 2816, 4 × 512).

Variants (``tpkernels.train.Trainer``, the same config but ``model.finetune``): ``full`` (every weight
trains), ``LoRA`` (rank 16 adapters on every decoder-layer TP linear; the base frozen in the run's
precision), ``QLoRA nf4`` and ``QLoRA int8`` (the same adapters on the quantised frozen base). One step
is ``forward_backward`` + ``reduce_gradients`` + ``optimizer_step`` (AdamW, clipping 1.0) on one fixed
batch (``prepare_batch(0)``). Layouts: one process, and on the CPU TP2 with sequence parallelism on 2
gloo ranks (``tpkernels.parallel.local_ranks.RankPool``, ``--threads`` torch threads per rank). This
machine may have only 2 cores: TP2 then runs its two ranks on them, contended with each other (and with
anything else the machine runs); its times compare variants at that layout, not layouts.

Timing: every variant takes one warm-up step, then ``--steps`` rounds each run one step of every variant
in turn (interleaved, so a slow spell of the machine hits all variants alike); the table quotes each
variant's median (TP: of the slowest rank's time, a barrier before each step) and its ratio to LoRA at
the same layout. On the CPU only the ratios are meant to be quoted. Memory, per rank:
- ``base_mb``: the frozen base of the decoder-layer TP linears (q/k/v, o, gate/up, down): the sum of
  ``QuantizedWeight.nbytes`` (packed codes, absmax codes, scales, offset) for QLoRA, the same linears'
  weight tensors (fp32 on the CPU, bf16 on the GPU) for LoRA and full; ``bytes_per_param`` is it over
  those weights' element count. Exact on any machine (not a timing);
- ``peak_mb``: the peak live tensor bytes of one more (untimed) step: CPU ``tpkernels.live_bytes.LiveTensorBytes``
  (tensors made in the step: activations, gradients, optimizer temporaries; not the weights and the
  optimizer state made before it); CUDA ``torch.cuda.max_memory_allocated`` during the step less what was
  allocated before it (the same meaning);
- ``state_mb``: what stays resident between steps: parameters and buffers (QLoRA's quantised base
  among them), gradients and the optimizer state;
- ``trainable``: trainable parameters on a rank.
Precision: fp32 on the CPU (bf16 on a CPU is slow and unrepresentative: QLoRA's CPU GEMM dequantises
NF4 panels to fp32 and calls the ATen GEMM), bf16 with fp32 masters on CUDA.

The floor of a step, per decoder linear of N × K weights and M tokens (rank r adapters, r ≪ N, K):
- full: 6·M·N·K FLOPs (forward, input gradient, weight gradient), and the optimizer reads/writes the
  weight, its gradient and two moments (~16 B/param bf16 + fp32 state);
- LoRA: 4·M·N·K + ~6·M·r·(N + K): no weight-gradient GEMM for the frozen base, no optimizer traffic
  for it; the two base GEMMs read the weight twice, 2 × 2 B/weight (bf16);
- QLoRA: the same 4·M·N·K FLOPs (the frozen base has no weight-gradient GEMM either), but the two NF4
  GEMMs read 2 × 0.516 B/weight (4-bit codes + one 8-bit absmax code per 64 + one fp32 scale per 256
  blocks), plus the dequantisation (one multiply per weight per K step tile on the GPU, per panel on the
  CPU). A GEMM is weight-bandwidth bound only when M is below ~peak FLOP/s / bandwidth / (B/weight · ½):
  on an H200 (989 TFLOP/s bf16, 4.8 TB/s) M < ~100 for bf16 and M < ~26 for NF4, so a training step (M in
  thousands) is compute bound and QLoRA's floor is LoRA's: its step time over LoRA's is what the
  dequantisation costs; the saving is memory (base_mb: 0.516 vs 2 B/param on the GPU, vs 4 here in fp32).
  int8: 1 B/param + an fp32 scale per row, dequantised in panels into the activation dtype.

Writes benchmarks/results/qlora_<cpu|cuda>.csv ($OUT instead, if set). Must not import tpkernels.testing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import print_table, run_metadata, write_csv

LORA_RANK, LR = 16, 1e-4
VARIANTS = {"full": ("full", None), "LoRA": ("lora", None), "QLoRA nf4": ("qlora", "nf4"),
            "QLoRA int8": ("qlora", "int8")}


def _size(hidden, ffn, layers, heads, kv_heads, vocab, seq, rows, steps) -> dict:
    return {"hidden": hidden, "ffn": ffn, "layers": layers, "heads": heads, "kv_heads": kv_heads, "vocab": vocab,
            "seq": seq, "rows": rows, "steps": steps}


SIZES = {  # (device, quick) -> shape and batch: hidden, ffn, layers, heads, kv heads, vocab, seq, rows, steps
    ("cpu", False): _size(512, 1408, 4, 8, 4, 2048, 256, 2, 5),
    ("cpu", True): _size(256, 704, 2, 4, 2, 1024, 128, 2, 3),
    ("cuda", False): _size(2048, 5632, 4, 16, 8, 32000, 1024, 4, 10),
    ("cuda", True): _size(1024, 2816, 4, 8, 4, 8192, 512, 4, 5),
}


def write_model(folder: Path, a) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=max(1024, a.seq),
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))


def config(folder: str, variant: str, a, tp: int):
    from tpkernels.train import TrainConfig

    finetune, quant = VARIANTS[variant]
    values = {"model.name": folder, "model.init_from": folder, "model.finetune": finetune,
              "data.source": "random-documents", "data.seq_length": a.seq,
              "parallel.micro_batch_size": a.rows, "parallel.num_microbatches": 1,
              "training.precision": "bf16" if a.device == "cuda" else "fp32", "training.steps": 1000,
              "optimizer.lr": LR, "optimizer.min_lr": LR, "optimizer.warmup_steps": 0, "optimizer.clip_grad": 1.0,
              "logging.progress": False}
    if finetune != "full":
        values["model.lora_rank"] = LORA_RANK
    if quant:
        values["model.quant"] = quant
    if tp > 1:
        values.update({"parallel.tp": tp, "parallel.sequence_parallel": True})
    return TrainConfig.from_values(values)


def base_linears(model) -> list:
    """The decoder layers' TP linears (q/k/v, o, gate/up, down): QLoRA's quantised base, LoRA's frozen one."""
    from tpkernels.nn import ColumnParallelLinear, RowParallelLinear

    return [m for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and ".layers." in f".{name}"]


def base_bytes(model) -> tuple[int, int]:
    """(bytes, weights) of the base linears on this rank."""
    nbytes = weights = 0
    for m in base_linears(model):
        if getattr(m, "qweight", None) is not None:
            nbytes += m.qweight.nbytes
            weights += m.qweight.shape[0] * m.qweight.shape[1]
        else:
            nbytes += m.weight.numel() * m.weight.element_size()
            weights += m.weight.numel()
    return nbytes, weights


def state_bytes(trainer) -> int:
    """Parameters, buffers, gradients and optimizer state resident on this rank (each storage once)."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for t in [*trainer.model.parameters(), *trainer.model.buffers()]:
        add(t)
        add(t.grad)
        add(getattr(t, "main_grad", None))
    mp = getattr(trainer, "mp", None)
    for t in (mp.masters if mp is not None else []):
        add(t)
        add(t.grad)
    for st in trainer.optimizer.state.values():
        for t in st.values():
            add(t)
    return sum(seen.values())


class Variant:
    def __init__(self, name, folder, a, tp):
        from tpkernels.train import Trainer

        self.name = name
        self.trainer = Trainer(config(folder, name, a, tp))
        self.batch = self.trainer.prepare_batch(0)
        self.base, self.weights = base_bytes(self.trainer.model)
        self.trainable = sum(p.numel() for p in self.trainer.model.parameters() if p.requires_grad)

    def step(self):
        t = self.trainer
        t.forward_backward(self.batch)
        t.reduce_gradients()
        t.optimizer_step(LR)


def measure(rank: int, world: int, folder: str, a) -> dict:
    """Every variant on this rank: times of the timed rounds, peak step bytes, base bytes, state bytes."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    cuda = a.device == "cuda"
    dist_on = dist.is_initialized() and world > 1

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if dist_on:
            dist.barrier()

    variants = [Variant(name, folder, a, world) for name in VARIANTS]
    for v in variants:  # warm-up (Triton compiles, first-touch allocations)
        v.step()
        v.trainer.model.check_inputs = False  # what Trainer.train does after the first step
    times = {v.name: [] for v in variants}
    for _ in range(a.steps):
        for v in variants:
            sync()
            t0 = time.perf_counter()
            v.step()
            sync()
            times[v.name].append(time.perf_counter() - t0)
    out = {}
    for v in variants:
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            v.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            from tpkernels.live_bytes import LiveTensorBytes

            with LiveTensorBytes() as mem:
                v.step()
            peak = mem.peak_bytes
        out[v.name] = {"times": times[v.name], "peak": peak, "base": v.base, "weights": v.weights,
                       "state": state_bytes(v.trainer), "trainable": v.trainable}
    return out


def rows_of(layout: str, per_rank: list[dict], a, meta: dict) -> list[dict]:
    names = list(VARIANTS)
    # per round the slowest rank's time, then the median over rounds
    med = {n: statistics.median(max(r[n]["times"][i] for r in per_rank) for i in range(a.steps)) for n in names}
    worst = {n: {k: max(r[n][k] for r in per_rank) for k in ("peak", "base", "weights", "state", "trainable")}
             for n in names}
    lora = worst["LoRA"]
    rows = []
    for n in names:
        w = worst[n]
        rows.append({
            "variant": n, "layout": layout, "step_s": f"{med[n]:.3f}", "step_vs_lora": f"{med[n] / med['LoRA']:.2f}",
            "base_mb": f"{w['base'] / 2 ** 20:.2f}", "base_vs_lora": f"{w['base'] / lora['base']:.3f}",
            "bytes_per_param": f"{w['base'] / w['weights']:.3f}",
            "peak_mb": f"{w['peak'] / 2 ** 20:.1f}", "peak_vs_lora": f"{w['peak'] / lora['peak']:.2f}",
            "state_mb": f"{w['state'] / 2 ** 20:.1f}", "state_vs_lora": f"{w['state'] / lora['state']:.2f}",
            "trainable": w["trainable"],
            **meta, "precision": "bf16" if a.device == "cuda" else "fp32", "hidden": a.hidden, "ffn": a.ffn,
            "layers": a.layers, "vocab": a.vocab, "tokens": a.rows * a.seq, "lora_rank": LORA_RANK,
            "steps": a.steps, "threads": a.threads if a.device == "cpu" else ""})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 rounds")
    ap.add_argument("--steps", type=int, help="timed rounds (each: one step of every variant)")
    ap.add_argument("--layouts", nargs="+", choices=("1", "tp2"), default=["1", "tp2"],
                    help="CPU layouts: one process, TP2 (SP) on 2 gloo ranks (CUDA: one process only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads of the process and of each TP rank (default 1: the same work per core)")
    for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "seq", "rows"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int)
    a = ap.parse_args()
    for k, v in SIZES[(a.device, a.quick)].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    # one thread per process by default: the TP2 ranks run one each (2 ranks on a 2-core machine), and the
    # one-process layout then does the same work per core
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    meta = run_metadata(torch.device(a.device))
    work = Path(tempfile.mkdtemp(prefix="tpk_bench_qlora_"))
    rows = []
    t0 = time.perf_counter()
    try:
        folder = work / "model"
        write_model(folder, a)
        layouts = ["1"] if a.device == "cuda" else a.layouts
        for layout in layouts:
            t1 = time.perf_counter()
            if layout == "1":
                per_rank = [measure(0, 1, str(folder), a)]
                label = "1 process"
            else:
                from tpkernels.parallel.local_ranks import RankPool

                with RankPool(2, threads_per_rank=a.threads, timeout=600) as pool:
                    per_rank = pool.run(measure, str(folder), a, timeout=600)
                label = "TP2 SP (2 gloo ranks)"
            rows += rows_of(label, per_rank, a, meta)
            print(f"{label}: {time.perf_counter() - t1:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    prec = "bf16 (fp32 masters)" if a.device == "cuda" else f"fp32, {a.threads} thread(s) per process"
    print(f"QLoRA vs LoRA vs full fine-tuning, {meta['device']}, torch {meta['torch']}, {prec}; random Llama "
          f"hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, {a.heads}/{a.kv_heads} heads, vocab {a.vocab}; "
          f"{a.rows} x {a.seq} tokens a step; LoRA rank {LORA_RANK}; median of {a.steps} interleaved rounds; "
          f"memory per rank (the largest rank); {time.perf_counter() - t0:.0f} s in all")
    print_table(rows, ["variant", "layout", "step_s", "step_vs_lora", "base_mb", "base_vs_lora", "bytes_per_param",
                       "peak_mb", "peak_vs_lora", "state_mb", "state_vs_lora", "trainable"])
    print(f"wrote {write_csv(f'qlora_{a.device}', rows)}")


if __name__ == "__main__":
    main()
