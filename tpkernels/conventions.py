"""Conventions every layer of the package shares (a leaf module: it imports nothing of the package).

* ``IGNORE_INDEX``: the target value no loss counts (PyTorch's ``cross_entropy`` default and Hugging
  Face's label padding, -100): prompts under SFT, documents' last tokens, padding.
* ``rows(t)``: a tensor ``(..., n)`` as the 2-D ``(rows, n)`` that kernels and GEMMs read, its last
  dim of stride 1: a view whenever possible, a copy only when the layout needs one.
"""

from __future__ import annotations

from torch import Tensor

IGNORE_INDEX = -100


def rows(t: Tensor) -> Tensor:
    """(..., n) -> (rows, n) with last-dim stride 1; a view whenever possible."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


__all__ = ["IGNORE_INDEX", "rows"]
