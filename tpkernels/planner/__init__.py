"""Parallel-layout planner: memory and step-time model, search over TP/PP/DP layouts, `tpkernels plan`.

    from tpkernels.planner import model_preset, gpu_preset, ClusterSpec, TrainingSetup, plan
    p = plan(model_preset("Llama-3-70B"), TrainingSetup(global_batch=512, seq_length=8192),
             ClusterSpec(gpu_preset("H100-SXM"), gpus_per_node=8, nodes=8))
    p.best.config        # ParallelConfig(tp=8, pp=2, dp=4, ...)
"""

from tpkernels.description import MODEL_PRESETS, ModelConfig, model_preset
from tpkernels.planner.efficiency import A100_CALIBRATED, H100_CALIBRATED, Efficiency, calibrated_for
from tpkernels.planner.estimate import Estimate, estimate, layout_errors
from tpkernels.planner.fp8_choice import Fp8LayerChoice, Fp8Rates, format_choices, fp8_layer_choices, measure_fp8_rates
from tpkernels.planner.hardware import GPU_PRESETS, ClusterSpec, GPUSpec, gpu_preset
from tpkernels.planner.search import Plan, explain, parse_layout, plan
from tpkernels.planner.workload import TrainingSetup

__all__ = [
    "A100_CALIBRATED", "GPU_PRESETS", "H100_CALIBRATED", "calibrated_for", "MODEL_PRESETS", "ClusterSpec", "Efficiency", "Estimate", "GPUSpec",
    "ModelConfig", "Plan", "TrainingSetup", "estimate", "explain", "gpu_preset", "layout_errors",
    "Fp8LayerChoice", "Fp8Rates", "format_choices", "fp8_layer_choices", "measure_fp8_rates",
    "model_preset", "parse_layout", "plan",
]
