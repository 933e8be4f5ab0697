"""The planner against published throughput (A100: Narayanan et al. 2021, Table 1; H100: NeMo 24.12's
pre-training table), its search speed, and the practitioners' cases of the README."""

from __future__ import annotations


import pytest

from tpkernels.planner import ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner.report import no_fit_message
from tpkernels.planner.calibration import (
    a100_rows,
    error,
    h100_rows,
    held_out_rows,
    predict,
    rank_of_published,
    search,
    table_rows,
)

A100_ROWS, H100_ROWS = a100_rows(), h100_rows()
ROWS = table_rows()


def test_tables_are_complete():
    assert [r.model for r in A100_ROWS] == ["1.7B", "3.6B", "7.5B", "18B", "39B", "76B", "145B", "310B", "530B", "1T"]
    assert len(H100_ROWS) == 10 and {r.gpu for r in H100_ROWS} == {"H100-SXM"}


@pytest.mark.parametrize("row", ROWS, ids=[r.model for r in ROWS])
def test_predicted_step_within_10_percent(row):
    # the target (benchmarks/planner_calibration.py reports each row); one constant set per
    # GPU generation, no per-row factor
    assert abs(error(row)) <= 0.10, (row.model, error(row))


@pytest.mark.parametrize("row", A100_ROWS, ids=[r.model for r in A100_ROWS])
def test_published_a100_layouts_fit(row):
    est = predict(row)
    assert est.fits, est.notes


@pytest.mark.parametrize("row", A100_ROWS, ids=[r.model for r in A100_ROWS])
def test_published_layout_is_in_top_five(row):
    rank = rank_of_published(row, search(row))
    assert rank is not None and rank <= 5, (row.model, rank)


def test_h100_rows_reproduce_the_tables_flops_per_token():
    # the model shapes in tpkernels/planner/data were chosen to match the table's own TFLOP/s ÷ tokens/s
    for row in H100_ROWS:
        m = row.spec
        per_token = m.model_flops_per_step(1, row.training.seq_length) / row.training.seq_length
        published = row.published_tflops_per_gpu * 1e12 / (row.training.tokens / row.published_step_s / row.gpus)
        assert per_token == pytest.approx(published, rel=0.02), row.model


def test_held_out_cp_rows_are_predicted_within_15_percent():
    """NeMo's two CP2 rows, never fitted on: the CP model (the ring's hops, DP × CP reduction) must not
    be far off. Today the planner is 11–12% pessimistic on both; the LLAMA2-7B row at 4k, without CP,
    is 8% pessimistic too (attention at long sequences, not the exchange, is the larger part)."""
    rows = [r for r in held_out_rows() if r.config.cp > 1]
    assert [(r.model, r.config.cp) for r in rows] == [("LLAMA3-8B@8", 2), ("LLAMA3-70B@64", 2)]
    for row in rows:
        m = row.spec
        per_token = m.model_flops_per_step(1, row.training.seq_length) / row.training.seq_length
        published = row.published_tflops_per_gpu * 1e12 / (row.training.tokens / row.published_step_s / row.gpus)
        assert per_token == pytest.approx(published, rel=0.02), row.model
        assert abs(error(row)) <= 0.15, (row.model, error(row))
        assert predict(row).time.cp_comm > 0


def test_later_h100_rows_are_held_out_and_reported():
    """Megatron-Bridge 25.11 and torchtitan rows (bf16 and TP8 among them): read with their own precision
    and recompute, valid layouts, never in the fitted set; Megatron-Bridge's (the software the H100
    constants were fitted on, a newer release) within 20%."""
    later = [r for r in held_out_rows() if r.source == "h100_held_out.csv"]
    fitted = {(r.model, r.gpus) for r in h100_rows()}
    assert len(later) == 4 and not {(r.model, r.gpus) for r in later} & fitted
    assert {r.training.precision for r in later} == {"bf16", "fp8"} and any(r.config.tp == 8 for r in later)
    assert {r.config.recompute for r in later} == {"none", "selective", "full"}
    sizes = {"8B": 8_030_261_248, "70B": 70_553_706_496}  # Llama 3 / 3.1 (untied embeddings)
    for row in later:
        size = next(v for k, v in sizes.items() if row.model.split("@")[0].endswith(k))
        assert row.spec.num_params() == pytest.approx(size, rel=2e-3), row.model
        e = error(row)
        assert e == e and abs(e) < 1.0, (row.model, e)  # reported, finite; the table in results.md
        if "megatron-bridge" in row.model:
            assert abs(e) <= 0.20, (row.model, e)


def test_hardware_flops_match_the_papers_formula():
    for row in A100_ROWS:
        m, B, s = row.spec, row.training.global_batch, 2048
        l, h, V = m.num_layers, m.hidden_size, m.vocab_size
        paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        assert predict(row).hardware_flops == pytest.approx(paper, rel=1e-9)


def test_search_over_1024_gpus_for_a_1t_model_finds_a_layout():
    """(How long it takes is benchmarks/bench_planner_search.py's: a speed target, not a test.)"""
    p = plan(model_preset("GPT-1T"), TrainingSetup(global_batch=2048, seq_length=2048),
             ClusterSpec(gpu_preset("H100-SXM"), gpus_per_node=8, nodes=128))
    assert p.best is not None and p.evaluated > 1000 and p.best.fits


def test_14b_on_one_8xa100_node():
    p = plan(model_preset("Qwen-14B"), TrainingSetup(64, 4096), ClusterSpec(gpu_preset("A100-80GB"), 8, 1))
    best = p.best.config
    assert best.tp * best.pp >= 2  # 14B with Adam (252 GB of states) cannot be plain data parallel
    assert best.tp <= 8 and p.best.fits and p.best.mfu > 0.4
    assert best.sequence_parallel or best.tp == 1


def test_70b_on_64_h100():
    p = plan(model_preset("Llama-3-70B"), TrainingSetup(512, 8192), ClusterSpec(gpu_preset("H100-SXM"), 8, 8))
    best = p.best.config
    # TP inside the NVLink node, PP across nodes: NeMo's own H100 recipe for this model is TP4 PP8
    assert best.tp in (4, 8) and best.pp >= 2
    assert 0.4 < p.best.mfu < 0.7


def test_13b_lora_on_a10():
    p = plan(model_preset("Llama-2-13B"), TrainingSetup(32, 4096, finetune="lora"),
             ClusterSpec(gpu_preset("A10-24GB"), 8, 1))
    assert p.best is not None and p.best.fits
    full = plan(model_preset("Llama-2-13B"), TrainingSetup(32, 4096), ClusterSpec(gpu_preset("A10-24GB"), 8, 1))
    assert full.best is None  # 13B × 18 bytes = 234 GB does not fit in 8 × 22.5 GiB
    assert no_fit_message(full).startswith("No layout fits in 22.5 GiB per GPU")
