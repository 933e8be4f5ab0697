"""The FlashAttention tolerance rule, used by every numerical test.

Given ``ref64`` (the math in float64) and ``ref_lp`` (the same PyTorch math in the input's
dtype), a kernel output passes when

    max|ours - ref64| <= k * max|ref_lp - ref64| + floor

with k = 2 for outputs and 3 for gradients, and floor = ``ulps`` units in the last place of
the output dtype at the reference's scale (max(1, max|ref64|)). The floor dominates in fp32,
where PyTorch's own error is tiny. NaN anywhere fails.

``ref_lp`` may be several low-precision evaluations of the same math (say the textbook form and
the blocked form a kernel uses); the yardstick is the largest of their errors. One evaluation
alone can be exact by structure where any other order of the same sums is not: with one key,
softmax's textbook backward P·dP − P·Σ(P·dP) cancels exactly (P = 1), while FlashAttention's
dS = P·(dP − rowsum(dO∘O)) subtracts two differently summed dot products of the head dimension,
whose difference is roundoff of their size (√d times the output's), not of the output's. With
that one evaluation as the yardstick only the floor was left, and a correct kernel failed it
(dq 4.30e-6 against 4.13e-6 at 64 queries and one key, seed 3327238499).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

K_OUTPUT = 2.0
K_GRAD = 3.0


def _evaluations(ref_lp: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [ref_lp] if isinstance(ref_lp, Tensor) else list(ref_lp)


def fa_tolerance(ref64: Tensor, ref_lp: Tensor | Sequence[Tensor], dtype: torch.dtype, k: float,
                 ulps: float = 4.0) -> float:
    """k · (the largest error of the low-precision evaluations ``ref_lp``) + ``ulps`` ulps of ``dtype`` at
    max(1, max|ref64|)."""
    if not ref64.numel():
        return ulps * torch.finfo(dtype).eps
    scale = max(1.0, ref64.abs().max().item())
    base = max((r.double() - ref64).abs().max().item() for r in _evaluations(ref_lp))
    return k * base + ulps * torch.finfo(dtype).eps * scale


def assert_fa_close(ours: Tensor, ref64: Tensor, ref_lp: Tensor | Sequence[Tensor], *, grad: bool = False,
                    ulps: float = 4.0, name: str = "output", floor_dtype: torch.dtype | None = None) -> None:
    """Assert the FlashAttention rule (k = 3 if ``grad`` else 2). Shapes must match exactly; ``ref_lp``
    is one low-precision evaluation or several.
    ``floor_dtype``: the dtype whose ulps make the floor (default: ``ours.dtype``). Give the input
    dtype when a kernel returns a wider dtype than the low-precision reference: that reference is
    rounded to its own dtype, so its error is anywhere in [0, ulp/2] by luck and k × it alone is
    no yardstick."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}"
    if ours.numel() == 0:
        return
    ours64 = ours.detach().double().cpu()
    ref64 = ref64.detach().double().cpu()
    ref_lp = [r.detach().cpu() for r in _evaluations(ref_lp)]
    assert not torch.isnan(ours64).any(), f"{name}: {int(torch.isnan(ours64).sum())} NaN values (unwritten or bad math)"
    tol = fa_tolerance(ref64, ref_lp, floor_dtype or ours.dtype, K_GRAD if grad else K_OUTPUT, ulps)
    err = (ours64 - ref64).abs()
    worst = err.max().item()
    if worst > tol:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(f"{name}: max error {worst:.3e} at {idx} (ours {ours64[idx].item():.6g}, "
                             f"ref {ref64[idx].item():.6g}) exceeds tolerance {tol:.3e} "
                             f"({ours.dtype}, {'grad' if grad else 'output'} rule)")
