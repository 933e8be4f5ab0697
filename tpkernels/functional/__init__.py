"""Public functions and their autograd, one module per op family."""

from tpkernels.functional.attention import flash_attn_func, flash_attn_varlen_func
from tpkernels.functional.bias_gelu import bias_gelu
from tpkernels.functional.gemm_comm import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from tpkernels.functional.grouped_gemm import grouped_gemm, grouped_swiglu_mlp
from tpkernels.functional.linear_cross_entropy import linear_cross_entropy
from tpkernels.functional.moe_dispatch import dispatch_combine
from tpkernels.functional.moe_permute import permute, unpermute
from tpkernels.functional.moe_router import Routing, load_balancing_loss, route, update_balance_bias, z_loss
from tpkernels.functional.nf4_linear import nf4_linear
from tpkernels.functional.norms import layer_norm, rms_norm
from tpkernels.functional.rotary import apply_rotary, rotary_cache
from tpkernels.functional.swiglu import swiglu
from tpkernels.functional.tp_linear import column_parallel_linear, row_parallel_linear
from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["Routing", "all_gather_matmul", "apply_rotary", "bias_gelu", "column_parallel_linear", "dispatch_combine",
           "flash_attn_func",
           "flash_attn_varlen_func", "grouped_gemm", "grouped_swiglu_mlp", "layer_norm", "linear_cross_entropy",
           "load_balancing_loss", "matmul_all_reduce", "matmul_reduce_scatter", "nf4_linear", "permute", "rms_norm",
           "rotary_cache", "route", "row_parallel_linear", "swiglu", "unpermute", "update_balance_bias",
           "vocab_parallel_cross_entropy", "z_loss"]
