"""Training data: the global batch of step k, the same at every layout, sharded over DP.

    data = make_data(cfg, vocab_size)
    ids, position_ids = data.batch(step, global_batch)      # (global_batch, seq), on the CPU
    mine = rows_of_dp_rank(ids, dp_rank, dp)

Deterministic and resumable: the batch of step k depends only on (seed, k), so a run resumed at
step k, or restarted at another layout, sees the same tokens (the data position is the step).

* ``RandomTokens``: uniform ids (benchmarks, tests).
* ``PackedText``: a text file or a folder of ``*.txt`` files, byte-level tokens (ids 0–255, 256 =
  end of document), documents (separated by blank lines) packed into rows of ``seq`` tokens;
  ``position_ids`` restart at each document so attention never crosses one. Rows are shuffled per
  epoch with the seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

EOD = 256
BYTE_VOCAB = 257


class RandomTokens:
    def __init__(self, vocab_size: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab_size, seq, seed

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab, (rows, self.seq), generator=g), None


class PackedText:
    def __init__(self, path: str | Path, seq: int, seed: int, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"vocab ({vocab_size}) must be at least {BYTE_VOCAB} for byte-level text data")
        path = Path(path)
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"data ({str(path)!r}) must be a text file or a folder of .txt files")
        tokens = []
        for f in files:
            for doc in f.read_bytes().split(b"\n\n"):
                doc = doc.strip()
                if doc:
                    tokens += list(doc) + [EOD]
        n = len(tokens) // seq
        if n < 1:
            raise ValueError(f"data ({str(path)!r}) has {len(tokens)} tokens: fewer than one row of seq_length ({seq})")
        self.ids = torch.tensor(tokens[:n * seq]).view(n, seq)
        self.pos = restart_per_document(self.ids)
        self.seq, self.seed, self.rows = seq, seed, n

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.empty(rows, dtype=torch.long)
        for i in range(rows):
            k = step * rows + i
            epoch, j = divmod(k, self.rows)
            perm = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            idx[i] = perm[j]
        return self.ids[idx], self.pos[idx]


def restart_per_document(ids: torch.Tensor) -> torch.Tensor:
    """Positions counting from 0 at each row start and after each end-of-document token (a document
    cut by a row end continues from 0 in the next row)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == EOD
    t = torch.arange(ids.shape[1]).expand_as(ids)
    return t - torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values


def make_data(source: str, seq: int, seed: int, vocab_size: int):
    if source == "random":
        return RandomTokens(vocab_size, seq, seed)
    return PackedText(source, seq, seed, vocab_size)


def rows_of_dp_rank(t: torch.Tensor | None, dp_rank: int, dp: int) -> torch.Tensor | None:
    """This DP replica's contiguous share of the global batch."""
    if t is None:
        return None
    per = t.shape[0] // dp
    return t[dp_rank * per:(dp_rank + 1) * per]
