"""The shape-dependent GEMM model and the overlap terms: the properties the planner's rankings rely on."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig
from tpkernels.planner import H100_CALIBRATED, ClusterSpec, TrainingSetup, gpu_preset, model_preset
from tpkernels.planner.collectives import exposed_after_overlap, group_collective_time
from tpkernels.planner.gemm_model import achieved_efficiency, gemm_time
from tpkernels.planner.step_time import step_time

H100 = gpu_preset("H100-SXM")
A100 = gpu_preset("A100-80GB")


def test_the_whole_step_gemm_rate_stays_below_a_lone_gemms():
    """The fitted ceiling is what GEMMs sustain inside whole training steps: never above the ≈ 790
    TFLOP/s one H200 measured for a lone 8192³ bf16 matmul, and not absurdly below it."""
    tflops = achieved_efficiency(8192, 8192, 8192, gpu_preset("H200"), H100_CALIBRATED) * 989
    assert 0.7 * 790 < tflops < 790


@pytest.mark.parametrize("gpu,precision", [(A100, "bf16"), (H100, "bf16"), (H100, "fp8")],
                         ids=["A100-bf16", "H100-bf16", "H100-fp8"])  # Ampere has no FP8
def test_a_bigger_gemm_never_has_lower_efficiency_at_the_same_shape_ratios(gpu, precision, fresh_seed):
    """Monotone in size: scaling m, n and k together never lowers the GEMM model's efficiency (at the
    shipped constants and at random ones)."""
    rng = random.Random(fresh_seed)
    for i in range(50):
        eff = H100_CALIBRATED if i % 2 else H100_CALIBRATED.replace(
            gemm=rng.uniform(0.3, 0.95), gemm_fp8=rng.uniform(0.3, 0.95), gemm_k0=rng.uniform(0, 512),
            gemm_tail=rng.uniform(0, 0.5), gemm_launch_s=rng.uniform(0, 1e-4), hbm=rng.uniform(0.3, 1.0))
        m, n, k = (rng.choice([1, 17, 129, 512, 1000, 4096]) * rng.uniform(0.5, 2) for _ in range(3))
        effs = [achieved_efficiency(m * s, n * s, k * s, gpu, eff, precision) for s in (1, 1.3, 2, 4, 8)]
        assert all(b >= a * (1 - 1e-12) for a, b in zip(effs, effs[1:])), (m, n, k, effs)
        assert 0 < effs[-1] <= 1


def test_skinny_tp8_gemms_lose_efficiency_that_large_ones_do_not():
    # TP8 of a 4096-wide model at micro-batch 1: the down projection has k = 14336 / 8
    small = achieved_efficiency(4096, 4096, 14336 / 8, H100, H100_CALIBRATED)
    tiny = achieved_efficiency(512, 4096 // 8, 4096, H100, H100_CALIBRATED)
    big = achieved_efficiency(8192, 8192, 8192, H100, H100_CALIBRATED)
    assert tiny < small < big


def test_gemm_time_is_never_below_the_memory_roof_nor_the_flops():
    for _ in range(50):
        m, n, k = (random.randint(1, 20000) for _ in range(3))
        t = gemm_time(m, n, k, H100, H100_CALIBRATED)
        assert t >= 2.0 * (m * k + k * n + m * n) / (H100.hbm_gbs * 1e9)
        assert t >= 2.0 * m * n * k / (H100.peak_tflops_bf16 * 1e12)
    assert gemm_time(0, 10, 10, H100, H100_CALIBRATED) == 0.0


def test_hierarchical_dp_collective_uses_every_nic_of_the_node():
    cluster = ClusterSpec(H100, gpus_per_node=8, nodes=16)
    nbytes = 4e9
    one_per_node = group_collective_time("all_reduce", nbytes, 16, 8, cluster, H100_CALIBRATED)  # TP8: 1 per node
    eight_per_node = group_collective_time("all_reduce", nbytes, 128, 1, cluster, H100_CALIBRATED)  # TP1
    flat_ring = 2 * 127 / 128 * nbytes / (cluster.inter_gbs * 1e9 * H100_CALIBRATED.link)
    assert eight_per_node < 0.3 * flat_ring  # the inter-node phase moves 1/8 of the bytes per NIC
    assert one_per_node == pytest.approx(2 * 15 / 16 * nbytes / (cluster.inter_gbs * 1e9 * H100_CALIBRATED.link)
                                         + 2 * 15 * H100_CALIBRATED.collective_latency_s)
    inside = group_collective_time("all_reduce", nbytes, 8, 1, cluster, H100_CALIBRATED)
    assert inside == pytest.approx(2 * 7 / 8 * nbytes / (cluster.intra_gbs * 1e9 * H100_CALIBRATED.link)
                                   + 2 * 7 * H100_CALIBRATED.collective_latency_s)


def test_overlap_pipeline_formula():
    assert exposed_after_overlap(1.0, 10.0, 10) == pytest.approx(0.1)  # only the last bucket shows
    assert exposed_after_overlap(10.0, 1.0, 10) == pytest.approx(10.0 - 9 * 0.1)  # comm-bound: queues
    assert exposed_after_overlap(0.0, 1.0, 4) == 0.0
    assert exposed_after_overlap(2.0, 0.0, 4) == 2.0
    for _ in range(100):
        comm, compute, n = random.uniform(0, 5), random.uniform(0, 5), random.randint(1, 64)
        e = exposed_after_overlap(comm, compute, n)
        assert 0 <= e <= comm + 1e-12
        assert exposed_after_overlap(comm, compute * 1.5, n) <= e + 1e-12  # more to hide behind: never worse


@pytest.mark.parametrize("zero1", [False, True])
def test_more_overlap_never_predicts_a_slower_step(zero1):
    model = model_preset("Llama-3-8B")
    cluster = ClusterSpec(H100, gpus_per_node=8, nodes=4)
    cfg = ParallelConfig(tp=2, pp=2, dp=8, micro_batch_size=1, num_microbatches=4, sequence_parallel=True,
                         zero1=zero1)
    base = dict(global_batch=32, seq_length=4096)
    times = []
    for flags in ({}, {"overlap_grad_reduce": True}, {"overlap_grad_reduce": True, "overlap_param_gather": True},
                  {"overlap_grad_reduce": True, "overlap_param_gather": True, "overlap_p2p": True}):
        train = TrainingSetup(**base, **{"overlap_grad_reduce": False, **flags})
        times.append(step_time(model, train, cfg, cluster, H100_CALIBRATED).total)
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:])), times
    assert times[-1] < times[0]
    tp = [step_time(model, TrainingSetup(**base), cfg, cluster, H100_CALIBRATED.replace(tp_overlap=x)).total
          for x in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert all(b <= a + 1e-12 for a, b in zip(tp, tp[1:])), tp
