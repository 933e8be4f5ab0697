"""ModelConfig: one dataclass for the GPT-2 and Llama families (Llama 2/3/3.1, Qwen2/2.5, Mistral).

    ModelConfig.from_hf("path/to/checkpoint")             # a folder with config.json, or the file
    ModelConfig.from_hf(transformers_model.config)        # a transformers config object (or a dict)
    ModelConfig.from_preset("Llama-3-8B")                 # the planner's presets (one list for both)

Family differences are fields, not subclasses: ``norm`` ("layernorm" | "rmsnorm"), ``positions``
("learned" | "rotary", with ``rope_theta`` and a Hugging Face ``rope_scaling`` dict),
``activation`` ("gelu_tanh" | "gelu" | "swiglu"), biases (``qkv_bias``, ``out_bias``,
``mlp_bias``: GPT-2 all three, Qwen2 q/k/v only), tied embeddings and a sliding window (Mistral,
Qwen2 with ``use_sliding_window``), optionally on some layers only.

Padding rule: the vocabulary is padded to a multiple of ``vocab_pad_multiple × tp`` (every TP
shard a whole number of GEMM tiles, Megatron's ``make_vocab_size_divisible_by``); the padding rows
are zero, never looked up, and left out of the loss (``linear_cross_entropy(vocab_size=…)``).
Every other divisibility rule is ParallelConfig's, with its message (:meth:`layout_rules`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
MODEL_TYPES = ("gpt2", "llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Transformer (see the module docstring).

    model_type: the Hugging Face architecture this maps to ("gpt2", "llama", "qwen2", "mistral").
    head_dim: per-head size (default hidden_size / num_attention_heads; Mistral-style configs set it).
    sliding_window: left window of ``sliding_window`` keys including the query's own (HF's meaning),
        on the layers in ``sliding_window_layers`` (None: every layer).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    positions: str = "rotary"
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    activation: str = "swiglu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tied_embeddings: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    initializer_range: float = 0.02
    vocab_pad_multiple: int = 128
    name: str = ""

    def __post_init__(self):
        errs = []
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                  "max_position_embeddings", "vocab_pad_multiple"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{f} ({v!r}) must be a positive integer")
        if errs:
            raise ValueError("; ".join(errs))
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type ({self.model_type!r}) must be one of {', '.join(MODEL_TYPES)}")
        choices = {"norm": ("layernorm", "rmsnorm"), "positions": ("learned", "rotary"),
                   "activation": ("gelu_tanh", "gelu", "swiglu")}
        for f, allowed in choices.items():
            if getattr(self, f) not in allowed:
                raise ValueError(f"{f} ({getattr(self, f)!r}) must be one of {', '.join(allowed)}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_kv_heads "
                             f"({self.kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads}) unless head_dim is given")
        if self.positions == "rotary" and self.dhead % 2:
            raise ValueError(f"head_dim ({self.dhead}) must be even for rotary embeddings")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window ({self.sliding_window!r}) must be a positive integer or None")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps ({self.norm_eps!r}) must be > 0")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type ({rope_type!r}) is not supported; supported: "
                                 f"{', '.join(ROPE_TYPES)}")

    # ---- shapes ----
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def family(self) -> str:
        return "gpt2" if self.model_type == "gpt2" else "llama"

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows of the embedding and head tables at tensor-parallel size ``tp``."""
        m = self.vocab_pad_multiple * tp
        return math.ceil(self.vocab_size / m) * m

    def window(self, layer: int) -> tuple[int, int]:
        """flash-attn's (left, right) window of ``layer`` (causal: right is 0)."""
        if self.sliding_window is None or (self.sliding_window_layers is not None
                                           and layer not in self.sliding_window_layers):
            return (-1, 0)
        return (self.sliding_window - 1, 0)

    def layout_rules(self, seq_length: int | None = None) -> dict:
        """The keyword arguments of ``ParallelConfig.validate`` that tie a layout to this model."""
        rules = dict(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                     num_kv_heads=self.kv_heads, ffn_hidden_size=self.ffn_hidden_size)
        if seq_length is not None:
            rules["seq_length"] = seq_length
        return rules

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- the planner's view ----
    def to_spec(self, seq_length: int | None = None):
        """The planner's ModelSpec of this model."""
        from tpkernels.planner.models import ModelSpec  # noqa: PLC0415

        return ModelSpec(self.name or self.model_type, self.num_layers, self.hidden_size, self.num_attention_heads,
                         self.ffn_hidden_size, self.vocab_size, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                         mlp="swiglu" if self.activation == "swiglu" else "gelu", norm=self.norm,
                         qkv_bias=self.qkv_bias, linear_bias=self.mlp_bias and self.out_bias,
                         tied_embeddings=self.tied_embeddings,
                         learned_positions=self.max_position_embeddings if self.positions == "learned" else 0,
                         seq_length=seq_length or min(self.max_position_embeddings, 8192),
                         rope_theta=self.rope_theta, norm_eps=self.norm_eps)

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        """A model of the planner's preset list (``tpkernels.planner.models.MODEL_PRESETS``)."""
        from tpkernels.planner.models import model_preset  # noqa: PLC0415

        spec = model_preset(name)
        if spec.mlp == "gelu":
            return cls("gpt2", spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.ffn_hidden_size,
                       spec.vocab_size, norm="layernorm", norm_eps=spec.norm_eps, positions="learned",
                       max_position_embeddings=spec.learned_positions or spec.seq_length, activation="gelu_tanh",
                       qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=spec.tied_embeddings,
                       name=spec.name)
        return cls("qwen2" if spec.qkv_bias else "llama", spec.num_layers, spec.hidden_size,
                   spec.num_attention_heads, spec.ffn_hidden_size, spec.vocab_size, num_kv_heads=spec.kv_heads,
                   head_dim=spec.head_dim, norm_eps=spec.norm_eps, max_position_embeddings=spec.seq_length,
                   rope_theta=spec.rope_theta, qkv_bias=spec.qkv_bias, tied_embeddings=spec.tied_embeddings,
                   name=spec.name)

    # ---- Hugging Face ----
    @classmethod
    def from_hf(cls, config, *, drop_dropout: bool = False) -> "ModelConfig":
        """From a ``transformers`` config object, a config dict, a ``config.json`` path or a checkpoint
        folder. Unsupported features raise ValueError naming the config field. Dropout > 0 is an error
        (these models have none) unless ``drop_dropout=True``: then it is left out."""
        from tpkernels.models.hf_config import config_from_hf  # noqa: PLC0415

        return config_from_hf(config, drop_dropout=drop_dropout)

    def to_hf(self):
        """The ``transformers`` config object of this model (for export)."""
        from tpkernels.models.hf_config import config_to_hf  # noqa: PLC0415

        return config_to_hf(self)

    @staticmethod
    def is_checkpoint_dir(path) -> bool:
        return Path(path).is_dir() and (Path(path) / "config.json").is_file()


__all__ = ["MODEL_TYPES", "ROPE_TYPES", "ModelConfig"]
