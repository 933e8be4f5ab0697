"""Transformer shapes for the planner: presets, Hugging Face config.json import, parameter and
FLOP counts.

One decoder layer = attention (q: heads*head_dim, k/v: kv_heads*head_dim, output projection) +
MLP (GeLU: two matrices; SwiGLU: three) + two norms. Counting every weight this way reproduces
the published parameter counts (Llama-3-8B: 8,030,261,248).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only Transformer.

    mlp: "gelu" (two matrices, GPT) or "swiglu" (gate, up, down: Llama/Qwen).
    qkv_bias / linear_bias: biases on the q/k/v projections / on every other linear layer.
    learned_positions: size of a learned position table (GPT), 0 for rotary embeddings.
    dropout: the model trains with dropout (adds masks to the stored activations).
    rope_theta / norm_eps: what the runnable model (``tpkernels.models.ModelConfig.from_preset``)
    takes from a preset; the planner's counts do not depend on them.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    qkv_bias: bool = False
    linear_bias: bool = False
    tied_embeddings: bool = False
    learned_positions: int = 0
    dropout: bool = False
    seq_length: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f} ({value!r}) must be a positive integer")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp ({self.mlp!r}) must be 'gelu' or 'swiglu'")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm ({self.norm!r}) must be 'layernorm' or 'rmsnorm'")
        if self.kv_heads < 1 or self.num_attention_heads % self.kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads}) unless head_dim is given")

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ shapes
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dhead

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dhead

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    # ------------------------------------------------------------------ parameters
    def linear_weights_per_layer(self) -> int:
        """Weights of the GEMMs of one layer (what FLOPs scale with)."""
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        return attn + self.mlp_matrices * h * self.ffn_hidden_size

    def params_per_layer(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        n = self.linear_weights_per_layer()
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.linear_bias:
            n += h + (f * (self.mlp_matrices - 1)) + h  # output projection, up (and gate), down
        return n + 2 * self.norm_params()

    def norm_params(self) -> int:
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def embedding_params(self) -> int:
        """Input embedding + learned positions (first pipeline stage)."""
        return self.vocab_size * self.hidden_size + self.learned_positions * self.hidden_size

    def head_params(self) -> int:
        """Final norm + output projection (last pipeline stage); 0 extra weights when tied."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer() + self.embedding_params() + self.head_params()

    def num_non_embedding_params(self) -> int:
        return self.num_params() - self.embedding_params() - (0 if self.tied_embeddings else
                                                              self.vocab_size * self.hidden_size)

    def lora_params_per_layer(self, rank: int) -> int:
        """LoRA adapters (A: in×r, B: r×out) on every linear layer of one decoder layer."""
        h, f = self.hidden_size, self.ffn_hidden_size
        shapes = [(h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h)]
        shapes += [(h, f)] * (self.mlp_matrices - 1) + [(f, h)]
        return sum(rank * (i + o) for i, o in shapes)

    # ------------------------------------------------------------------ FLOPs
    def forward_flops_per_layer(self, batch: int, seq: int) -> tuple[float, float]:
        """(GEMM FLOPs of the linear layers, FLOPs of the attention core QK^T and PV) of one
        layer's forward over ``batch`` sequences of ``seq`` tokens. A multiply-add is 2 FLOPs;
        the attention core is counted in full (no causal halving), as Megatron's formula does."""
        tokens = batch * seq
        return 2.0 * tokens * self.linear_weights_per_layer(), 4.0 * batch * seq * seq * self.q_dim

    def logits_forward_flops(self, batch: int, seq: int) -> float:
        return 2.0 * batch * seq * self.hidden_size * self.vocab_size

    def model_flops_per_step(self, global_batch: int, seq: int) -> float:
        """Forward + backward FLOPs of one step without recompute: for GPT shapes this is
        72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) (Narayanan et al. 2021)."""
        lin, core = self.forward_flops_per_layer(global_batch, seq)
        return 3.0 * (self.num_layers * (lin + core) + self.logits_forward_flops(global_batch, seq))

    def describe(self) -> str:
        kv = f", {self.kv_heads} KV heads" if self.kv_heads != self.num_attention_heads else ""
        return (f"{self.name}: {self.num_params() / 1e9:.2f}B params, {self.num_layers} layers, hidden "
                f"{self.hidden_size}, {self.num_attention_heads} heads{kv}, ffn {self.ffn_hidden_size} "
                f"({self.mlp}), vocab {self.vocab_size}")


