"""`tpkernels plan`: table, JSON, --explain, --measure, and clear errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from tpkernels.cli import main
from tpkernels.planner import ClusterSpec, gpu_preset, model_preset
from tpkernels.planner.efficiency import A100_CALIBRATED
from tpkernels.planner.measure import Measurement, calibrate, layer_gemm_shapes, measure
from tpkernels.planner.workload import TrainingSetup

BASE = ["plan", "--model", "Llama-3-8B", "--gpu", "H100-SXM", "--nodes", "2", "--global-batch", "64",
        "--seq-len", "4096"]


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_and_explanation(capsys):
    rc, out, _ = run(capsys, *BASE, "--top", "3")
    assert rc == 0
    assert "Llama-3-8B: 8.03B params" in out and "2×8 H100-SXM" in out
    lines = [ln for ln in out.splitlines() if ln[:2] in ("1 ", "2 ", "3 ")]
    assert len(lines) == 3
    assert " wins: " in out and "The runner-up" in out


def test_json_is_ranked(capsys):
    rc, out, _ = run(capsys, *BASE, "--json", "--top", "5")
    data = json.loads(out)
    assert rc == 0 and len(data["ranked"]) == 5
    steps = [r["step_time_s"] for r in data["ranked"]]
    assert steps == sorted(steps)
    assert data["model"]["num_params"] == 8_030_261_248
    first = data["ranked"][0]
    assert first["tp"] * first["pp"] * first["dp"] == 16 and first["fits"]


def test_fix_restricts_the_search(capsys):
    rc, out, _ = run(capsys, *BASE, "--json", "--fix", "TP=2,SP=on")
    assert rc == 0
    assert all(r["tp"] == 2 and r["sequence_parallel"] for r in json.loads(out)["ranked"])


def test_explain_valid_layout(capsys):
    rc, out, _ = run(capsys, *BASE, "--explain", "TP=8,PP=2,SP=off")
    assert rc == 0
    assert out.startswith("TP=8,PP=2,SP=off → best setting TP8 PP2 DP1")
    assert "What is wrong with it:" in out and "sequence_parallel off" in out and "slower than the best" in out


def test_explain_invalid_layout_lists_every_rule(capsys):
    rc, out, _ = run(capsys, *BASE, "--explain", "TP=3,PP=5")
    assert rc == 2
    assert "world_size (16) must be divisible by tp (3) × pp (5) = 15" in out
    assert "num_attention_heads (32) must be divisible by tp (3)" in out
    assert "num_layers (32) must be divisible by pp (5)" in out
    assert "The best valid layout is" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "GPT-5"], "model.name ('GPT-5') is not a known preset"),
    (["plan", "--model", "Llama-3-8B", "--gpu", "B300"], "gpu ('B300') is not a known preset"),
    (["plan", "--layers", "4", "--hidden", "512"], "model.name is not set: give --model"),
    (["plan", "--model", "Llama-3-8B", "--layers", "four"], "model.layers ('four') must be an integer or none"),
    (["plan", "--model", "Llama-3-8B", "--json", "maybe"], "json ('maybe') must be true or false"),
    (["plan", "--model", "Llama-3-8B", "--precision", "fp4"], "training.precision ('fp4') must be one of bf16"),
    (["plan", "--model", "Llama-3-8B", "--model.lora_rank", "0"], "model.lora_rank (0) must be a positive integer"),
    (["plan", "--model", "Llama-3-8B", "--explain", "TP4"], "layout item ('TP4') must look like KEY=VALUE"),
    (["plan", "--model", "Llama-3-8B", "--fix", "XP=2"], "layout key ('XP') must be one of"),
    (["plan", "--model", "Llama-3-8B", "--global-batch", "0"], "training.global_batch (0) must be a positive integer"),
    (["plan", "--model", "Llama-3-8B", "--gpu", "A10-24GB", "--intra-link", "nvlink"],
     "intra_link ('nvlink') is not available on A10-24GB"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("extra,message", [
    (["--fix", "TP=0"], "fix ('TP=0'): TP (0) must be a positive integer"),
    (["--explain", "TP=0"], "explain ('TP=0'): TP (0) must be a positive integer"),
    (["--explain", "mbs=0"], "explain ('mbs=0'): mbs (0) must be a positive integer"),
    (["--fix", "TP=-2"], "fix ('TP=-2'): TP (-2) must be a positive integer"),
    (["--fix", "TP=8,TP=2"], "fix ('TP=8,TP=2'): TP is given twice (TP=8 and TP=2): give each layout field once"),
    (["--fix", "recompute=most"], "recompute ('most') must be one of none, selective, full"),
    (["--intra-node-gbs", "0"], "cluster.intra_node_gbs (0.0) must be a finite number > 0"),
    (["--inter-node-gbs", "-1"], "cluster.inter_node_gbs (-1.0) must be a finite number > 0"),
    (["--gpu-tflops", "0"], "cluster.gpu_tflops (0.0) must be a finite number > 0"),
    (["--gpu-memory-gib", "-1"], "cluster.gpu_memory_gib (-1.0) must be a finite number > 0"),
    (["--seq-len", "0"], "training.seq_length (0) must be a positive integer"),
    (["--top", "-1"], "top (-1) must be a positive integer"),
    (["--memory-margin", "1.5"], "memory_margin (1.5) must be a fraction in [0, 1)"),
    (["--nodes", "0"], "cluster.nodes (0) must be a positive integer"),
    (["--training.selective_policy", "layer"],
     "training.selective_policy ('layer') must be one of attention, every_other_matmul"),
    (["--training.tp_overlap_style", "nccl"],
     "training.tp_overlap_style ('nccl') must be one of userbuffers, async_tp"),
    (["--training.kernels", "compiled"], "training.kernels ('compiled') must be one of fused, eager"),
])
def test_bad_numbers_and_layouts_are_one_line_naming_the_flag(capsys, extra, message):
    rc, out, err = run(capsys, *BASE, *extra)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and message in lines[0], err
    assert out == ""


def test_layout_strings_read_values_as_the_flags_do():
    """parse_layout: the spellings of one table (SHORT_NAMES and the field names), values typed by
    options.coerce as a --parallel.<key> flag is (any case for a choice), errors naming the key as written."""
    from tpkernels import options
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.config import SHORT_NAMES
    from tpkernels.planner.search import parse_layout

    got = parse_layout("TP=4 pp=2, SP=yes,RC=Selective,mbs=2,VPP=2,zero=off,schedule=ZB-H1,cp=2,cp_algo=A2A")
    assert got == {"tp": 4, "pp": 2, "sequence_parallel": True, "recompute": "selective", "micro_batch_size": 2,
                   "virtual_stages": 2, "zero1": False, "schedule": "zb-h1", "cp": 2, "cp_algo": "a2a"}
    keys = {k.path: k for k in options.keys_of(ParallelConfig)}
    for short, field in SHORT_NAMES.items():
        value = {bool: "on", int: "2", str: keys[field].choices[0] if keys[field].choices else "x"}[keys[field].base]
        assert list(parse_layout(f"{short.upper()}={value}")) == [field]
    for text, message in (("SP=maybe", r"SP \('maybe'\) must be true or false"),
                          ("mbs=1.5", r"mbs \('1.5'\) must be an integer"),
                          ("dp=none", r"dp \('none'\) must be an integer"),
                          ("schedule=none", r"schedule \('none'\) must be one of gpipe, 1f1b, interleaved, zb-h1$"),
                          ("rc=full,recompute=none", r"recompute is given twice \(rc='full' and recompute=none\)")):
        with pytest.raises(ValueError, match=message):
            parse_layout(text)


def test_bad_hf_configs_are_one_line(capsys, tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "empty_dir").mkdir()
    cases = [(tmp_path / "missing.json", "does not exist: give a Hugging Face config.json"),
             (tmp_path / "empty_dir", "is a folder without a config.json"),
             (tmp_path / "list.json", "must hold a JSON object (a Hugging Face model config), not a list"),
             (tmp_path / "broken.json", "is not a readable JSON file")]
    for path, message in cases:
        rc, out, err = run(capsys, "plan", "--hf-config", str(path), "--gpu", "H100-SXM")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and f"model.name ('{path}')" in err and message in err
    # a checkpoint folder holding config.json is read like the file
    ckpt = tmp_path / "my-llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 1000}))
    rc, out, err = run(capsys, "plan", "--hf-config", str(ckpt), "--gpu", "H100-SXM", "--global-batch", "8",
                       "--top", "1")
    assert rc == 0 and "my-llama" in out, err


def test_explicit_seq_len_is_used(capsys):
    rc, out, _ = run(capsys, *BASE[:-2], "--seq-len", "1024", "--json", "--top", "1")
    assert rc == 0 and json.loads(out)["training"]["seq_length"] == 1024


def test_no_fit_exit_code_and_message(capsys):
    rc, out, _ = run(capsys, "plan", "--model", "Llama-3-70B", "--gpu", "A10-24GB", "--nodes", "1",
                     "--global-batch", "8", "--seq-len", "2048")
    assert rc == 3 and "No layout fits in 22.5 GiB per GPU" in out


def test_calibrate_same_gpu_sets_constants():
    cluster = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)
    meas = Measurement("cuda", "NVIDIA H100 80GB HBM3", 700.0, "bfloat16", 1e12, 2900.0, 79.6, "nccl", 360.0)
    out, eff, notes = calibrate(cluster, A100_CALIBRATED, meas)
    assert out is cluster
    assert eff.gemm == pytest.approx(700 / 989) and eff.hbm == pytest.approx(2900 / 3350)
    assert eff.link == pytest.approx(360 / 450) and "this is a H100-SXM" in notes[0]
    pcie = ClusterSpec(gpu_preset("H100-PCIe"), 8, 1)
    _, _, notes = calibrate(pcie, A100_CALIBRATED, meas)  # an SXM card is not the PCIe preset
    assert "is not a H100-PCIe" in notes[0]


def test_calibrate_foreign_device_plans_for_it():
    cluster = ClusterSpec(gpu_preset("H100-SXM"), 2, 1)
    meas = Measurement("cpu", "CPU x86_64 ×1 threads", 0.15, "float32", 1e10, 20.0, 24.0, "gloo", 1.0, threads=1,
                       cores=2, op_overhead_s=1e-5, attention_tflops=0.05, collective_latency_s=2e-4, p2p_gbs=0.8,
                       elementwise_gbs=10.0)
    mine, eff, notes = calibrate(cluster, A100_CALIBRATED, meas)
    assert mine.gpu.peak_tflops_bf16 == 0.15 and mine.gpu.peak_tflops_fp32 == 0.15 and mine.gpu.memory_gib == 24.0
    assert mine.intra_gbs == 0.8  # the slower of all-reduce and pairwise exchange: the TP ring's path
    assert mine.gpu.hbm_gbs == 10.0  # memory-bound kernels at the measured elementwise rate
    assert (eff.gemm, eff.hbm, eff.link, eff.gemm_tail, eff.tp_overlap) == (1.0, 1.0, 1.0, 0.0, 0.0)
    assert eff.attention == pytest.approx(0.05 / 0.15) and eff.kernel_launch_s == 1e-5
    assert eff.collective_latency_s == pytest.approx(1e-4) and "is not a H100-SXM" in notes[0]
    # four one-thread ranks on two cores: each gets half the rates and waits twice as long
    crowded, eff4, notes = calibrate(ClusterSpec(gpu_preset("H100-SXM"), 4, 1), A100_CALIBRATED, meas)
    assert crowded.gpu.peak_tflops_fp32 == pytest.approx(0.075) and crowded.gpu.hbm_gbs == pytest.approx(5.0)
    assert eff4.kernel_launch_s == pytest.approx(2e-5) and "50% of the measured rates" in notes[-1]
    assert eff4.collective_latency_s == pytest.approx(2e-4)  # no contended timing: the idle one, twice over
    # timed with the plan's 4 ranks computing: the collectives cost what that timing saw
    busy = dataclasses.replace(meas, contended_ranks=4, contended_latency_s=3e-3, contended_busbw_gbs=0.3)
    crowded, eff4, notes = calibrate(ClusterSpec(gpu_preset("H100-SXM"), 4, 1), A100_CALIBRATED, busy)
    assert eff4.collective_latency_s == pytest.approx(1.5e-3) and eff4.p2p_latency_s == pytest.approx(3e-3)
    assert crowded.intra_gbs == 0.3 and "timed with that many ranks computing" in notes[-1]
    # a timing for another rank count is not this plan's
    other, eff8, _ = calibrate(ClusterSpec(gpu_preset("H100-SXM"), 8, 1), A100_CALIBRATED, busy)
    assert eff8.collective_latency_s == pytest.approx(4e-4) and other.intra_gbs == 0.8


def test_layer_gemm_shapes_cover_one_layer():
    m = model_preset("Llama-3-8B")
    shapes = layer_gemm_shapes(m, 7)
    assert sum(2 * a * b * c for a, b, c in shapes) == m.forward_flops_per_layer(1, 7)[0]


@pytest.mark.slow
def test_measure_on_this_machine():
    """Real timings (a GEMM, a copy, a 2-rank gloo all-reduce): positive, finite, sensible."""
    small = model_preset("Llama-3-8B").replace(hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                                ffn_hidden_size=1408)
    meas = measure(small, TrainingSetup(8, 512))
    assert 1e-4 < meas.gemm_tflops < 5000 and 0.1 < meas.copy_gbs < 1e5 and meas.memory_gib > 1
    if meas.device == "cpu":
        assert meas.collective.startswith("gloo") and 0 < meas.busbw_gbs < 1e4
        assert meas.contended_latency_s is None or meas.cores < 2  # two ranks fit on two cores


@pytest.mark.skipif(torch.cuda.is_available() or (os.cpu_count() or 1) > 4,
                    reason="starts two ranks per core: a CPU-only machine with at most 4 cores (CI has 2)")
def test_measure_times_collectives_with_the_plans_ranks_when_they_outnumber_the_cores():
    """Twice as many one-thread ranks as cores, all computing: a collective's cost includes the wait
    for a peer that has no core. Positive and finite; the planner's latency comes from it."""
    small = model_preset("Llama-3-8B").replace(num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                                                ffn_hidden_size=352)
    ranks = 2 * (os.cpu_count() or 1)
    meas = measure(small, TrainingSetup(8, 64), ranks=ranks)
    assert meas.contended_ranks == ranks and 0 <= meas.contended_latency_s and math.isfinite(meas.contended_latency_s)
    assert 0 < meas.contended_busbw_gbs < 1e4 and f"with {ranks} ranks computing" in meas.describe()
    _, eff, _ = calibrate(ClusterSpec(gpu_preset("H100-SXM"), ranks, 1), A100_CALIBRATED, meas)
    assert eff.collective_latency_s == pytest.approx(meas.contended_latency_s / 2)


