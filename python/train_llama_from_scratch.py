"""Pre-train a small Llama from scratch on a text file, then resume it at another layout and export it.

    python python/train_llama_from_scratch.py [--text FILE] [--steps 30]

1. trains `steps` steps at TP2 × PP2 with sequence parallelism (4 gloo ranks spawned here; on GPUs
   use `torchrun ... -m tpkernels.train` with the same keys), saving a checkpoint half-way;
2. resumes that checkpoint at TP1 × PP4 and checks that the second half's losses are the ones of
   the uninterrupted run (checkpoints reshard);
3. exports the final weights as a Hugging Face folder and checks that `transformers` loads it and
   gives the same loss.
Text: this repository's README by default, byte-level tokens.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.launch import launch

MODEL = {"name": "Llama-2-7B", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 512}


def run(cfg: TrainConfig) -> list[float]:
    """One rank (launched by torch's elastic launcher, as --nproc and torchrun do)."""
    return [h["loss"] for h in Trainer(cfg).train()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", help="keep the Hugging Face export here (default: a temporary folder, removed at the end)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpk_scratch_"))
    common = TrainConfig.from_values({
        "model": MODEL, "data": {"source": args.text, "seq_length": 128},
        "parallel": {"micro_batch_size": 1, "num_microbatches": 4},
        "training": {"steps": args.steps}, "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3},
        "logging": {"progress": False}})
    tp2pp2 = {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": True}
    half = args.steps // 2
    full = launch(run, 4, common.with_values(tp2pp2))[0]
    print(f"TP2 PP2 SP, {args.steps} steps: loss {full[0]:.4f} -> {full[-1]:.4f}")

    ck = work / "ckpt"
    launch(run, 4, common.with_values({**tp2pp2, "training.stop_at_step": half,  # stopped half-way
                                       "checkpoint.save_dir": str(ck)}))
    resumed = launch(run, 4, common.with_values({"parallel.pp": 4, "checkpoint.save_dir": str(ck)}))[0]
    worst = max(abs(a - b) for a, b in zip(resumed, full[half:]))
    print(f"saved at step {half} at TP2 PP2, resumed at TP1 PP4: the last {len(resumed)} losses differ from the "
          f"uninterrupted run's by at most {worst:.1e}")
    if worst > 1e-4:
        raise SystemExit("resharded resume diverged")

    import torch
    import transformers

    from tpkernels.train.checkpoint import export_hf

    out = export_hf(ck, args.out or work / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    trainer = Trainer(common.with_values({"checkpoint.save_dir": str(ck)}))  # one process, at the final checkpoint
    from tpkernels.models import next_token_targets

    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        ours = trainer.model(ids, target=next_token_targets(ids)).item()
        theirs = hf(ids, labels=ids).loss.item()
    where = f"exported to {out}" if args.out else "exported (to a temporary folder, removed at the end: --out DIR keeps it)"
    print(f"{where}: transformers loads it; loss on a batch: ours {ours:.5f}, transformers {theirs:.5f}")
    if abs(ours - theirs) > 1e-4:
        raise SystemExit("the exported model differs")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
