"""Hugging Face parameter names per family: the one table that maps our layers to checkpoints.

Each entry is a module path (``{i}`` = layer index); ``.weight`` / ``.bias`` are appended. How a
tensor is split over TP ranks lives with the layer that owns it (``hf_parts`` of each module), so
this table stays names only. GPT-2's linear layers are ``Conv1D``: weight stored (in, out), the
transpose of ``nn.Linear`` (``transposed``); its q/k/v are one fused ``c_attn`` (``fused_qkv``).
Llama, Qwen2 and Mistral share one naming; q/k/v and gate/up are fused on load into our
``qkv`` and ``gate_up`` column-parallel GEMMs.
"""

from __future__ import annotations

HF_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "embed": "model.embed_tokens",
        "norm1": "model.layers.{i}.input_layernorm",
        "q": "model.layers.{i}.self_attn.q_proj",
        "k": "model.layers.{i}.self_attn.k_proj",
        "v": "model.layers.{i}.self_attn.v_proj",
        "out": "model.layers.{i}.self_attn.o_proj",
        "norm2": "model.layers.{i}.post_attention_layernorm",
        "gate": "model.layers.{i}.mlp.gate_proj",
        "up": "model.layers.{i}.mlp.up_proj",
        "down": "model.layers.{i}.mlp.down_proj",
        "final_norm": "model.norm",
        "head": "lm_head",
    },
    "gpt2": {
        "embed": "transformer.wte",
        "positions": "transformer.wpe",
        "norm1": "transformer.h.{i}.ln_1",
        "qkv": "transformer.h.{i}.attn.c_attn",
        "out": "transformer.h.{i}.attn.c_proj",
        "norm2": "transformer.h.{i}.ln_2",
        "up": "transformer.h.{i}.mlp.c_fc",
        "down": "transformer.h.{i}.mlp.c_proj",
        "final_norm": "transformer.ln_f",
        "head": "lm_head",
    },
}

TRANSPOSED = {"gpt2": True, "llama": False}  # Conv1D stores (in, out)
# older GPT-2 checkpoints (the Hub's "gpt2") have no "transformer." prefix
OPTIONAL_PREFIXES = ("transformer.", "model.")


__all__ = ["HF_NAMES", "OPTIONAL_PREFIXES", "TRANSPOSED"]
