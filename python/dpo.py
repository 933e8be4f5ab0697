"""DPO with LoRA at TP2 on 2 gloo ranks, the reference log-probs cached before training.

    python python/dpo.py [--steps 20] [--loss-type sigmoid|ipo|hinge|simpo]

Writes a tiny local preference corpus (python/chat_data.py: addition questions whose chosen answer
is the sum and rejected one is off by one, a word-level tokenizer with a real chat template, a
random Llama), first fine-tunes it briefly with SFT (so the policy has something to prefer from),
then trains DPO on the pairs (`training.task dpo`, implied by prompt/chosen/rejected records) and
prints the first and last losses and the reward accuracy (the share of pairs whose chosen answer
gets the higher implicit reward: TRL's rewards/accuracies).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from chat_data import write_corpus
from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.launch import launch


def run(cfg: TrainConfig) -> list[dict]:
    """One rank."""
    return Trainer(cfg).train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--loss-type", default="sigmoid", choices=("sigmoid", "ipo", "hinge", "simpo"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpk_dpo_"))
    try:
        paths = write_corpus(work)
        common = {"parallel": {"tp": 2, "sequence_parallel": True, "micro_batch_size": 4, "num_microbatches": 2},
                  "logging": {"progress": False, "log_every": 1}}
        # SFT first, exported to a Hugging Face folder: the DPO run's policy and (cached) reference
        sft = TrainConfig.from_values({
            **common, "model": {"name": str(paths["model"]), "init_from": str(paths["model"])},
            "data": {"source": str(paths["sft"]), "tokenizer": str(paths["tokenizer"]), "seq_length": 64},
            "training": {"steps": 12}, "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
            "checkpoint": {"save_dir": str(work / "sft")}})
        launch(run, 2, sft)
        from tpkernels.train.checkpoint import export_hf

        start = export_hf(work / "sft", work / "sft_hf")
        cfg = TrainConfig.from_values({
            **common, "model": {"name": str(start), "init_from": str(start), "finetune": "lora", "lora_rank": 8},
            "data": {"source": str(paths["pairs"]), "tokenizer": str(paths["tokenizer"]), "seq_length": 64},
            "training": {"steps": args.steps}, "optimizer": {"lr": 5e-3, "min_lr": 5e-4},
            "dpo": {"beta": 0.5, "loss_type": args.loss_type, "cache_dir": str(work / "reference")}})
        hist = launch(run, 2, cfg)[0]
        k = max(1, len(hist) // 4)  # one step is one batch of pairs: compare the first and last quarters
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        early, late = hist[:k], hist[-k:]
        print(f"DPO ({args.loss_type}), LoRA at TP2+SP, {args.steps} steps, means of the first and last {k}: loss "
              f"{mean(early, 'loss'):.4f} -> {mean(late, 'loss'):.4f}; reward accuracy "
              f"{mean(early, 'rewards/accuracies'):.2f} -> {mean(late, 'rewards/accuracies'):.2f}, margin "
              f"{mean(early, 'rewards/margins'):.3f} -> {mean(late, 'rewards/margins'):.3f}")
        if not mean(late, "loss") < mean(early, "loss"):
            raise SystemExit("the DPO loss did not go down")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
