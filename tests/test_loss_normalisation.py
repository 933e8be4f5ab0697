"""The loss of a step is the token mean of the global batch, whatever the layout.

On packed documents of uneven length each micro-batch holds its own number of targets (a
document's last token predicts nothing), so a mean of per-micro-batch means changes with the
micro-batch size, their number, DP and CP. Here the same global batch is trained three steps at
mbs 1×4, 2×2, 4×1, DP2, PP2 (each schedule), CP2, DP2×CP2 and TP2×PP2+SP, every run in float64,
and each step's loss and gradient norm must equal the one-process fp64 run that takes the whole
batch as one micro-batch, to 1e-6 relative (they agree to ~1e-12; a normalisation slip is ~1e-3).
"""

from __future__ import annotations

import pytest
import torch

from test_train import small
from tpkernels.models import next_token_targets
from tpkernels.train import Trainer
from tpkernels.train.data import RandomDocuments

PACKED = {"data.source": "random-documents", "training.precision": "fp64", "steps": 3}

CASES = {
    "mbs1x4": dict(micro_batch_size=1, num_microbatches=4),
    "mbs2x2": dict(micro_batch_size=2, num_microbatches=2),
    "dp2": dict(dp=2, micro_batch_size=1, num_microbatches=2),
    "pp2-gpipe": dict(pp=2, num_microbatches=4, schedule="gpipe"),
    "pp2-1f1b": dict(pp=2, num_microbatches=4, schedule="1f1b"),
    "pp2-zb-h1": dict(pp=2, num_microbatches=4, schedule="zb-h1"),
    "pp2-interleaved": dict(pp=2, virtual_stages=2, num_microbatches=2, micro_batch_size=2, schedule="interleaved"),
    "cp2": dict(cp=2, micro_batch_size=2, num_microbatches=2),
    "dp2cp2": dict(dp=2, cp=2, micro_batch_size=1, num_microbatches=2),
    "tp2pp2-sp": dict(tp=2, pp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=2),
}


def _train(kw: dict, seed: int) -> tuple[list[float], list[float]]:
    history = Trainer(small(**PACKED, seed=seed, **kw)).train()
    return [h["loss"] for h in history], [h["grad_norm"] for h in history]


def _worker(rank, world, kw, seed):
    return _train(kw, seed)


def test_micro_batches_hold_different_target_counts(fresh_seed):
    """What makes the other tests bite: the 4 rows of a step hold different numbers of targets."""
    b = RandomDocuments(97, 16, fresh_seed % 2**31).batch(0, 4)
    ids, pos = b.ids, b.position_ids
    counts = (next_token_targets(ids, pos) != -100).sum(dim=1)
    assert len(set(counts.tolist())) > 1, counts
    assert bool((pos[:, 1:] == 0).any())  # documents restart inside rows


@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_trains_the_whole_batch_token_mean(rank_pool, case, fresh_seed):
    seed = fresh_seed % 2**31
    want_loss, want_norm = _train(dict(micro_batch_size=4, num_microbatches=1), seed)
    kw = CASES[case]
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1) * kw.get("cp", 1)
    results = rank_pool(world).run(_worker, kw, seed, timeout=300) if world > 1 else [_train(kw, seed)]
    for loss, norm in results:
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), rtol=1e-6, atol=0)


def test_fp32_micro_batching_agrees_with_the_fp64_token_mean(fresh_seed):
    """fp32 at mbs 1×4 tracks the fp64 whole-batch run to fp32 rounding, not to a mean of means."""
    seed = fresh_seed % 2**31
    want, _ = _train(dict(micro_batch_size=4, num_microbatches=1), seed)
    got = [h["loss"] for h in Trainer(small(**{**PACKED, "training.precision": "fp32"}, seed=seed,
                                            micro_batch_size=1, num_microbatches=4)).train()]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-6, atol=0)
