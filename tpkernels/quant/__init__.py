"""Weight quantisation for frozen base weights (QLoRA): NF4 with double quantisation, and int8.

Pure PyTorch, any device. The GEMMs that read these formats are the ``nf4_linear`` op
(:mod:`tpkernels.functional.nf4_linear`).
"""

from tpkernels.quant.nf4 import (
    ABSMAX_BLOCK,
    BLOCK,
    DYNAMIC_MAP,
    NF4_CODE,
    Int8Weight,
    NF4Weight,
    dequantize_absmax,
    dequantize_int8,
    dequantize_nf4,
    dynamic_map,
    nf4_bytes_per_param,
    nf4_code,
    quantize_int8,
    quantize_nf4,
)

__all__ = ["ABSMAX_BLOCK", "BLOCK", "DYNAMIC_MAP", "NF4_CODE", "Int8Weight", "NF4Weight", "dequantize_absmax",
           "dequantize_int8", "dequantize_nf4", "dynamic_map", "nf4_bytes_per_param", "nf4_code", "quantize_int8",
           "quantize_nf4"]