def _llama(name, layers, hidden, heads, kv, ffn, vocab, *, qkv_bias=False, tied=False, seq=4096, theta=10000.0,
           eps=1e-5):
    return ModelSpec(name, layers, hidden, heads, ffn, vocab, num_kv_heads=kv, qkv_bias=qkv_bias,
                     tied_embeddings=tied, seq_length=seq, rope_theta=theta, norm_eps=eps)


def _gpt(name, layers, hidden, heads, vocab=51200, seq=2048):
    """GPT-2/3 and the Megatron GPT family: GeLU MLP of 4h, LayerNorm, biases everywhere, learned
    positions, tied embeddings, dropout."""
    return ModelSpec(name, layers, hidden, heads, 4 * hidden, vocab, mlp="gelu", norm="layernorm",
                     qkv_bias=True, linear_bias=True, tied_embeddings=True, learned_positions=seq,
                     dropout=True, seq_length=seq)


# (heads, hidden, layers) of the GPT models of Narayanan et al. 2021, Table 1 (vocab 51200, seq 2048)
NARAYANAN_2021_GPT = {
    "1.7B": (24, 2304, 24), "3.6B": (32, 3072, 30), "7.5B": (32, 4096, 36), "18B": (48, 6144, 40),
    "39B": (64, 8192, 48), "76B": (80, 10240, 60), "145B": (96, 12288, 80), "310B": (128, 16384, 96),
    "530B": (128, 20480, 105), "1T": (160, 25600, 128),
}

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
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


def model_preset(name: str) -> ModelSpec:
    for preset in MODEL_PRESETS:
        if preset.lower() == name.strip().lower():
            return MODEL_PRESETS[preset]
    raise ValueError(f"model ({name!r}) is not a known preset; choose one of {', '.join(MODEL_PRESETS)} "
                     "or pass a Hugging Face config.json")


def read_hf_config(path: str | Path, what: str = "hf_config") -> tuple[dict, str]:
    """(the JSON object of a Hugging Face ``config.json``, a name for it). ``path`` is the file or a
    checkpoint folder holding it; ``what`` names the argument in errors."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{what} ({str(path)!r}) is a folder without a config.json: give the file or a "
                             "Hugging Face checkpoint folder")
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{what} ({str(path)!r}) does not exist: give a Hugging Face config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} ({str(path)!r}) is not a readable JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} ({str(path)!r}) must hold a JSON object (a Hugging Face model config), "
                         f"not a {type(config).__name__}")
    return config, path.parent.name or path.stem


def from_hf_config(config: dict | str | Path, name: str | None = None, flag: str = "hf_config") -> ModelSpec:
    """ModelSpec from a Hugging Face ``config.json`` (a dict, a path, or a checkpoint folder holding
    it): Llama, Mistral, Qwen2/2.5/3, Qwen (v1) and GPT-2 layouts. ``flag`` names the argument in errors."""
    if not isinstance(config, dict):
        config, default_name = read_hf_config(config, flag)
        name = name or default_name
    kind = config.get("model_type", "")
    name = name or config.get("_name_or_path") or kind or "hf-model"
    if kind == "gpt2":
        h = config["n_embd"]
        return ModelSpec(name, config["n_layer"], h, config["n_head"], config.get("n_inner") or 4 * h,
                         config["vocab_size"], mlp="gelu", norm="layernorm", qkv_bias=True, linear_bias=True,
                         tied_embeddings=True, learned_positions=config["n_positions"], dropout=True,
                         seq_length=config.get("n_ctx", config["n_positions"]))
    if kind == "qwen":
        return ModelSpec(name, config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
                         config["intermediate_size"] // 2, config["vocab_size"], qkv_bias=True,
                         tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                         seq_length=config.get("seq_length", 2048))
    needed = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in needed if k not in config]
    if missing:
        raise ValueError(f"config.json (model_type {kind!r}) lacks {', '.join(missing)}: supported layouts are "
                         "llama, mistral, qwen2, qwen3, qwen and gpt2")
    hidden_act = config.get("hidden_act", "silu")
    return ModelSpec(
        name, config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
        config["intermediate_size"], config["vocab_size"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim"),
        mlp="swiglu" if hidden_act in ("silu", "swish") else "gelu",
        qkv_bias=bool(config.get("attention_bias", kind == "qwen2")),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        seq_length=min(int(config.get("max_position_embeddings", 4096)), 8192),
    )
