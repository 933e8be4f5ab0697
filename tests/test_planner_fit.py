"""The planner's per-machine corrections: fitted to measured layouts, kept in a cache by machine,
used by `tpkernels plan` (which says so) unless --no-cache, and written by an autotuned run."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tpkernels.cli import main
from tpkernels.planner import ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner import fit as fitting
from tpkernels.planner.efficiency import H100_CALIBRATED


def test_fit_recovers_known_corrections(fresh_seed):
    rng = random.Random(fresh_seed)
    a, c, g = rng.uniform(0.5, 2.0), rng.uniform(0.5, 3.0), rng.uniform(0.0, 5e-5)
    samples = [(comp, comm, ops, a * comp + c * comm + g * ops)
               for comp, comm, ops in ((rng.uniform(0.05, 0.3), rng.uniform(0.0, 0.1), rng.uniform(100, 3000))
                                       for _ in range(5))]
    f = fitting.fit(samples)
    assert f.compute_scale == pytest.approx(a, rel=0.05) and f.comm_scale == pytest.approx(c, rel=0.1)
    assert f.op_overhead_s == pytest.approx(g, abs=5e-6) and f.worst_error < 0.02 and f.n == 5


def test_noisy_trials_lean_on_the_prior_where_they_barely_determine_a_term(fresh_seed):
    """One world: every layout computes about the same, so compute and the per-op overhead are nearly
    collinear and ±10% noise picks their split. Weighing the prior by the trials' scatter keeps
    compute nearer its true ×1 than a free fit (typically half as far; 0.68 was the worst of 100 runs)."""
    rng = random.Random(fresh_seed)
    weighted, free = [], []
    for _ in range(60):
        samples = []
        for _ in range(6):
            comp, comm = rng.uniform(0.19, 0.21), rng.uniform(0.01, 0.03)
            samples.append((comp, comm, rng.uniform(950, 1050), (comp + comm) * rng.uniform(0.9, 1.1)))
        weighted.append(abs(fitting.fit(samples).compute_scale - 1))
        free.append(abs(fitting.fit(samples, pull=fitting.MIN_PULL).compute_scale - 1))
    assert statistics.median(weighted) < 0.85 * statistics.median(free)
    with pytest.raises(ValueError, match=r"pull \(0\) must be > 0"):
        fitting.fit(samples, pull=0)


def test_a_term_the_trials_did_not_exercise_stays_put():
    f = fitting.fit([(0.1, 0.0, 0.0, 0.08), (0.2, 0.0, 0.0, 0.16), (0.3, 0.0, 0.0, 0.24)])  # no comm, no ops
    assert f.comm_scale == pytest.approx(1.0, abs=1e-6) and f.compute_scale == pytest.approx(0.8, rel=0.02)
    with pytest.raises(ValueError, match="at least one measured step time"):
        fitting.fit([(0.1, 0.0, 10.0, float("nan"))])
    with pytest.raises(ValueError, match="kernel counts"):
        fitting.fit([(0.1, 0.0, -1.0, 0.1)])


def test_corrections_change_the_planners_step_time():
    m, t, cl = model_preset("Llama-3-8B"), TrainingSetup(64, 4096), ClusterSpec(gpu_preset("H100-SXM"), 8, 2)
    base = plan(m, t, cl, H100_CALIBRATED, fixed={"tp": 2, "pp": 1})
    f = fitting.Fit(1.5, 2.0, 2e-5)
    fixed = plan(m, t, cl, f.apply(H100_CALIBRATED), fixed={"tp": 2, "pp": 1})
    b, x = base.best.time, fixed.best.time
    assert x.gemm == pytest.approx(1.5 * b.gemm) and x.tp_exposed == pytest.approx(2.0 * b.tp_exposed)
    assert x.ops == b.ops > 0 and x.overhead == pytest.approx(2e-5 * b.ops) and x.total > b.total
    compute, comm, ops = fitting.components(x, f.apply(H100_CALIBRATED))
    assert compute == pytest.approx(b.gemm + b.elementwise + b.bubble + b.optimizer) and ops == b.ops
    assert f.predict(compute, comm, ops) == pytest.approx(x.total, rel=1e-9)


def test_a_fit_transfers_to_a_50x_smaller_model(fresh_seed):
    """A machine whose truth is rates (compute ×a, communication ×c, g seconds per kernel): fitted on
    layouts of one model, the corrections predict a model with ~50× less work within 10% (the old
    fixed per-step overhead made a 4-layer model's +75.7 ms the plan of a 0.057 s step)."""
    from tpkernels.parallel import ParallelConfig  # noqa: PLC0415
    from tpkernels.planner.step_time import step_time  # noqa: PLC0415

    rng = random.Random(fresh_seed)
    a, c, g = rng.uniform(0.7, 1.5), rng.uniform(0.7, 3.0), rng.uniform(1e-5, 1e-4)
    cl = ClusterSpec(gpu_preset("A100-80GB"), 4, 1)
    eff = H100_CALIBRATED.replace(kernel_launch_s=5e-6)

    def truth(model, train, cfg):
        t = step_time(model, train, cfg, cl, eff)
        comp, comm, ops = fitting.components(t, eff)
        return (comp, comm, ops), a * comp + c * comm + g * ops

    big = model_preset("Llama-2-7B").replace(num_layers=8)
    layouts = [ParallelConfig(tp=tp, pp=pp, dp=4 // (tp * pp), num_microbatches=4, sequence_parallel=tp > 1)
               for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))]
    train = TrainingSetup(4 * 4, 1024)
    samples = [(*x, t) for x, t in (truth(big, TrainingSetup(4 * cfg.dp, 1024), cfg) for cfg in layouts)]
    f = fitting.fit(samples)
    small = big.replace(num_layers=2, hidden_size=512, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=1408,
                        vocab_size=8000)
    cfg = ParallelConfig(tp=1, pp=2, dp=2, num_microbatches=4)
    (comp, comm, ops), true = truth(small, train, cfg)
    (big_comp, _, _), _ = truth(big, TrainingSetup(4 * 2, 1024), cfg)
    assert big_comp > 20 * comp  # the small model is ~50× less work
    assert f.predict(comp, comm, ops) == pytest.approx(true, rel=0.10)


