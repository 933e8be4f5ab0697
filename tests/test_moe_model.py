"""Mixture-of-experts models (issue 42): the ModelConfig fields and their rules, the one Hugging Face reader and
writer for mixtral / qwen2_moe / qwen3_moe, the presets' parameter counts against transformers' own models."""

from __future__ import annotations

import pytest
import torch

from tpkernels.description import MODEL_PRESETS, ModelConfig
from tpkernels.description.hf_config import config_to_hf

transformers = pytest.importorskip("transformers")

MOE_PRESETS = [name for name, mc in MODEL_PRESETS.items() if mc.num_experts]
# published (total, active) parameters, billions
PUBLISHED = {"Mixtral-8x7B": (46.7, 12.9), "Mixtral-8x22B": (141, 39), "Qwen2-57B-A14B": (57.4, 14.2),
             "Qwen3-30B-A3B": (30.5, 3.3), "Qwen3-235B-A22B": (235, 22)}


def _meta_count(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_presets_count_what_transformers_builds(name):
    """Each MoE preset's total count is what transformers' model of the same config holds (built on the meta
    device), the active count is the published one, and the config survives the trip through transformers."""
    mc = MODEL_PRESETS[name]
    cfg = config_to_hf(mc)
    assert _meta_count(cfg) == mc.num_params()
    total, active = PUBLISHED[name]
    assert mc.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert mc.num_active_params() / 1e9 == pytest.approx(active, rel=0.02)
    assert ModelConfig.read_hf(cfg).replace(name="") == mc.replace(name="")


def tiny(kind: str, **kw):
    common = dict(vocab_size=61, hidden_size=24, intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if kind == "mixtral":
        return transformers.MixtralConfig(**{**common, "num_local_experts": 5, **kw})
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**{**common, "num_experts": 3, "moe_intermediate_size": 14,
                                              "shared_expert_intermediate_size": 18, **kw})
    return transformers.Qwen3MoeConfig(**{**common, "num_experts": 3, "moe_intermediate_size": 14, **kw})


def test_mixtral_fields():
    mc = ModelConfig.read_hf(tiny("mixtral", router_aux_loss_coef=0.02, sliding_window=7))
    assert (mc.num_experts, mc.experts_per_token, mc.expert_ffn, mc.shared_expert_ffn_hidden_size) == (5, 2, 20, 0)
    assert mc.router_normalize and mc.moe_layers is None and mc.router_aux_loss_coef == 0.02
    assert not mc.qkv_bias and mc.window(3) == (6, 0) and all(mc.is_moe_layer(i) for i in range(4))
    assert config_to_hf(mc).num_local_experts == 5


def test_qwen2_moe_fields_sparse_step_and_dense_layers():
    mc = ModelConfig.read_hf(tiny("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert mc.moe_layers == (1,) and [mc.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (mc.expert_ffn, mc.ffn_hidden_size, mc.shared_expert_ffn_hidden_size) == (14, 20, 18)
    assert mc.shared_expert_gate and mc.qkv_bias and mc.router_normalize
    assert _meta_count(config_to_hf(mc)) == mc.num_params()
    back = ModelConfig.read_hf(config_to_hf(mc))  # written as mlp_only_layers, read back alike
    assert back.replace(name="") == mc.replace(name="")
    # a dense layer's MLP is the dense width; the active count leaves out (E - k) experts of the MoE layer only
    assert mc.num_params() - mc.num_active_params() == (3 - 2) * 3 * 24 * 14


def test_qwen3_moe_is_planned_not_built():
    mc = ModelConfig.read_hf(tiny("qwen3_moe", head_dim=8))
    assert mc.qk_norm and mc.num_experts == 3 and mc.dhead == 8
    assert _meta_count(config_to_hf(mc)) == mc.num_params()
    assert any("q_norm, k_norm" in e for e in mc.build_errors())
    with pytest.raises(ValueError, match="q_norm, k_norm"):
        ModelConfig.from_hf(tiny("qwen3_moe"))


def test_router_jitter_is_refused_like_dropout():
    mc = ModelConfig.read_hf(tiny("mixtral", router_jitter_noise=0.1))
    assert mc.router_jitter == 0.1
    with pytest.raises(ValueError, match=r"router_jitter_noise \(0.1\) > 0"):
        ModelConfig.from_hf(tiny("mixtral", router_jitter_noise=0.1))


@pytest.mark.parametrize("changes, message", [
    (dict(experts_per_token=6), r"experts_per_token \(6\) must be between 1 and num_experts \(5\)"),
    (dict(experts_per_token=0), r"experts_per_token \(0\) must be between 1"),
    (dict(num_experts=-1), r"num_experts \(-1\) must be a non-negative integer"),
    (dict(moe_ffn_hidden_size=0), r"moe_ffn_hidden_size \(0\) must be a positive integer"),
    (dict(moe_layers=(2, 1)), r"moe_layers \(\(2, 1\)\) must be a sorted tuple"),
    (dict(moe_layers=(4,)), r"moe_layers \(\(4,\)\) must be a sorted tuple of distinct layer ids in \[0, num_layers"),
    (dict(shared_expert_gate=True), r"shared_expert_gate \(True\) needs a shared expert"),
    (dict(capacity_factor=0.0), r"capacity_factor \(0.0\) must be a finite number > 0"),
    (dict(router_aux_loss_coef=-1.0), r"router_aux_loss_coef \(-1.0\) must be a finite number >= 0"),
    (dict(router_score="relu"), r"router_score \('relu'\) must be one of softmax, sigmoid"),
    (dict(num_experts=0), r"experts_per_token \(2\) set on a dense model"),
    (dict(activation="gelu"), r"activation \('gelu'\) must be 'swiglu' with num_experts \(5\)"),
])
def test_bad_moe_fields_are_named(changes, message):
    mc = ModelConfig.read_hf(tiny("mixtral"))
    with pytest.raises(ValueError, match=message):
        mc.replace(**changes)


def test_other_families_with_experts_are_refused():
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2)
    cfg.num_experts = 8
    with pytest.raises(ValueError, match=r"num_experts \(8\): experts in a 'qwen2' config are not supported"):
        ModelConfig.from_hf(cfg)


def test_flops_count_active_experts_and_router():
    """Mixtral-8x7B: a token's GEMM weights are attention + router + 2 of 8 experts; model FLOPs per token are
    6 × (active non-embedding weights) + attention core + logits, as Megatron-Core counts MoE."""
    mc = MODEL_PRESETS["Mixtral-8x7B"]
    h, f, e = 4096, 14336, 8
    attn = h * 4096 + 2 * h * 1024 + 4096 * h
    assert mc.linear_weights_per_layer() == attn + e * h + 2 * 3 * h * f
    lin, _ = mc.forward_flops_per_layer(1, 1)
    assert lin == 2 * (mc.num_active_params() - mc.embedding_params() - mc.head_params() - 32 * 2 * h) / 32
    dense = mc.replace(num_experts=0, experts_per_token=0)
    assert mc.model_flops_per_step(1, 4096) > dense.model_flops_per_step(1, 4096)
    F, B, W = mc.weight_split_flops(4096, 1, 2)
    assert W == lin * 4096 / 2
    r = 8
    assert mc.lora_params_per_layer(r) == r * (2 * (h + 4096) + 2 * (h + 1024)) + e * 3 * r * (h + f)
