"""Tokenizers of plain text: byte-level, a ``tokenizers`` JSON file or a local Hugging Face folder.

    encode, eod, needed = text_encoder("tok.json")   # encode(str) -> list[int]; the end-of-document id;
                                                     # the vocabulary the model needs (ids < needed)
"""

from __future__ import annotations

from pathlib import Path

EOD = 256  # byte-level: ids 0–255 are the UTF-8 bytes, 256 ends a document
BYTE_VOCAB = 257


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def load_tokenizer(path: str):
    """(encode(text) -> ids, end-of-document id, vocabulary size) of a ``tokenizers`` JSON file or a
    Hugging Face tokenizer folder."""
    p = Path(path)
    if not p.exists():  # a local path only: never a network lookup for a typo
        raise ValueError(f"data.tokenizer ({path!r}) does not exist: give a tokenizers JSON file or a local Hugging "
                         "Face tokenizer folder")
    if p.is_file():
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(p))
        eod = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]") if tok.token_to_id(t)
                    is not None), None)
        size = tok.get_vocab_size()
        return (lambda text: tok.encode(text).ids), (size if eod is None else eod), size + (eod is None)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(str(p))
    eod = tok.eos_token_id if tok.eos_token_id is not None else len(tok)
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"]), eod, max(len(tok), eod + 1)


def text_encoder(tokenizer: str | None):
    """(encode, end-of-document id, vocabulary needed): byte-level when ``tokenizer`` is None."""
    if tokenizer is None:
        return _bytes, EOD, BYTE_VOCAB
    return load_tokenizer(tokenizer)


def check_vocab(vocab_size: int, needed: int, tokenizer: str | None) -> None:
    if vocab_size < needed:
        raise ValueError(f"vocab ({vocab_size}) must be at least {needed} for "
                         f"{'byte-level text' if tokenizer is None else 'data.tokenizer ' + repr(tokenizer)} "
                         "(model.vocab sets it)")
