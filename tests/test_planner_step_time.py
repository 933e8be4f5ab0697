"""Step-time model: bubble, TP overlap, DP reduction, flags; every layout the search returns is valid."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig
from tpkernels.planner import A100_CALIBRATED, ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner.estimate import estimate, layout_errors
from tpkernels.planner.step_time import step_time

MODEL = model_preset("Llama-3-8B")
CLUSTER = ClusterSpec(gpu_preset("H100-SXM"), 8, 4)


def test_bubble_is_textbook_fraction(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(20):
        p = rng.choice([2, 4, 8])
        v = rng.choice([1, 2, 4]) if 32 % (p * 4) == 0 else 1
        m = p * rng.randint(1, 8)
        dp = 32 // (p * 2)
        cfg = ParallelConfig(tp=2, pp=p, dp=dp, virtual_stages=v, num_microbatches=m, sequence_parallel=True)
        t = step_time(MODEL, TrainingSetup(m * dp, 2048), cfg, CLUSTER, A100_CALIBRATED)
        per_mb = (t.total - t.bubble - t.dp_exposed - t.optimizer) / m
        # the engine's simulator on cost ratios rounded to a 4% grid reproduces the closed form
        assert t.bubble / (m * per_mb) == pytest.approx((p - 1) / (v * m), rel=0.03)


def test_sequence_parallel_hides_the_overlap_share():
    cfg = ParallelConfig(tp=8, pp=1, dp=4, num_microbatches=4)
    train = TrainingSetup(16, 4096)
    plain = step_time(MODEL, train, cfg, CLUSTER, A100_CALIBRATED)
    sp = step_time(MODEL, train, cfg.replace(sequence_parallel=True), CLUSTER, A100_CALIBRATED)
    assert plain.tp_exposed == plain.tp_comm > 0
    assert sp.tp_exposed == pytest.approx(sp.tp_comm * (1 - A100_CALIBRATED.tp_overlap))
    none = step_time(MODEL, train, cfg, CLUSTER, A100_CALIBRATED.replace(tp_overlap=0.0))
    assert none.tp_comm == plain.tp_comm


def test_overlap_cannot_hide_more_than_the_gemms():
    cfg = ParallelConfig(tp=8, pp=1, dp=1, num_microbatches=8, sequence_parallel=True)
    pcie = ClusterSpec(gpu_preset("H100-SXM"), 8, 1, intra_link="pcie", intra_node_gbs=4.0)
    t = step_time(MODEL, TrainingSetup(8, 4096), cfg, pcie, A100_CALIBRATED)
    assert t.tp_comm > t.gemm  # this link is far too slow for TP8
    assert t.tp_exposed > t.tp_comm * (1 - A100_CALIBRATED.tp_overlap)
    assert t.tp_exposed >= t.tp_comm - t.gemm


def test_zero1_shrinks_memory_not_comm_volume_much():
    cfg = ParallelConfig(tp=1, pp=1, dp=32, num_microbatches=2)
    train = TrainingSetup(64, 2048)
    a = estimate(MODEL, train, CLUSTER, cfg, A100_CALIBRATED)
    b = estimate(MODEL, train, CLUSTER, cfg.replace(zero1=True), A100_CALIBRATED)
    assert b.memory.optimizer == pytest.approx(a.memory.optimizer / 32)
    assert 0.5 < b.time.dp_comm / a.time.dp_comm < 1.0  # RS(fp32) + AG(bf16) vs 2 × fp32


def test_slow_links_raise_comm_ratio_and_get_flagged():
    cfg = ParallelConfig(tp=8, pp=1, dp=1, num_microbatches=8)
    train = TrainingSetup(8, 4096)
    pcie = ClusterSpec(gpu_preset("H100-SXM"), 8, 1, intra_link="pcie")
    fast = estimate(MODEL, train, ClusterSpec(gpu_preset("H100-SXM"), 8, 1), cfg, A100_CALIBRATED)
    slow = estimate(MODEL, train, pcie, cfg, A100_CALIBRATED)
    assert slow.time.comm_ratio > 3 * fast.time.comm_ratio
    assert any(n.startswith("communication/compute ratio") for n in slow.notes)


def test_every_ranked_layout_is_valid_and_fits(fresh_seed):
    rng = random.Random(fresh_seed)
    name = rng.choice(["Llama-3-8B", "Qwen2.5-14B", "GPT-7.5B"])
    gpu = rng.choice(["A100-80GB", "H100-SXM", "L20"])
    nodes, batch = rng.choice([1, 2, 3]), rng.choice([16, 48, 96])
    model, train = model_preset(name), TrainingSetup(batch, 2048)
    cluster = ClusterSpec(gpu_preset(gpu), 8, nodes)
    p = plan(model, train, cluster)
    for e in p.ranked:
        assert layout_errors(model, train, cluster, e.config) == []
        assert e.fits and e.config.world_size == 8 * nodes and e.config.global_batch_size == batch
    times = [e.step_time for e in p.ranked]
    assert times == sorted(times)


def test_fixed_choices_are_honoured_and_unknown_ones_named():
    p = plan(MODEL, TrainingSetup(64, 2048), CLUSTER, fixed={"tp": 4, "recompute": "full"})
    assert p.ranked and all(e.config.tp == 4 and e.config.recompute == "full" for e in p.ranked)
    with pytest.raises(ValueError, match="not layout fields"):
        plan(MODEL, TrainingSetup(64, 2048), CLUSTER, fixed={"pipeline": 2})


def test_fp8_needs_fp8_tensor_cores():
    errs = layout_errors(MODEL, TrainingSetup(8, 2048, precision="fp8"), ClusterSpec(gpu_preset("A100-80GB"), 8, 1),
                         ParallelConfig(tp=8, num_microbatches=8))
    assert errs == ["precision ('fp8') is not supported by A100-80GB: it has no FP8 tensor cores"]
    h100 = estimate(MODEL, TrainingSetup(8, 2048, precision="fp8"), CLUSTER, ParallelConfig(tp=8, dp=4, num_microbatches=2),
                    A100_CALIBRATED)
    bf16 = estimate(MODEL, TrainingSetup(8, 2048), CLUSTER, ParallelConfig(tp=8, dp=4, num_microbatches=2), A100_CALIBRATED)
    assert h100.time.gemm < bf16.time.gemm


def test_tp_must_stay_in_a_node():
    errs = layout_errors(MODEL, TrainingSetup(8, 2048), ClusterSpec(gpu_preset("H100-SXM"), 4, 4),
                         ParallelConfig(tp=8, dp=2, num_microbatches=4))
    assert "tp (8) must divide gpus_per_node (4)" in errs[0]


def test_shared_cores_recover_the_bubble(fresh_seed):
    """Ranks sharing cores (a CPU host): the bubble only costs what the machine's total work leaves."""
    from tpkernels.planner.step_time import shared_core_bubble  # noqa: PLC0415

    rng = random.Random(fresh_seed)
    busy, bubble = rng.uniform(0.5, 2.0), rng.uniform(0.1, 3.0)
    assert shared_core_bubble(busy, bubble, 1.0) == bubble  # own cores (GPUs): unchanged
    for share in (0.25, 0.5, 0.75):
        left = shared_core_bubble(busy, bubble, share)
        assert left == pytest.approx(max(0.0, share * (busy + bubble) - busy))
        assert 0.0 <= left < bubble
    cfg = ParallelConfig(tp=1, pp=4, dp=1, num_microbatches=4)
    train = TrainingSetup(4, 2048)
    own = step_time(MODEL, train, cfg, CLUSTER, A100_CALIBRATED)
    shared = step_time(MODEL, train, cfg, CLUSTER, A100_CALIBRATED.replace(core_share=0.5))
    assert shared.bubble < own.bubble and shared.gemm == own.gemm
    flat = step_time(MODEL, train, cfg.replace(pp=1, dp=4, num_microbatches=1), CLUSTER,
                     A100_CALIBRATED.replace(core_share=0.5))
    assert flat.bubble == 0.0
