"""Triton kernels. Import lazily: importing triton costs about a second.

Every kernel module (``KERNEL_MODULES``) exposes ``compile_specs(arch)``;
``tpkernels.kernels.triton.aot_check`` compiles them all for given SM targets without a GPU.
"""

KERNEL_MODULES = ("tpkernels.kernels.triton.bias_gelu", "tpkernels.kernels.triton.flash_attn",
                  "tpkernels.kernels.triton.rms_norm", "tpkernels.kernels.triton.layer_norm",
                  "tpkernels.kernels.triton.swiglu",
                  "tpkernels.kernels.triton.rotary", "tpkernels.kernels.triton.cross_entropy",
                  "tpkernels.kernels.triton.ag_matmul", "tpkernels.kernels.triton.matmul_signal",
                  "tpkernels.kernels.triton.tile_reduce",
                  "tpkernels.kernels.triton.nf4_linear",
                  "tpkernels.kernels.triton.moe_permute", "tpkernels.kernels.triton.grouped_gemm")
