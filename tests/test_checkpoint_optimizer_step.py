"""AdamW's step count survives a checkpoint when some ranks own no optimizer state: LoRA on one
layer's ``down`` projection (2 trainable tensors) with ZeRO-1 over DP4 leaves two ranks without any.
The count is one key written by every rank, of which DCP keeps one copy (from the rank that writes the
least: an owner-less one); a 0 there resets Adam's bias correction on resume. A resume at step 3 must
find the count 3 on every owner and continue with the losses of the uninterrupted run."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed.checkpoint as dcp

from test_train import small
from tpkernels.train.checkpoint_files import SafeLoadPlanner, SafeReader

STEPS, STOP = 6, 3
KW = {"dp": 4, "zero1": True, "model.layers": 1, "model.finetune": "lora", "model.lora_rank": 4,
      "training.steps": STEPS}


def _worker(rank, world, folder, stop):
    from tpkernels.models import lora
    from tpkernels.train import trainer as trainer_module
    from tpkernels.train.checkpoint import local_optimizer

    def down_only(model, rank, alpha=None, targets=None, **kw):  # the trainer passes targets positionally
        return lora.apply_lora(model, rank, alpha, ("down",), **kw)

    with mock.patch.object(trainer_module, "apply_lora", down_only):  # the pool's ranks serve other tests
        kw = {**KW, "save_dir": folder, "stop_at_step": stop} if folder else KW
        t = trainer_module.Trainer(small(**kw))
        owned = sum(len(g["params"]) for g in local_optimizer(t.optimizer).param_groups)
        steps_found = sorted({float(s["step"]) for s in local_optimizer(t.optimizer).state.values() if "step" in s})
        history = t.train()
    return owned, steps_found, t.step_index, [h["loss"] for h in history]


def test_the_step_count_survives_ranks_that_own_no_optimizer_state(rank_pool, tmp_path):
    pool = rank_pool(4)
    full = pool.run(_worker, None, None, timeout=300)
    assert sorted(o for o, *_ in full) == [0, 0, 1, 1], "two ranks own no optimizer state (the case under test)"
    folder = str(tmp_path / "ck")
    first = pool.run(_worker, folder, STOP, timeout=300)
    assert [r[2] for r in first] == [STOP] * 4
    saved = {"optim::step": torch.zeros((), dtype=torch.float64)}
    dcp.load(saved, storage_reader=SafeReader(str(tmp_path / "ck" / f"step_{STOP:08d}")), planner=SafeLoadPlanner())
    assert float(saved["optim::step"]) == STOP, "the checkpoint holds the owners' count, not an owner-less rank's 0"
    resumed = pool.run(_worker, folder, None, timeout=300)
    for owned, steps_found, _, _ in resumed:
        assert steps_found == ([float(STOP)] if owned else []), "every owner resumes at AdamW step 3"
    torch.testing.assert_close(torch.tensor(resumed[0][3]), torch.tensor(full[0][3][STOP:]), rtol=1e-6, atol=0)
    assert full[0][3][-1] != full[0][3][0]
