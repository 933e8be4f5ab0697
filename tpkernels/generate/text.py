"""Text in and out of generation: the tokenizer a run trained with (``data.tokenizer``: byte-level, a
``tokenizers`` JSON file or a local Hugging Face folder) or a Hugging Face model folder's own.

    codec = TextCodec.load("tok_folder")          # None: byte-level (ids 0-255 the UTF-8 bytes, 256 ends text)
    ids = codec.encode("Hello")                   # the prompt's ids (the tokenizer's own special tokens:
                                                  # a Llama tokenizer prepends its BOS, as transformers does)
    ids = codec.chat([{"role": "user", "content": "Hi"}])   # the chat template, with the generation prompt
    text = codec.decode(ids); codec.stop_ids      # end of text, end of turn
"""

from __future__ import annotations

import json
from pathlib import Path

from tpkernels.data.tokenizer import BYTE_VOCAB, EOD

# tokens that end an assistant turn in the common chat templates (Llama 3, ChatML / Qwen, Gemma, Phi-3)
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


class TextCodec:
    """encode / decode / chat over one tokenizer; ``stop_ids``: the ids that end a reply (EOS, end of turn)."""

    def __init__(self, kind: str, tok=None, path: str | None = None):
        self.kind, self.tok, self.path = kind, tok, path
        if kind == "bytes":
            self.stop_ids, self.vocab = {EOD}, BYTE_VOCAB
        elif kind == "tokenizers":
            ids = (tok.token_to_id(t) for t in END_OF_TURN)
            self.stop_ids, self.vocab = {i for i in ids if i is not None}, tok.get_vocab_size()
        else:
            stop = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            vocab = tok.get_vocab()
            stop |= {vocab[t] for t in END_OF_TURN if t in vocab and t in tok.all_special_tokens}
            self.stop_ids, self.vocab = stop, len(tok)

    @classmethod
    def load(cls, path: str | None, what: str = "tokenizer") -> "TextCodec":
        """Byte-level for None; a ``tokenizers`` JSON file; or a local Hugging Face tokenizer folder (never
        the hub: a typo is an error, not a download). ``what``: how errors name the setting."""
        if path is None:
            return cls("bytes")
        p = Path(path)
        if not p.exists():
            raise ValueError(f"{what} ({str(path)!r}) does not exist: give a tokenizers JSON file or a local Hugging "
                             "Face tokenizer folder")
        if p.is_file():
            from tokenizers import Tokenizer  # noqa: PLC0415

            return cls("tokenizers", Tokenizer.from_file(str(p)), str(p))
        from transformers import AutoTokenizer  # noqa: PLC0415

        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{what} ({str(path)!r}) is not a loadable Hugging Face tokenizer folder: "
                             f"{str(e).strip().splitlines()[0][:300]}") from None
        return cls("hf", tok, str(p))

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode())
        if self.kind == "tokenizers":
            return self.tok.encode(text).ids
        return self.tok(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode(errors="replace")
        if self.kind == "tokenizers":
            return self.tok.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.kind == "hf" and bool(getattr(self.tok, "chat_template", None))

    def chat(self, messages: list[dict]) -> list[int]:
        """The conversation's ids through the tokenizer's chat template, ending with the generation prompt
        (the assistant's turn opened)."""
        if not self.has_chat_template:
            where = "byte-level text" if self.kind == "bytes" else f"tokenizer {self.path!r}"
            raise ValueError(f"--chat needs a tokenizer with a chat template; {where} has none (give --tokenizer a "
                             "Hugging Face tokenizer folder whose tokenizer_config.json holds a chat_template, see "
                             "docs/training.md)")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)


def read_prompts(path: str, what: str = "--prompts") -> list:
    """The prompts of a JSONL file: strings or message lists (named errors with the line; ``what``: how they
    name the setting)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} ({path!r}) does not exist or is not a file")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {path}:{n}: not JSON ({e.msg})") from None
        if isinstance(v, dict):
            v = v.get("messages", v.get("prompt", v.get("text")))
        if isinstance(v, str) and v:
            out.append(v)
        elif isinstance(v, list) and v and all(isinstance(m, dict) and "role" in m and "content" in m for m in v):
            out.append(v)
        else:
            raise ValueError(f"{what} {path}:{n}: a line must be a non-empty string, {{\"prompt\": ...}} or "
                             "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    if not out:
        raise ValueError(f"{what} ({path!r}) holds no prompt")
    return out


__all__ = ["END_OF_TURN", "TextCodec", "read_prompts"]
