"""The per-layer FP8 decision (fp8.layers: auto): FP8 where the GEMM model predicts it faster, casts and
the halved SP all-gather included (tpkernels/planner/fp8_choice.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tpkernels.description import ModelConfig, model_preset
from tpkernels.planner import (
    Fp8LayerChoice,
    Fp8Rates,
    format_choices,
    fp8_layer_choices,
    gpu_preset,
    measure_fp8_rates,
)
from tpkernels.planner.collectives import ring_phase_time
from tpkernels.planner.efficiency import calibrated_for

L8B = model_preset("Llama-3-8B")
H200 = gpu_preset("H200")
TINY = ModelConfig("llama", 2, 64, 4, 176, 1000)
NAMES = ["qkv", "out", "gate_up", "down"]


def _by_name(choices: list[Fp8LayerChoice]) -> dict[str, Fp8LayerChoice]:
    return {c.name: c for c in choices}


@pytest.mark.parametrize("tp, sp", [(1, False), (8, True)])
def test_llama3_8b_on_h200_big_mlp_layers_chosen_in_band(tp, sp):
    c = _by_name(fp8_layer_choices(L8B, tp=tp, sequence_parallel=sp, tokens=8192, gpu=H200))
    assert list(c) == NAMES
    assert (c["gate_up"].m, c["gate_up"].k, c["gate_up"].n) == (8192, 4096, 2 * 14336 // tp)
    assert (c["down"].k, c["down"].n) == (14336 // tp, 4096)
    for name in ("gate_up", "qkv"):
        assert c[name].chosen, c[name]
        # TransformerEngine measures 1.57-1.69x on GEMM-bound layers of an H200; casts take some of it
        assert 1.2 <= c[name].gain <= 2.0, c[name]
        assert c[name].gain == pytest.approx(c[name].bf16_s / c[name].fp8_s)
        assert "faster" in c[name].reason
    if tp == 1:
        assert all(x.chosen for x in c.values())
    else:  # TP8's out projection (k = 512) is the shortest GEMM: FP8 pays least there
        assert c["out"].gain < min(c["qkv"].gain, c["gate_up"].gain)
        assert c["down"].chosen


def test_tiny_model_is_not_chosen_the_casts_cost_more():
    choices = fp8_layer_choices(TINY, tp=1, sequence_parallel=False, tokens=128, gpu=H200)
    for c in choices:
        assert not c.chosen and c.gain < 1.0, c
        assert "casts" in c.reason and c.cast_s > 0


def test_min_gain_threshold():
    choices = fp8_layer_choices(L8B, tp=1, sequence_parallel=False, tokens=8192, gpu=H200, min_gain=1.6)
    assert not any(c.chosen for c in choices)
    assert all("below the 1.60× threshold" in c.reason for c in choices)


def test_k_or_n_not_multiple_of_16_never_chosen():
    # ffn 14344: down's k is 14344 = 16·896 + 8; gate_up's n (28688) still divides by 16
    m = ModelConfig("llama", 2, 4096, 32, 14344, 1000, num_kv_heads=8)
    c = _by_name(fp8_layer_choices(m, tp=1, sequence_parallel=False, tokens=8192, gpu=H200))
    assert c["down"].gain > 1.05  # FP8 would pay: the rule alone refuses it
    assert not c["down"].chosen and c["down"].reason == "k (14344) not a multiple of 16 (FP8 GEMMs)"
    assert c["gate_up"].chosen
    m = ModelConfig("llama", 2, 4096, 32, 14340, 1000, num_kv_heads=8)  # gate_up n = 28680
    c = _by_name(fp8_layer_choices(m, tp=1, sequence_parallel=False, tokens=8192, gpu=H200))
    assert not c["gate_up"].chosen and "n (28680) not a multiple of 16" in c["gate_up"].reason


def test_a100_has_no_fp8():
    for c in fp8_layer_choices(L8B, tp=1, sequence_parallel=False, tokens=8192, gpu=gpu_preset("A100")):
        assert not c.chosen and c.reason == "no FP8 tensor cores on A100-80GB"
        assert c.bf16_s > 0 and math.isfinite(c.bf16_s) and c.fp8_s == math.inf


def test_no_gpu_no_rates():
    for c in fp8_layer_choices(L8B, tp=1, sequence_parallel=False, tokens=8192):
        assert not c.chosen and c.reason.startswith("no FP8 GEMM rate") and "fp8.measure true" in c.reason
        assert math.isnan(c.bf16_s)


def test_measured_rates_flip_the_choice():
    fast = fp8_layer_choices(L8B, tp=1, sequence_parallel=False, tokens=4096, rates=Fp8Rates("cpu", 1.0, 2.0, 100.0))
    slow = fp8_layer_choices(L8B, tp=1, sequence_parallel=False, tokens=4096, rates=Fp8Rates("cpu", 1.0, 0.5, 100.0))
    assert all(c.chosen for c in fast) and not any(c.chosen for c in slow)
    for c in fast:
        assert 1.8 < c.gain < 2.0  # the GEMMs at twice the rate, less the casts
    for c in slow:
        assert c.gain < 0.5 and "FP8 GEMMs are slower" in c.reason


def test_frozen_drops_weight_gradient():
    kw = {"tp": 1, "sequence_parallel": False, "tokens": 8192, "gpu": H200}
    trained, frozen = fp8_layer_choices(L8B, **kw), fp8_layer_choices(L8B, frozen=True, **kw)
    for t, f in zip(trained, frozen):
        # three GEMMs of equal FLOPs become two
        assert f.bf16_s == pytest.approx(2 / 3 * t.bf16_s, rel=0.05)
        assert f.cast_s < t.cast_s  # no transposed copies of x and dY


def test_sp_all_gather_halved_in_fp8():
    kw = {"tp": 8, "tokens": 8192, "gpu": H200}
    sp, plain = _by_name(fp8_layer_choices(L8B, sequence_parallel=True, **kw)), \
        _by_name(fp8_layer_choices(L8B, sequence_parallel=False, **kw))
    eff, m = calibrated_for(H200), 8192
    for name in ("qkv", "gate_up"):
        c, p = sp[name], plain[name]
        k = c.k
        # the bf16 all-gather of the input (once: the gathered input is kept): at least its first ring
        # chunk exposed, at most all of it; FP8 gathers half the bytes
        bw = ring_phase_time(2.0 * m * k, 8, H200.nvlink_gbs, eff)
        assert bw / 8 <= c.bf16_comm_s <= bw * 1.01 + 1e-4
        assert c.fp8_comm_s > 0 and c.fp8_comm_s < c.bf16_comm_s
        # the rest of bf16_s / fp8_s is what the layer costs without SP (x cast on the m/8 local rows)
        assert c.bf16_s - c.bf16_comm_s == pytest.approx(p.bf16_s)
        assert c.fp8_s - c.fp8_comm_s - c.cast_s == pytest.approx(p.fp8_s - p.cast_s)
        assert p.cast_s - c.cast_s == pytest.approx(3 * (m - m / 8) * k / (H200.hbm_gbs * 1e9 * eff.hbm))
        assert p.bf16_comm_s == p.fp8_comm_s == 0.0
    for name in ("out", "down"):  # row-parallel: the output gradient's all-gather in the backward, halved
        c = sp[name]
        bw = ring_phase_time(2.0 * m * c.n, 8, H200.nvlink_gbs, eff)
        assert bw / 8 <= c.bf16_comm_s <= bw * 1.01 + 1e-4 and 0 < c.fp8_comm_s < c.bf16_comm_s
        assert plain[name].bf16_comm_s == 0.0
    # the rowwise recipe gathers 16-bit values: no saving, and FP8's shorter GEMM hides no more of them
    rowwise = _by_name(fp8_layer_choices(L8B, sequence_parallel=True, fp8_gather=False, **kw))
    for c in rowwise.values():
        assert c.fp8_comm_s >= c.bf16_comm_s * (1 - 1e-9) and c.bf16_comm_s > 0
    assert rowwise["qkv"].cast_s > sp["qkv"].cast_s  # cast after the gather: all m rows


def test_format_choices_lists_every_layer():
    gelu = ModelConfig("gpt2", 2, 1024, 16, 4096, 1000, activation="gelu_tanh", norm="layernorm")
    choices = fp8_layer_choices(gelu, tp=1, sequence_parallel=False, tokens=4096, gpu=H200)
    assert [c.name for c in choices] == ["qkv", "out", "up", "down"]
    lines = format_choices(choices).splitlines()
    assert len(lines) == 5 and lines[0].split()[:2] == ["layer", "GEMM"]
    for line, c in zip(lines[1:], choices):
        assert line.split()[0] == c.name and f"{c.m}×{c.k}×{c.n}" in line and c.reason in line
        assert ("yes" if c.chosen else "no") in line.split()
    text = format_choices(fp8_layer_choices(gelu, tp=1, sequence_parallel=False, tokens=4096))
    assert text.count("—") == 12  # no rates: bf16, fp8, gain unknown for each of the 4 layers


def test_measure_fp8_rates_cpu():
    r = measure_fp8_rates(torch.device("cpu"), sizes=(256,), reps=1)
    assert r.device == "cpu"
    for v in (r.bf16_tflops, r.fp8_tflops, r.cast_gbs, r.cast_op_s):
        assert 0 < v < math.inf
    c = fp8_layer_choices(TINY, tp=1, sequence_parallel=False, tokens=128, rates=r)
    assert all(math.isfinite(x.gain) and x.gain > 0 for x in c)
