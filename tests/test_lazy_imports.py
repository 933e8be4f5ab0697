"""What a command imports before it needs it: `tpkernels plan`, `--help` and the launcher's parsing run
without torch (seconds per process), the trainer without torch.distributed.checkpoint; and the package
gives every public name whatever was imported first (its names load on first use, PEP 562)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpkernels.train.launch import launches_ranks


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_command_line_plans_and_parses_without_torch():
    out = _run("import sys\n"
               "from tpkernels.cli import main\n"
               "import tpkernels.train.cli, tpkernels.train.generate_cli, tpkernels.pipeline.simulator\n"
               "main(['plan', '--model', 'Llama-3-8B', '--gpu', 'H100-SXM', '--nodes', '1', '--global-batch', '16',\n"
               "      '--seq-len', '2048', '--top', '1'])\n"
               "print('torch imported:', 'torch' in sys.modules)")
    assert "wins:" in out  # it planned
    assert out.strip().endswith("torch imported: False")


# each a fresh interpreter: the first import decides the order modules initialise in
@pytest.mark.parametrize("first", ["import tpkernels.models", "import tpkernels.functional.attention",
                                   "from tpkernels.train import Trainer"])
def test_every_public_name_whatever_is_imported_first(first):
    out = _run(f"{first}\n"
               "import sys\n"
               "import tpkernels\n"
               "assert callable(tpkernels.rms_norm) and callable(tpkernels.build_info)\n"
               "assert tpkernels.parallel.mappings.__name__ == 'tpkernels.parallel.mappings'\n"
               "assert tpkernels.nn.BiasGeLU and tpkernels.backends.select and tpkernels.hf.apply_kernels\n"
               "from tpkernels import swiglu, route\n"
               "from tpkernels.train import Trainer, TrainConfig\n"
               "print('dcp imported:', 'torch.distributed.checkpoint' in sys.modules)")
    assert out.strip().endswith("dcp imported: False")  # the trainer loads it on the first save or load
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        import tpkernels

        tpkernels.no_such_name  # noqa: B018


@pytest.mark.parametrize("argv, starts", [
    (["--nproc", "2"], True), (["--nproc=4", "--tp", "2"], True), (["ck", "--nproc", "2"], True),
    (["--nproc", "2", "--dry-run"], False), (["--nproc", "2", "--help"], False), (["--steps", "3"], False), ([], False)])
def test_only_a_launch_starts_the_ranks_server_early(argv, starts):
    assert launches_ranks(argv) is starts
