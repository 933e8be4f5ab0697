"""The one Hugging Face config reader (and writer) of the package: ``config.json`` ⇄ ModelConfig fields.

Both ``tpkernels plan --model X`` and ``tpkernels train --model X`` read a file through
:func:`read_fields`, so they agree on it: the same model, the same refusals, the same messages.

Families transformers knows (GPT-2, Llama, Qwen2, Qwen3, Mistral, and the mixture-of-experts
Mixtral, Qwen2-MoE, Qwen3-MoE) are read through
``transformers.AutoConfig``, so that every config.json spelling transformers accepts arrives
normalised (its class defaults for missing keys; ``rope_scaling`` + ``rope_theta`` of older files,
``rope_parameters`` of 5.x; Qwen2's ``layer_types``). Qwen (v1), which transformers only loads as
remote code, is read from its JSON keys. What no part of the package can use raises a ValueError
naming the config field: other model types, experts in other families (a Llama config with
``num_experts``), unknown rope types, partial rotary, other activations. What only the models
cannot build yet (Qwen v1's weight names, dropout, Mixtral's router jitter) is
recorded and left to ``ModelConfig.build_errors``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpkernels.description.families import MODEL_TYPES, MOE_TYPES, ROPE_TYPES

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_DROPOUT_FIELDS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop")}  # others: attention_dropout
_REMOTE_CODE_TYPES = ("qwen",)  # read from the JSON keys (transformers has no class for them)


class _Keys:
    """Attribute access to a plain config dict (what transformers' config objects give)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def _load_json(path: Path, what: str) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} ({str(path)!r}) is not a readable JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} ({str(path)!r}) must hold a JSON object (a Hugging Face model config), "
                         f"not a {type(config).__name__}")
    return config


def _config_object(config, what: str):
    """(an object with the config's fields as attributes, a default name)."""
    name = ""
    if not isinstance(config, dict) and hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return config, getattr(config, "_name_or_path", "") or ""  # a transformers config object
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"{what} ({str(config)!r}) is a folder without a config.json: give the file or a "
                                 "Hugging Face checkpoint folder")
            path = path / "config.json"
        elif not path.is_file():
            raise ValueError(f"{what} ({str(config)!r}) is neither a preset, a config.json nor a folder holding one")
        name = path.parent.name or path.stem
        config = _load_json(path, what)
    d = dict(config)
    kind = d.get("model_type")
    if kind is None:
        raise ValueError(f"{what} lacks model_type (one of {', '.join(MODEL_TYPES)})")
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type ({kind!r}) is not supported; supported: {', '.join(MODEL_TYPES)}")
    name = d.get("_name_or_path") or name
    if kind in _REMOTE_CODE_TYPES:
        return _Keys(d), name
    import transformers  # noqa: PLC0415  (only for files of the families it knows)

    fields = {k: v for k, v in d.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(kind, **fields), name


def _rope(cfg) -> tuple[float, dict | None]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:  # transformers < 5
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type ({rope_type!r}) is not supported; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0 or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (rotary on every head feature only)")
    return theta, (None if rope_type == "default" else params)


def _dropout(cfg, kind: str) -> dict:
    """{dropout: the largest probability, dropout_source: its field} (empty when none)."""
    best, source = 0.0, ""
    for f in _DROPOUT_FIELDS.get(kind, ("attention_dropout",)):
        p = float(getattr(cfg, f, 0.0) or 0.0)
        if p > best:
            best, source = p, f
    return dict(dropout=best, dropout_source=source) if best > 0 else {}


def _gpt2(cfg, name: str) -> dict:
    act = cfg.activation_function
    if act not in _GPT2_ACTIVATIONS:
        raise ValueError(f"activation_function ({act!r}) must be one of {', '.join(_GPT2_ACTIVATIONS)}")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("scale_attn_by_inverse_layer_idx (True) is not supported")
    if not getattr(cfg, "scale_attn_weights", True):
        raise ValueError("scale_attn_weights (False) is not supported (scores are scaled by 1/sqrt(head_dim))")
    h = cfg.n_embd
    return dict(model_type="gpt2", num_layers=cfg.n_layer, hidden_size=h, num_attention_heads=cfg.n_head,
                ffn_hidden_size=cfg.n_inner or 4 * h, vocab_size=cfg.vocab_size, norm="layernorm",
                norm_eps=cfg.layer_norm_epsilon, positions="learned", max_position_embeddings=cfg.n_positions,
                activation=_GPT2_ACTIVATIONS[act], qkv_bias=True, out_bias=True, mlp_bias=True,
                tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
                initializer_range=cfg.initializer_range, name=name, **_dropout(cfg, "gpt2"))


def _qwen_v1(cfg, name: str) -> dict:
    needed = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in needed if getattr(cfg, k, None) is None]
    if missing:
        raise ValueError(f"config.json (model_type 'qwen') lacks {', '.join(missing)}")
    # Qwen (v1)'s intermediate_size is the width of the fused w1|w2 projection: twice each matrix's.
    return dict(model_type="qwen", num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.intermediate_size // 2,
                vocab_size=cfg.vocab_size, norm_eps=float(getattr(cfg, "layer_norm_epsilon", 1e-6)),
                max_position_embeddings=int(getattr(cfg, "seq_length", 2048)),
                rope_theta=float(getattr(cfg, "rotary_emb_base", 10000.0)), qkv_bias=True,
                tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), name=name)


