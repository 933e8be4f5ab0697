"""ModelConfig ⇄ ``transformers`` configs (GPT-2, Llama, Qwen2, Mistral).

Read through ``transformers.AutoConfig`` so that every config.json spelling transformers accepts
(``rope_scaling`` + ``rope_theta`` of older files, ``rope_parameters`` of 5.x) arrives normalised.
Anything these models do not implement raises a ValueError naming the config field: MoE, unknown
rope types, partial rotary, other activations, dropout (unless dropped on purpose).
"""

from __future__ import annotations

from pathlib import Path

from tpkernels.models.config import MODEL_TYPES, ROPE_TYPES, ModelConfig

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _hf_config_object(config):
    import transformers  # noqa: PLC0415

    if isinstance(config, transformers.PretrainedConfig):
        return config
    if isinstance(config, dict):
        d = dict(config)
        kind = d.pop("model_type", None)
        if kind is None:
            raise ValueError("config dict lacks model_type (one of gpt2, llama, qwen2, mistral)")
        return transformers.AutoConfig.for_model(kind, **d)
    path = Path(config)
    if path.is_file():
        path = path.parent if path.name == "config.json" else path
    if not (path / "config.json").is_file():
        raise ValueError(f"config ({str(config)!r}) is neither a transformers config, a dict, a config.json nor a "
                         "folder holding one")
    return transformers.AutoConfig.from_pretrained(str(path))


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


def _dropout(cfg, fields, drop: bool) -> None:
    for f in fields:
        p = getattr(cfg, f, 0.0) or 0.0
        if p > 0 and not drop:
            raise ValueError(f"{f} ({p}) > 0: tpkernels models train without dropout; pass drop_dropout=True to "
                             "load the model and train it without (as LLM pre-training usually does)")


def config_from_hf(config, *, drop_dropout: bool = False) -> ModelConfig:
    cfg = _hf_config_object(config)
    kind = cfg.model_type
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type ({kind!r}) is not supported; supported: {', '.join(MODEL_TYPES)}")
    for f in _MOE_FIELDS:
        if getattr(cfg, f, None):
            raise ValueError(f"{f} ({getattr(cfg, f)}): mixture-of-experts models are not supported")
    name = getattr(cfg, "_name_or_path", "") or kind
    if kind == "gpt2":
        act = cfg.activation_function
        if act not in _GPT2_ACTIVATIONS:
            raise ValueError(f"activation_function ({act!r}) must be one of {', '.join(_GPT2_ACTIVATIONS)}")
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError("scale_attn_by_inverse_layer_idx (True) is not supported")
        if not getattr(cfg, "scale_attn_weights", True):
            raise ValueError("scale_attn_weights (False) is not supported (scores are scaled by 1/sqrt(head_dim))")
        _dropout(cfg, ("attn_pdrop", "resid_pdrop", "embd_pdrop"), drop_dropout)
        h = cfg.n_embd
        return ModelConfig("gpt2", cfg.n_layer, h, cfg.n_head, cfg.n_inner or 4 * h, cfg.vocab_size,
                           norm="layernorm", norm_eps=cfg.layer_norm_epsilon, positions="learned",
                           max_position_embeddings=cfg.n_positions, activation=_GPT2_ACTIVATIONS[act],
                           qkv_bias=True, out_bias=True, mlp_bias=True,
                           tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
                           initializer_range=cfg.initializer_range, name=name)
    if cfg.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act ({cfg.hidden_act!r}) must be 'silu' (SwiGLU MLP)")
    _dropout(cfg, ("attention_dropout",), drop_dropout)
    theta, scaling = _rope(cfg)
    window, window_layers = None, None
    if kind == "mistral" and getattr(cfg, "sliding_window", None):
        window = int(cfg.sliding_window)
    layer_types = getattr(cfg, "layer_types", None)
    if kind == "qwen2" and getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        window = int(cfg.sliding_window)
    if window is not None and layer_types:
        window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if kind == "qwen2" and not window_layers:
            window = None
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim == cfg.hidden_size // cfg.num_attention_heads:
        head_dim = None  # the default, however the file spells it
    return ModelConfig(
        kind, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim, norm="rmsnorm", norm_eps=cfg.rms_norm_eps, positions="rotary",
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=theta, rope_scaling=scaling,
        activation="swiglu", qkv_bias=kind == "qwen2" or attention_bias, out_bias=attention_bias and kind != "qwen2",
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)), tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_window=window, sliding_window_layers=window_layers,
        initializer_range=getattr(cfg, "initializer_range", 0.02), name=name)


def config_to_hf(mc: ModelConfig):
    """The ``transformers`` config of ``mc`` (export: ``save_pretrained`` of it is the config.json)."""
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
        layer_types = None
        if mc.sliding_window is not None:
            layers = mc.sliding_window_layers if mc.sliding_window_layers is not None else range(mc.num_layers)
            layer_types = ["sliding_attention" if i in layers else "full_attention" for i in range(mc.num_layers)]
        return transformers.Qwen2Config(**common, use_sliding_window=mc.sliding_window is not None,
                                        sliding_window=mc.sliding_window, layer_types=layer_types,
                                        architectures=["Qwen2ForCausalLM"])
    if mc.model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=mc.sliding_window,
                                          architectures=["MistralForCausalLM"])
    return transformers.LlamaConfig(**common, attention_bias=mc.qkv_bias, mlp_bias=mc.mlp_bias,
                                    architectures=["LlamaForCausalLM"])


__all__ = ["config_from_hf", "config_to_hf"]
