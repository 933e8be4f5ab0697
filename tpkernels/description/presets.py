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
        _gpt("GPT-3-175B", 96, 12288, 96, vocab=50257),
        *(_gpt(f"GPT-{size}", layers, hidden, heads) for size, (heads, hidden, layers) in NARAYANAN_2021_GPT.items()),
    )
}

__all__ = ["NARAYANAN_2021_GPT", "PRESETS"]
