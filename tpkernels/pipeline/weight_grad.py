"""Zero-bubble schedules split backward into B (input gradients) and W (weight gradients). The
mechanism is :mod:`tpkernels.functional.weight_grad`, shared with the tensor-parallel layers
(``ColumnParallelLinear`` / ``RowParallelLinear`` always use it); this module makes plain
``nn.Linear`` layers use it too.

The Linear weights carry nearly all the FLOPs of a Transformer's weight gradient; other
parameters (norms, embeddings) get their gradients in B. This is how the Zero Bubble paper's
Megatron implementation splits backward.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.functional.weight_grad import linear


def _split_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def enable_weight_grad_split(module: nn.Module) -> nn.Module:
    """Make every ``nn.Linear`` in ``module`` able to defer its weight gradient (in place; returns
    ``module``). Outside a W-splitting schedule the layers compute exactly what ``nn.Linear`` does."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.forward = _split_forward.__get__(m, nn.Linear)
    return module
