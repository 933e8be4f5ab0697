"""Text files packed into rows: ``PackedText`` (a .txt file or a folder of them).

    data = PackedText("corpus.txt", seq=128, seed=0, vocab_size=257)   # byte-level without a tokenizer
    batch = data.batch(step, rows)                                       # TokenBatch (rows, seq)

Documents (separated by blank lines) are tokenized (:mod:`tpkernels.data.tokenizer`), each closed
by the end-of-document id, concatenated and cut into rows of ``seq`` tokens (a document cut by a
row end continues in the next row); ``position_ids`` restart after each end-of-document id, so
attention never crosses one. Rows are visited in a fresh permutation per epoch
(:mod:`tpkernels.data.stream`). A file that is not UTF-8 is a named error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpkernels.data.batch import TokenBatch
from tpkernels.data.sources import read_utf8
from tpkernels.data.stream import step_positions, stream_rows
from tpkernels.data.tokenizer import EOD, check_vocab, text_encoder


def text_files(path: str | Path) -> list[Path]:
    path = Path(path)
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"data.source ({str(path)!r}) must be 'random', 'random-documents', a text file or a "
                         "folder of .txt files, a .jsonl/.json/.parquet/.arrow file or a datasets.save_to_disk "
                         "folder, or an indexed corpus (.bin/.idx prefix or folder) — and exist")
    return files


def text_source(path: str | Path, vocab_size: int, tokenizer: str | None = None):
    """(the .txt files, encode, end-of-document id) of a text source, every rule checked but nothing
    tokenized yet: what a launcher checks once before its ranks each read the corpus."""
    encode, eod, needed = text_encoder(tokenizer)
    check_vocab(vocab_size, needed, tokenizer)
    return text_files(path), encode, eod


def documents(files: list[Path]):
    """The non-empty documents (blank-line separated, stripped) of text files, in order."""
    for f in files:
        for doc in read_utf8(f).split("\n\n"):
            doc = doc.strip()
            if doc:
                yield doc


class PackedText:
    """Documents of a text file / folder of .txt files packed into rows (see the module docstring);
    ``tokenizer``: a ``tokenizers`` JSON or an HF tokenizer folder instead of bytes."""

    def __init__(self, path: str | Path, seq: int, seed: int, vocab_size: int, tokenizer: str | None = None):
        files, encode, eod = text_source(path, vocab_size, tokenizer)
        tokens = []
        for doc in documents(files):
            tokens += list(encode(doc)) + [eod]
        n = len(tokens) // seq
        if n < 1:
            raise ValueError(f"data.source ({str(path)!r}) has {len(tokens)} tokens: fewer than one row of "
                             f"data.seq_length ({seq})")
        self.ids = torch.tensor(tokens[:n * seq]).view(n, seq)
        self.pos = restart_per_document(self.ids, eod)
        self.seq, self.seed, self.rows = seq, seed, n

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        idx = stream_rows(positions, self.rows, self.seed)
        return TokenBatch(self.ids[idx], self.pos[idx])


def restart_per_document(ids: torch.Tensor, eod: int = EOD) -> torch.Tensor:
    """Positions counting from 0 at each row start and after each end-of-document token (a document
    cut by a row end continues from 0 in the next row)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eod
    t = torch.arange(ids.shape[1]).expand_as(ids)
    return t - torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
