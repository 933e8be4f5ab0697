"""SFT and DPO steps (ours) against TRL's SFTTrainer / DPOTrainer: step time and peak live tensor memory,
on the CPU, one process, fp32, the same random Llama and the same tokens.

    python benchmarks/bench_post_training.py [--steps 3] [--quick] [--rows 4] [--seq 256] [--vocab 8192]

The corpus is python/chat_data.py's (a word-level tokenizer with a chat template whose `{% generation %}`
marks the assistant tokens; addition questions as SFT conversations and as preference pairs). The model
is a random Hugging Face Llama (hidden 128, 4 layers, 4 heads / 2 KV heads, ffn 352) saved to a folder
that both sides load. Its vocabulary is ``--vocab`` (default 8192: the tokenizer uses the first 33
ids, the rest are never seen), so that the logits (tokens × vocab) are by far the largest tensor a step
could make and the memory check means something; ``--vocab 0`` takes the tokenizer's own (33). Ours
computes the loss chunk by chunk over tokens (``linear_cross_entropy``, chunks of at least 512 tokens):
with more than 512 tokens in the batch (the default 4 × 256) its largest logits chunk is a fraction
of the full logits.

One step of each variant is a forward + backward + gradient clipping (1.0) + AdamW on ONE fixed batch
(the same every step):
- ours: ``Trainer.prepare_batch(0)`` once (``micro_batch_size`` --rows × ``seq_length`` --seq, samples
  packed padding-free, a pair's chosen and rejected two documents of one row), then per step
  ``forward_backward`` (DPO: the reference log-probs first), ``reduce_gradients``, ``optimizer_step``;
- TRL: the trainer built on exactly the records our batch packs (SFT: the conversations; DPO: the
  pairs), one batch of all of them from its own dataloader and collator, then per step its own
  ``training_step`` (its loss, metrics, backward), ``clip_grad_norm_`` and its optimizer's step.
  SFTTrainer: ``packing=True`` (best-fit rows of ``max_length`` --seq, padding-free, position ids
  restart per sample), ``assistant_only_loss=True`` (our mask). DPOTrainer: padded (its default; no
  flash attention on a CPU), β 0.1, sigmoid, ``precompute_ref_log_probs`` True (the analogue of our
  cached reference) or False (a frozen reference model copy, or with LoRA the adapters disabled, a
  forward pass every step).

On this corpus (documents of ~10 tokens) ours' CPU step is dominated by the packed attention: the CPU
varlen path calls PyTorch's fused attention once per document (~85 per row batch, per layer, each way),
about 60% of an SFT step in a profile; TRL's padded or padding-free SDPA makes one call per layer.

All variants run in one process and are interleaved (one step of each per round, after one warm-up
step each); the table quotes each variant's median step time over --steps rounds and its ratio to a
baseline. Peak memory: one more step of each under ``tpkernels.live_bytes.LiveTensorBytes`` (every
tensor an op returns, counted while it is alive; the weights, gradients-to-be-zeroed-before and the
optimizer state made before the step are not counted, gradients made in the step are), untimed. "largest"
is the largest tensor made in the step, in elements, beside the logits' tokens × vocab. On the CPU only
the ratios are meant to be quoted. Writes benchmarks/results/post_training_cpu.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
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
sys.path.insert(0, str(HERE.parent / "python"))
from chat_data import write_corpus
from common import print_table, run_metadata, write_csv

from tpkernels.live_bytes import LiveTensorBytes
from tpkernels.train import TrainConfig, Trainer

LR, BETA, LORA_RANK, CLIP = 1e-4, 0.1, 8, 1.0


def write_model(folder: Path, vocab: int, hidden: int, layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------- ours
class Ours:
    def __init__(self, name, paths, work, args, source, lora=False, reference=None):
        self.name = name
        model = {"name": str(paths["model"]), "init_from": str(paths["model"])}
        if lora:
            model.update(finetune="lora", lora_rank=LORA_RANK)
        values = {"model": model, "parallel": {"micro_batch_size": args.rows, "num_microbatches": 1},
                  "data": {"source": str(source), "tokenizer": str(paths["tokenizer"]), "seq_length": args.seq},
                  "training": {"steps": 1000, "precision": "fp32"},
                  "optimizer": {"lr": LR, "min_lr": LR, "warmup_steps": 0, "weight_decay": 0.0, "clip_grad": CLIP},
                  "logging": {"progress": False}}
        if reference is not None:
            values["dpo"] = {"beta": BETA, "reference": reference, "cache_dir": str(work / "reference")}
        self.trainer = Trainer(TrainConfig.from_values(values))
        self.batch = self.trainer.prepare_batch(0)
        ids, pos = self.batch.input_ids, self.batch.position_ids
        self.tokens = self.tensor_tokens = ids.numel()  # tokens: the records' (set by records_of)
        starts = (pos == 0) if pos is not None else torch.zeros_like(ids, dtype=torch.bool)
        self.docs = int(starts.sum())
        tgt = self.batch.target["target"] if isinstance(self.batch.target, dict) else self.batch.target
        self.supervised = int((tgt != -100).sum())
        self.pairs = self.batch.pairs.num_pairs if self.batch.pairs is not None else 0

    def step(self):
        t = self.trainer
        t.forward_backward(self.batch)
        t.reduce_gradients()
        t.optimizer_step(LR)


# ---------------------------------------------------------------------------------------------- TRL
class Trl:
    def __init__(self, name, kind, model_dir, tok_dir, records, args, work, precompute=None, lora=False):
        import datasets
        import transformers
        import trl

        self.name = name
        tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        ds = datasets.Dataset.from_list(records)
        common = {"output_dir": str(work / f"trl_{name}"),
                  "per_device_train_batch_size": len(records) if kind == "dpo" else args.rows, "learning_rate": LR,
                  "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": CLIP, "max_steps": 1000,
                  "report_to": [], "save_strategy": "no", "use_cpu": True, "bf16": False, "fp16": False,
                  "dataloader_num_workers": 0, "logging_steps": 10 ** 6, "disable_tqdm": True, "seed": 0}
        peft_config = None
        if lora:
            import peft

            peft_config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, bias="none",
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], task_type="CAUSAL_LM")
        if kind == "sft":
            cfg = trl.SFTConfig(**common, packing=True, max_length=args.seq, assistant_only_loss=True)
            self.trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                                          peft_config=peft_config)
        else:
            cfg = trl.DPOConfig(**common, beta=BETA, loss_type=["sigmoid"], max_length=args.seq,
                                precompute_ref_log_probs=precompute, precompute_ref_batch_size=len(records))
            self.trainer = trl.DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                                          peft_config=peft_config)
        tr = self.trainer
        tr.create_optimizer_and_scheduler(num_training_steps=1000)
        tr.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its loop
        batches = list(tr.get_train_dataloader())  # DPO with precompute: the reference pass happens here
        self.batch = tr._prepare_inputs(batches[0])
        self.extra_batches = len(batches) - 1
        am = self.batch.get("attention_mask")
        ids = self.batch["input_ids"]
        self.tokens = int(am.sum()) if am is not None else ids.numel()
        self.tensor_tokens = ids.numel()
        self.params = [p for p in tr.model.parameters() if p.requires_grad]

    def step(self):
        tr = self.trainer
        tr.model.train()
        tr.training_step(tr.model, self.batch)
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        tr.optimizer.step()
        tr.lr_scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)


def records_of(ours: Ours, jsonl: Path, tok_dir: Path) -> list[dict]:
    """The records our batch packs, found by their tokens: each document of the batch is one conversation's
    chat template rendering (SFT), a pair's chosen and rejected are two consecutive ones (prompt + answer)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))

    def ids_of(messages):
        out = tok.apply_chat_template(messages, tokenize=True)
        return tuple(out["input_ids"] if hasattr(out, "keys") else out)

    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    by_key: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        key = ids_of(r["messages"]) if "messages" in r else \
            (ids_of(r["prompt"] + r["chosen"]), ids_of(r["prompt"] + r["rejected"]))
        by_key.setdefault(key, []).append(i)
    b, pairs = ours.batch, ours.batch.pairs is not None
    docs = []
    for r in range(b.input_ids.shape[0]):
        pos = b.position_ids[r].tolist()
        starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
        docs += [tuple(b.input_ids[r, s:e].tolist()) for s, e in itertools.pairwise(starts)]
    keys = list(itertools.pairwise(docs)) if pairs else docs
    found, ours.tokens = [], 0
    for key in keys:
        if by_key.get(key):
            found.append(by_key[key].pop())
            ours.tokens += sum(len(d) for d in key) if pairs else len(key)
    want = ours.pairs if pairs else ours.docs
    if not want - (0 if pairs else b.input_ids.shape[0]) <= len(found) <= want:  # SFT: a row's filler is a document
        raise SystemExit(f"found {len(found)} of the batch's {want} records")
    return [rows[i] for i in found]


