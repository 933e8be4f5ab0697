"""A tiny chat corpus for the fine-tuning examples, written locally (no hub): a word-level tokenizer
folder with a real chat template, SFT conversations and preference pairs, and a random Llama.

    python python/chat_data.py OUT_DIR        # writes OUT_DIR/{tokenizer,model,sft.jsonl,pairs.jsonl}

The task is two-number addition in words ("what is three plus four" → "seven"); a preference pair's
chosen answer is the sum, its rejected one is off by one. The chat template marks the assistant's
tokens with ``{% generation %}`` (what `tpkernels train` uses for the SFT mask) and ends each turn
with ``<|end|>``, which is supervised too.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen").split()
WORDS = ["what", "is", "plus", "the", "answer", "please", "add"]
SPECIAL = ["[UNK]", "<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
            "<|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def write_tokenizer(folder: Path) -> int:
    """A WordLevel tokenizer over the corpus' words with the chat specials; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + NUMBERS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    return len(vocab)


def write_model(folder: Path, vocab: int, seed: int = 0) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))


def _question(rng) -> tuple[str, int]:
    a, b = rng.randrange(10), rng.randrange(9)
    return f"{rng.choice(['what is', 'please add'])} {NUMBERS[a]} plus {NUMBERS[b]}", a + b


def write_corpus(out: Path, samples: int = 96, seed: int = 0) -> dict[str, Path]:
    """Tokenizer, random model, SFT conversations and preference pairs under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    vocab = write_tokenizer(out / "tokenizer")
    write_model(out / "model", vocab, seed)
    sft, pairs = [], []
    for _ in range(samples):
        q, s = _question(rng)
        sft.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": NUMBERS[s]}]})
        wrong = s + rng.choice([-1, 1]) if s > 0 else 1
        pairs.append({"prompt": [{"role": "user", "content": q}],
                      "chosen": [{"role": "assistant", "content": NUMBERS[s]}],
                      "rejected": [{"role": "assistant", "content": NUMBERS[wrong]}]})
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"tokenizer": out / "tokenizer", "model": out / "model", "sft": out / "sft.jsonl",
            "pairs": out / "pairs.jsonl"}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        paths = write_corpus(Path(sys.argv[1]))
        print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    else:
        print(__doc__)
