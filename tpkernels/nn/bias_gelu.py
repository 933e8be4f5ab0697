"""``BiasGeLU``: the bias and the GeLU of ``nn.Linear(bias=True) + nn.GELU()``, fused.

Replace the pair in an existing model with ``nn.Linear(bias=False)`` followed by ``BiasGeLU``
that owns the bias (same weights, same function, one fewer pass over the activation):

    >>> fused = BiasGeLU.fuse_linear(model.fc1, model.act)    # -> nn.Sequential(linear, bias_gelu)
    >>> model.fc1, model.act = fused, nn.Identity()

or by hand:

    >>> lin = nn.Linear(d, 4 * d, bias=False); lin.weight = old.weight
    >>> act = BiasGeLU(4 * d, approximate="tanh"); act.bias = old.bias
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpkernels.functional.bias_gelu import APPROXIMATIONS, bias_gelu


class BiasGeLU(nn.Module):
    """y = gelu(x + bias). x: (..., features) -> y: (..., features).

    Args:
        features: size of the last dim of the input (the bias length).
        approximate: ``"none"`` (exact) or ``"tanh"``, as in :class:`torch.nn.GELU`.
        device, dtype: of the bias parameter.
    """

    def __init__(self, features: int, approximate: str = "none", device=None, dtype=None):
        super().__init__()
        if not isinstance(features, int) or features < 1:
            raise ValueError(f"features ({features!r}) must be a positive int")
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"approximate ({approximate!r}) must be 'none' or 'tanh'")
        self.features = features
        self.approximate = approximate
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return bias_gelu(x, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"features={self.features}, approximate={self.approximate!r}"

    @classmethod
    def fuse_linear(cls, linear: nn.Linear, gelu: nn.GELU) -> nn.Sequential:
        """``Sequential(Linear(bias=False), BiasGeLU)`` computing the same as ``gelu(linear(x))``.

        The new modules share (not copy) ``linear``'s weight and bias parameters, so optimizer
        state and checkpoints keyed on them keep working.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be nn.Linear, got {type(linear).__name__}")
        if not isinstance(gelu, nn.GELU):
            raise TypeError(f"gelu must be nn.GELU, got {type(gelu).__name__}")
        if linear.bias is None:
            raise ValueError("linear has no bias to fuse (bias=False); nothing for BiasGeLU to own")
        w = linear.weight
        new_linear = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        new_linear.weight = w
        act = cls(linear.out_features, approximate=gelu.approximate, device="meta")
        act.bias = linear.bias
        return nn.Sequential(new_linear, act)
