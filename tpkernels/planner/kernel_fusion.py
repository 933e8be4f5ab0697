"""How much more HBM traffic a layer's memory-bound ops move when they run as separate eager PyTorch
ops instead of fused kernels.

The step-time model charges the memory-bound kernels (norms, rotary, the MLP's activation, residual
adds) as the stored activation bytes × ``Efficiency.elementwise_traffic`` over the HBM bandwidth,
a count that fits fused kernels (TransformerEngine, torch.compile, ours). Eager PyTorch runs each
op of the model code as its own kernel, and each reads and writes the whole tensor:
``eager_traffic_ratio`` counts the bytes per token of one layer's forward both ways and the planner
scales that term by their ratio when ``TrainingSetup.kernels`` is "eager". The eager count follows
torchtitan's Llama (torchtitan/models/llama3/model.py, the eager runs of its published benchmarks):

  RMSNorm     x.float(), pow(2), mean, · rsqrt, type_as, · weight: 2+4, 4+4, 4, 4+4, 4+2, 2+2 = 36
              bytes per element, against 4 fused (read and write 16 bits); a LayerNorm model's
              F.layer_norm is one kernel either way (4)
  rotary      q and k through complex fp32: float() 2+4, complex multiply 4+4, type_as 4+2 = 20,
              against 4 fused; none with learned positions
  SwiGLU      silu 2+2, multiply 4+2 = 10 per ffn element, against 6 fused (read gate and up,
              write the product); a two-matrix MLP's GeLU reads and writes once either way (4)
  attention   the output's transpose to (tokens, heads · dim) is a copy (2+2) eager, free fused
  residuals   two adds, 4+2 each, either way

The backward is taken to grow in the same ratio (autograd runs each eager op's backward as its own
kernels, on the same fp32 intermediates). Counted, not fitted: Llama-3-8B's ratio is 3.2.
"""

from __future__ import annotations

from tpkernels.description import ModelConfig


def layer_elementwise_bytes(model: ModelConfig, eager: bool) -> float:
    """Bytes per token that one decoder layer's forward memory-bound ops move (16-bit activations)."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    gated = model.mlp_matrices == 3
    norms = 2 * (36 if eager and model.norm == "rmsnorm" else 4) * h
    rotary = (20 if eager else 4) * (q + kv) if model.positions == "rotary" else 0
    mlp = (10 if eager else 6) * f if gated else 4 * f
    transpose = 4 * q if eager else 0
    residuals = 2 * 6 * h
    return norms + rotary + mlp + transpose + residuals


def eager_traffic_ratio(model: ModelConfig) -> float:
    """Eager PyTorch's memory-bound bytes over fused kernels', per layer (> 1)."""
    return layer_elementwise_bytes(model, eager=True) / layer_elementwise_bytes(model, eager=False)
