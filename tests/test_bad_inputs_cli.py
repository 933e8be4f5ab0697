"""The command line's bad inputs, as a user meets them: one line naming the parameter, its value and
the rule, exit code 2, no traceback (``--debug`` shows it). Output paths that cannot be written,
malformed config files, launcher flags, export to a file, and a rank's error inside ``--nproc``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tpkernels.cli import main

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab", "97",
        "--seq-length", "16", "--steps", "2", "--progress", "false"]


def _paths(tmp: Path) -> dict:
    (tmp / "a_file").write_text("x")
    (tmp / "a_folder").mkdir()
    return {"file": str(tmp / "a_file"), "under": str(tmp / "a_file" / "sub"), "folder": str(tmp / "a_folder")}


CASES = {
    "save_dir is a file": (["--save-dir", "{file}"], r"checkpoint.save_dir \('.*a_file'\) is a file; it must be a folder"),
    "save_dir under a file": (["--save-dir", "{under}"], r"checkpoint.save_dir \('.*sub'\) lies under '.*a_file', which "
                                                          r"is a file"),
    "metrics_file is a folder": (["--metrics-file", "{folder}"], r"logging.metrics_file \('.*a_folder'\) is a folder; "
                                                                 r"it must be a file"),
    "metrics_file under a file": (["--metrics-file", "{under}"], r"logging.metrics_file .* lies under"),
    "trace under a file": (["--trace", "{under}"], r"logging.trace \('.*sub'\) lies under '.*a_file'"),
    "trace is a folder": (["--trace", "{folder}"], r"logging.trace .* is a folder"),
    "nproc 0": (["--nproc", "0"], r"--nproc \(0\) must be a positive integer"),
    "max-restarts negative": (["--nproc", "2", "--max-restarts", "-1"], r"--max-restarts \(-1\) must be >= 0"),
    "max-restarts without nproc": (["--max-restarts", "2"], r"--max-restarts \(2\) needs --nproc"),
    "initial_loss_scale 0": (["--initial-loss-scale", "0"], r"training.initial_loss_scale \(0.0\) must be > 0"),
    "world not TP x PP x DP": (["--nproc", "3", "--tp", "2"], r"world_size \(3\) must be divisible by parallel.tp \(2\)"),
    "data missing": (["--vocab", "300", "--data", "{under}"], r"data.source \('.*sub'\) must be 'random', 'random-documents', a text file or a folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_bad_inputs_are_one_line_exit_2(tmp_path, capsys, case):
    flags, message = CASES[case]
    p = _paths(tmp_path)
    argv = ["train", *TINY, *[f.format(**p) for f in flags]]
    if "--nproc" not in flags:
        argv.append("--dry-run")
    assert main(argv) == 2
    err = capsys.readouterr().err
    import re

    assert re.search(message, err), err
    assert "Traceback" not in err and err.count("error:") == 1, err


@pytest.mark.parametrize("text, where", [
    ("training:\n  steps: 2\n   lr: [1\n", r"is not valid YAML at line 3, column 6: mapping values are not allowed"),
    ('training:\n  steps: "2\n', r"is not valid YAML at line 3, column 1: while scanning a quoted scalar"),
])
def test_a_malformed_yaml_file_names_the_line_and_column(tmp_path, capsys, text, where):
    import re

    (tmp_path / "c.yaml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"config \('.*c.yaml'\) " + where, err), err


def test_export_hf_refuses_paths_it_cannot_use(tmp_path, capsys):
    from test_train import small
    from tpkernels.train.trainer import Trainer

    Trainer(small(steps=2, save_dir=str(tmp_path / "ck"))).train()
    p = _paths(tmp_path)
    for out, says in ((p["file"], r"out \('.*a_file'\) is a file; it must be a folder"),
                      (p["under"], r"out \('.*sub'\) lies under '.*a_file', which is a file")):
        assert main(["export-hf", str(tmp_path / "ck"), out]) == 2
        err = capsys.readouterr().err
        import re

        assert re.search(says, err) and "Traceback" not in err, err
    assert main(["export-hf", str(tmp_path / "nothing_here"), str(tmp_path / "hf")]) == 2
    assert "checkpoint ('" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) in (0, None)


def test_a_rank_error_under_nproc_is_said_once_without_a_traceback(tmp_path):
    """A Hugging Face folder with a bool norm: the ranks find it after the launch; the user reads one
    line, exit 2; --debug shows the launcher's log and the traceback."""
    import torch
    from safetensors.torch import load_file, save_file

    from model_checks import save_tiny_model

    folder = Path(save_tiny_model("llama", tmp_path / "hf", 3))
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.layers.3.input_layernorm.weight"] = sd["model.layers.3.input_layernorm.weight"] > 0
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert sd["model.norm.weight"].dtype == torch.float32
    cmd = [sys.executable, "-m", "tpkernels.train", "--nproc", "2", "--pp", "2", "--init-from", str(folder),
           "--seq-length", "16", "--steps", "1", "--progress", "false"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.layers.3.input_layernorm.weight: dtype bool" in lines[0], r.stderr[-2000:]
    d = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=300)
    assert d.returncode != 0 and "Traceback" in d.stderr
