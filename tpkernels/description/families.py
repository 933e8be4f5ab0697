"""The model types the one Hugging Face reader knows, and which of them ``tpkernels.models`` builds."""

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
BUILDABLE_TYPES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
# Read and planned, not built; the reason is what ModelConfig.build_errors() says.
PLAN_ONLY_TYPES = {
    "qwen": "model_type ('qwen') is Qwen (v1): its checkpoints' weight names (transformer.h.N.attn.c_attn, "
            "mlp.w1/w2) are not mapped by tpkernels.models; convert it to Qwen2 first",
}
MODEL_TYPES = BUILDABLE_TYPES + tuple(PLAN_ONLY_TYPES)
# Mixture-of-experts families and their Hugging Face weight naming (tpkernels.models.hf_names)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

__all__ = ["BUILDABLE_TYPES", "MODEL_TYPES", "MOE_TYPES", "PLAN_ONLY_TYPES", "ROPE_TYPES"]
