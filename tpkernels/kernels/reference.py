"""Pure-PyTorch kernels: the CPU fallback of every op and the oracle of every test.

They compute in float32 (float64 for float64 inputs) and cast back, like the fused kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Constants of the GeLU formulas (see csrc/gelu/bias_gelu_math.h for their meaning).
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _opmath(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def gelu_grad(z: Tensor, approximate: str) -> Tensor:
    """d gelu(z)/dz, elementwise, in the dtype of ``z``."""
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _TANH_CUBIC * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * z * z)
    return 0.5 * (1 + torch.erf(z * _INV_SQRT2)) + z * _INV_SQRT_2PI * torch.exp(-0.5 * z * z)


def bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    """y = gelu(x + bias). x: (..., n), bias: (n,) -> y: (..., n), dtype of x."""
    z = _opmath(x) + _opmath(bias)
    return torch.nn.functional.gelu(z, approximate=approximate).to(x.dtype)


def bias_gelu_bwd(grad: Tensor, x: Tensor, bias: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_bias) of gelu(x + bias); grad_bias sums grad_x over all leading dims."""
    z = _opmath(x) + _opmath(bias)
    dx = (_opmath(grad) * gelu_grad(z, approximate)).to(x.dtype)
    db = _opmath(dx).reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return dx, db
