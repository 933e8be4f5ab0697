"""Validation (eval.source / eval.every / eval.batches): forward-only passes over held-out data at the
run's layout; the loss is the held-out token mean (SFT: over the supervised tokens) over every held-out row
once (capped by eval.batches), its perplexity, and for DPO the mean pair loss with TRL's metrics; the same at
every layout."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from data_checks import CHATS, MARKED, make_tokenizer, write_jsonl
from test_dpo import _cfg as dpo_cfg
from test_train import small
from tpkernels.data.batch import TokenBatch
from tpkernels.models import ParallelTransformer
from tpkernels.parallel import ParallelConfig
from tpkernels.parallel.state import ParallelState
from tpkernels.train import Trainer
from tpkernels.train.data import make_data

SEQ = 48


def _cfg(tmp_path, **kw):
    tok = tmp_path / "tok"
    if not tok.exists():
        make_tokenizer(tok, MARKED)
        write_jsonl(tmp_path / "train.jsonl", CHATS * 4)
        write_jsonl(tmp_path / "held_out.jsonl", CHATS[1:] * 3)
    return small(**{"data.source": str(tmp_path / "train.jsonl"), "data.tokenizer": str(tok), "seq_length": SEQ,
                    "training.precision": "fp64", "steps": 3, "eval.source": str(tmp_path / "held_out.jsonl"),
                    "eval.every": 2, "eval.batches": 2, "micro_batch_size": 2, "num_microbatches": 1, **kw})


def test_held_out_loss_is_the_token_mean_of_every_held_out_row_once(tmp_path):
    """lr 0: the weights stay the initial ones, so the validation after steps 2 and 3 is the one-process
    model's token mean over the supervised tokens of every held-out row, each counted once, computed here
    directly: 3 packed rows in global batches of 2 (the last one padded), eval.batches 2 reaching past them
    (no row read twice); with eval.batches 1, the pass's first global batch only."""
    cfg = _cfg(tmp_path, **{"optimizer.lr": 0.0, "optimizer.min_lr": 0.0})
    trainer = Trainer(cfg)
    hist = trainer.train()
    assert ["eval/loss" in h for h in hist] == [False, True, True]  # after step 2 (every 2) and the last
    data = make_data(str(tmp_path / "held_out.jsonl"), SEQ, cfg.training.seed, cfg.model_config().vocab_size,
                     str(tmp_path / "tok"))
    packed = data.packed
    assert packed.rows == 3 < 2 * 2  # the pass ends inside eval.batches × global batch
    state = ParallelState.create(ParallelConfig(micro_batch_size=1, num_microbatches=1))
    model = ParallelTransformer(cfg.model_config(), state, seed=cfg.training.seed, dtype=torch.float64)
    losses, counts = [], []
    for r in range(packed.rows):  # the packed rows themselves, in any order: each once
        row = TokenBatch(packed.ids[r:r + 1], packed.pos[r:r + 1], packed.mask[r:r + 1])
        target = row.targets()
        counts.append(int((target != -100).sum()))
        assert 0 < counts[-1] < int((row.position_ids[:, 1:] != 0).sum())  # the prompts are not in it
        losses.append(counts[-1] * model.evaluate(row.ids, target, row.position_ids))
    for h in hist[1:]:
        assert h["eval/loss"] == pytest.approx(sum(losses) / sum(counts), rel=1e-12)
        assert h["eval/perplexity"] == pytest.approx(math.exp(sum(losses) / sum(counts)), rel=1e-12)
    trainer.cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batches=1))  # the pass's first batch
    first = [int(torch.nonzero((packed.ids == data.rows_at(torch.tensor([k])).ids).all(1))[0]) for k in (0, 1)]
    want = sum(losses[r] for r in first) / sum(counts[r] for r in first)
    assert trainer.validate()["eval/loss"] == pytest.approx(want, rel=1e-12)


def _eval_losses(cfg) -> list[float]:
    return [h["eval/loss"] for h in Trainer(cfg).train() if "eval/loss" in h]


def _worker(rank, world, tmp_path, kw, dpo):
    return _eval_losses((dpo_cfg if dpo else _cfg)(tmp_path, **kw))


LAYOUTS = {"tp2pp2": dict(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=2),
           "dp2cp2": dict(dp=2, cp=2, micro_batch_size=1, num_microbatches=1)}


@pytest.mark.parametrize("dpo,layout,batches", [(False, "tp2pp2", 2), (True, "tp2pp2", 2), (True, "dp2cp2", 8)],
                         ids=["sft-tp2pp2", "dpo-tp2pp2", "dpo-dp2cp2"])
def test_validation_at_other_layouts_equals_one_process(rank_pool, tmp_path, dpo, layout, batches):
    """The same held-out rows at every layout, a padded last batch included (sft: 3 rows in 2 batches of 2,
    a PP micro-batch with no target; dpo-dp2cp2: 15 rows of pairs in 8, a DP replica with no pair)."""
    extra = {"eval.source": str(tmp_path / "pairs.jsonl"), "eval.every": 2, "eval.batches": batches} if dpo else {}
    one = dict(micro_batch_size=2, num_microbatches=1, **extra)
    want = _eval_losses((dpo_cfg if dpo else _cfg)(tmp_path, **one))
    assert len(want) == 2 and want[1] != want[0]  # trained in between
    kw = dict(**LAYOUTS[layout], **extra)
    for got in rank_pool(4).run(_worker, tmp_path, kw, dpo, timeout=300):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-12)


def test_dpo_validation_reports_trls_metrics(tmp_path):
    hist = Trainer(dpo_cfg(tmp_path, **{"eval.source": str(tmp_path / "pairs.jsonl"), "eval.every": 1,
                                        "eval.batches": 1, "micro_batch_size": 2, "num_microbatches": 1})).train()
    for h in hist:
        assert {"eval/loss", "eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen"} <= set(h)
        assert 0.0 <= h["eval/rewards/accuracies"] <= 1.0
    assert hist[-1]["eval/rewards/margins"] != 0.0


@pytest.mark.parametrize("kw,message", [
    ({"eval.every": 2, "eval.source": None}, "eval.every (2) needs eval.source"),
    ({"eval.every": -1}, "eval.every (-1) must be >= 0"),
    ({"eval.batches": 0}, "eval.batches (0) >= 1"),
])
def test_bad_eval_settings_are_named(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(tmp_path, **kw)
