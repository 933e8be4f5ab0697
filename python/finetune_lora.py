"""LoRA (or QLoRA) fine-tuning of a local Hugging Face checkpoint at TP2 with SP, and the merged export.

    python python/finetune_lora.py [CHECKPOINT_DIR] [--text FILE] [--rank 8] [--steps 12] [--quant nf4|int8]

Only the adapters train (the base weights stay frozen and outside the optimizer); A and B are
sharded with their tensor-parallel base layers. ``--quant nf4`` is QLoRA: each rank quantises its
shards of the base as it reads them (4-bit NormalFloat with double quantisation, ~0.52 bytes a
weight) and the GEMMs dequantise on the fly. The merged weights (W + alpha/r · B·A; for QLoRA W is
the base as the TP2 ranks dequantised their own shards) are exported as a Hugging Face folder, and
the program checks that transformers' logits for it equal the adapted model's. Without
CHECKPOINT_DIR: a random tiny Llama (vocab 512) is written first.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.launch import launch


def run(cfg: TrainConfig) -> list[float]:
    """One rank (launched by torch's elastic launcher, as --nproc and torchrun do)."""
    from tpkernels.models.hf_io import quantized_layers

    trainer = Trainer(cfg)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    quantised = quantized_layers(trainer.model).values()
    base = sum(m.weight.numel() for m in quantised)
    losses = [h["loss"] for h in trainer.train()]
    if trainer.state.rank == 0:
        print(f"rank 0 trains {trainable:,} of its {total + base:,} parameters ({len(trainer.lora_layers)} adapted "
              "layers)" + (f"; its quantised base: {base:,} weights in {sum(m.qweight.nbytes for m in quantised):,} "
                           "bytes" if base else ""))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quant", choices=("none", "nf4", "int8"), default="none", help="QLoRA's base format")
    ap.add_argument("--out", help="keep the merged Hugging Face export here (default: a temporary folder, removed at "
                                  "the end)")
    args = ap.parse_args()
    finetune = "lora" if args.quant == "none" else "qlora"
    work = Path(tempfile.mkdtemp(prefix="tpk_lora_"))
    import torch
    import transformers

    if args.checkpoint is None:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        transformers.LlamaForCausalLM(cfg).save_pretrained(str(work / "base"))
        args.checkpoint = str(work / "base")
    cfg = TrainConfig.from_values({
        "model": {"name": args.checkpoint, "init_from": args.checkpoint, "finetune": finetune, "quant": args.quant,
                  "lora_rank": args.rank},
        "parallel": {"tp": 2, "sequence_parallel": True, "micro_batch_size": 2, "num_microbatches": 2},
        "data": {"source": args.text, "seq_length": 128}, "training": {"steps": args.steps},
        "optimizer": {"lr": 1e-2, "min_lr": 1e-3}, "logging": {"progress": False},
        "checkpoint": {"save_dir": str(work / "ckpt")}})
    losses = launch(run, 2, cfg)[0]
    what = "LoRA" if finetune == "lora" else f"QLoRA ({args.quant})"
    print(f"{what} r={args.rank} at TP2 SP, {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    from tpkernels.models import ParallelTransformer
    from tpkernels.models.hf_io import dequantize_as_trained_at_
    from tpkernels.models.lora import apply_lora
    from tpkernels.train.checkpoint import export_hf, latest, load

    out = export_hf(work / "ckpt", args.out or work / "merged")
    # the adapted model as the run computed with it: the checkpoint's weights and adapters; a QLoRA base holds
    # what each TP2 rank's quantised shards held (NF4 blocks never span two ranks), not one process's quantisation
    quant = None if args.quant == "none" else args.quant
    adapted = ParallelTransformer(cfg.model_config(), None, init=None, quant=quant)
    apply_lora(adapted, args.rank)
    load(latest(work / "ckpt"), adapted)
    if quant is not None:  # the checkpoint holds no quantised base
        dequantize_as_trained_at_(adapted, args.checkpoint, cfg.parallel.tp)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.randint(0, adapted.config.vocab_size, (2, 32))
    with torch.no_grad():
        diff = (merged(ids).logits - adapted(ids)).abs().max().item()
    where = f"merged export {out}" if args.out else "merged export (a temporary folder, removed at the end: --out DIR keeps it)"
    print(f"{where}: transformers' logits equal the adapted model's (max |difference| {diff:.1e})")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    if diff > 1e-4:
        raise SystemExit("the merged export differs from the adapted model")


if __name__ == "__main__":
    main()
