"""How much of the data a tokenizer could not read: the share of tokens it mapped to its unknown
token. A tokenizer made for other text (the example's word list reused on one's own chats gave 70%
``[UNK]``) trains the model to predict ``[UNK]``, without an error anywhere; this share is checked
when the data is read.

    unk, total = unknown_count(data, unk_id)     # over the tokens a run reads (padding left out)
    check_unknown(data, "tok/", max_share=0.05)   # ValueError above the share, a warning with the rate below

Counted over what was tokenized: packed text (``PackedText``, text records) and packed samples
(chat, prompt/completion, preference records; padding left out), each part of a blend. Indexed
corpora (``tpkernels prepare-data``) and synthetic tokens are not tokenized here and not counted.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def unknown_id(tokenizer: str | None) -> int | None:
    """The unknown token's id of a ``tokenizers`` JSON file or a Hugging Face tokenizer folder (None: byte-level
    text, or a tokenizer without one, e.g. byte-level BPE)."""
    if tokenizer is None:
        return None
    p = Path(tokenizer)
    if p.is_file():
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(p))
        unk = getattr(tok.model, "unk_token", None)
        return tok.token_to_id(unk) if unk else None
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(p)).unk_token_id


def _parts(data) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(token ids, which of them are real: None for all) of each tokenized part of ``data``."""
    if hasattr(data, "sources"):  # a blend
        return [x for src in data.sources for x in _parts(src)]
    packed = getattr(data, "packed", None)
    if packed is not None:
        real = torch.arange(packed.ids.shape[1]) < packed.filled[:, None]  # each row's samples, then padding
        return [(packed.ids, real)]
    ids = getattr(data, "ids", None)
    return [(ids, None)] if isinstance(ids, torch.Tensor) else []


def unknown_count(data, unk_id: int) -> tuple[int, int]:
    """(tokens equal to ``unk_id``, tokens counted) over the tokenized parts of ``data``."""
    unk = total = 0
    for ids, real in _parts(data):
        hit = ids == unk_id
        if real is not None:
            hit, n = hit & real, int(real.sum())
        else:
            n = ids.numel()
        unk, total = unk + int(hit.sum()), total + n
    return unk, total


def check_unknown(data, tokenizer: str | None, max_share: float) -> float | None:
    """The share of ``data``'s tokens that ``tokenizer`` mapped to its unknown token (None: nothing to
    count). Above ``max_share``: a ValueError naming the rate, the tokenizer and the keys; above 0: a
    warning with the rate."""
    unk_id = unknown_id(tokenizer)
    if unk_id is None:
        return None
    unk, total = unknown_count(data, unk_id)
    if total == 0:
        return None
    share = unk / total
    said = (f"data.tokenizer ({tokenizer!r}) maps {share:.1%} of the data's tokens ({unk} of {total}) to its unknown "
            f"token (id {unk_id})")
    if share > max_share:
        raise ValueError(f"{said}, above data.max_unknown ({max_share:g}): it was made for other text, and the model "
                         "would learn to predict the unknown token. Give a tokenizer made for this data (docs/training.md "
                         "shows how to build one with a chat template), or raise data.max_unknown")
    if unk:
        warnings.warn(f"{said}; data.max_unknown ({max_share:g}) allows it", UserWarning, stacklevel=2)
    return share


__all__ = ["check_unknown", "unknown_count", "unknown_id"]
