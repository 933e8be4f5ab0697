"""ModelConfig: from transformers configs, config.json files and the planner's presets; the
errors for what the models do not implement; the padding rule."""

from __future__ import annotations

import json

import pytest

from model_checks import hf_config
from tpkernels.models import ModelConfig
from tpkernels.planner.models import MODEL_PRESETS

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral"])
def test_from_transformers_config_and_back(family, tmp_path):
    cfg = hf_config(family)
    mc = ModelConfig.from_hf(cfg)
    assert mc.model_type == family
    back = mc.to_hf()
    assert ModelConfig.from_hf(back).replace(name="") == mc.replace(name="")
    cfg.save_pretrained(str(tmp_path))  # config.json: the same config from the file and its folder
    for src in (tmp_path, tmp_path / "config.json", json.loads((tmp_path / "config.json").read_text())):
        assert ModelConfig.from_hf(src).replace(name="") == mc.replace(name="")


def test_family_fields():
    gpt2 = ModelConfig.from_hf(hf_config("gpt2"))
    assert (gpt2.norm, gpt2.positions, gpt2.activation, gpt2.tied_embeddings) == ("layernorm", "learned", "gelu_tanh",
                                                                                   True)
    assert gpt2.qkv_bias and gpt2.out_bias and gpt2.mlp_bias
    llama = ModelConfig.from_hf(hf_config("llama"))
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0 and llama.kv_heads == 2
    qwen = ModelConfig.from_hf(hf_config("qwen2"))
    assert qwen.qkv_bias and not qwen.out_bias and not qwen.mlp_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_hf(hf_config("mistral"))
    assert mistral.window(0) == (4, 0) and mistral.dhead == 8


def test_qwen2_sliding_window_only_on_its_layers():
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=7,
                                   max_window_layers=2)
    mc = ModelConfig.from_hf(cfg)
    assert [mc.window(i) for i in range(4)] == [(-1, 0), (-1, 0), (6, 0), (6, 0)]


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}, r"rope_type \('yarn'\)"),
    ("attention_dropout", 0.1, r"attention_dropout \(0.1\) > 0"),
    ("hidden_act", "gelu", r"hidden_act \('gelu'\) must be 'silu'"),
])
def test_unsupported_features_name_the_field(field, value, message):
    cfg = hf_config("llama")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg)


def test_moe_and_unknown_model_types_are_refused():
    with pytest.raises(ValueError, match=r"model_type \('mixtral'\) is not supported"):
        ModelConfig.from_hf(transformers.MixtralConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                       intermediate_size=32))
    cfg = hf_config("qwen2")
    cfg.num_experts = 8
    with pytest.raises(ValueError, match=r"num_experts \(8\): mixture-of-experts"):
        ModelConfig.from_hf(cfg)


def test_gpt2_dropout_is_an_error_unless_dropped():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)  # transformers' default 0.1
    with pytest.raises(ValueError, match=r"attn_pdrop \(0.1\) > 0.*drop_dropout=True"):
        ModelConfig.from_hf(cfg)
    assert ModelConfig.from_hf(cfg, drop_dropout=True).model_type == "gpt2"


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen2.5-7B", "GPT-1.7B", "Llama-2-13B"])
def test_presets_are_the_planners(name):
    """One preset list: the runnable config of a planner preset counts the planner's parameters."""
    mc = ModelConfig.from_preset(name)
    spec = MODEL_PRESETS[name]
    assert mc.to_spec().num_params() == spec.num_params()
    assert mc.rope_theta == spec.rope_theta and mc.norm_eps == spec.norm_eps


@pytest.mark.parametrize("vocab, tp, padded", [(97, 1, 128), (97, 2, 256), (128256, 8, 129024), (50257, 3, 50304)])
def test_vocab_padding_rule(vocab, tp, padded):
    mc = ModelConfig.from_hf(hf_config("llama")).replace(vocab_size=vocab)
    assert mc.padded_vocab(tp) == padded and padded % (128 * tp) == 0 and padded >= vocab


def test_bad_shapes_name_the_field():
    base = ModelConfig.from_hf(hf_config("llama"))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        base.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"vocab_size \(0\) must be a positive integer"):
        base.replace(vocab_size=0)
