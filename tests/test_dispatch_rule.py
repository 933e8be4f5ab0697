"""The one dispatch rule, for every op: an explicit argument beats TPKERNELS_BACKEND (an op's own
entry beats a bare name), which beats the op's default; a chosen implementation that cannot run
raises, naming the op, where the choice came from and why."""

from __future__ import annotations

import os

import subprocess
import sys

import pytest
import torch

import tpkernels
from tpkernels import backends
from tpkernels.backends import BackendUnavailableError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)


def test_every_op_is_behind_the_rule():
    ops = backends.registered_ops()
    assert set(ops) >= {"bias_gelu", "flash_attn", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"}
    assert ops["all_gather_matmul"] == ops["matmul_reduce_scatter"] == ops["matmul_all_reduce"] == \
        ("collective", "ring", "fused")


def test_fused_says_why_it_cannot_run_here():
    cpu = torch.device("cpu")
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert "need CUDA tensors and torch symmetric memory" in backends.why_not("fused", op, cpu, torch.float16)
        with pytest.raises(BackendUnavailableError, match=r"algo argument cannot run .* CUDA tensors"):
            backends.select(op, cpu, "fused", dtype=torch.float16, k=16, n=16)
        # auto never picks it on a CPU, however large the GEMM
        assert backends.select(op, cpu, dtype=torch.bfloat16, flops=1e15, world=8, k=8192, n=8192) != "fused"
    cuda = torch.device("cuda", 0)
    why = backends.why_not("fused", "matmul_reduce_scatter", cuda, torch.float32, k=16, n=16)
    assert why == "the fused kernels take bfloat16 and float16, got torch.float32"
    assert backends.why_not("fused", "all_gather_matmul", cuda, torch.bfloat16, k=17, n=32) == \
        "the fused kernels need K a multiple of 16, got K = 17"
    assert backends.why_not("fused", "all_gather_matmul", cuda, torch.bfloat16, k=32, n=129) == \
        "the fused kernels need N a multiple of 16, got N = 129"


def test_an_explicit_argument_beats_the_environment(monkeypatch):
    x, b = torch.randn(3, 5), torch.randn(5)
    monkeypatch.setenv(backends.ENV_VAR, "cuda")  # cannot run on CPU tensors
    with pytest.raises(BackendUnavailableError, match="TPKERNELS_BACKEND=cuda"):
        tpkernels.bias_gelu(x, b)
    torch.testing.assert_close(tpkernels.bias_gelu(x, b, backend="reference"), torch.nn.functional.gelu(x + b))
    monkeypatch.setenv(backends.ENV_VAR, "flash_attn=triton")
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)  # fp64: no Triton kernel; the argument still decides
    tpkernels.flash_attn_func(q, q, q, backend="reference")
    with pytest.raises(BackendUnavailableError, match=r"TPKERNELS_BACKEND=flash_attn=triton cannot run flash_attn"):
        tpkernels.flash_attn_func(q, q, q)


def test_per_op_entries_and_bare_names(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "bias_gelu=reference, flash_attn=reference")
    assert backends.select("bias_gelu", CPU) == "reference"
    assert backends.select("flash_attn", CPU) == "reference"
    monkeypatch.setenv(backends.ENV_VAR, "reference,bias_gelu=cpp")  # the op's own entry beats the bare name
    assert backends.select("bias_gelu", CPU) == "cpp"
    assert backends.select("flash_attn", CPU) == "reference"
    monkeypatch.setenv(backends.ENV_VAR, "gemm_comm=ring")  # a family names both GEMM-comm ops
    assert backends.select("all_gather_matmul", CPU, flops=1.0, world=2) == "ring"
    assert backends.select("matmul_reduce_scatter", CPU, flops=1.0, world=2) == "ring"
    assert backends.select("bias_gelu", CPU) == "cpp"  # untouched: its default


def test_a_bare_name_an_op_lacks_says_which_op_and_how_to_force_one(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "cuda")  # meant for bias_gelu's CUDA kernel
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(BackendUnavailableError) as e:
        tpkernels.flash_attn_func(q, q, q)
    msg = str(e.value)
    assert "TPKERNELS_BACKEND=cuda (every op) cannot run flash_attn" in msg
    assert "op flash_attn has no cuda implementation (it has: triton, reference)" in msg
    assert "TPKERNELS_BACKEND=bias_gelu=cuda" in msg  # the per-op form


def test_bad_environment_values_are_errors(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "bias_gleu=cuda")
    with pytest.raises(BackendUnavailableError, match=r"names unknown op 'bias_gleu'"):
        backends.select("bias_gelu", CPU)
    monkeypatch.setenv(backends.ENV_VAR, "cpp,reference")
    with pytest.raises(BackendUnavailableError, match=r"names two implementations for every op \('cpp', 'reference'\)"):
        backends.select("bias_gelu", CPU)
    monkeypatch.setenv(backends.ENV_VAR, "bias_gelu=metal")
    with pytest.raises(BackendUnavailableError, match=r"unknown implementation 'metal'; choose one of cuda, triton, cpp"):
        backends.select("bias_gelu", CPU)


