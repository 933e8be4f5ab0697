"""Hugging Face parameter names per family: the one table that maps our layers to checkpoints.

Each entry is a module path (``{i}`` = layer index); ``.weight`` / ``.bias`` are appended. How a
tensor is split over TP ranks lives with the layer that owns it (``hf_parts`` of each module), so
this table stays names only. GPT-2's linear layers are ``Conv1D``: weight stored (in, out), the
transpose of ``nn.Linear`` (``transposed``); its q/k/v are one fused ``c_attn`` (``fused_qkv``).
Llama, Qwen2, Qwen3 and Mistral share one naming (Qwen3 adds ``q_norm`` / ``k_norm``); q/k/v and gate/up are fused on load into our
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
        "q_norm": "model.layers.{i}.self_attn.q_norm",  # Qwen3's per-head q/k norms (qk_norm)
        "k_norm": "model.layers.{i}.self_attn.k_norm",
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

# Mixture-of-experts blocks (``{e}`` = expert index), as the checkpoints on the Hub and transformers'
# save_pretrained name them: one tensor per expert (transformers 5 fuses them into ``experts.gate_up_proj``
# (E, 2F, H) and ``experts.down_proj`` (E, H, F) in memory, its conversion mapping splitting / joining
# them at save / load: :func:`tpkernels.models.hf_checkpoint.unfuse_experts` does the same for a module).
# Attention, norms, embedding and head keep the "llama" names.
_QWEN_MOE = {
    "router": "model.layers.{i}.mlp.gate",
    "expert_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj",
    "expert_up": "model.layers.{i}.mlp.experts.{e}.up_proj",
    "expert_down": "model.layers.{i}.mlp.experts.{e}.down_proj",
    "shared_gate": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj",
    "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate",
}
MOE_NAMES: dict[str, dict[str, str]] = {
    "mixtral": {
        "router": "model.layers.{i}.block_sparse_moe.gate",
        "expert_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1",
        "expert_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3",
        "expert_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2",
    },
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
}
# transformers' in-memory module names of the MoE block (the router and fused experts; Mixtral's block is
# ``mlp`` there, ``block_sparse_moe`` in files)
MODULE_MOE_NAMES = {"router": "model.layers.{i}.mlp.gate.weight", "gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
                    "down": "model.layers.{i}.mlp.experts.down_proj"}

TRANSPOSED = {"gpt2": True, "llama": False}  # Conv1D stores (in, out)
# older GPT-2 checkpoints (the Hub's "gpt2") have no "transformer." prefix
OPTIONAL_PREFIXES = ("transformer.", "model.")


__all__ = ["HF_NAMES", "MODULE_MOE_NAMES", "MOE_NAMES", "OPTIONAL_PREFIXES", "TRANSPOSED"]
