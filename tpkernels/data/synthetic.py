"""Synthetic tokens: ``random`` (uniform ids, one document per row: benchmarks) and ``random-documents``
(uniform ids in documents of uneven length packed into rows: what packed text is to the loss,
without a corpus; the tests' default). ``batch(step, rows)`` -> TokenBatch (rows, seq)."""

from __future__ import annotations

import torch

from tpkernels.data.batch import TokenBatch


class RandomTokens:
    def __init__(self, vocab_size: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab_size, seq, seed

    def batch(self, step: int, rows: int) -> TokenBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return TokenBatch(torch.randint(0, self.vocab, (rows, self.seq), generator=g))


class RandomDocuments:
    """Documents of 1 to ``seq // 2`` tokens (uniform lengths, at least 1 to 2), uniform ids, packed into
    rows back to back; the last document of a row is cut at the row's end. Positions restart at 0 at
    each document."""

    def __init__(self, vocab_size: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab_size, seq, seed
        self.longest = max(2, seq // 2)

    def batch(self, step: int, rows: int) -> TokenBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 7_777_777)
        ids = torch.randint(0, self.vocab, (rows, self.seq), generator=g)
        pos = torch.empty_like(ids)
        for r in range(rows):
            t = 0
            while t < self.seq:
                n = min(int(torch.randint(1, self.longest + 1, (), generator=g)), self.seq - t)
                pos[r, t:t + n] = torch.arange(n)
                t += n
        return TokenBatch(ids, pos)


SYNTHETIC = {"random": RandomTokens, "random-documents": RandomDocuments}
