"""Test helpers of the data layer: a tiny local tokenizer folder with a real chat template, JSONL
writing, and an assistant mask computed by a separate, simple rule (not the package's)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("hello hi how are you fine thanks what is two plus three five four the answer ok bye again tell me a "
         "story once upon time end yes no sky blue why because").split()
SPECIAL = ["[UNK]", "<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
         "{% if add_generation_prompt %}<|assistant|> {% endif %}")
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
          "<|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# the turn count first: rendering more turns changes the start, so no rendering is a prefix of the next
NOT_MONOTONE = "{{ messages | length }} " + PLAIN


def _save(tok, folder, template):
    """``tok`` as a transformers tokenizer folder with the house special tokens (and ``template``)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|end|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def make_tokenizer(folder: Path, template: str | None = PLAIN) -> Path:
    """A WordLevel tokenizer over WORDS (whitespace-split) with the chat specials, saved as an HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    return _save(tok, folder, template)


# code-style chats: a ByteLevel BPE tokenizer (``tokenizers``' defaults, offsets trimmed) with a template that
# opens with a preamble (<s>) and an injected system prompt, headers as special tokens
CODE_PLAIN = ("<s>{% if messages[0]['role'] != 'system' %}<|system|>be brief<|end|>\n{% endif %}"
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CODE_MARKED = ("<s>{% if messages[0]['role'] != 'system' %}<|system|>be brief<|end|>\n{% endif %}"
               "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
               "{{ m['content'] }}<|end|>{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# a space between header and content, as PLAIN has: a reply opening with indentation merges it into its first token
CODE_SPACED = ("<s>{% if messages[0]['role'] != 'system' %}<|system|>be brief<|end|>\n{% endif %}"
               "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|> {% endif %}")
CODE = ["def add(a, b):\n    if a:\n        return a + b\n    return b\n",
        "    return x  # indented\n\n\tdone",
        "for i in range(3):\n    print(i)\n"]
CODE_CHATS = [
    {"messages": [{"role": "user", "content": "write add"}, {"role": "assistant", "content": CODE[0]},
                  {"role": "user", "content": "and the loop"}, {"role": "assistant", "content": CODE[2]}]},
    {"messages": [{"role": "assistant", "content": CODE[1]}, {"role": "user", "content": "more"},
                  {"role": "assistant", "content": CODE[0]}]},
    {"messages": [{"role": "system", "content": "code"}, {"role": "assistant", "content": CODE[1]}]},
]


def make_bytelevel_tokenizer(folder: Path, template: str | None = CODE_PLAIN) -> Path:
    """A byte-level BPE trained here on the code snippets (tokenizers' ByteLevel pre-tokenizer and
    post-processor at their defaults: whitespace-only tokens get empty trimmed offsets), as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CODE * 20 + ["write add and the loop more code be brief"] * 5, trainer)
    return _save(tok, folder, template)


def reference_mask(ids: list[int], last_only: bool = False, tok=None) -> list[bool]:
    """Supervised tokens by the templates' own structure: after each <|assistant|> token up to and including
    the <|end|> that closes the turn (the last such turn only with ``last_only``); ``tok``: a tokenizer whose
    special ids differ from make_tokenizer's."""
    a, e = SPECIAL.index("<|assistant|>"), SPECIAL.index("<|end|>")
    if tok is not None:
        a, e = tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|end|>")
    mask, inside, turns = [], False, []
    for t in ids:
        if t == a:
            inside = True
            turns.append([])
            mask.append(False)
            continue
        mask.append(inside)
        if inside:
            turns[-1].append(len(mask) - 1)
        if t == e:
            inside = False
    if last_only:
        keep = set(turns[-1]) if turns else set()
        mask = [i in keep for i in range(len(ids))]
    return mask


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CHATS = [
    {"messages": [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "fine thanks"},
                  {"role": "user", "content": "what is two plus three"},
                  {"role": "assistant", "content": "the answer is five"}]},
    {"messages": [{"role": "system", "content": "yes"}, {"role": "user", "content": "tell me a story"},
                  {"role": "assistant", "content": "once upon a time the end"}]},
    {"messages": [{"role": "user", "content": "why is the sky blue"},
                  {"role": "assistant", "content": "because"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "bye"}, {"role": "assistant", "content": "bye again"}]},
]


def save_hf_llama(folder: Path, vocab: int, seed: int = 0) -> Path:
    """A random 2-layer Hugging Face Llama (hidden 32, GQA 4/2), float64, saved to ``folder``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).double().save_pretrained(str(folder))
    return folder


# the trainer keys that load ``folder`` as the model (the tests' small shape overrides cleared)
def from_hf_keys(folder: Path) -> dict:
    return {"model.init_from": str(folder), "model.name": str(folder),
            **{f"model.{k}": None for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")}}
