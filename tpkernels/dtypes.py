"""The one accumulation policy of the package.

Sums (GEMM partial sums travelling between ranks, weight gradients over chunks, reductions over
ranks, softmax statistics) are taken in float32 for 16-bit inputs, and in the input dtype
otherwise: float32 stays float32 and float64 stays float64 (a float64 run is a reference run, and
rounding it to float32 anywhere would make it useless as one).
"""

from __future__ import annotations

import torch

_WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16, else ``dtype`` itself."""
    return _WIDENED.get(dtype, dtype)


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its accumulation dtype (``t`` itself when that is its dtype: no copy)."""
    acc = accumulation_dtype(t.dtype)
    return t if acc == t.dtype else t.to(acc)
