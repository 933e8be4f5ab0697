"""A records source (JSONL, Parquet, Arrow, a save_to_disk folder) as packed training rows.

    data = RecordData("chat.jsonl", seq=512, seed=0, vocab_size=32000, tokenizer="tok/",
                      fmt="auto", loss_on="all_assistant", overflow="error", task=None)
    data.format, data.task          # "messages", "sft"
    batch = data.batch(step, rows)  # TokenBatch: ids, position_ids, loss_mask (+ pair_index, chosen)
    data.rows                       # the packed rows: stream positions 0 … rows - 1 read each once

``text`` records are pre-training documents: tokenized, each closed by the end-of-document id,
concatenated and cut into rows as text files are (:class:`~tpkernels.train.data.PackedText`).
``messages`` and ``prompt_completion`` records are SFT samples and ``preference`` records pairs:
encoded through the chat template (:mod:`tpkernels.data.chat`) and packed by best fit
(:mod:`tpkernels.data.packing`), one document each.

``task`` (``training.task``; None: implied by the format): ``sft`` supervises what the format
marks (assistant turns, completions); ``pretrain`` on chat records supervises every token of every
sample (never the filler).
"""

from __future__ import annotations

import torch

from tpkernels.data.batch import TokenBatch
from tpkernels.data.chat import Encoded, SampleEncoder, load_hf_tokenizer
from tpkernels.data.formats import CHAT_FORMATS, detect_format
from tpkernels.data.packing import PackedSamples
from tpkernels.data.sources import open_records
from tpkernels.data.stream import step_positions, stream_rows
from tpkernels.data.text import restart_per_document
from tpkernels.data.tokenizer import check_vocab, text_encoder

TASKS = ("pretrain", "sft", "dpo")


def implied_task(fmt: str) -> str:
    return "sft" if fmt in CHAT_FORMATS else "pretrain" if fmt == "text" else "dpo"


class RecordData:
    def __init__(self, source: str, seq: int, seed: int, vocab_size: int, tokenizer: str | None = None, *,
                 fmt: str = "auto", loss_on: str = "all_assistant", overflow: str = "error",
                 task: str | None = None):
        ds = open_records(source)
        self.format = detect_format(list(ds.column_names), fmt, source)
        self.task = task or implied_task(self.format)
        if self.task == "dpo" and self.format != "preference":
            raise ValueError(f"training.task dpo needs preference records (prompt/chosen/rejected); data.source "
                             f"({source!r}) is {self.format!r} records (columns {sorted(ds.column_names)})")
        if self.format == "preference" and self.task != "dpo":
            raise ValueError(f"data.source ({source!r}) holds preference pairs (prompt/chosen/rejected): train them "
                             f"with training.task dpo (or auto), not {self.task}")
        if self.task == "sft" and self.format not in CHAT_FORMATS:
            raise ValueError(f"training.task sft needs a messages or prompt/completion dataset; data.source "
                             f"({source!r}) is {self.format!r} records (columns {sorted(ds.column_names)})")
        if self.format == "text":
            self._text(ds, source, seq, seed, vocab_size, tokenizer)
            return
        tok = load_hf_tokenizer(tokenizer, f"data.source ({source!r}, {self.format} records)")
        check_vocab(vocab_size, len(tok), tokenizer)
        enc = SampleEncoder(tok, self.format, loss_on)
        items, names = [], []
        for k, record in enumerate(ds):
            where = f"data.source ({source!r}) record {k}"
            docs = enc.encode(record, where)
            if self.task == "pretrain":
                docs = [Encoded(d.ids, [True] * len(d)) for d in docs]
            items.append(docs)
            names.append(where)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.packed = PackedSamples(items, seq, seed, pad, overflow=overflow, names=names, source=source)
        self.rows = self.packed.rows

    def _text(self, ds, source, seq, seed, vocab_size, tokenizer) -> None:
        encode, eod, needed = text_encoder(tokenizer)
        check_vocab(vocab_size, needed, tokenizer)
        tokens = []
        for k, text in enumerate(ds["text"]):
            if not isinstance(text, str):
                raise ValueError(f"data.source ({source!r}) record {k}: text must be a string, not {text!r:.80}")
            if text.strip():
                tokens += list(encode(text)) + [eod]
        n = len(tokens) // seq
        if n < 1:
            raise ValueError(f"data.source ({source!r}) has {len(tokens)} tokens: fewer than one row of "
                             f"data.seq_length ({seq})")
        ids = torch.tensor(tokens[:n * seq]).view(n, seq)
        self.packed = None
        self.ids, self.pos, self.rows, self.seed = ids, restart_per_document(ids, eod), n, seed

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        if self.packed is not None:
            return self.packed.rows_at(positions)
        idx = stream_rows(positions, self.rows, self.seed)
        return TokenBatch(self.ids[idx], self.pos[idx])