def test_cache_round_trip_and_plan_says_it_uses_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPKERNELS_CACHE_DIR", str(tmp_path))
    key = fitting.machine_key("H100-SXM", 16)
    assert fitting.load(key) is None
    path = fitting.save(key, fitting.Fit(1.25, 1.5, 1e-3, 3, 0.04), layouts=["TP2 PP1 DP8 mbs1"])
    assert path == tmp_path / "planner_fits.json" and json.loads(path.read_text())[key]["n"] == 3
    f, rec = fitting.load(key)
    assert (f.compute_scale, f.comm_scale, f.op_overhead_s) == (1.25, 1.5, 1e-3) and rec["layouts"]
    argv = ["plan", "--model", "Llama-3-8B", "--gpu", "H100-SXM", "--nodes", "2", "--global-batch", "64",
            "--seq-len", "4096", "--json", "--top", "1"]
    assert main(argv) == 0
    used = json.loads(capsys.readouterr().out)
    assert used["corrections"]["machine"] == key and used["efficiency"]["compute_scale"] == 1.25
    assert main(argv + ["--no-cache"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["corrections"] is None and plain["efficiency"]["compute_scale"] == 1.0
    assert used["ranked"][0]["step_time_s"] > plain["ranked"][0]["step_time_s"] + 0.4  # 1 ms × ≥ 1,000 kernels
    assert main(argv[:-3] + ["--top", "1"]) == 0
    assert "using the corrections autotune measured on H100-SXM, 16 GPUs" in capsys.readouterr().out
    old = {key: {"compute_scale": 1.0, "comm_scale": 1.0, "step_overhead_s": 0.0757}}
    path.write_text(json.dumps(old))
    assert fitting.load(key) is None  # a fit of the old form (a fixed cost per step) does not transfer
    path.write_text("{not json")
    assert fitting.load(key) is None  # a damaged cache is ignored, not fatal


def test_an_autotuned_run_keeps_its_fit_for_the_next_plan(tmp_path):
    """`tpkernels train --layout auto --autotune 3 --nproc 2` fits and keeps the corrections; the next
    layout-auto run on this machine plans with them and says so. Two ranks and 12 steps hold the trials
    (3 steps each) and a few more; the fit is kept per world size whatever it is, and each rank's start-up
    costs seconds on 2 cores."""
    env = {**__import__("os").environ, "TPKERNELS_CACHE_DIR": str(tmp_path)}
    args = ["--layout", "auto", "--autotune", "3", "--nproc", "2", "--layers", "2", "--hidden", "32", "--heads", "4",
            "--kv-heads", "2", "--ffn", "48", "--vocab", "97", "--seq-length", "16", "--steps", "12",
            "--num-microbatches", "4", "--progress", "false"]
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "tpkernels.train", *args], capture_output=True, text=True, timeout=300,
                       cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "planner refit for cpu " in r.stdout and ", 2 ranks:" in r.stdout, r.stdout
    data = json.loads((tmp_path / "planner_fits.json").read_text())
    (key, rec), = data.items()
    assert rec["n"] >= 1 and len(rec["layouts"]) == rec["n"] and rec["compute_scale"] > 0
    again = subprocess.run([sys.executable, "-m", "tpkernels.train", *args[:4], *args[6:], "--nproc", "2",
                            "--steps", "2"], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "with this machine's measured corrections" in again.stdout, again.stdout


def test_bounds_hold_when_the_trials_cannot_separate_the_terms():
    # three layouts of nearly one compute time: the solve would go negative; the bounds pin it
    samples = [(1.11, 0.58, 2000.0, 1.75), (1.28, 0.26, 2000.0, 1.43), (0.91, 0.13, 2000.0, 1.91)]
    f = fitting.fit(samples)
    assert f.compute_scale >= 0.05 and f.comm_scale >= 0.05 and f.op_overhead_s >= 0
    assert f.worst_error < 0.25


def test_trials_span_the_layout_families():
    from tpkernels.parallel import ParallelConfig
    from tpkernels.train.autotune import diverse_order, family

    ranked = [ParallelConfig(tp=2, dp=2), ParallelConfig(tp=4), ParallelConfig(tp=2, pp=2),
              ParallelConfig(pp=2, dp=2), ParallelConfig(dp=4), ParallelConfig(pp=4), ParallelConfig(cp=2, dp=2)]
    order = diverse_order(ranked, config_of=lambda x: x)
    assert [family(x) for x in order[:4]] == ["TP", "PP", "DP", "CP"]
    assert order[4:] == [ranked[1], ranked[2], ranked[5]]  # then the planner's rank
