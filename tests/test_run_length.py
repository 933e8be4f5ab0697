"""training.epochs: the run's length in passes over the data (steps = ceil(epochs × packed rows / global
batch)), said at the start; steps and epochs in one layer refused by name, a later layer's one
replacing an earlier's other; an endless source refused; --dry-run on chat / preference data prints
the data's summary (samples, packed rows, supervised share) and the epochs a run makes."""

from __future__ import annotations

import math
import random
import re

import pytest

from tpkernels.train import TrainConfig, Trainer
from tpkernels.train import trainer as trainer_mod
from tpkernels.train.cli import dry_run

from data_checks import CHATS, make_tokenizer, write_jsonl
from test_train import small


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return root, make_tokenizer(root / "tok")


def test_steps_and_epochs_in_one_layer_are_refused_and_a_later_layer_wins(tmp_path):
    with pytest.raises(ValueError, match=r"training.steps \(5\) and training.epochs \(2.0\) are both set"):
        TrainConfig.from_values({"training.steps": 5, "training.epochs": 2})
    f = tmp_path / "run.yaml"
    f.write_text("training: {steps: 5, epochs: 1.5}\n")
    with pytest.raises(ValueError, match=r"both set in .*run.yaml"):
        TrainConfig.load(f)
    f.write_text("training: {steps: 5}\n")
    assert TrainConfig.load(f, {"training.epochs": "2"}, text_overrides=True).training.epochs == 2.0
    f.write_text("training: {epochs: 2}\n")
    t = TrainConfig.load(f, {"training.steps": "7"}, text_overrides=True).training
    assert (t.steps, t.epochs) == (7, None)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match=r"training.epochs \(.*\) must be a finite number"):
            TrainConfig.from_values({"training.epochs": bad})


def test_an_endless_source_has_no_epochs():
    with pytest.raises(ValueError, match=r"training.epochs \(1.0\) needs a data.source of finite size.*"
                                         r"'random-documents' is endless"):
        Trainer(small().with_values({"training.epochs": 1.0}))  # a later layer: the epochs replace the steps


def test_epochs_make_the_steps_and_the_run_says_them(chat, capsys, fresh_seed):
    root, tok = chat
    rnd = random.Random(fresh_seed)
    records = [rnd.choice(CHATS) for _ in range(rnd.randint(9, 24))]
    data = write_jsonl(root / f"sft{fresh_seed}.jsonl", records)
    epochs = rnd.choice([0.5, 1.0, 1.7])
    trainer_mod._SAID.clear()
    cfg = TrainConfig.from_values({"model": small().to_dict()["model"], "data.source": str(data), "data.tokenizer": str(tok),
                                   "data.seq_length": 32, "training.epochs": epochs, "optimizer.warmup_steps": 0,
                                   "parallel.micro_batch_size": 4, "parallel.num_microbatches": 1,
                                   "logging.progress": False})
    t = Trainer(cfg)
    rows, gb = t.data.rows, t.pc.global_batch_size
    want = max(1, math.ceil(epochs * rows / gb))
    assert t.cfg.training.steps == want and t.cfg.training.epochs is None
    history = t.train()
    assert len(history) == want
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert said == [f"data: {rows:,} packed rows of 32 tokens; training.epochs {epochs:g} -> {want} steps × {gb} rows "
                    f"read {want * gb:,}: {want * gb / rows:.3g} epochs"]

    text = dry_run(cfg.with_values({"training.epochs": None, "training.steps": 3}), 1)
    m = re.search(r"data: (\d+) samples \(messages, task sft\) packed into (\d+) rows of 32 tokens; supervised tokens "
                  r"([\d,]+) of ([\d,]+) \((\d+\.\d)%; padding (\d+\.\d)% of the rows\)", text)
    assert m, text
    assert int(m[1]) == len(records) and int(m[2]) == rows
    sup, filled = int(m[3].replace(",", "")), int(m[4].replace(",", ""))
    mask = t.data.packed.mask
    assert sup == int(mask.sum()) and 0 < sup < filled <= rows * 32
    assert f"data: {rows:,} packed rows of 32 tokens; 3 steps × {gb} rows read {3 * gb:,}" in text
