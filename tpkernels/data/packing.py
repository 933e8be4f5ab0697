"""Samples packed into rows padding-free, by best fit on length; the rows of step k.

    rows = best_fit([len(d) for d in docs], seq)        # [[sample index, ...] per row]
    data = PackedSamples(items, seq, seed, pad_id)      # items: [[Encoded], ...] (a pair: [chosen, rejected])
    batch = data.batch(step, global_batch)               # TokenBatch (rows, seq)

Each sample is its own document in its row: positions restart at 0 at its first token, so the
model's varlen attention stays inside it and its last token predicts nothing (the next sample's
first token is never a target). A preference pair's two sequences are two documents of one row.
What a row has left after best fit is filler: one more document of ``pad_id`` tokens, never a
target (its ``loss_mask`` is False; ``pair_index`` -1).

Samples longer than ``seq`` (a pair: together): ``data.overflow`` ``error`` (named, with the
record) or ``truncate`` (a single sample cut to ``seq`` tokens; a pair's sequences cut so both fit,
the shorter keeping up to half the row); a truncated sample left with no supervised target is
dropped and counted in a warning.

Deterministic: the samples are shuffled with the seed before the best-fit pass (longest first, ties
in the shuffled order); rows are then visited in a fresh permutation per epoch, row ``k`` of the
stream (step * rows + i) depending only on (seed, k), as :class:`~tpkernels.train.data.PackedText`.
"""

from __future__ import annotations

import bisect
import warnings

import torch

from tpkernels.data.batch import TokenBatch, number_pairs
from tpkernels.data.chat import Encoded
from tpkernels.data.stream import step_positions, stream_rows

OVERFLOW = ("error", "truncate")


def best_fit(lengths: list[int], seq: int) -> list[list[int]]:
    """Rows of sample indices: longest first, each into the row with the least room that holds it (a new
    row when none does). Every length must be <= ``seq``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (seq - n, len(rows) - 1))
        else:
            room, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
    return rows


def fit_overflow(docs: list[Encoded], seq: int, overflow: str, where: str) -> list[Encoded] | None:
    """``docs`` (one sample, or a pair) within ``seq`` tokens together, by ``overflow``; None: nothing
    supervised is left after truncation (the sample is dropped)."""
    total = sum(len(d) for d in docs)
    if total <= seq:
        return docs
    what = "sample" if len(docs) == 1 else "chosen/rejected pair"
    if overflow == "error":
        raise ValueError(f"{where}: the {what} has {' + '.join(str(len(d)) for d in docs)} tokens, longer than a row "
                         f"(data.seq_length {seq}); raise data.seq_length or set data.overflow=truncate")
    if len(docs) == 1:
        budgets = [seq]
    else:
        a, b = len(docs[0]), len(docs[1])
        short = min(a, b, seq // 2)
        budgets = [short, seq - short] if a <= b else [seq - short, short]
    out = [Encoded(d.ids[:n], d.mask[:n]) for d, n in zip(docs, budgets)]
    if not all(any(d.mask[1:]) for d in out):
        return None
    return out


class PackedSamples:
    """Encoded samples packed into rows once (see the module docstring); ``batch(step, rows)``."""

    def __init__(self, items: list[list[Encoded]], seq: int, seed: int, pad_id: int, *, overflow: str = "error",
                 names: list[str] | None = None, source: str = ""):
        if overflow not in OVERFLOW:
            raise ValueError(f"data.overflow ({overflow!r}) must be one of {', '.join(OVERFLOW)}")
        fitted, dropped = [], 0
        for k, docs in enumerate(items):
            f = fit_overflow(docs, seq, overflow, names[k] if names else f"{source} record {k}")
            if f is None:
                dropped += 1
            else:
                fitted.append(f)
        if dropped:
            warnings.warn(f"data.source ({source!r}): {dropped} sample(s) longer than data.seq_length ({seq}) kept no "
                          "supervised token after truncation and were dropped", UserWarning, stacklevel=2)
        if not fitted:
            raise ValueError(f"data.source ({source!r}) has no sample to train on")
        self.pairs = len(fitted[0]) == 2
        perm = torch.randperm(len(fitted), generator=torch.Generator().manual_seed(seed * 104_729 + 1)).tolist()
        fitted = [fitted[i] for i in perm]
        layout = best_fit([sum(len(d) for d in docs) for docs in fitted], seq)
        n = len(layout)
        self.ids = torch.full((n, seq), pad_id, dtype=torch.long)
        self.pos = torch.empty((n, seq), dtype=torch.long)
        self.mask = torch.zeros((n, seq), dtype=torch.bool)
        self.pair = torch.full((n, seq), -1, dtype=torch.long)  # per row: the pair's number within its row
        self.chosen = torch.zeros((n, seq), dtype=torch.bool)
        self.sample = torch.full((n, seq), -1, dtype=torch.long)  # the pair's index in the packed data
        pairs = 0
        self.filled = torch.zeros(n, dtype=torch.long)  # per row: its samples' tokens (the rest is padding)
        for r, members in enumerate(layout):
            t = 0
            for j, i in enumerate(sorted(members)):  # by the shuffled order: rows do not depend on dict order
                for d, doc in enumerate(fitted[i]):
                    L = len(doc)
                    self.ids[r, t:t + L] = torch.tensor(doc.ids)
                    self.pos[r, t:t + L] = torch.arange(L)
                    self.mask[r, t:t + L] = torch.tensor(doc.mask)
                    if self.pairs:
                        self.pair[r, t:t + L] = j
                        self.chosen[r, t:t + L] = d == 0
                        self.sample[r, t:t + L] = pairs
                    t += L
                pairs += self.pairs
            self.filled[r] = t
            self.pos[r, t:] = torch.arange(seq - t)  # the filler: a document of its own, never a target
        self.seq, self.seed, self.rows, self.samples = seq, seed, n, len(fitted)
        self.num_pairs = pairs  # preference data: pair_sample runs over [0, num_pairs)

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        """The rows at stream ``positions`` (a blend reads a source's stream this way)."""
        return self.packed_rows(stream_rows(positions, self.rows, self.seed))

    def packed_rows(self, idx: torch.Tensor) -> TokenBatch:
        """The packed rows ``idx`` (row order of the packing, not of the stream: a pass over the whole
        dataset, as the DPO reference pass makes, reads them so)."""
        out = TokenBatch(self.ids[idx], self.pos[idx], self.mask[idx])
        if self.pairs:  # the pairs numbered over the batch, in row order
            out.pair_index, out.chosen = number_pairs(self.pair[idx]), self.chosen[idx]
            out.pair_sample = self.sample[idx]
        return out
