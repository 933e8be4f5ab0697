"""The planner against published throughput (Narayanan et al. 2021, Table 1), its search speed,
and the practitioners' cases of the README."""

from __future__ import annotations

import time

import pytest

from tpkernels.planner import ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner.report import no_fit_message
from tpkernels.planner.calibration import predict, rank_of_published, search, table_rows

ROWS = table_rows()


def test_table_is_complete():
    assert [r.model for r in ROWS] == ["1.7B", "3.6B", "7.5B", "18B", "39B", "76B", "145B", "310B", "530B", "1T"]


@pytest.mark.parametrize("row", ROWS, ids=[r.model for r in ROWS])
def test_predicted_tflops_within_15_percent(row):
    est = predict(row)
    assert est.fits, est.notes
    assert est.hardware_tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=0.15)


@pytest.mark.parametrize("row", ROWS, ids=[r.model for r in ROWS])
def test_published_layout_is_in_top_five(row):
    rank = rank_of_published(row, search(row))
    assert rank is not None and rank <= 5, (row.model, rank)


def test_hardware_flops_match_the_papers_formula():
    for row in ROWS:
        m, B, s = row.spec, row.global_batch, 2048
        l, h, V = m.num_layers, m.hidden_size, m.vocab_size
        paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        assert predict(row).hardware_flops == pytest.approx(paper, rel=1e-9)


def test_search_over_1024_gpus_for_a_1t_model_is_fast():
    t0 = time.perf_counter()
    p = plan(model_preset("GPT-1T"), TrainingSetup(global_batch=2048, seq_length=2048),
             ClusterSpec(gpu_preset("H100-SXM"), gpus_per_node=8, nodes=128))
    elapsed = time.perf_counter() - t0
    assert p.best is not None and p.evaluated > 1000
    assert elapsed < 5.0, f"search took {elapsed:.1f} s"


def test_14b_on_one_8xa100_node():
    p = plan(model_preset("Qwen-14B"), TrainingSetup(64, 4096), ClusterSpec(gpu_preset("A100-80GB"), 8, 1))
    best = p.best.config
    assert best.tp * best.pp >= 2  # 14B with Adam (252 GB of states) cannot be plain data parallel
    assert best.tp <= 8 and p.best.fits and p.best.mfu > 0.4
    assert best.sequence_parallel or best.tp == 1


def test_70b_on_64_h100():
    p = plan(model_preset("Llama-3-70B"), TrainingSetup(512, 8192), ClusterSpec(gpu_preset("H100-SXM"), 8, 8))
    best = p.best.config
    assert best.tp == 8 and best.pp >= 2  # TP fills the NVLink node, PP spans nodes
    assert 0.4 < p.best.mfu < 0.7


def test_13b_lora_on_a10():
    p = plan(model_preset("Llama-2-13B"), TrainingSetup(32, 4096, finetune="lora"),
             ClusterSpec(gpu_preset("A10-24GB"), 8, 1))
    assert p.best is not None and p.best.fits
    full = plan(model_preset("Llama-2-13B"), TrainingSetup(32, 4096), ClusterSpec(gpu_preset("A10-24GB"), 8, 1))
    assert full.best is None  # 13B × 18 bytes = 234 GB does not fit in 8 × 22.5 GiB
    assert no_fit_message(full).startswith("No layout fits in 22.5 GiB per GPU")
