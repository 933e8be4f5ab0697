"""A config file and the flags are merged first (a flag beats the file), then the rules are checked
once: a rule that ties two keys judges the file's value against the flag's, not against a default.
Two spellings of one key in a file (nested and dotted, ``-`` and ``_``, an alias and its real name)
are refused as a YAML key given twice is, naming both."""

from __future__ import annotations

import contextlib
import re

import pytest

from test_bad_inputs_cli import TINY
from tpkernels.train import TrainConfig

# (file, flags accepted with it, what they give, flags refused with it, the rule named)
CASES = {
    "warmup_steps in the file, --steps": (
        "optimizer:\n  warmup_steps: 100\n", {"steps": "1000"}, ("optimizer.warmup_steps", 100),
        {"steps": "50"}, r"optimizer.warmup_steps \(100\) must be in \[0, training.steps \(50\)\]"),
    "min_lr in the file, --lr": (
        "optimizer:\n  min_lr: 0.01\n", {"lr": "0.1"}, ("optimizer.min_lr", 0.01),
        {"lr": "0.001"}, r"optimizer.min_lr \(0.01\) must be <= optimizer.lr \(0.001\)"),
    "autotune.candidates in the file, --layout auto": (
        "autotune:\n  candidates: 2\n", {"layout": "auto"}, ("autotune.candidates", 2),
        {"layout": "manual"}, r"autotune.candidates \(2\) needs layout: auto"),
    "sequence_parallel in the file, --tp 2": (
        "parallel:\n  sequence_parallel: true\n", {"tp": "2"}, ("parallel.sequence_parallel", True),
        {"tp": "1"}, r"parallel.sequence_parallel=True requires parallel.tp > 1"),
    "stop_at_step in the file, --steps": (
        "training:\n  stop_at_step: 50\n", {"steps": "100"}, ("training.stop_at_step", 50),
        {"steps": "20"}, r"training.stop_at_step \(50\) must be <= training.steps \(20\)"),
}


def _flags(short: dict) -> dict:
    from tpkernels.train.config import FLAG_ALIASES

    return {FLAG_ALIASES.get(k, k): v for k, v in short.items()}


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("case", list(CASES))
def test_the_file_and_the_flags_are_checked_together(tmp_path, case):
    text, ok_flags, (key, value), bad_flags, rule = CASES[case]
    (tmp_path / "run.yaml").write_text(text)
    cfg = TrainConfig.load(tmp_path / "run.yaml", _flags(ok_flags), text_overrides=True)
    assert _get(cfg, key) == value
    with pytest.raises(ValueError, match=rule):
        TrainConfig.load(tmp_path / "run.yaml", _flags(bad_flags), text_overrides=True)
    with pytest.raises(ValueError, match=rule.split(r" \(")[0]):  # the file alone breaks the rule (default)
        TrainConfig.load(tmp_path / "run.yaml")


def test_a_flag_beats_the_file_and_a_fixed_value_is_not_refused(tmp_path):
    (tmp_path / "run.yaml").write_text("parallel:\n  tp: 2\ntraining:\n  steps: 0\n")
    cfg = TrainConfig.load(tmp_path / "run.yaml", _flags({"tp": "1", "steps": "5"}), text_overrides=True)
    assert (cfg.parallel.tp, cfg.training.steps) == (1, 5)


def test_the_command_line_merges_before_it_checks(tmp_path, capsys):
    from tpkernels.cli import main

    (tmp_path / "run.yaml").write_text("optimizer:\n  warmup_steps: 100\n")
    assert main(["train", "--config", str(tmp_path / "run.yaml"), *TINY, "--steps", "1000", "--dry-run"]) == 0
    assert '"warmup_steps": 100' in capsys.readouterr().out
    assert main(["train", "--config", str(tmp_path / "run.yaml"), *TINY, "--dry-run"]) == 2  # TINY: 2 steps
    err = capsys.readouterr().err
    assert re.search(r"optimizer.warmup_steps \(100\) must be in \[0, training.steps \(2\)\]", err), err


TWICE = {
    "nested and dotted": ("run.yaml", "parallel:\n  tp: 2\nparallel.tp: 1\n",
                          r"config key 'parallel.tp' is given twice \(as 'parallel: \{tp\}' and as 'parallel.tp'\)"),
    "dashes and underscores": ("run.yaml", "parallel.micro-batch-size: 2\nparallel.micro_batch_size: 1\n",
                               r"config key 'parallel.micro_batch_size' is given twice \(as 'parallel.micro-batch-size' "
                               r"and as 'parallel.micro_batch_size'\)"),
    "an alias and its key": ("run.yaml", "tp: 2\nparallel.tp: 1\n",
                             r"config key 'parallel.tp' is given twice \(as 'tp' and as 'parallel.tp'\)"),
    "old model string and model.name": ("run.yaml", "model: Llama-2-7B\nmodel.name: GPT2\n",
                                        r"config key 'model.name' is given twice \(as 'model' and as 'model.name'\)"),
    "TOML table and dotted key": ("run.toml", '"parallel.tp" = 1\n[parallel]\ntp = 2\n',
                                  r"config key 'parallel.tp' is given twice \(as 'parallel.tp' and as 'parallel: \{tp\}'\)"),
}


@pytest.mark.parametrize("case", list(TWICE))
def test_two_spellings_of_one_key_are_refused(tmp_path, case):
    name, text, message = TWICE[case]
    (tmp_path / name).write_text(text)
    with pytest.warns(FutureWarning) if case == "an alias and its key" else contextlib.nullcontext():
        with pytest.raises(ValueError, match=message + f" in .*{re.escape(name)}; give each key once"):
            TrainConfig.load(tmp_path / name)


def test_the_planner_refuses_two_spellings_too(tmp_path, capsys):
    from tpkernels.cli import main

    (tmp_path / "plan.yaml").write_text("cluster:\n  nodes: 2\ncluster.nodes: 1\n")
    assert main(["plan", "--config", str(tmp_path / "plan.yaml"), "--model", "Llama-3-8B"]) == 2
    assert "config key 'cluster.nodes' is given twice (as 'cluster: {nodes}' and as 'cluster.nodes')" in \
        capsys.readouterr().err
