"""ModelConfig, the one model description: from transformers configs, config.json files and the one
preset list; the errors for what the models do not implement; the padding rule; the planner and the
model agree on every preset and every config file."""

from __future__ import annotations

import json

import pytest

from model_checks import hf_config
from tpkernels.description import MODEL_PRESETS
from tpkernels.models import ModelConfig, ParallelTransformer

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


def test_moe_in_dense_families_and_unknown_model_types_are_refused():
    with pytest.raises(ValueError, match=r"model_type \('falcon'\) is not supported"):
        ModelConfig.from_hf({"model_type": "falcon", "hidden_size": 16})
    cfg = hf_config("qwen2")
    cfg.num_experts = 8  # experts are read for the MoE families only (tests/test_moe_model.py)
    with pytest.raises(ValueError, match=r"num_experts \(8\): experts in a 'qwen2' config are not supported"):
        ModelConfig.from_hf(cfg)


def test_gpt2_dropout_is_an_error_unless_dropped():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)  # transformers' default 0.1
    with pytest.raises(ValueError, match=r"attn_pdrop \(0.1\) > 0.*drop_dropout=True"):
        ModelConfig.from_hf(cfg)
    assert ModelConfig.from_hf(cfg, drop_dropout=True).model_type == "gpt2"


def _built_params(mc: ModelConfig) -> int:
    """Parameters of the model tpkernels.models builds for ``mc`` (on the meta device: no memory), less the
    vocabulary padding rows, which hold nothing."""
    import torch

    model = ParallelTransformer(mc, device=torch.device("meta"), init=None)
    padding = (mc.padded_vocab(1) - mc.vocab_size) * mc.hidden_size
    return sum(p.numel() for p in model.parameters()) - padding * (1 if mc.tied_embeddings else 2)


@pytest.mark.parametrize("name", [n for n, mc in MODEL_PRESETS.items() if not mc.build_errors()])
def test_planner_and_model_count_every_preset_alike(name):
    """One preset list, one type: the planner's parameter count is what the model holds."""
    mc = ModelConfig.from_preset(name)
    assert mc is MODEL_PRESETS[name]
    assert _built_params(mc) == mc.num_params()


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral"])
def test_planner_and_model_agree_on_config_files(family, tmp_path):
    """The test suite's config files: plan reads what train builds, and counts it alike."""
    cfg = hf_config(family)
    cfg.save_pretrained(str(tmp_path))
    planned, built = ModelConfig.read_hf(tmp_path), ModelConfig.from_hf(tmp_path)
    assert planned == built and _built_params(built) == planned.num_params()


def test_what_the_model_cannot_build_is_planned_and_refused_alike(tmp_path, capsys):
    """A Qwen3 config with dropout: read by the one reader (its per-head q/k norms counted); plan notes the
    dropout, train refuses it, with the same message; a family neither knows is refused by both alike."""
    from tpkernels.cli import main

    qwen3 = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     attention_dropout=0.1)
    qwen3.save_pretrained(str(tmp_path / "q3"))
    mc = ModelConfig.read_hf(tmp_path / "q3")
    assert mc.model_type == "qwen3" and mc.qk_norm
    assert mc.num_params() - mc.replace(qk_norm=False).num_params() == 2 * 2 * 8  # q and k norms, 2 layers
    reason, = mc.build_errors()
    assert reason.startswith("attention_dropout (0.1) > 0")
    with pytest.raises(ValueError, match=r"attention_dropout \(0.1\) > 0"):
        ModelConfig.from_hf(tmp_path / "q3")
    with pytest.raises(ValueError, match=r"attention_dropout \(0.1\) > 0"):
        ParallelTransformer(mc)
    rc = main(["plan", "--model", str(tmp_path / "q3"), "--gpu", "H100-SXM", "--global-batch", "8", "--top", "1"])
    out = capsys.readouterr()
    assert rc == 0 and f"cannot build this model yet: {reason}" in out.out
    rc = main(["train", "--model", str(tmp_path / "q3"), "--dry-run"])
    assert rc == 2 and reason in capsys.readouterr().err
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 8}))
    for cmd in (["plan", "--gpu", "H100-SXM"], ["train", "--dry-run"]):
        assert main([cmd[0], "--model", str(tmp_path / "unknown"), *cmd[1:]]) == 2
        assert "model_type ('falcon') is not supported; supported: gpt2, llama" in capsys.readouterr().err


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


