"""Memory model: Korthikanti et al. 2022 activation formulas, bytes per parameter, pipeline in-flight."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.activations import layer_activations
from tpkernels.planner.memory import inflight_layers, stage_memory, stage_params_per_rank
from tpkernels.description import ModelConfig, model_preset
from tpkernels.planner.workload import TrainingSetup


def random_gpt(rng) -> ModelConfig:
    heads = rng.choice([8, 16, 32, 40])
    h = heads * rng.choice([64, 128])
    return ModelConfig("gpt2", rng.choice([4, 24, 48]), h, heads, 4 * h, 51200, activation="gelu_tanh",
                       norm="layernorm", positions="learned", max_position_embeddings=2048, qkv_bias=True,
                       out_bias=True, mlp_bias=True, tied_embeddings=True, dropout=0.1)


def acts(m, s, b, t, sp, rc, flash=False):
    return layer_activations(m, seq=s, micro_batch=b, tp=t, sequence_parallel=sp, recompute=rc, flash_attention=flash)


def test_gpt_activations_reduce_to_korthikanti(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(30):
        m = random_gpt(rng)
        s, b, t = rng.choice([1, 17, 2048, 4096]), rng.randint(1, 8), rng.choice([1, 2, 4, 8])
        h, a = m.hidden_size, m.num_attention_heads
        sbh = s * b * h
        assert acts(m, s, b, 1, False, "none").stored == pytest.approx(sbh * (34 + 5 * a * s / h))
        assert acts(m, s, b, t, False, "none").stored == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert acts(m, s, b, t, True, "none").stored == pytest.approx(sbh / t * (34 + 5 * a * s / h))
        assert acts(m, s, b, t, True, "selective").stored == pytest.approx(sbh / t * 34)
        assert acts(m, s, b, t, False, "selective").stored == pytest.approx(sbh * (10 + 24 / t))
        assert acts(m, s, b, t, False, "full").stored == pytest.approx(2 * sbh)
        assert acts(m, s, b, t, True, "full").stored == pytest.approx(2 * sbh / t)


def test_flash_attention_stores_no_scores_and_gqa_swiglu_are_sized():
    m = model_preset("Llama-3-8B")  # 32 heads, 8 KV heads (K, V are 1/4 of h), SwiGLU 14336, no dropout
    s, b, h = 4096, 1, 4096
    f = acts(m, s, b, 1, False, "none", flash=True).stored / (s * b * h)
    # norms 4 + QKV in 2 + MLP in 2 | Q 2, K 0.5, V 0.5, proj in 2 | gate, up, product 3·2·3.5
    assert f == pytest.approx(8 + 2 + 0.5 + 0.5 + 2 + 6 * 14336 / 4096)
    no_flash = acts(m, s, b, 1, False, "none", flash=False).stored / (s * b * h)
    assert no_flash - f == pytest.approx(2 * 32 * s / h)  # softmax output only (no dropout)


def test_bytes_per_parameter_full_and_zero1():
    m = model_preset("Llama-3-8B")
    train = TrainingSetup(global_batch=64, seq_length=1024)
    for dp in (1, 4, 8):
        cfg = ParallelConfig(dp=dp, num_microbatches=64 // dp)
        params = stage_params_per_rank(m, cfg, 0)
        plain = stage_memory(m, train, cfg, 0)
        assert (plain.weights + plain.gradients + plain.optimizer) / params == pytest.approx(18)
        z = stage_memory(m, train, cfg.replace(zero1=True), 0)
        assert (z.weights + z.gradients + z.optimizer) / params == pytest.approx(6 + 12 / dp)


def test_lora_trains_only_adapters():
    m = model_preset("Llama-2-13B")
    cfg = ParallelConfig(tp=2, pp=2, dp=2, num_microbatches=8)
    full = stage_memory(m, TrainingSetup(32, 2048), cfg, 0)
    lora = stage_memory(m, TrainingSetup(32, 2048, finetune="lora", lora_rank=16), cfg, 0)
    assert lora.optimizer < full.optimizer / 100 and lora.gradients < full.gradients / 100
    assert full.weights < lora.weights < full.weights * 1.02


def test_first_stage_holds_p_microbatches_and_interleaving_factor():
    m = random_gpt(random.Random(0)).replace(num_layers=48)
    for p in (2, 4, 8):
        cfg = ParallelConfig(pp=p, num_microbatches=4 * p)
        assert inflight_layers(m, cfg, 0) == pytest.approx(48)  # p micro-batches × l/p layers
        assert inflight_layers(m, cfg, p - 1) == pytest.approx(48 / p)
        for v in (2, 3):
            if 48 % (p * v):
                continue
            x = inflight_layers(m, cfg.replace(virtual_stages=v), 0)
            assert x == pytest.approx(48 * (1 + (p - 1) / (p * v)))  # Korthikanti et al., interleaved
    few = ParallelConfig(pp=8, num_microbatches=3)
    assert inflight_layers(m, few, 0) == pytest.approx(3 * 48 / 8)  # cannot hold more than it has


def test_tensor_parallel_splits_weights_and_pipeline_splits_layers():
    m = model_preset("Llama-3-70B")
    one = stage_params_per_rank(m, ParallelConfig(), 0)
    assert one == m.num_params()
    tp8 = stage_params_per_rank(m, ParallelConfig(tp=8), 0)
    assert m.num_params() / 8 < tp8 < m.num_params() / 8 * 1.01  # norms replicated
    pp4 = [stage_params_per_rank(m, ParallelConfig(pp=4), s) for s in range(4)]
    assert sum(pp4) == pytest.approx(m.num_params())
