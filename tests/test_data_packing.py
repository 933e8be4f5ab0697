"""Best-fit packing: no sample split, positions restart per sample, a pair's chosen and rejected in one
row (so in one micro-batch and DP share), pairs numbered over the batch, the filler never a target,
the batch of step k a function of (seed, k) only and the same at every DP split; overflow."""

from __future__ import annotations

import random

import pytest
import torch

from tpkernels.data.batch import TokenBatch
from tpkernels.data.chat import Encoded
from tpkernels.data.packing import PackedSamples, best_fit

SEQ = 32


def _items(n: int, seed: int, pairs: bool = False) -> list[list[Encoded]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        docs = []
        for d in range(2 if pairs else 1):
            L = rng.randint(2, SEQ // 2 - 1 if pairs else SEQ)
            prompt = rng.randint(1, L - 1)
            docs.append(Encoded([1000 * k + 100 * d + t for t in range(L)], [False] * prompt + [True] * (L - prompt)))
        out.append(docs)
    return out


def _documents(batch: TokenBatch):
    """(row, start, length) of each document (position 0 starts one)."""
    out = []
    for r in range(batch.rows):
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [SEQ]
        out += [(r, a, b - a) for a, b in zip(starts, starts[1:])]
    return out


def test_best_fit_fills_rows_without_splitting():
    lengths = [random.Random(3).randint(1, SEQ) for _ in range(200)]
    rows = best_fit(lengths, SEQ)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lengths[i] for i in r) <= SEQ for r in rows)
    assert len(rows) <= 1.15 * sum(lengths) / SEQ + 1  # dense: close to the bound


@pytest.mark.parametrize("pairs", [False, True])
def test_every_sample_whole_and_positions_restart(pairs):
    items = _items(40, 1, pairs)
    data = PackedSamples(items, SEQ, seed=5, pad_id=7)
    seen = {}
    b = data.batch(0, data.rows)  # one epoch: every row
    for r, a, n in _documents(b):
        ids = b.ids[r, a:a + n].tolist()
        assert b.position_ids[r, a:a + n].tolist() == list(range(n))
        if ids[0] == 7 and not b.loss_mask[r, a:a + n].any():  # the filler
            assert (b.pair_index is None or (b.pair_index[r, a:a + n] == -1).all())
            continue
        k, d = divmod(ids[0] // 100, 10)
        doc = items[k][d]
        assert ids == doc.ids and b.loss_mask[r, a:a + n].tolist() == doc.mask  # whole, in order
        seen[(k, d)] = (r, b.pair_index[r, a].item() if pairs else None)
        if pairs:
            assert b.chosen[r, a:a + n].all() == (d == 0) and (b.pair_index[r, a:a + n] == b.pair_index[r, a]).all()
    assert set(seen) == {(k, d) for k in range(40) for d in range(2 if pairs else 1)}
    if pairs:  # chosen and rejected: one row, one pair number; numbers 0.. over the batch in row order
        assert all(seen[(k, 0)] == seen[(k, 1)] for k in range(40))
        numbers = [b.pair_index[r][b.pair_index[r] >= 0].unique().tolist() for r in range(b.rows)]
        assert sum(numbers, []) == list(range(40))


def test_targets_ignore_prompts_filler_and_document_ends():
    data = PackedSamples(_items(10, 2), SEQ, seed=0, pad_id=7)
    b = data.batch(0, 4)
    t = b.targets()
    want = torch.full_like(b.ids, -100)
    for r, a, n in _documents(b):
        for i in range(a, a + n - 1):
            if b.loss_mask[r, i + 1]:
                want[r, i] = b.ids[r, i + 1]
    assert torch.equal(t, want)


def test_batches_depend_only_on_seed_and_step_and_split_over_dp():
    items = _items(30, 4, pairs=True)
    a, b = PackedSamples(items, SEQ, 11, 7), PackedSamples(items, SEQ, 11, 7)
    for step in (0, 3, 9):  # past an epoch too
        x, y = a.batch(step, 4), b.batch(step, 4)
        assert all(torch.equal(u, v) for u, v in zip(x.fields().values(), y.fields().values()))
    whole = a.batch(2, 4)
    for dp in (1, 2, 4):
        parts = [whole.rows_of_dp_rank(r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([p.ids for p in parts]), whole.ids)
        for p in parts:  # each share holds whole pairs: every pair number twice as a document start
            starts = p.position_ids == 0
            nums = p.pair_index[starts & (p.pair_index >= 0)]
            assert all((nums == v).sum() == 2 for v in nums.unique())
    assert not torch.equal(a.batch(0, 4).ids, PackedSamples(items, SEQ, 12, 7).batch(0, 4).ids)


def test_overflow():
    long = [[Encoded(list(range(40)), [False] * 10 + [True] * 30)]]
    with pytest.raises(ValueError, match=r"rec 0: the sample has 40 tokens, longer than a row \(data.seq_length 32\)"):
        PackedSamples(long, SEQ, 0, 7, names=["rec 0"])
    cut = PackedSamples(long, SEQ, 0, 7, overflow="truncate")
    assert cut.ids[0].tolist() == list(range(32))
    pair = [[Encoded(list(range(20)), [False] + [True] * 19), Encoded(list(range(30)), [False] + [True] * 29)]]
    with pytest.raises(ValueError, match=r"the chosen/rejected pair has 20 \+ 30 tokens, longer than a row"):
        PackedSamples(pair, SEQ, 0, 7)
    cut = PackedSamples(pair, SEQ, 0, 7, overflow="truncate")
    assert (cut.pos[0] == 0).nonzero().flatten().tolist() == [0, 16]
    with pytest.warns(UserWarning, match="1 sample"):  # nothing supervised within the row: dropped, counted
        PackedSamples([[Encoded(list(range(40)), [False] * 35 + [True] * 5)], [Encoded([1, 2], [False, True])]],
                      SEQ, 0, 7, overflow="truncate")
    with pytest.raises(ValueError, match=r"data.overflow \('drop'\) must be one of"):
        PackedSamples(long, SEQ, 0, 7, overflow="drop")