def _llama_like(cfg, kind: str, name: str) -> dict:
    """Llama, Qwen2, Qwen3, Mistral: SwiGLU, RMSNorm, rotary."""
    if cfg.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act ({cfg.hidden_act!r}) must be 'silu' (SwiGLU MLP)")
    theta, scaling = _rope(cfg)
    window, window_layers = None, None
    if kind == "mistral" and getattr(cfg, "sliding_window", None):
        window = int(cfg.sliding_window)
    qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if kind in qwen and getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        window = int(cfg.sliding_window)
    layer_types = getattr(cfg, "layer_types", None)
    if window is not None and layer_types:
        window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if kind in qwen and not window_layers:
            window = None
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim == cfg.hidden_size // cfg.num_attention_heads:
        head_dim = None  # the default, however the file spells it
    return dict(
        model_type=kind, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim, norm="rmsnorm", norm_eps=cfg.rms_norm_eps, positions="rotary",
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=theta, rope_scaling=scaling,
        activation="swiglu", qkv_bias=kind == "qwen2" or attention_bias, out_bias=attention_bias and kind != "qwen2",
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=kind in ("qwen3", "qwen3_moe"),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_window=window, sliding_window_layers=window_layers,
        initializer_range=getattr(cfg, "initializer_range", 0.02), name=name, **_dropout(cfg, kind))


def _moe(cfg, kind: str, fields: dict) -> dict:
    """Mixtral / Qwen2-MoE / Qwen3-MoE: the dense fields of :func:`_llama_like` plus the experts."""
    L = fields["num_layers"]
    if kind == "mixtral":
        # Mixtral: every layer has experts; intermediate_size is each expert's width; no bias anywhere
        fields.update(qkv_bias=False, out_bias=False, num_experts=int(cfg.num_local_experts),
                      experts_per_token=int(cfg.num_experts_per_tok), router_normalize=True,
                      router_jitter=float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0))
        if getattr(cfg, "sliding_window", None):
            fields.update(sliding_window=int(cfg.sliding_window), sliding_window_layers=None)
    else:
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(cfg, "mlp_only_layers", None) or [])
        if step < 1:
            raise ValueError(f"decoder_sparse_step ({step}) must be a positive integer")
        layers = tuple(i for i in range(L) if i not in dense and (i + 1) % step == 0)
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if kind == "qwen2_moe" else 0
        fields.update(num_experts=int(cfg.num_experts), experts_per_token=int(cfg.num_experts_per_tok),
                      moe_ffn_hidden_size=int(cfg.moe_intermediate_size), shared_expert_ffn_hidden_size=shared,
                      shared_expert_gate=shared > 0, router_normalize=bool(getattr(cfg, "norm_topk_prob", False)),
                      moe_layers=None if len(layers) == L else layers)
        if kind == "qwen2_moe":
            fields.update(qkv_bias=bool(getattr(cfg, "qkv_bias", True)), out_bias=False)
        if not layers:  # experts on no layer: a dense model
            fields.update(num_experts=0, experts_per_token=0, moe_ffn_hidden_size=None,
                          shared_expert_ffn_hidden_size=0, shared_expert_gate=False, moe_layers=None,
                          router_normalize=True)
            return fields
    fields["router_aux_loss_coef"] = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    return fields


def read_fields(config, what: str = "config") -> dict:
    """The ModelConfig fields of a Hugging Face config: a ``transformers`` config object, a config
    dict, a ``config.json`` path or a checkpoint folder holding one. ``what`` names the argument in
    errors."""
    cfg, name = _config_object(config, what)
    kind = cfg.model_type
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type ({kind!r}) is not supported; supported: {', '.join(MODEL_TYPES)}")
    if kind not in MOE_TYPES:
        for f in _MOE_FIELDS:
            if getattr(cfg, f, None):
                raise ValueError(f"{f} ({getattr(cfg, f)}): experts in a {kind!r} config are not supported; "
                                 f"mixture-of-experts models are read as model_type {', '.join(MOE_TYPES)}")
    name = name or kind
    if kind == "gpt2":
        return _gpt2(cfg, name)
    if kind == "qwen":
        return _qwen_v1(cfg, name)
    fields = _llama_like(cfg, kind, name)
    return _moe(cfg, kind, fields) if kind in MOE_TYPES else fields


