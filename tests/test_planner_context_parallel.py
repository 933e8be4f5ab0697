"""The planner's context-parallel model: activations and logits over CP, the K/V exchange of each
algorithm and what hides it, DP × CP reduction and ZeRO-1, the search, and a long-context case that
fits only with CP."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig
from tpkernels.planner import A100_CALIBRATED, ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner.activations import layer_activations
from tpkernels.planner.context_parallel import cp_attention_comm, kv_block_bytes
from tpkernels.planner.estimate import estimate, layout_errors
from tpkernels.planner.search import CP_MIN_SEQ, cp_choices, explain, parse_layout
from tpkernels.planner.step_time import step_time

LLAMA8 = model_preset("Llama-3-8B")
LLAMA70 = model_preset("Llama-3-70B")
H100x64 = ClusterSpec(gpu_preset("H100-SXM"), 8, 8)


def acts(m, s, t, cp, algo="ring", rc="none"):
    return layer_activations(m, seq=s, micro_batch=1, tp=t, sequence_parallel=t > 1, recompute=rc,
                             flash_attention=True, cp=cp, cp_algo=algo)


def test_activations_per_rank_fall_as_one_over_cp(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(20):
        m = rng.choice([LLAMA8, LLAMA70])
        t, cp = rng.choice([1, 2, 8]), rng.choice([2, 3, 4, 8])
        s = 2 * cp * rng.choice([1, 17, 129, 2048])
        rc = rng.choice(["none", "full"])
        one, many = acts(m, s, t, 1, rc=rc), acts(m, s, t, cp, rc=rc)
        assert many.stored == pytest.approx(one.stored / cp)
        assert many.produced == pytest.approx(one.produced / cp)
        # all-gather keeps the whole sequence's K/V for the backward: more than the ring, by (cp − 1) local K/V
        gathered = acts(m, s, t, cp, "allgather", rc="none")
        local_kv = 2 * 2 * s / cp * max(1, m.kv_heads / t) * m.dhead  # K and V, 2 bytes each
        assert gathered.stored - many.stored == pytest.approx((cp - 1) * local_kv, rel=1e-9) if rc == "none" else True


def test_memory_breakdown_divides_activations_and_logits_and_zero1_shards_over_dp_cp():
    train = TrainingSetup(8, 131072)
    base = ParallelConfig(tp=8, pp=1, dp=8, num_microbatches=1, sequence_parallel=True, recompute="full", zero1=True)
    cp = base.replace(dp=1, cp=8)
    a = estimate(LLAMA70, train, H100x64, base, A100_CALIBRATED)
    b = estimate(LLAMA70, train, H100x64, cp, A100_CALIBRATED)
    assert b.memory.logits == pytest.approx(a.memory.logits / 8)
    assert b.memory.activations < a.memory.activations / 6  # 1/8 of them plus the ring's blocks in flight
    assert b.memory.optimizer == pytest.approx(a.memory.optimizer)  # ZeRO-1 over DP × CP = 8 either way
    assert b.memory.weights == pytest.approx(a.memory.weights)  # CP replicates the weights
    assert b.time.dp_comm > 0  # the gradients are reduced over the CP group even at DP1


def test_ring_hides_behind_attention_unless_the_link_is_slow():
    cfg = ParallelConfig(tp=1, pp=1, dp=1, num_microbatches=1, cp=8)
    ideal = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)
    slow = ClusterSpec(gpu_preset("H100-SXM"), 8, 1, intra_link="pcie", intra_node_gbs=0.5)
    train = TrainingSetup(1, 131072)
    fast_t = step_time(LLAMA8, train, cfg, ideal, A100_CALIBRATED)
    slow_t = step_time(LLAMA8, train, cfg, slow, A100_CALIBRATED)
    # long blocks hide every hop but the last one that brings dK/dV home
    assert 0 < fast_t.cp_exposed < 0.1 * fast_t.cp_comm
    assert slow_t.cp_exposed > 0.5 * slow_t.cp_comm
    assert slow_t.total > fast_t.total
    # all-gather and a2a are not overlapped: everything they send is exposed
    for algo in ("allgather", "a2a"):
        t = step_time(LLAMA8, train, cfg.replace(cp_algo=algo), ideal, A100_CALIBRATED)
        assert t.cp_exposed == pytest.approx(t.cp_comm) and t.cp_comm > 0


def test_ring_hop_count_and_block_bytes():
    cfg = ParallelConfig(tp=2, pp=1, dp=1, num_microbatches=1, cp=4)
    B = kv_block_bytes(LLAMA8, cfg, 16384, 2)
    assert B == 2 * 16384 / 4 * (8 / 2) * 128 * 2  # K and V of 4 KV heads per TP rank
    c = cp_attention_comm(LLAMA8, cfg, 16384, 2, att_f=0.0, att_b=0.0, cluster=ClusterSpec(gpu_preset("H100-SXM")),
                          eff=A100_CALIBRATED)
    assert c["fwd_exposed"] == pytest.approx(c["fwd"])  # nothing to hide behind
    one = cp_attention_comm(LLAMA8, cfg.replace(cp=1), 16384, 2, 1.0, 1.0, ClusterSpec(gpu_preset("H100-SXM")),
                            A100_CALIBRATED)
    assert one == {"fwd": 0.0, "fwd_exposed": 0.0, "bwd": 0.0, "bwd_exposed": 0.0}


def test_cp_is_searched_only_for_long_sequences():
    assert cp_choices(TrainingSetup(8, CP_MIN_SEQ // 2), 64) == [1]
    assert cp_choices(TrainingSetup(8, 131072), 8) == [1, 2, 4, 8]
    assert 3 not in cp_choices(TrainingSetup(8, 131072), 24)  # 131072 does not split into 6 chunks
    short = plan(LLAMA8, TrainingSetup(64, 4096), ClusterSpec(gpu_preset("H100-SXM"), 8, 1), A100_CALIBRATED)
    assert all(e.config.cp == 1 for e in short.ranked)


def test_long_context_fits_only_with_cp():
    """Llama-3-70B at a 512k context on 64 H100: no layout without CP fits; with CP one does."""
    train = TrainingSetup(8, 524288)
    without = plan(LLAMA70, train, H100x64, fixed={"cp": 1})
    assert without.best is None and without.too_big
    found = plan(LLAMA70, train, H100x64)
    assert found.best is not None and found.best.fits and found.best.config.cp > 1
    assert not layout_errors(LLAMA70, train, H100x64, found.best.config)


def test_128k_on_64_h100_picks_cp():
    train = TrainingSetup(64, 131072)
    p = plan(LLAMA70, train, H100x64)
    assert p.best.fits and p.best.config.cp > 1
    assert p.best.step_time < plan(LLAMA70, train, H100x64, fixed={"cp": 1}).best.step_time


def test_layout_strings_and_named_errors():
    assert parse_layout("TP=8,CP=4,cp_algo=a2a") == {"tp": 8, "cp": 4, "cp_algo": "a2a"}
    with pytest.raises(ValueError, match=r"cp_algo \('star'\) must be one of ring, allgather, a2a"):
        parse_layout("CP=2,cp_algo=star")
    train = TrainingSetup(8, 131072)
    x = explain(LLAMA70, train, H100x64, "TP=8,CP=3")
    assert any("world_size (64) must be divisible by tp (8) × cp (3) × pp (1) = 24" in e for e in x.errors), x.errors
    # a2a needs the 8 KV heads over TP8 (1 per rank) divisible by CP2
    errs = layout_errors(LLAMA70, train, H100x64, ParallelConfig(tp=8, dp=4, cp=2, cp_algo="a2a", num_microbatches=2))
    assert any("cp_algo 'a2a' needs" in e for e in errs), errs
    odd = layout_errors(LLAMA70, TrainingSetup(8, 131070), H100x64, ParallelConfig(tp=8, dp=4, cp=2,
                                                                                   num_microbatches=2))
    assert any("sequence length (131070) must be divisible by 2 × cp (4)" in e for e in odd), odd


def test_layout_auto_takes_the_planners_cp_layout():
    """``layout: auto`` turns the planner's best estimate into the run's parallel section, CP included."""
    from tpkernels.train import TrainConfig
    from tpkernels.train.auto_layout import apply_plan

    found = plan(LLAMA70, TrainingSetup(8, 524288), H100x64)
    cfg = TrainConfig.from_values({"layout": "auto", "parallel.overlap_dp": False})
    out = apply_plan(cfg, found.best)
    assert out.layout == "manual" and out.parallel.cp == found.best.config.cp > 1
    assert out.parallel.cp_algo == found.best.config.cp_algo and out.parallel.overlap_dp is False
    assert out.predicted["layout"] == out.parallel.short() and "CP" in out.predicted["layout"]


def test_the_ring_backward_charges_the_overlap_the_code_does():
    """Block 0 hides a K/V hop, blocks 1..cp−2 a K/V and an accumulator hop, block cp−1 an
    accumulator hop; the last accumulator hop home is always exposed."""
    cfg = ParallelConfig(tp=1, pp=1, dp=1, num_microbatches=1, cp=4)
    cl = ClusterSpec(gpu_preset("H100-SXM"))
    zero = cp_attention_comm(LLAMA8, cfg, 16384, 2, 0.0, 0.0, cl, A100_CALIBRATED)
    hop = zero["fwd"] / 3
    acc = (zero["bwd"] - 3 * hop) / 4
    assert zero["bwd_exposed"] == pytest.approx(zero["bwd"])  # nothing to hide behind
    long = cp_attention_comm(LLAMA8, cfg, 16384, 2, 0.0, 4 * 10 * (hop + acc), cl, A100_CALIBRATED)
    assert long["bwd_exposed"] == pytest.approx(acc)  # long blocks: only the hop home shows
    block = (hop + acc) / 2  # between a lone hop and both hops at once
    mid = cp_attention_comm(LLAMA8, cfg, 16384, 2, 0.0, 4 * block, cl, A100_CALIBRATED)
    want = max(0, hop - block) + 2 * (hop + acc - block) + max(0, acc - block) + acc
    assert mid["bwd_exposed"] == pytest.approx(want)
