"""The example programs in python/ run and check themselves."""

import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_lanes import lanes

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "python").glob("*.py"))
# shorter runs of the longest examples (each still checks itself: its loss falls, its resume and export
# agree); finetune_lora runs as QLoRA here (its LoRA path is the default users run)
ARGS = {"dpo.py": ["--steps", "12"], "sft_chat.py": ["--steps", "16"], "train_llama_from_scratch.py": ["--steps", "8"],
        "finetune_lora.py": ["--steps", "6", "--quant", "nf4"], "long_context.py": ["--seq-len", "1024"]}


@pytest.fixture(scope="module")
def example_runs(request):
    """Every selected example's run, two at a time (tests/subprocess_lanes.py)."""
    def job(path):
        return subprocess.run([sys.executable, str(path), *ARGS.get(path.name, [])], capture_output=True, text=True,
                              timeout=300)

    with lanes(request, "test_example_runs", "path", job) as runs:
        yield runs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, example_runs, request):
    r = example_runs[request.node.nodeid].result()
    assert r.returncode == 0, r.stderr[-3000:]


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_example_under_torchrun(tmp_path):
    """The sequence-parallel example on 2 gloo ranks, launched as users launch it."""
    script = Path(__file__).resolve().parents[1] / "python" / "tp_mlp_sequence_parallel.py"
    trace = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script), "--trace", str(trace)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 rank(s): sequence-parallel MLP matches the dense one" in r.stdout
    assert trace.stat().st_size > 0


def test_pipeline_example_under_torchrun(tmp_path):
    script = Path(__file__).resolve().parents[1] / "python" / "pipeline_schedules.py"
    gantt = tmp_path / "pp.png"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script), "--schedule", "interleaved",
                        "--microbatches", "4", "--gantt", str(gantt)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "interleaved on 2 stage(s), 4 micro-batches: losses match single-process training" in r.stdout
    assert gantt.stat().st_size > 1000


def test_llama_from_hf_on_spawned_gloo_ranks():
    """TP2 × PP2 with SP on 4 ranks the example spawns itself (a machine without GPUs)."""
    script = Path(__file__).resolve().parents[1] / "python" / "llama_from_hf.py"
    r = subprocess.run([sys.executable, str(script), "--tp", "2", "--pp", "2", "--sp", "--nproc", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TP2 PP2 DP1 mbs1 SP (4 rank(s), float32): tpkernels loss" in r.stdout


def test_llama_from_hf_under_torchrun(tmp_path):
    """DP2 under torchrun, from a checkpoint folder the test writes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from llama_from_hf import tiny_checkpoint  # noqa: PLC0415

    folder = tiny_checkpoint(str(tmp_path / "ckpt"))
    script = Path(__file__).resolve().parents[1] / "python" / "llama_from_hf.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script), folder, "--microbatches", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TP1 PP1 DP2 mbs1 (2 rank(s), float32): tpkernels loss" in r.stdout