def test_dtype_limits_are_part_of_the_rule():
    # the attention's second, dtype-based layer now lives in the rule: fp32 on CUDA skips Triton
    assert backends.select("flash_attn", CUDA, dtype=torch.bfloat16) == "triton"
    assert backends.select("flash_attn", CUDA, dtype=torch.float32) == "reference"
    with pytest.raises(BackendUnavailableError, match="take float16, bfloat16 CUDA tensors, got torch.float32"):
        backends.select("flash_attn", CUDA, "triton", dtype=torch.float32)
    assert backends.select("bias_gelu", CUDA, dtype=torch.float64) == "reference"  # no fp64 CUDA/Triton kernel


def test_gemm_comm_algorithms_follow_the_same_rule(monkeypatch):
    from tpkernels.functional.gemm_comm import choose_algo

    monkeypatch.setenv(backends.ENV_VAR, "gemm_comm=ring")
    assert choose_algo("all_gather_matmul", "collective", 4, 1e15, CPU) == "collective"  # explicit wins
    assert choose_algo("all_gather_matmul", "auto", 4, 1.0, CPU) == "ring"  # "auto" = no choice: the environment
    monkeypatch.setenv(backends.ENV_VAR, "cuda")  # a kernel name does not touch the algorithms
    assert choose_algo("all_gather_matmul", "auto", 4, 1.0, CPU) == "collective"


def test_info_shows_the_rule(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "flash_attn=reference")
    r = subprocess.run([sys.executable, "-m", "tpkernels.cli", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dispatch rule   explicit argument (backend=/algo=, options=) > TPKERNELS_BACKEND op=name entry" in r.stdout
    assert "TPKERNELS_BACKEND flash_attn=reference" in r.stdout
    from tpkernels import env_vars

    for var in env_vars.TABLE:  # the one table of every variable, with what it is now
        row = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith(var.name + " ") and " now " in ln)
        assert f"now {os.environ.get(var.name) or 'unset'} " in row, row
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("flash_attn"))
    assert line.split()[1] == "reference"
    assert "auto: ring from" in next(ln for ln in r.stdout.splitlines() if "all_gather_matmul" in ln)


def test_fused_options_are_read_at_call_time_and_explicit_ones_win(monkeypatch):
    """The fused path's knobs: an explicit option beats the environment, which is read when the call
    resolves them (changing it after import takes effect), and a bad value is named."""
    import torch

    from tpkernels.functional.gemm_comm_fused import FusedOptions

    cpu = torch.device("cpu")
    assert FusedOptions().resolved(cpu).ag_chunks == 4
    monkeypatch.setenv("TPKERNELS_FUSED_AG_CHUNKS", "7")
    monkeypatch.setenv("TPKERNELS_FUSED_RS", "push")
    monkeypatch.setenv("TPKERNELS_SIGNAL_SPINS", "123")
    got = FusedOptions().resolved(cpu)
    assert (got.ag_chunks, got.rs_mode, got.signal_spins) == (7, "push", 123)
    assert FusedOptions(ag_chunks=2, rs_mode="pull").resolved(cpu).ag_chunks == 2
    monkeypatch.setenv("TPKERNELS_FUSED_AG_CHUNKS", "zero")
    with pytest.raises(ValueError, match=r"TPKERNELS_FUSED_AG_CHUNKS \('zero'\) must be an integer"):
        FusedOptions().resolved(cpu)
    monkeypatch.setenv("TPKERNELS_FUSED_AG_CHUNKS", "4")
    monkeypatch.setenv("TPKERNELS_FUSED_RS", "sideways")
    with pytest.raises(ValueError, match=r"TPKERNELS_FUSED_RS \('sideways'\) must be one of pull, push"):
        FusedOptions().resolved(cpu)


def test_every_tpkernels_variable_is_in_the_one_table():
    """Each TPKERNELS_* name the package, setup.py or the GPU check reads is in tpkernels.env_vars."""
    import re
    from pathlib import Path

    from tpkernels import env_vars

    root = Path(__file__).resolve().parent.parent
    macros = {"TPKERNELS_VERSION", "TPKERNELS_WITH_CUDA"}  # C preprocessor macros of csrc/, not variables
    files = [f for f in root.joinpath("tpkernels").rglob("*.py") if f.name != "env_vars.py"]
    files += [root / "setup.py", *root.joinpath("benchmarks").glob("*.sh"), root / "Makefile"]
    found = {m for f in files for m in re.findall(r"TPKERNELS_[A-Z0-9_]+", f.read_text())} - macros
    assert found <= set(env_vars.BY_NAME), found - set(env_vars.BY_NAME)  # nothing read that the table lacks
    assert set(env_vars.BY_NAME) <= found, set(env_vars.BY_NAME) - found  # nothing listed that nobody reads
