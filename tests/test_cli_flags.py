"""The command line as the docs say (issue 44 §4): an unknown flag gets the nearest known one, as an unknown
file key does; a switch is true or false on the command line as in a file; --help shows each key's real
default (parallel.dp: none, what the world leaves)."""

from __future__ import annotations

import random

import pytest

from tpkernels import options
from tpkernels.cli import main
from tpkernels.train import TrainConfig


@pytest.mark.parametrize("command, flag, hint", [
    (["train"], "--stepz", "did you mean '--steps', i.e. training.steps?"),
    (["train"], "--parallel.seq_parallel", "did you mean '--parallel.sequence_parallel'?"),
    (["train"], "--training.stepz", "did you mean '--training.steps'?"),
    (["plan", "--model", "Llama-3-8B"], "--gpux", "did you mean '--gpu', i.e. cluster.gpu?"),
    (["generate", "no/such/checkpoint"], "--max-new-tokenz", "did you mean '--max-new-tokens'?"),
])
def test_an_unknown_flag_names_the_nearest(command, flag, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, flag, "3", "--dry-run"] if command == ["train"] else [*command, flag, "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unknown flag '{flag}' ({hint})" in err, err
    assert "usage:" not in err and len(err.splitlines()) == 1  # one line, not argparse's screen of usage


def test_a_switch_is_true_or_false_on_the_command_line_as_in_a_file(tmp_path, capsys, fresh_seed):
    word = random.Random(fresh_seed).choice(["no", "yes", "on", "off", "1", "0", "nope"])
    assert main(["train", "--parallel.sequence_parallel", word, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"parallel.sequence_parallel ('{word}') must be true or false" in err, err
    (tmp_path / "run.yaml").write_text(f'parallel:\n  sequence_parallel: "{word}"\n')
    with pytest.raises(ValueError, match=rf"parallel.sequence_parallel \(the string '{word}'\) must be true or false"):
        TrainConfig.load(tmp_path / "run.yaml")
    for ok, want in (("true", True), ("False", False)):
        assert TrainConfig.load(None, {"logging.progress": ok}, text_overrides=True).logging.progress is want
    from tpkernels.planner.search import parse_layout  # the planner's compact layout strings keep yes/on/off

    assert parse_layout("tp=2,sp=yes,zero=off")["sequence_parallel"] is True


def test_help_shows_the_real_defaults(capsys):
    keys = {k.path: k for k in options.keys_of(TrainConfig)}
    assert keys["parallel.dp"].default is None and TrainConfig().parallel.dp is None
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "data-parallel replicas; none: world size / (tp · cp · pp) (default: none)" in text
    assert "a progress bar on rank 0" in text or "progress on rank 0" in text
    assert "(default: true)" in text and "(default: True)" not in text


def test_the_docs_config_table_is_current():
    """docs/training.md's config reference is the one the config classes' help strings make: a key added,
    renamed or re-described without `python -m tpkernels.train.config_table --write docs/training.md` fails here."""
    from pathlib import Path

    from tpkernels.train.config_table import config_table, current_in

    doc = Path(__file__).resolve().parents[1] / "docs" / "training.md"
    assert current_in(doc.read_text()) == config_table(), \
        "docs/training.md's config table is stale: run python -m tpkernels.train.config_table --write docs/training.md"
    table = config_table()
    for key in ("dpo.loss_type", "eval.source", "fp8.recipe", "autotune.candidates", "training.task",
                "data.format", "data.loss_on", "data.overflow", "data.max_unknown", "training.check_memory"):
        assert f"| `{key}` |" in table, key
    assert ".jsonl" in table and "parquet" in table and "indexed" in table and "blend" in table
