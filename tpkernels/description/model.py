"""ModelConfig: the one description of a decoder-only Transformer, shared by the models and the planner.

    ModelConfig.from_preset("Llama-3-8B")        # the one preset list (tpkernels.description.presets)
    ModelConfig.from_hf("path/to/checkpoint")    # a folder with config.json, the file, a dict or a
                                                 # transformers config; refuses what models cannot build
    ModelConfig.read_hf("path/to/config.json")   # the same reader, for planning: records everything

Family differences are fields, not subclasses: ``norm`` ("layernorm" | "rmsnorm"), ``positions``
("learned" | "rotary", with ``rope_theta`` and a Hugging Face ``rope_scaling`` dict),
``activation`` ("gelu_tanh" | "gelu" | "swiglu"), biases (``qkv_bias``, ``out_bias``,
``mlp_bias``: GPT-2 all three, Qwen2 q/k/v only), tied embeddings, a sliding window (Mistral,
Qwen2 with ``use_sliding_window``), optionally on some layers only, per-head q/k norms (Qwen3)
and dropout. Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE) is fields too: ``num_experts`` > 0
routed SwiGLU experts of width ``moe_ffn_hidden_size``, ``experts_per_token`` of them per token,
on the layers ``moe_layers`` (the others keep the dense MLP of ``ffn_hidden_size``), optionally a
shared expert (``shared_expert_ffn_hidden_size``) with Qwen2-MoE's sigmoid gate.

What ``tpkernels.models`` cannot build yet is said in one place, :meth:`ModelConfig.build_errors`:
the planner plans such a model (and prints the reasons), the model and ``tpkernels train`` refuse
it with the same messages.

Counting (the planner's parameters, FLOPs; the trainer's MFU): one decoder layer = attention
(q: heads·head_dim, k/v: kv_heads·head_dim, output projection) + MLP (GeLU: two matrices; SwiGLU:
three) + two norms. Counting every weight this way reproduces the published parameter counts
(Llama-3-8B: 8,030,261,248). A MoE layer holds the router (E × hidden), E experts and the shared
expert: :meth:`num_params` counts them all, :meth:`num_active_params` the weights one token passes
through (k of the E experts), and the FLOPs count the active ones (Mixtral-8x7B: 46.7B / 12.9B).

Padding rule: the vocabulary is padded to a multiple of ``vocab_pad_multiple × tp`` (every TP
shard a whole number of GEMM tiles, Megatron's ``make_vocab_size_divisible_by``); the padding rows
are zero, never looked up, and left out of the loss and of :meth:`num_params`. Every other
divisibility rule is ParallelConfig's, with its message (:meth:`layout_rules`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tpkernels.description import hf_config, presets
from tpkernels.description.families import BUILDABLE_TYPES, MODEL_TYPES, PLAN_ONLY_TYPES, ROPE_TYPES

_CHOICES = {"norm": ("layernorm", "rmsnorm"), "positions": ("learned", "rotary"),
            "activation": ("gelu_tanh", "gelu", "swiglu"), "router_score": ("softmax", "sigmoid")}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Transformer (see the module docstring).

    model_type: the Hugging Face architecture this maps to (``MODEL_TYPES``).
    head_dim: per-head size (default hidden_size / num_attention_heads; Mistral/Qwen3 configs set it).
    sliding_window: left window of ``sliding_window`` keys including the query's own (HF's meaning),
        on the layers in ``sliding_window_layers`` (None: every layer).
    qk_norm: RMSNorm over each head of q and k before rotary (Qwen3).
    dropout: the largest dropout probability of the Hugging Face config (``dropout_source`` names
        its field): the planner counts the masks it stores; the models train without dropout and
        refuse a config with dropout > 0 unless it is dropped (``from_hf(drop_dropout=True)``).

    Mixture of experts (``num_experts`` 0: a dense model, every other MoE field at its default):
    num_experts: routed experts per MoE layer (E). experts_per_token: top-k (1 ≤ k ≤ E).
    moe_ffn_hidden_size: each routed expert's SwiGLU width (None: ``ffn_hidden_size``, Mixtral's case).
    shared_expert_ffn_hidden_size: the always-on shared expert's width (0: none); shared_expert_gate:
        its output times sigmoid(x · w) (Qwen2-MoE). router_score: "softmax" (Mixtral, Qwen) or
        "sigmoid" (DeepSeek-V3). router_normalize: the k weights divided by their sum (Mixtral always,
        Qwen ``norm_topk_prob``). moe_layers: the layers with experts (None: every layer; Qwen2-MoE's
        ``decoder_sparse_step`` / ``mlp_only_layers``). router_aux_loss_coef / router_z_loss_coef: the
        load-balancing and z-loss coefficients. capacity_factor: None = dropless; else each expert keeps
        at most ceil(cf · T · k / E) assignments. router_jitter: Mixtral's multiplicative input noise
        in training (read so the planner sees it; the models refuse it, like dropout).
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
    qk_norm: bool = False
    tied_embeddings: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    dropout: float = 0.0
    initializer_range: float = 0.02
    vocab_pad_multiple: int = 128
    name: str = ""
    dropout_source: str = field(default="", compare=False)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int | None = None
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    router_score: str = "softmax"
    router_normalize: bool = True
    moe_layers: tuple[int, ...] | None = None
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    router_jitter: float = 0.0

    def __post_init__(self):
        errs = []
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                  "max_position_embeddings", "vocab_pad_multiple"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{f} ({v!r}) must be a positive integer")
        for f in ("num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                errs.append(f"{f} ({v!r}) must be a positive integer or None")
        if errs:
            raise ValueError("; ".join(errs))
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type ({self.model_type!r}) must be one of {', '.join(MODEL_TYPES)}")
        for f, allowed in _CHOICES.items():
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
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"dropout ({self.dropout!r}) must be in [0, 1)")
        self._check_moe()
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type ({rope_type!r}) is not supported; supported: "
                                 f"{', '.join(ROPE_TYPES)}")

    def _check_moe(self) -> None:
        """The MoE fields' rules, one named message each (a dense model leaves them at their defaults)."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        e, k = self.num_experts, self.experts_per_token
        if not is_int(e) or e < 0:
            raise ValueError(f"num_experts ({e!r}) must be a non-negative integer (0: a dense model)")
        if not is_int(k) or k < 0:
            raise ValueError(f"experts_per_token ({k!r}) must be a non-negative integer")
        for f in ("router_aux_loss_coef", "router_z_loss_coef", "router_jitter"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{f} ({v!r}) must be a finite number >= 0")
        if not is_int(self.shared_expert_ffn_hidden_size) or self.shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"shared_expert_ffn_hidden_size ({self.shared_expert_ffn_hidden_size!r}) must be a "
                             "non-negative integer (0: no shared expert)")
        if e == 0:
            moe_set = [f for f in ("experts_per_token", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size",
                                   "moe_layers", "capacity_factor") if getattr(self, f) not in (0, None)]
            if moe_set:
                raise ValueError(f"{', '.join(f'{f} ({getattr(self, f)!r})' for f in moe_set)} set on a dense model: "
                                 "num_experts (0) must be > 0 for mixture-of-experts fields")
            return
        if self.activation != "swiglu":
            raise ValueError(f"activation ({self.activation!r}) must be 'swiglu' with num_experts ({e}) > 0: the "
                             "experts are SwiGLU MLPs")
        if not 1 <= k <= e:
            raise ValueError(f"experts_per_token ({k}) must be between 1 and num_experts ({e})")
        if self.moe_ffn_hidden_size is not None and (not is_int(self.moe_ffn_hidden_size)
                                                     or self.moe_ffn_hidden_size < 1):
            raise ValueError(f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size!r}) must be a positive integer or None")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ValueError("shared_expert_gate (True) needs a shared expert: shared_expert_ffn_hidden_size (0) "
                             "must be > 0")
        if self.moe_layers is not None:
            layers = self.moe_layers
            if (not isinstance(layers, tuple) or not all(is_int(i) and 0 <= i < self.num_layers for i in layers)
                    or list(layers) != sorted(set(layers))):
                raise ValueError(f"moe_layers ({layers!r}) must be a sorted tuple of distinct layer ids in "
                                 f"[0, num_layers ({self.num_layers})), or None for every layer")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and not isinstance(cf, bool) and math.isfinite(cf)
                                   and cf > 0):
            raise ValueError(f"capacity_factor ({cf!r}) must be a finite number > 0, or None (dropless)")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ what the models can build
    def build_errors(self) -> list[str]:
        """Why ``tpkernels.models`` cannot build this model (empty when it can). The one place that says
        so: ``ParallelTransformer`` and ``tpkernels train`` raise these, ``tpkernels plan`` prints them."""
        errs = []
        if self.model_type in PLAN_ONLY_TYPES:
            errs.append(PLAN_ONLY_TYPES[self.model_type])
        if self.dropout > 0:
            errs.append(f"{self.dropout_source or 'dropout'} ({self.dropout}) > 0: tpkernels models train without "
                        "dropout; pass drop_dropout=True (tpkernels train: model.drop_dropout true) to load the "
                        "model and train it without (as LLM pre-training usually does)")
        if self.router_jitter > 0:
            errs.append(f"router_jitter_noise ({self.router_jitter}) > 0: tpkernels models route without input "
                        "jitter; set it to 0 in the config to train without (Mixtral's published checkpoints do)")
        if self.num_experts and self.router_score != "softmax":
            errs.append(f"router_score ({self.router_score!r}): tpkernels.models builds softmax routers only (the "
                        "sigmoid scores of DeepSeek-V3 are a routing option of tpkernels.functional.moe_router)")
        return errs

    def require_buildable(self) -> "ModelConfig":
        errs = self.build_errors()
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def without_dropout(self) -> "ModelConfig":
        return self.replace(dropout=0.0, dropout_source="")

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
    def gated_mlp(self) -> bool:
        """SwiGLU (gate, up, down) rather than GeLU (up, down)."""
        return self.activation == "swiglu"

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def learned_positions(self) -> int:
        """Rows of the learned position table (GPT-2), 0 for rotary embeddings."""
        return self.max_position_embeddings if self.positions == "learned" else 0

    @property
    def family(self) -> str:
        """The Hugging Face weight naming: "gpt2", or "llama" (Llama, Qwen2, Mistral)."""
        return "gpt2" if self.model_type == "gpt2" else "llama"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's SwiGLU width (0 for a dense model)."""
        return (self.moe_ffn_hidden_size or self.ffn_hidden_size) if self.num_experts else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` has routed experts (else the dense MLP of ``ffn_hidden_size``)."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts. The per-layer means below are closed forms over the two kinds of
        layer (MoE and dense) weighted by their counts: the planner's search calls them per layout."""
        if self.num_experts <= 0:
            return 0
        if self.moe_layers is None:
            return self.num_layers
        return len(self.moe_layers)  # sorted distinct ids below num_layers (a construction rule)

    def _over_layers(self, per_kind) -> float:
        """Mean over the layers of ``per_kind(moe: bool)`` (an integer when it divides evenly)."""
        n = self.num_moe_layers
        total = n * per_kind(True) + (self.num_layers - n) * per_kind(False) if n else self.num_layers * per_kind(False)
        return total // self.num_layers if total % self.num_layers == 0 else total / self.num_layers

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
        if self.num_experts:  # ParallelConfig's expert rules (ep divides E; expert and shared FFN over tp)
            rules.update(num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                         moe_ffn_hidden_size=self.expert_ffn,
                         shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size)
        if seq_length is not None:
            rules["seq_length"] = seq_length
        return rules

    # ------------------------------------------------------------------ parameters
    def _attention_weights(self) -> int:
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h

    def _attention_extras(self) -> int:
        """Biases and q/k norms of the attention."""
        n = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        n += self.hidden_size if self.out_bias else 0
        return n + (2 * self.dhead if self.qk_norm else 0)

    def _dense_mlp_params(self, layer: int) -> tuple[int, int]:
        """(GEMM weights, biases) of layer ``layer``'s dense MLP (0 on a MoE layer)."""
        return self._dense_mlp_of(self.is_moe_layer(layer))

    def _dense_mlp_of(self, moe: bool) -> tuple[int, int]:
        if moe:
            return 0, 0
        h, f = self.hidden_size, self.ffn_hidden_size
        return self.mlp_matrices * h * f, (f * (self.mlp_matrices - 1) + h if self.mlp_bias else 0)

    def moe_params(self, layer: int) -> dict[str, int]:
        """Parameters of layer ``layer``'s MoE block by kind: router (E × hidden), experts (E SwiGLU MLPs),
        shared (the shared expert and its gate). Empty on a dense layer."""
        return self._moe_block_of(self.is_moe_layer(layer))

    def _moe_block_of(self, moe: bool) -> dict[str, int]:
        if not moe:
            return {}
        h, e, s = self.hidden_size, self.num_experts, self.shared_expert_ffn_hidden_size
        return dict(router=e * h, experts=e * 3 * h * self.expert_ffn,
                    shared=3 * h * s + (h if self.shared_expert_gate else 0))

    def layer_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of decoder layer ``layer``; ``active``: those one token passes through (k of the E
        experts)."""
        return self._layer_params_of(self.is_moe_layer(layer), active)

    def _layer_params_of(self, is_moe: bool, active: bool = False) -> int:
        moe = self._moe_block_of(is_moe)
        experts = moe.get("experts", 0)
        if active and experts:
            experts = experts // self.num_experts * self.experts_per_token
        dense_w, dense_b = self._dense_mlp_of(is_moe)
        return (self._attention_weights() + self._attention_extras() + 2 * self.norm_params() + dense_w + dense_b
                + moe.get("router", 0) + moe.get("shared", 0) + experts)

    def linear_weights_per_layer(self) -> float:
        """GEMM weights one token passes through in a layer (what FLOPs scale with), the mean over the
        layers: attention, the dense MLP or, on a MoE layer, the router, k of the E experts and the
        shared expert. An integer for a dense model."""
        def per_kind(is_moe: bool) -> int:
            dense_w, _ = self._dense_mlp_of(is_moe)
            moe = self._moe_block_of(is_moe)
            active = moe.get("experts", 0) // max(1, self.num_experts) * self.experts_per_token
            return self._attention_weights() + dense_w + moe.get("router", 0) + active + moe.get("shared", 0)

        return self._over_layers(per_kind)

    def norm_params(self) -> int:
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def params_per_layer(self) -> float:
        """Parameters of one decoder layer, the mean over the layers (an integer when every layer is
        alike: a dense model, or experts on every layer)."""
        return self._over_layers(self._layer_params_of)

    def expert_params_per_layer(self) -> float:
        """Routed-expert parameters of one layer, the mean over the layers (what EP shards)."""
        return self._over_layers(lambda is_moe: self._moe_block_of(is_moe).get("experts", 0))

    def embedding_params(self) -> int:
        """Input embedding + learned positions (first pipeline stage), without vocabulary padding."""
        return (self.vocab_size + self.learned_positions) * self.hidden_size

    def head_params(self) -> int:
        """Final norm + output projection (last pipeline stage); no extra weights when tied."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def num_params(self) -> int:
        """Every parameter (all experts of a MoE model), without vocabulary padding."""
        n = self.num_moe_layers
        layers = n * self._layer_params_of(True) + (self.num_layers - n) * self._layer_params_of(False)
        return layers + self.embedding_params() + self.head_params()

    def num_active_params(self) -> int:
        """The parameters one token passes through: :meth:`num_params` with k of the E experts of each
        MoE layer (the equal of num_params for a dense model)."""
        n = self.num_moe_layers
        layers = n * self._layer_params_of(True, True) + (self.num_layers - n) * self._layer_params_of(False, True)
        return layers + self.embedding_params() + self.head_params()

    def num_non_embedding_params(self) -> int:
        return self.num_params() - self.embedding_params() - (0 if self.tied_embeddings else
                                                              self.vocab_size * self.hidden_size)

    def lora_params_per_layer(self, rank: int) -> float:
        """LoRA adapters (A: in×r, B: r×out) on every linear layer of one decoder layer (the mean over
        the layers): attention, the dense MLP or each routed expert's gate, up and down and the shared
        expert's (not the router, nor the shared expert's gate)."""
        h = self.hidden_size
        attn = [(h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h)]

        def mlp(f):
            return [(h, f)] * (self.mlp_matrices - 1) + [(f, h)]

        def per_kind(is_moe: bool) -> int:
            shapes = list(attn)
            if is_moe:
                shapes += mlp(self.expert_ffn) * self.num_experts
                if self.shared_expert_ffn_hidden_size:
                    shapes += mlp(self.shared_expert_ffn_hidden_size)
            else:
                shapes += mlp(self.ffn_hidden_size)
            return sum(rank * (a + b) for a, b in shapes)

        return self._over_layers(per_kind)

    # ------------------------------------------------------------------ FLOPs
    def forward_flops_per_layer(self, batch: int, seq: int) -> tuple[float, float]:
        """(GEMM FLOPs of the linear layers, FLOPs of the attention core QK^T and PV) of one
        layer's forward over ``batch`` sequences of ``seq`` tokens, the mean over the layers. A
        multiply-add is 2 FLOPs; the attention core is counted in full (no causal halving), as
        Megatron's formula does. A MoE layer counts the router and the k active experts of each
        token (:meth:`linear_weights_per_layer`), not the E it holds."""
        tokens = batch * seq
        return 2.0 * tokens * self.linear_weights_per_layer(), 4.0 * batch * seq * seq * self.q_dim

    def logits_forward_flops(self, batch: int, seq: int) -> float:
        return 2.0 * batch * seq * self.hidden_size * self.vocab_size

    def model_flops_per_step(self, global_batch: int, seq: int) -> float:
        """Forward + backward FLOPs of one step without recompute: for GPT shapes this is
        72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) (Narayanan et al. 2021); a MoE model counts its active
        experts and router (the MFU convention of Megatron-Core and torchtitan)."""
        lin, core = self.forward_flops_per_layer(global_batch, seq)
        return 3.0 * (self.num_layers * (lin + core) + self.logits_forward_flops(global_batch, seq))

    def weight_split_flops(self, seq: int, micro_batch: int, tp: int,
                           flash_attention: bool = True) -> tuple[float, float, float]:
        """(F, B, W) of one layer and micro-batch in FLOPs on one TP rank: the ratios ZB-H1's order is
        built for (``tpkernels.pipeline.schedules.zb_h1``; the planner times the same split). B is the
        input gradient (the linear layers' dX GEMMs and the attention core's whole backward, which
        FlashAttention runs at 2.5× its forward since it recomputes the scores), W the linear
        layers' weight gradients. MoE layers count their active experts (an EP rank computes, on
        average, its tokens' share of the experts' work)."""
        lin, core = self.forward_flops_per_layer(micro_batch, seq)
        bwd_core = (2.5 if flash_attention else 2.0) * core
        return (lin + core) / tp, (lin + bwd_core) / tp, lin / tp

    def describe(self) -> str:
        kv = f", {self.kv_heads} KV heads" if self.kv_heads != self.num_attention_heads else ""
        mlp = "swiglu" if self.gated_mlp else "gelu"
        moe = ""
        if self.num_experts:
            shared = f" + shared {self.shared_expert_ffn_hidden_size}" if self.shared_expert_ffn_hidden_size else ""
            moe = (f", {self.num_experts} experts of ffn {self.expert_ffn} top-{self.experts_per_token}{shared} "
                   f"({self.num_active_params() / 1e9:.2f}B active)")
        return (f"{self.name or self.model_type}: {self.num_params() / 1e9:.2f}B params, {self.num_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_attention_heads} heads{kv}, ffn {self.ffn_hidden_size} ({mlp}), "
                f"vocab {self.vocab_size}{moe}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        """A model of the one preset list (:data:`MODEL_PRESETS`)."""
        return model_preset(name)

    @classmethod
    def read_hf(cls, config, what: str = "config") -> "ModelConfig":
        """Everything a Hugging Face config says (:func:`tpkernels.description.hf_config.read_fields`),
        also what the models cannot build: for planning. ``what`` names the argument in errors."""
        return cls(**hf_config.read_fields(config, what))

    @classmethod
    def from_hf(cls, config, *, drop_dropout: bool = False, what: str = "config") -> "ModelConfig":
        """A model the package can build, from a ``transformers`` config object, a config dict, a
        ``config.json`` path or a checkpoint folder. What it cannot build raises ValueError naming the
        config field (:meth:`build_errors`); ``drop_dropout=True`` leaves dropout out."""
        mc = cls.read_hf(config, what)
        if drop_dropout:
            mc = mc.without_dropout()
        return mc.require_buildable()

    def to_hf(self):
        """The ``transformers`` config object of this model (for export)."""
        if self.build_errors():
            raise ValueError(f"no Hugging Face export of {self.name or self.model_type}: {self.build_errors()[0]}")
        return hf_config.config_to_hf(self)


MODEL_PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**fields) for name, fields in presets.PRESETS.items()}


def model_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive)."""
    for preset in MODEL_PRESETS:
        if preset.lower() == str(name).strip().lower():
            return MODEL_PRESETS[preset]
    raise ValueError(f"model ({name!r}) is not a known preset; choose one of {', '.join(MODEL_PRESETS)} "
                     "or give a Hugging Face config.json / checkpoint folder")


__all__ = ["BUILDABLE_TYPES", "MODEL_PRESETS", "MODEL_TYPES", "PLAN_ONLY_TYPES", "ROPE_TYPES", "ModelConfig",
           "model_preset"]
