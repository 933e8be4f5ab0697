"""logging.tensorboard_dir: the event files, read back with TensorBoard's own reader (EventAccumulator),
hold every number the metrics file records at its step, the config and the context as text; a
resumed run continues the same curves (no step twice, the steps trained again hold the new run's
values); a new run drops an older run's curves in the folder. logging.wandb_project without wandb is
refused naming the key."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # a pinned requirement
from tensorboard.util import tensor_util

from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.metrics import MetricsFile
from tpkernels.train.experiment_log import close_logs, wandb_available

from test_train import small


def read_events(folder) -> tuple[dict, dict]:
    """({scalar tag: [(step, value)]}, {text tag: [(step, text)]}) as TensorBoard shows them."""
    ea = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    scalars = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
    texts = {t.removesuffix("/text_summary"): [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
                                               for e in ea.Tensors(t)] for t in ea.Tags()["tensors"]}
    return scalars, texts


def expected_scalars(metrics) -> dict:
    """What the metrics file says each curve is: every number of a step record (a bool as 0/1), a nested
    mapping's numbers under "key/sub", at the record's step."""
    want: dict = {}
    for r in map(json.loads, metrics.read_text().splitlines()):
        if "step" not in r:
            continue
        for k, v in r.items():
            items = v.items() if isinstance(v, dict) else [(None, v)]
            for sub, x in items:
                if k != "step" and isinstance(x, (int, float)):
                    want.setdefault(k if sub is None else f"{k}/{sub}", []).append((r["step"], float(x)))
    return want


def same(a: list, b: list) -> bool:
    """Equal curves: steps equal, values equal at TensorBoard's float32 (NaN equal to NaN)."""
    return [s for s, _ in a] == [s for s, _ in b] and all(
        (math.isnan(x) and math.isnan(y)) or np.float32(x) == np.float32(y) for (_, x), (_, y) in zip(a, b))


def test_event_files_mirror_the_metrics_file_across_a_resume(tmp_path, fresh_seed):
    from torch.utils.tensorboard import SummaryWriter

    metrics, ck, tb = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "tb"
    old = SummaryWriter(str(tb))  # an older run's curve in the folder: a new run replaces it
    for s in range(9):
        old.add_scalar("loss", 99.0, s)
    old.close()
    steps = 5 + fresh_seed % 3  # 5..7 steps, resumed from the checkpoint of step 2 or 4
    kw = {"steps": steps, "num_microbatches": 1, "metrics_file": str(metrics), "tensorboard_dir": str(tb),
          "eval.source": "random-documents", "eval.every": 2, "eval.batches": 1, "training.seed": fresh_seed % 97}
    first = Trainer(small(**kw, save_dir=str(ck), save_every=2)).train()
    resume_at = 4 if steps > 5 and fresh_seed % 2 else 2
    for p in ck.iterdir():
        if int(p.name.split("_")[1]) > resume_at:
            shutil.rmtree(p)
    again = Trainer(small(**kw, save_dir=str(ck))).train()
    close_logs()
    assert [h["step"] for h in again] == list(range(resume_at, steps))

    scalars, texts = read_events(tb)
    want = expected_scalars(metrics)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "comm_ratio", "phases/compute",
            "eval/loss", "eval/perplexity"} <= set(want)
    assert set(scalars) == set(want)
    bad = {t: (scalars[t], want[t]) for t in want if not same(scalars[t], want[t])}
    assert not bad
    # the curve is the run as finally taken: the first run's early steps, then the resumed run's
    loss = [(h["step"], h["loss"]) for h in first[:resume_at] + again]
    assert same(scalars["loss"], loss)
    assert same(scalars["step_s"], [(h["step"], h["step_s"]) for h in first[:resume_at] + again])
    # the config at each start, the layout as text
    assert [s for s, _ in texts["config"]] == [0, resume_at]
    assert "seq_length: 16" in texts["config"][-1][1] and f"steps: {steps}" in texts["config"][-1][1]
    assert texts["layout"][0][1] == again[-1].get("layout", "TP1 PP1 DP1 mbs1")


