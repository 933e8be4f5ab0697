"""A run that tells its story in a log file: one plain progress line per logging.log_every steps when
stdout is not a terminal (no carriage returns), where each checkpoint went, "resumed from step N
(saved at layout X)", "nothing to do" for a finished run, a note when nothing is kept, and a summary
whose tokens/s and MFU are over the run; the comm/compute warning is judged after the warm-up step,
with advice that fits the run."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tpkernels.train import Trainer
from tpkernels.train import trainer as trainer_mod
from tpkernels.train.metrics import comm_advice
from tpkernels.train.progress import over_the_run, run_summary

from test_train import small


@pytest.fixture(autouse=True)
def fresh_process_memory():
    trainer_mod._SAID.clear()  # what this process has said once (the note about save_dir)


LINE = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d{4})  lr (\S+)  tokens/s ([\d,]+)(  eval (\d+\.\d{4}))?  "
                  r"ETA \d+:\d\d:\d\d$")


def test_progress_in_a_file_is_one_plain_line_per_logging_step(capsys, fresh_seed):
    steps, every = 5 + fresh_seed % 4, 2 + fresh_seed % 2
    cfg = small(steps=steps, num_microbatches=1, **{"logging.progress": True, "logging.log_every": every,
                                                  "eval.source": "random-documents", "eval.every": 3,
                                                  "eval.batches": 1})
    history = Trainer(cfg).train()
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = [m for m in map(LINE.match, out.splitlines()) if m]
    # the logging steps, the first after the warm-up, the last
    want = sorted({s for s in range(steps) if s % every == 0} | {1, steps - 1})
    assert [int(m[1]) - 1 for m in lines] == want
    assert all(int(m[2]) == steps for m in lines)
    for m in lines:
        h = history[int(m[1]) - 1]
        assert m[3] == f"{h['loss']:.4f}" and float(m[4]) == pytest.approx(h["lr"], rel=1e-2)
        assert (m[7] is not None) == ("eval/loss" in h)
        if m[7]:
            assert m[7] == f"{h['eval/loss']:.4f}"


def test_saves_resume_and_a_finished_run_are_said(tmp_path, capsys):
    ck = tmp_path / "ck"
    kw = dict(steps=5, num_microbatches=1, save_dir=str(ck))
    Trainer(small(**kw, save_every=3)).train()
    out = capsys.readouterr().out
    assert f"checkpoint: step 3 saved to {ck / 'step_00000003'}" in out
    assert f"checkpoint: step 5 saved to {ck / 'step_00000005'}" in out
    assert "not kept" not in out
    t = Trainer(small(**kw))
    assert t.train() == []
    out = capsys.readouterr().out.splitlines()
    assert out == [f"resumed from step 5 of {ck / 'step_00000005'} (saved at TP1 PP1 DP1 mbs1)",
                   "nothing to do: already at step 5 (training.steps 5); raise training.steps to train further"]


def test_a_run_without_save_dir_says_the_model_is_not_kept(capsys):
    Trainer(small(steps=2, num_microbatches=1)).train()
    Trainer(small(steps=2, num_microbatches=1)).train()  # said once per process
    said = [line for line in capsys.readouterr().out.splitlines() if "not kept" in line]
    assert said == ["note: checkpoint.save_dir is not set: the trained model is not kept (set it to keep checkpoints "
                    "to resume from and export)"]


def test_summary_reports_speed_over_the_run_and_best_eval(tmp_path, fresh_seed):
    import random

    rnd = random.Random(fresh_seed)
    cfg = small(steps=6, num_microbatches=1, save_dir=str(tmp_path / "ck"),
                **{"logging.tensorboard_dir": str(tmp_path / "tb")})
    tokens = 8 * 16  # rows × seq of each step
    history = []
    for s in range(6):
        dt = rnd.uniform(0.05, 2.0)
        history.append({"step": s, "loss": rnd.uniform(1, 5), "step_s": dt, "tokens_per_s": tokens / dt,
                        "mfu": 1e9 / (dt * 1e11)})
    history[2]["eval/loss"], history[5]["eval/loss"] = 2.5, 3.25
    tps, mfu = over_the_run(history)
    total = sum(h["step_s"] for h in history)
    assert tps == pytest.approx(6 * tokens / total) and mfu == pytest.approx(6e9 / (total * 1e11))
    text = run_summary(cfg, history, layout="TP1 PP1 DP1 mbs1", peak_label="x")
    assert text.splitlines()[0] == f"TP1 PP1 DP1 mbs1: 6 steps: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}"
    assert "eval loss    3.2500 final, 2.5000 best (after step 2)" in text
    assert f"{6 * tokens / total:,.0f} tokens/s" in text
    assert f"checkpoint   none complete in {tmp_path / 'ck'}" in text  # set, though nothing saved yet
    assert f"tensorboard  {tmp_path / 'tb'}" in text


def test_comm_warning_waits_for_the_warm_up_step(capsys):
    t = Trainer(small(steps=12, num_microbatches=1, **{"logging.log_every": 5}))
    rec = lambda step: trainer_mod.StepRecord(step, 1.0, 1e-3, 1.0, 0.1, 1.0, False, 0.0, 8.64, 0.0, {})  # noqa: E731
    t._warn_comm(rec(0))  # the warm-up: 864% says nothing
    assert capsys.readouterr().out == ""
    assert t._logging_step(1)  # the first step after the warm-up is measured on the worst rank
    t._warn_comm(rec(1))
    t._warn_comm(rec(5))
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("warning: communication/compute 864% > 30% on the worst rank at "
                                                 "TP1 PP1 DP1 mbs1 (step 1): give each rank more work")


def test_comm_advice_fits_the_run(monkeypatch):
    import tpkernels.train.metrics as metrics

    cfg = small(tp=2)
    mc, pc = cfg.model_config(), cfg.parallel.for_world(2)
    monkeypatch.setattr(metrics, "memory_capacity_gib", lambda device: 1000.0)
    assert comm_advice(pc, cfg, mc).startswith("lower parallel.tp (2 -> 1, with more dp or pp); or a larger")
    monkeypatch.setattr(metrics, "memory_capacity_gib", lambda device: 1e-6)  # nothing fits at TP1
    said = comm_advice(pc, cfg, mc)
    assert said.startswith("parallel.tp (2) is the smallest that fits") and "lower" not in said
    measured = dataclasses.replace(cfg, predicted={"step_s": 1.0, "bubble": 0, "comm_ratio": 0.5, "layout": "x",
                                                   "chosen_by": "autotune"})
    said = comm_advice(pc, measured, mc)
    assert "autotune measured TP2 PP1 DP1 mbs1 the fastest" in said and "lower" not in said
    planned = dataclasses.replace(cfg, predicted={"step_s": 1.0, "bubble": 0, "comm_ratio": 0.5, "layout": "x"})
    assert "the planner picked" in comm_advice(pc, planned, mc) and "lower" not in comm_advice(pc, planned, mc)


def test_warnings_are_one_line_in_the_package_voice_once_and_on_rank_0_only(capsys, monkeypatch):
    import warnings

    from tpkernels.train.voice import SAID_ENV, install_warning_voice

    monkeypatch.setenv(SAID_ENV, "said by the launcher")  # what the parent said before the ranks started
    for rank in (1, 0):
        monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
        install_warning_voice(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(3):
                warnings.warn("data.source ('x'): 2 sample(s) were dropped", UserWarning, stacklevel=1)
                warnings.warn("said by the launcher", UserWarning, stacklevel=1)
    assert capsys.readouterr().err.splitlines() == ["warning: data.source ('x'): 2 sample(s) were dropped"]
