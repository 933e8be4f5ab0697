"""The one model description (below both ``tpkernels.models`` and ``tpkernels.planner``): ModelConfig,
its Hugging Face reader and writer, and the one preset list.

    from tpkernels.description import ModelConfig, model_preset
    model_preset("Llama-3-70B").num_params()          # 70,553,706,496
    ModelConfig.read_hf("path/to/config.json")        # what the file says (planning)
    ModelConfig.from_hf("path/to/checkpoint")         # ... and refused if the models cannot build it
"""

from tpkernels.description.families import BUILDABLE_TYPES, MODEL_TYPES, PLAN_ONLY_TYPES, ROPE_TYPES
from tpkernels.description.model import MODEL_PRESETS, ModelConfig, model_preset
from tpkernels.description.presets import NARAYANAN_2021_GPT

__all__ = ["BUILDABLE_TYPES", "MODEL_PRESETS", "MODEL_TYPES", "NARAYANAN_2021_GPT", "PLAN_ONLY_TYPES", "ROPE_TYPES",
           "ModelConfig", "model_preset"]