def test_any_record_goes_to_tensorboard_numbers_as_scalars_and_strings_as_text(tmp_path, fresh_seed):
    """The generic rule: a new kind of record (eval samples, an autotune table) needs no TensorBoard code."""
    rng = np.random.default_rng(fresh_seed)
    tb = tmp_path / "tb"
    cfg = TrainConfig.from_values({"logging.tensorboard_dir": str(tb)})
    sink = MetricsFile.of(cfg)
    sink.start(None)
    x = [float(v) for v in rng.normal(size=3)]
    sink.write({"step": 0, "loss": x[0], "phases": {"compute": x[1]}, "skipped": True, "layout": "TP2 PP1"})
    sink.write({"step": 1, "loss": x[2], "eval/samples": "Q: 2+2?\nA: 4", "layout": "TP2 PP1", "moved": []})
    rows = [{"candidate": 0, "layout": "TP2 PP1 DP2", "measured_step_s": x[0]},
            {"candidate": 1, "layout": "TP1 PP2 DP2", "status": "skipped: memory"}]
    sink.write({"autotune": rows, "winner": "TP2 PP1 DP2", "trial_s": 1.5})  # no step: at the last one
    close_logs()
    scalars, texts = read_events(tb)
    assert same(scalars["loss"], [(0, x[0]), (1, x[2])])
    assert same(scalars["phases/compute"], [(0, x[1])]) and scalars["skipped"] == [(0, 1.0)]
    assert scalars["trial_s"] == [(1, 1.5)]
    assert texts["eval/samples"] == [(1, "Q: 2+2?\nA: 4")]
    assert texts["layout"] == [(0, "TP2 PP1")]  # context: said when it changes, not every step
    table = texts["autotune"][0][1].splitlines()
    assert table[0] == "| candidate | layout | measured_step_s | status |"
    assert "TP1 PP2 DP2" in table[3] and "skipped: memory" in table[3]
    assert texts["winner"] == [(1, "TP2 PP1 DP2")]
    assert "moved" not in texts and "moved" not in scalars  # an empty list says nothing


@pytest.mark.skipif(wandb_available(), reason="wandb is installed here: the refusal is for its absence")
def test_wandb_project_without_wandb_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"logging.wandb_project \('demo'\) needs the wandb package"):
        TrainConfig.from_values({"logging.wandb_project": "demo"})


def test_tensorboard_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "tb"
    f.write_text("")
    with pytest.raises(ValueError, match=r"logging.tensorboard_dir .* is a file; it must be a folder"):
        Trainer(small(steps=2, tensorboard_dir=str(f)))


def _two_rank_worker(rank, world, folder, metrics):
    history = Trainer(small(steps=3, tp=2, num_microbatches=1, metrics_file=metrics, tensorboard_dir=folder)).train()
    close_logs()
    return [h["loss"] for h in history]


def test_only_the_logging_rank_writes_events(rank_pool, tmp_path):
    """At TP2 both ranks train; rank 0 alone writes the event files, and its curves are the metrics file's."""
    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    losses = rank_pool(2).run(_two_rank_worker, str(tb), str(metrics), timeout=300)
    assert losses[0] == losses[1]
    files = list(tb.glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars, _ = read_events(tb)
    want = expected_scalars(metrics)
    assert set(scalars) == set(want) and all(same(scalars[t], want[t]) for t in want)
    assert same(scalars["loss"], list(enumerate(losses[0])))


def test_wandb_gets_the_same_scalars_offline(tmp_path, monkeypatch):
    """With wandb importable (here a stand-in module that records its calls: no network, no package), the
    run is opened in offline mode with the config and logs every step's numbers at its step."""
    import importlib.machinery
    import sys
    import types

    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, values, step=None):
            calls["log"].append((step, dict(values)))

        def finish(self):
            calls["finish"] += 1

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    metrics = tmp_path / "m.jsonl"
    Trainer(small(steps=3, num_microbatches=1, metrics_file=str(metrics), wandb_project="tpk-test")).train()
    close_logs()
    (init,) = calls["init"]
    assert init["project"] == "tpk-test" and init["mode"] == "offline" and init["config"]["training"]["steps"] == 3
    want = expected_scalars(metrics)
    logged = {}
    for step, values in calls["log"]:
        for k, v in values.items():
            logged.setdefault(k, []).append((step, v))
    finite = {k: [(s, x) for s, x in v if math.isfinite(x)] for k, v in want.items()}
    assert logged == {k: v for k, v in finite.items() if v} and calls["finish"] == 1


def test_tensorboard_dir_without_tensorboard_is_refused_naming_the_key(monkeypatch):
    import tpkernels.train.experiment_log as xl

    monkeypatch.setattr(xl, "tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match=r"logging.tensorboard_dir \('runs/x'\) needs the tensorboard package"):
        TrainConfig.from_values({"logging.tensorboard_dir": "runs/x"})
