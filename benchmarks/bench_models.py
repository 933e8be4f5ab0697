"""A whole training step (forward + backward) of a Llama-shaped model: transformers as users run
it (SDPA attention), transformers with ``tpkernels.hf.apply_kernels``, and our
``ParallelTransformer`` (one process, TP = PP = 1).

    python benchmarks/bench_models.py [--device cpu|cuda] [--layers N] [--seq S] [--batch B] [--reps N]

CPU default: hidden 512, 8 heads / 4 KV heads, ffn 1408, vocab 32000, 4 layers, fp32, batch 2 × 512.
GPU default: Llama-3-8B layers (hidden 4096, 32/8 heads, ffn 14336, vocab 128256), 2 of them, bf16,
batch 1 × 4096. "TFLOP/s" is the model FLOPs of the step (the planner's count: 6 · params ·
tokens + attention) over the time; on a GPU the peak memory is the allocator's. Every variant
starts from the same weights; the script checks that their losses agree before timing.
Writes benchmarks/results/models_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, print_table, run_metadata, time_ms, write_csv  # noqa: E402


def hf_model(args, device, dtype):
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 64),
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    shape = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, layers=2, seq=4096, batch=1) if gpu \
        else dict(hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=32000, layers=4, seq=512, batch=2)
    for k, v in shape.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    dtype = torch.bfloat16 if gpu else torch.float32

    from tpkernels.hf import apply_kernels  # noqa: PLC0415
    from tpkernels.models import ParallelTransformer, next_token_targets  # noqa: PLC0415

    hf = hf_model(args, device, dtype)
    patched = copy.deepcopy(hf)
    apply_kernels(patched)
    ours = ParallelTransformer.from_hf(hf, dtype=dtype, device=device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    target = next_token_targets(ids)

    def hf_step(model):
        def run():
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            return loss.item()
        return run

    def ours_step():
        ours.zero_grad(set_to_none=True)
        return ours.step(ids, target, num_microbatches=1)

    variants = {"transformers (sdpa)": hf_step(hf), "transformers + apply_kernels": hf_step(patched),
                "tpkernels ParallelTransformer": ours_step}
    losses = {name: fn() for name, fn in variants.items()}
    spread = max(losses.values()) - min(losses.values())
    if spread > (5e-2 if gpu else 1e-4):
        raise SystemExit(f"losses disagree: {losses}")
    flops = ours.config.to_spec(args.seq).model_flops_per_step(args.batch, args.seq)
    rows = []
    base = None
    for name, fn in variants.items():
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        ms = time_ms(fn, device, args.reps, warmup=1)
        base = base or ms
        rows.append({"variant": name, "ms": f"{ms:.1f}", "speedup": f"{base / ms:.2f}",
                     "tokens/s": f"{args.batch * args.seq / ms * 1e3:.0f}", "TFLOP/s": f"{flops / ms / 1e9:.2f}",
                     "peak GiB": f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f}" if gpu else "-",
                     "loss": f"{losses[name]:.5f}"})
    meta = run_metadata(device)
    print(f"{meta['device']}, torch {meta['torch']}, {dtype}: {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads, ffn {args.ffn}, vocab {args.vocab}, batch {args.batch} × {args.seq}")
    print_table(rows, list(rows[0]))
    for r in rows:
        r.update(meta, layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch)
    print("wrote", write_csv(f"models_{device_slug(device)}", rows))


if __name__ == "__main__":
    main()