def test_per_layer_counts_equal_the_sum_over_the_layers(fresh_seed):
    """ModelConfig's per-layer means and totals are closed forms over the MoE / dense layer counts: they
    equal the sums over every layer (layer_params / moe_params / the layer's shapes) for random
    moe_layers patterns (a dense model, experts on every layer, any subset of the layers, none included)."""
    import random  # noqa: PLC0415

    rng = random.Random(fresh_seed)
    for _ in range(60):
        n = rng.randint(1, 9)
        kind = rng.choice(["dense", "all", "subset"])
        moe = {} if kind == "dense" else dict(
            num_experts=rng.choice([2, 3, 4, 8]), experts_per_token=1, moe_ffn_hidden_size=rng.choice([8, 12]),
            shared_expert_ffn_hidden_size=rng.choice([0, 16]))
        if moe:
            moe["experts_per_token"] = rng.randint(1, moe["num_experts"])
            moe["shared_expert_gate"] = bool(moe["shared_expert_ffn_hidden_size"]) and rng.random() < 0.5
        if kind == "subset":
            moe["moe_layers"] = tuple(sorted(rng.sample(range(n), rng.randint(0, n))))
        m = ModelConfig("qwen2_moe" if moe else "llama", n, 16, 2, rng.choice([24, 40]), 64, **moe)
        ids = range(n)
        moe_ids = [i for i in ids if m.is_moe_layer(i)]
        assert m.num_moe_layers == len(moe_ids)
        layer = [m.layer_params(i) for i in ids]
        active = [m.layer_params(i, active=True) for i in ids]
        experts = [m.moe_params(i).get("experts", 0) for i in ids]
        k_of_e = [e // max(1, m.num_experts) * m.experts_per_token for e in experts]
        attn_w = 16 * m.q_dim + 2 * 16 * m.kv_dim + m.q_dim * 16
        weights = [attn_w + m._dense_mlp_params(i)[0] + m.moe_params(i).get("router", 0) + k_of_e[i]
                   + m.moe_params(i).get("shared", 0) for i in ids]
        extra = m.embedding_params() + m.head_params()
        assert m.num_params() == sum(layer) + extra and m.num_active_params() == sum(active) + extra
        assert m.params_per_layer() == pytest.approx(sum(layer) / n, rel=1e-15)
        assert m.expert_params_per_layer() == pytest.approx(sum(experts) / n, rel=1e-15)
        assert m.linear_weights_per_layer() == pytest.approx(sum(weights) / n, rel=1e-15)
        r = rng.randint(1, 8)
        mlp = lambda f: [(16, f)] * (m.mlp_matrices - 1) + [(f, 16)]  # noqa: E731
        lora = 0
        for i in ids:
            shapes = [(16, m.q_dim), (16, m.kv_dim), (16, m.kv_dim), (m.q_dim, 16)]
            if i in moe_ids:
                shapes += mlp(m.expert_ffn) * m.num_experts + (mlp(m.shared_expert_ffn_hidden_size)
                                                              if m.shared_expert_ffn_hidden_size else [])
            else:
                shapes += mlp(m.ffn_hidden_size)
            lora += sum(r * (a + b) for a, b in shapes)
        assert m.lora_params_per_layer(r) == pytest.approx(lora / n, rel=1e-15)
        # an integer whenever the sum divides evenly, as before
        assert isinstance(m.params_per_layer(), int) == (sum(layer) % n == 0)