def measure_memory(v) -> tuple[int, int]:
    with LiveTensorBytes() as mem:
        v.step()
    return mem.peak_bytes, mem.largest_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed rounds (each: one step of every variant)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, no LoRA variants (about 1.5 min)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192, help="model vocabulary (0: the tokenizer's)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rows = min(args.steps, 2), min(args.rows, 4)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    meta = run_metadata(torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="tpk_bench_post_"))
    try:
        t0 = time.perf_counter()
        paths = write_corpus(work / "corpus", samples=64 * args.rows)
        vocab = args.vocab or len(json.loads((paths["tokenizer"] / "tokenizer.json").read_text())["model"]["vocab"])
        paths["model"] = work / "model"
        write_model(paths["model"], vocab, args.hidden, args.layers)

        ours_sft = Ours("ours SFT", paths, work, args, paths["sft"])
        ours_dpo = Ours("ours DPO cached", paths, work, args, paths["pairs"], reference="cached")
        ours = [ours_sft, ours_dpo]
        sft_recs = records_of(ours_sft, paths["sft"], paths["tokenizer"])
        dpo_recs = records_of(ours_dpo, paths["pairs"], paths["tokenizer"])
        variants = [
            ours_sft,
            Trl("TRL SFT", "sft", paths["model"], paths["tokenizer"], sft_recs, args, work),
            ours_dpo,
            Ours("ours DPO model-ref", paths, work, args, paths["pairs"], reference="model"),
            Trl("TRL DPO precomputed", "dpo", paths["model"], paths["tokenizer"], dpo_recs, args, work,
                precompute=True),
            Trl("TRL DPO ref-model", "dpo", paths["model"], paths["tokenizer"], dpo_recs, args, work,
                precompute=False),
        ]
        if not args.quick:
            variants += [
                Ours("ours SFT LoRA", paths, work, args, paths["sft"], lora=True),
                Ours("ours DPO cached LoRA", paths, work, args, paths["pairs"], lora=True, reference="cached"),
                Ours("ours DPO adapters LoRA", paths, work, args, paths["pairs"], lora=True, reference="adapters"),
                Trl("TRL DPO adapters LoRA", "dpo", paths["model"], paths["tokenizer"], dpo_recs, args, work,
                    precompute=False, lora=True),
            ]
        for v in variants:  # the same packed batch as ours SFT / ours DPO cached: the same records' tokens
            if isinstance(v, Ours) and v not in ours:
                v.tokens = (ours_dpo if v.pairs else ours_sft).tokens
        setup_s = time.perf_counter() - t0
        print(f"setup {setup_s:.0f} s", flush=True)
        for v in variants:  # warm-up
            v.step()
            if isinstance(v, Ours):
                v.trainer.model.check_inputs = False  # what Trainer.train does after the first step
        times = {v.name: [] for v in variants}
        for _ in range(args.steps):
            for v in variants:
                s = time.perf_counter()
                v.step()
                times[v.name].append((time.perf_counter() - s) * 1e3)
        print(f"timed {time.perf_counter() - t0 - setup_s:.0f} s", flush=True)
        mem = {v.name: measure_memory(v) for v in variants}
        print(f"memory {time.perf_counter() - t0 - setup_s:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(t) for k, t in times.items()}
    base = {"ours SFT": "TRL SFT", "ours DPO cached": "TRL DPO precomputed", "ours DPO model-ref": "TRL DPO ref-model",
            "ours DPO adapters LoRA": "TRL DPO adapters LoRA"}
    rows = []
    for v in variants:
        peak, largest = mem[v.name]
        logits = v.tensor_tokens * vocab * 4  # the (padded / packed) batch's full fp32 logits, bytes
        sft_name = "ours SFT LoRA" if "LoRA" in v.name else "ours SFT"
        trl_name = base.get(v.name)
        rows.append({
            "variant": v.name, "tokens": v.tokens, "batch_tokens": v.tensor_tokens, "pairs": getattr(v, "pairs", "") or "",
            "step_ms": round(med[v.name], 1),
            "vs_trl": round(med[v.name] / med[trl_name], 2) if trl_name else "",
            "vs_ours_sft": round(med[v.name] / med[sft_name], 2) if v.name.startswith("ours") else "",
            "peak_mb": round(peak / 2 ** 20, 1),
            "peak_vs_trl": round(peak / mem[trl_name][0], 2) if trl_name else "",
            "largest_mb": round(largest / 2 ** 20, 1), "logits_mb": round(logits / 2 ** 20, 1),
            "largest_vs_logits": round(largest / logits, 2),
            **meta, "rows": args.rows, "seq": args.seq, "vocab": vocab, "hidden": args.hidden, "layers": args.layers,
            "steps": args.steps, "threads": torch.get_num_threads()})
    print(f"post-training steps, {meta['device']}, torch {meta['torch']}, fp32, Llama hidden {args.hidden} x "
          f"{args.layers} layers, vocab {vocab}, ours {args.rows}x{args.seq} packed tokens; median of {args.steps} "
          f"interleaved rounds (setup {setup_s:.0f} s)")
    print_table(rows, ["variant", "tokens", "batch_tokens", "pairs", "step_ms", "vs_trl", "vs_ours_sft", "peak_mb", "peak_vs_trl",
                       "largest_mb", "logits_mb", "largest_vs_logits"])
    ratio = med["ours DPO cached"] / med["ours SFT"]
    print(f"target: ours DPO step (cached reference) <= 1.3x ours SFT step on the same tokens: {ratio:.2f}x, "
          f"{'met' if ratio <= 1.3 else 'NOT met'}")
    held = [r["variant"] for r in rows if r["variant"].startswith("ours") and r["largest_vs_logits"] >= 1]
    print("ours never makes a tensor as large as the full logits" if not held else
          f"ours makes a full-logits-sized tensor: {held}")
    print(f"wrote {write_csv('post_training_cpu', rows)}")


if __name__ == "__main__":
    main()
