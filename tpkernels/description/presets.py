"""The one list of model presets: published shapes, as ModelConfig fields (``MODEL_PRESETS`` in
:mod:`tpkernels.description.model` holds them built). Presets describe the architecture; a
published run's training recipe (e.g. dropout) belongs to that run (planner/calibration.py)."""

from __future__ import annotations


def _llama(name, layers, hidden, heads, kv, ffn, vocab, *, qkv_bias=False, tied=False, seq=4096, theta=10000.0,
           eps=1e-5) -> dict:
    """Llama / Qwen shapes: SwiGLU, RMSNorm, rotary; q/k/v biases make it a Qwen2 model."""
    return dict(model_type="qwen2" if qkv_bias else "llama", num_layers=layers, hidden_size=hidden,
                num_attention_heads=heads, ffn_hidden_size=ffn, vocab_size=vocab, num_kv_heads=kv,
                qkv_bias=qkv_bias, tied_embeddings=tied, max_position_embeddings=seq, rope_theta=theta,
                norm_eps=eps, name=name)


def _gpt(name, layers, hidden, heads, vocab=51200, seq=2048) -> dict:
    """GPT-2/3 and the Megatron GPT family: GeLU MLP of 4h, LayerNorm, biases everywhere, learned
    positions, tied embeddings."""
    return dict(model_type="gpt2", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                ffn_hidden_size=4 * hidden, vocab_size=vocab, norm="layernorm", positions="learned",
                max_position_embeddings=seq, activation="gelu_tanh", qkv_bias=True, out_bias=True, mlp_bias=True,
                tied_embeddings=True, name=name)


def _moe(name, kind, layers, hidden, heads, kv, ffn, vocab, experts, k, *, expert_ffn=None, shared=0, normalize=True,
         head_dim=None, seq=32768, theta=1e6, eps=1e-6, aux=0.001) -> dict:
    """Mixtral / Qwen-MoE shapes: Llama's attention and norms, experts on every layer. ``ffn`` is the dense
    MLP width (HF ``intermediate_size``); Mixtral's experts are that wide, Qwen's ``expert_ffn``
    (``moe_intermediate_size``)."""
    return dict(model_type=kind, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv,
                head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
                rope_theta=theta, norm_eps=eps, qkv_bias=kind == "qwen2_moe", qk_norm=kind == "qwen3_moe",
                num_experts=experts, experts_per_token=k, moe_ffn_hidden_size=expert_ffn,
                shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared > 0, router_normalize=normalize,
                router_aux_loss_coef=aux, name=name)


# (heads, hidden, layers) of the GPT models of Narayanan et al. 2021, Table 1 (vocab 51200, seq 2048)
NARAYANAN_2021_GPT = {
    "1.7B": (24, 2304, 24), "3.6B": (32, 3072, 30), "7.5B": (32, 4096, 36), "18B": (48, 6144, 40),
    "39B": (64, 8192, 48), "76B": (80, 10240, 60), "145B": (96, 12288, 80), "310B": (128, 16384, 96),
    "530B": (128, 20480, 105), "1T": (160, 25600, 128),
}

PRESETS: dict[str, dict] = {
    p["name"]: p
    for p in (
        _llama("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000),
        _llama("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000),
        _llama("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, seq=8192, theta=500000.0),
        _llama("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, seq=8192, theta=500000.0),
        # Qwen (v1): HF's intermediate_size (27392 / 49152) is twice the width of each MLP matrix.
        _llama("Qwen-14B", 40, 5120, 40, 40, 13696, 152064, qkv_bias=True, seq=2048, eps=1e-6),
        _llama("Qwen-72B", 80, 8192, 64, 64, 24576, 152064, qkv_bias=True, seq=32768, theta=1e6, eps=1e-6),
        _llama("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, seq=32768, theta=1e6, eps=1e-6),
        _llama("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, qkv_bias=True, seq=32768, theta=1e6, eps=1e-6),
        _llama("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True, seq=32768, theta=1e6, eps=1e-6),
        # Mixture of experts, from each model's config.json on the Hub; total / active parameters as published:
        # Mixtral 46.7B / 12.9B and 141B / 39B, Qwen2 57B / 14B, Qwen3 30.5B / 3.3B and 235B / 22B
        _moe("Mixtral-8x7B", "mixtral", 32, 4096, 32, 8, 14336, 32000, 8, 2, eps=1e-5, aux=0.02),
        _moe("Mixtral-8x22B", "mixtral", 56, 6144, 48, 8, 16384, 32768, 8, 2, seq=65536, eps=1e-5),
        _moe("Qwen2-57B-A14B", "qwen2_moe", 28, 3584, 28, 4, 18944, 151936, 64, 8, expert_ffn=2560, shared=20480,
             normalize=False),
        _moe("Qwen3-30B-A3B", "qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 128, 8, expert_ffn=768, head_dim=128,
             seq=40960),
        _moe("Qwen3-235B-A22B", "qwen3_moe", 94, 4096, 64, 4, 12288, 151936, 128, 8, expert_ffn=1536, head_dim=128,
             seq=40960),
        _gpt("GPT-3-175B", 96, 12288, 96, vocab=50257),
        *(_gpt(f"GPT-{size}", layers, hidden, heads) for size, (heads, hidden, layers) in NARAYANAN_2021_GPT.items()),
    )
}

__all__ = ["NARAYANAN_2021_GPT", "PRESETS"]
