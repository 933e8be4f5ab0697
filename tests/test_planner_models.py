"""Model presets, Hugging Face import, parameter and FLOP counts (of the one model description)."""

from __future__ import annotations

import json
import random

import pytest

from tpkernels.description import MODEL_PRESETS, NARAYANAN_2021_GPT, ModelConfig, model_preset


def gpt(layers, hidden, heads, ffn, vocab, **kw) -> ModelConfig:
    """A GPT shape without biases or learned positions (Narayanan et al.'s FLOP formula counts neither)."""
    return ModelConfig("gpt2", layers, hidden, heads, ffn, vocab, activation="gelu_tanh", norm="layernorm", **kw)

# Published totals (model cards / papers).
EXACT = {
    "Llama-3-8B": 8_030_261_248, "Llama-3-70B": 70_553_706_496, "Llama-2-7B": 6_738_415_616,
    "Llama-2-13B": 13_015_864_320, "Qwen2.5-7B": 7_615_616_512, "Qwen2.5-14B": 14_770_033_664,
    "Qwen2.5-72B": 72_706_203_648,
}
ROUNDED_BILLIONS = {"Qwen-14B": 14.2, "Qwen-72B": 72.3, "GPT-3-175B": 175.0}


@pytest.mark.parametrize("name,count", EXACT.items())
def test_exact_parameter_counts(name, count):
    assert model_preset(name).num_params() == count


@pytest.mark.parametrize("name,billions", ROUNDED_BILLIONS.items())
def test_rounded_parameter_counts(name, billions):
    assert model_preset(name).num_params() / 1e9 == pytest.approx(billions, rel=0.005)


def test_narayanan_table1_parameter_counts():
    """The table's params_billion column, to the precision it is printed with."""
    published = {"1.7B": 1.7, "3.6B": 3.6, "7.5B": 7.5, "18B": 18.4, "39B": 39.1, "76B": 76.1, "145B": 145.6,
                 "310B": 310.1, "530B": 529.6, "1T": 1008.0}
    assert set(published) == set(NARAYANAN_2021_GPT)
    for size, billions in published.items():
        n = model_preset(f"GPT-{size}").num_params() / 1e9
        assert abs(n - billions) <= 0.051, (size, n)


def test_gpt_flops_match_narayanan_formula(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(20):
        heads = rng.choice([8, 12, 16, 24])
        h, l, V, s, B = heads * rng.choice([64, 128]), rng.randint(1, 48), rng.randint(1000, 60000), \
            rng.choice([1, 17, 512, 2048]), rng.randint(1, 64)
        m = gpt(l, h, heads, 4 * h, V, max_position_embeddings=s)
        expected = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
        assert m.model_flops_per_step(B, s) == pytest.approx(expected, rel=1e-12)
        # and the parameter approximation 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) for GPT with positions
        g = m.replace(qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=True, positions="learned")
        # = 12·l·h² + 13·l·h + (V+s)·h, plus the final LayerNorm (2h)
        assert g.num_params() == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h


def test_from_hf_config_llama_matches_preset(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "hidden_act": "silu",
           "tie_word_embeddings": False, "max_position_embeddings": 8192}
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = ModelConfig.read_hf(path)
    assert m.name == "Meta-Llama-3-8B" and m == ModelConfig.from_hf(path)
    assert m.num_params() == 8_030_261_248


def test_from_hf_config_gpt2_and_qwen_v1():
    gpt2 = ModelConfig.read_hf({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                                "n_positions": 1024, "n_ctx": 1024})
    assert gpt2.num_params() == 124_439_808  # GPT-2 small
    assert gpt2.dropout == 0.1 and gpt2.build_errors()  # transformers' default dropout: planned, not built
    qwen = ModelConfig.read_hf({"model_type": "qwen", "num_hidden_layers": 40, "hidden_size": 5120,
                                "num_attention_heads": 40, "intermediate_size": 27392, "vocab_size": 152064})
    assert qwen.ffn_hidden_size == 13696 and qwen.num_params() == MODEL_PRESETS["Qwen-14B"].num_params()
    assert "Qwen (v1)" in qwen.build_errors()[0]


def test_bad_model_inputs_are_named():
    with pytest.raises(ValueError, match=r"model \('Llama-9'\) is not a known preset"):
        model_preset("Llama-9")
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\) must be divisible by num_kv_heads \(5\)"):
        ModelConfig("llama", 2, 768, 12, 3072, 1000, num_kv_heads=5)
    with pytest.raises(ValueError, match=r"num_layers \(0\) must be a positive integer"):
        ModelConfig("llama", 0, 768, 12, 3072, 1000)
    with pytest.raises(ValueError, match=r"model_type \('mystery'\) is not supported; supported: gpt2, llama"):
        ModelConfig.read_hf({"model_type": "mystery", "hidden_size": 8})


def test_bad_training_and_cluster_inputs_are_named():
    from tpkernels.planner import ClusterSpec, TrainingSetup, gpu_preset  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"precision \('fp4'\) must be one of bf16, fp16, fp8"):
        TrainingSetup(8, 2048, precision="fp4")
    with pytest.raises(ValueError, match=r"finetune \('dora'\) must be one of full, lora, qlora"):
        TrainingSetup(8, 2048, finetune="dora")
    with pytest.raises(ValueError, match=r"seq_length \(0\) must be a positive integer"):
        TrainingSetup(8, 0)
    with pytest.raises(ValueError, match=r"gpus_per_node \(0\) must be a positive integer"):
        ClusterSpec(gpu_preset("H200"), gpus_per_node=0)
    with pytest.raises(ValueError, match=r"intra_link \('ib'\) must be 'nvlink' or 'pcie'"):
        ClusterSpec(gpu_preset("H200"), intra_link="ib")
    assert gpu_preset("h100").name == "H100-SXM" and gpu_preset("A100-40GB").memory_gib == 40.0
