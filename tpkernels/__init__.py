"""tpkernels: kernels and modules for tensor-, sequence- and pipeline-parallel Transformer training.

Public API (this release):
    tpkernels.bias_gelu(x, bias, approximate="none")   fused gelu(x + bias) with autograd
    tpkernels.nn.BiasGeLU                              module owning the bias
    tpkernels.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, return_lse)
    tpkernels.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
                                                       FlashAttention-2 forward/backward, GQA, causal, varlen
    tpkernels.nn.FlashAttention                        core attention module (q, k, v -> out)
    tpkernels.backends                                 dispatch rule, TPKERNELS_BACKEND
    tpkernels.build_info()                             what tpkernels._C was built with
    tpkernels.all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce
                                                       TP communication overlapped with GEMMs: ring, or
                                                       fused Triton kernels over symmetric memory (CUDA)
    tpkernels.functional.virtual_tp.VirtualTP          N ranks emulated on one device, same fused kernels
    tpkernels.nn.ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding
    tpkernels.vocab_parallel_cross_entropy            loss over vocabulary-sharded logits
    tpkernels.rms_norm(x, weight, eps, residual=None) RMSNorm, fused with the residual add
    tpkernels.layer_norm(x, weight, bias, eps, residual=None)  LayerNorm (GPT-2), fused with the residual add
    tpkernels.nf4_linear(x, qweight, bias=None)        x · Wᵀ over a frozen NF4 weight (QLoRA base), dx too
    tpkernels.quant.quantize_nf4 / quantize_int8       NF4 (bitsandbytes' bytes) and int8 weight quantisation
    tpkernels.swiglu(gate, up=None)                   silu(gate) * up, or of a fused [gate | up]
    tpkernels.apply_rotary(q, k, cos, sin, ...)       rotary embedding (half-split or interleaved, packed)
    tpkernels.rotary_cache(head_dim, max_pos, theta, scaling)  cos/sin as Hugging Face computes them
    tpkernels.linear_cross_entropy(hidden, weight, target, tp_group=...)  LM head + loss, no logits
    tpkernels.route(logits, top_k, ...)               MoE router (Mixtral / Qwen-MoE / DeepSeek-V3), capacity
    tpkernels.load_balancing_loss / z_loss            the router's aux losses, rank shares over a group
    tpkernels.permute / unpermute                     token copies grouped by expert, and the weighted sum back
    tpkernels.grouped_gemm / grouped_swiglu_mlp       every expert's rows times its weights in one launch
    tpkernels.dispatch_combine(x_sorted, counts, expert_fn, ep_group, num_local_experts=, chunks=)
                                                       expert parallelism: all-to-all to the experts' ranks
                                                       and back, overlapped with the experts in chunks
    tpkernels.parallel.mappings                        copy/reduce/scatter/gather autograd mappings
    tpkernels.parallel.trace.CommTrace                 chrome trace of comm/GEMM overlap
    tpkernels.pipeline                                 schedules as data, simulator, P2P engine, runtime, timeline
    tpkernels.parallel.ParallelConfig                  a TP/PP/DP layout and its validation rules
    tpkernels.parallel.state.ParallelState             its process groups (create(config)), DeviceMesh view
    tpkernels.models.ModelConfig / ParallelTransformer GPT-2 and Llama-family models at any layout, HF in/out
    tpkernels.hf.apply_kernels(model)                  our kernels inside a transformers model
    tpkernels.planner.plan(model, training, cluster)   ranked layouts with memory and step time
                                                       (also `tpkernels plan` on the command line)

Importing never needs a GPU or the compiled extension.
"""

import importlib
import sys

from tpkernels._version import __version__

# The package's names load on first use (PEP 562): `tpkernels plan`, `tpkernels --help` and the launcher of
# `tpkernels train --nproc` import only the pure-Python modules they need, not torch (seconds). The first
# name used loads what `import tpkernels` always loaded (the dispatch rule, the ops, the modules), so
# `import tpkernels; tpkernels.parallel.mappings` works as it did.
_FUNCTIONAL = ("all_gather_matmul", "apply_rotary", "bias_gelu", "dispatch_combine", "flash_attn_func",
               "flash_attn_varlen_func", "grouped_gemm", "grouped_swiglu_mlp", "layer_norm", "linear_cross_entropy",
               "load_balancing_loss", "matmul_all_reduce", "matmul_reduce_scatter", "nf4_linear", "permute",
               "rms_norm", "rotary_cache", "route", "swiglu", "unpermute", "vocab_parallel_cross_entropy", "z_loss")


_LOADING: list[bool] = []  # set while _load runs: the modules it imports ask this package for their siblings


def _load() -> None:
    if "build_info" in globals() or _LOADING:
        return
    _LOADING.append(True)
    try:
        for name in ("backends", "nn", "functional"):
            importlib.import_module(f"tpkernels.{name}")
        functional = importlib.import_module("tpkernels.functional")
        build_info = importlib.import_module("tpkernels._extension").build_info
        globals().update({name: getattr(functional, name) for name in _FUNCTIONAL}, build_info=build_info)
    finally:
        _LOADING.clear()


def __getattr__(name: str):
    if name.startswith("__"):  # dunders (copy, pickle, inspect probe them): never a reason to import torch
        raise AttributeError(f"module 'tpkernels' has no attribute {name!r}")
    if name in _FUNCTIONAL or name == "build_info":
        _load()
        if name not in globals():  # asked for while _load itself runs: a circular import, said as Python says it
            raise AttributeError(f"partially initialized module 'tpkernels' has no attribute {name!r} yet")
        return globals()[name]
    try:  # a subpackage (tpkernels.nn, tpkernels.parallel, ...), also what `from tpkernels import x` asks for
        module = importlib.import_module(f"tpkernels.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"tpkernels.{name}":
            raise
        raise AttributeError(f"module 'tpkernels' has no attribute {name!r}") from None
    if not _importing():
        _load()  # user code: the package as `import tpkernels` always gave it (tpkernels.parallel.mappings bound)
    return module


def _importing() -> bool:
    """Whether a tpkernels module is being executed now (its own `from tpkernels import x` lands here)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for k, m in list(sys.modules.items()) if k == "tpkernels" or k.startswith("tpkernels."))


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = ["__version__", "all_gather_matmul", "apply_rotary", "backends", "bias_gelu", "build_info", "dispatch_combine",
           "flash_attn_func",
           "flash_attn_varlen_func", "grouped_gemm", "grouped_swiglu_mlp", "layer_norm", "linear_cross_entropy",
           "load_balancing_loss", "matmul_all_reduce", "matmul_reduce_scatter", "nf4_linear", "nn", "permute", "rms_norm",
           "rotary_cache", "route", "swiglu", "unpermute", "vocab_parallel_cross_entropy", "z_loss"]