def test_selective_policy_flag_reaches_the_step_time(capsys):
    """torchtitan's per-op checkpointing reruns projections that the attention-only policy keeps: the
    same selective layout, planned under each, is slower under every_other_matmul."""
    steps = {}
    for policy in ("attention", "every_other_matmul"):
        rc, out, _ = run(capsys, "plan", "--model", "Llama-3-8B", "--gpu", "H100-96GB-500W", "--global-batch", "16",
                         "--seq-len", "8192", "--fix", "TP=1,PP=1,recompute=selective", "--top", "1", "--json",
                         "--memory-margin", "0", "--gpu-memory-gib", "400", "--training.selective_policy", policy)
        assert rc == 0, out
        steps[policy] = json.loads(out)["ranked"][0]["step_time_s"]
    assert steps["attention"] < steps["every_other_matmul"] < 1.3 * steps["attention"]


@pytest.mark.parametrize("device_name,preset", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 96GB HBM2e", "H100-96GB-500W"),
    ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A10", "A10-24GB"), ("NVIDIA L20", "L20"), ("NVIDIA GeForce RTX 4090", None)])
def test_cuda_device_names_map_to_presets(device_name, preset):
    """`tpkernels train --layout auto`, the metrics' MFU, the FP8 choice and the benchmarks find the preset
    of the GPU they run on by its CUDA name; a name that states its memory picks the preset of that
    size (--layout auto on an 80 GB A100 planned for the 40 GB one's memory before)."""
    from tpkernels.planner.measure import preset_for_device

    found = preset_for_device(device_name)
    assert (found.name if found else None) == preset