def config_to_hf(mc):
    """The ``transformers`` config of ModelConfig ``mc`` (export: ``save_pretrained`` of it is the config.json)."""
    import transformers  # noqa: PLC0415

    if mc.model_type == "gpt2":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[mc.activation]
        return transformers.GPT2Config(vocab_size=mc.vocab_size, n_positions=mc.max_position_embeddings,
                                       n_embd=mc.hidden_size, n_layer=mc.num_layers, n_head=mc.num_attention_heads,
                                       n_inner=mc.ffn_hidden_size, activation_function=act,
                                       layer_norm_epsilon=mc.norm_eps, initializer_range=mc.initializer_range,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       tie_word_embeddings=mc.tied_embeddings, architectures=["GPT2LMHeadModel"],
                                       **({} if mc.vocab_size > 50256 else dict(bos_token_id=None, eos_token_id=None)))
    rope = {"rope_type": "default", **(mc.rope_scaling or {}), "rope_theta": mc.rope_theta}
    common = dict(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.ffn_hidden_size,
                  num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_attention_heads,
                  num_key_value_heads=mc.kv_heads, head_dim=mc.dhead, hidden_act="silu",
                  max_position_embeddings=mc.max_position_embeddings, rms_norm_eps=mc.norm_eps,
                  rope_parameters=rope, tie_word_embeddings=mc.tied_embeddings,
                  initializer_range=mc.initializer_range, attention_dropout=0.0)
    if mc.model_type == "qwen2":
        return transformers.Qwen2Config(**common, **_qwen_windows(mc), architectures=["Qwen2ForCausalLM"])
    if mc.model_type == "qwen3":
        return transformers.Qwen3Config(**common, **_qwen_windows(mc), attention_bias=mc.qkv_bias,
                                        architectures=["Qwen3ForCausalLM"])
    if mc.model_type in MOE_TYPES:
        return _moe_to_hf(mc, common)
    if mc.model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=mc.sliding_window,
                                          architectures=["MistralForCausalLM"])
    return transformers.LlamaConfig(**common, attention_bias=mc.qkv_bias, mlp_bias=mc.mlp_bias,
                                    architectures=["LlamaForCausalLM"])


def _qwen_windows(mc) -> dict:
    """Qwen2's sliding-window keys: the window and which layers have it (``layer_types``)."""
    layer_types = None
    if mc.sliding_window is not None:
        layers = mc.sliding_window_layers if mc.sliding_window_layers is not None else range(mc.num_layers)
        layer_types = ["sliding_attention" if i in layers else "full_attention" for i in range(mc.num_layers)]
    return dict(use_sliding_window=mc.sliding_window is not None, sliding_window=mc.sliding_window,
                layer_types=layer_types)


def _moe_to_hf(mc, common: dict):
    import transformers  # noqa: PLC0415

    moe = dict(num_experts_per_tok=mc.experts_per_token, router_aux_loss_coef=mc.router_aux_loss_coef,
               output_router_logits=False)
    if mc.model_type == "mixtral":
        if mc.moe_layers is not None or mc.shared_expert_ffn_hidden_size or not mc.router_normalize:
            raise ValueError("model_type 'mixtral' has experts on every layer, no shared expert and normalised "
                             "top-k weights; this config is not one")
        return transformers.MixtralConfig(**{**common, "intermediate_size": mc.expert_ffn}, **moe,
                                          num_local_experts=mc.num_experts, router_jitter_noise=mc.router_jitter,
                                          sliding_window=mc.sliding_window, architectures=["MixtralForCausalLM"])
    # Qwen2-/Qwen3-MoE: the MoE layers as mlp_only_layers (the dense ones), decoder_sparse_step 1
    dense = [] if mc.moe_layers is None else [i for i in range(mc.num_layers) if i not in mc.moe_layers]
    moe.update(num_experts=mc.num_experts, moe_intermediate_size=mc.expert_ffn, norm_topk_prob=mc.router_normalize,
               decoder_sparse_step=1, mlp_only_layers=dense)
    if mc.model_type == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, **moe, **_qwen_windows(mc), qkv_bias=mc.qkv_bias,
                                           shared_expert_intermediate_size=mc.shared_expert_ffn_hidden_size,
                                           architectures=["Qwen2MoeForCausalLM"])
    return transformers.Qwen3MoeConfig(**common, **moe, **_qwen_windows(mc), attention_bias=mc.qkv_bias,
                                       architectures=["Qwen3MoeForCausalLM"])


__all__ = ["config_to_hf", "read_fields"]
