"""Chat SFT with the loss on the assistant's tokens only: full fine-tuning at TP2×PP2 on 4 gloo ranks.

    python python/sft_chat.py [--steps 30]

Writes a tiny local chat corpus (python/chat_data.py: a word-level tokenizer with a real chat
template, addition questions, a random Llama), trains it with `training.task sft` (implied by the
`messages` records), and prints the first and last losses and how many of the batch's tokens the
loss covers (the assistant's answers and their end-of-turn token, not the prompts).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from chat_data import write_corpus
from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.launch import launch


def run(cfg: TrainConfig) -> list[float]:
    """One rank."""
    trainer = Trainer(cfg)
    if trainer.state.rank == 0:
        batch = trainer.data.batch(0, trainer.pc.global_batch_size)
        kept, total = int((batch.targets() != -100).sum()), batch.ids.numel()
        print(f"task {trainer.task}: the loss covers {kept} of the first batch's {total} tokens (assistant turns)")
    return [h["loss"] for h in trainer.train()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpk_sft_"))
    try:
        paths = write_corpus(work)
        cfg = TrainConfig.from_values({
            "model": {"name": str(paths["model"]), "init_from": str(paths["model"])},
            "parallel": {"tp": 2, "pp": 2, "sequence_parallel": True, "micro_batch_size": 2, "num_microbatches": 2},
            "data": {"source": str(paths["sft"]), "tokenizer": str(paths["tokenizer"]), "seq_length": 64},
            "training": {"steps": args.steps}, "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
            "logging": {"progress": False}})
        losses = launch(run, 4, cfg)[0]
        print(f"SFT, full fine-tuning at TP2×PP2+SP, {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if not losses[-1] < losses[0]:
            raise SystemExit("the SFT loss did not go down")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
