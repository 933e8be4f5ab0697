"""FP8 casts: formats, scales, the saturating cast with its counts, and the scaled GEMM.

    scale = scale_from_amax(x.abs().amax(), "e4m3")   # fp32: fp8_max / (amax · 2^margin), correctly rounded
    x8 = cast_to_fp8(x, scale, "e4m3")                 # float8_e4m3fn, x ≈ x8 / scale
    y = fp8_gemm(x8, scale, w8, scale_w, torch.bfloat16)   # x · wᵀ with the scales undone

Formats: E4M3 (``float8_e4m3fn``, max 448, smallest subnormal 2⁻⁹) for weights and activations,
E5M2 (``float8_e5m2``, max 57344, smallest subnormal 2⁻¹⁶) for gradients; a recipe may put
gradients in E4M3 too (``grad_format``).

A cast is ``q = cast(clamp(x · scale, ±max))``: values beyond the format's range *saturate* to
±max (counted), nonzero values below half the smallest subnormal *underflow* to 0 (counted), NaN
and ±inf are refused by name (a NaN would reach every rank's scale through the amax reduction; on a
GPU at the step's end, from the counted amax, not per cast: that check would sync the host).
The scale maps the amax to the format's max, ``fp8_max / (amax · 2^margin)``, divided in fp32 (IEEE
division: correctly rounded, as TransformerEngine computes it; ``max * amax.reciprocal()`` is one
ulp off for about a quarter of amaxes); amax 0 or a scale that would overflow fp32: scale 1.

Which amax a cast uses (the recipes, their history, the TP agreement) is run state: it lives in
:mod:`tpkernels.quant.fp8_state`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format ({fmt!r}) must be one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(fp8_dtype(fmt)).max)


def fp8_tiny(fmt: str) -> float:
    """The smallest positive subnormal of ``fmt`` (2⁻⁹ for E4M3, 2⁻¹⁶ for E5M2)."""
    return float(torch.finfo(fp8_dtype(fmt)).smallest_normal) / (8 if fmt == "e4m3" else 4)


def scale_from_amax(amax: Tensor, fmt: str, margin: int = 0) -> Tensor:
    """fp32 scale(s) mapping ``amax`` to the format's max (elementwise for rowwise amaxes): the correctly
    rounded fp32 quotient ``fp8_max / (amax · 2^margin)`` (2^margin is exact, so one rounding)."""
    amax = amax.float()
    scale = torch.full_like(amax, fp8_max(fmt)).div_(amax * 2.0 ** margin)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def check_finite(x: Tensor, name: str) -> None:
    """NaN / inf refused by name at once on the CPU; on a GPU the check would sync every cast, so a
    non-finite value shows in the counted amax instead, read once per step (the trainer names the layer)."""
    if x.device.type == "cuda":
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or infinite values: it has no FP8 code (and its amax would reach every "
                         "rank's scale); the step before produced them")


def cast_to_fp8(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    """``x`` (any float) · ``scale`` (a scalar or a (rows, 1) tensor), saturated to the range, in ``fmt``."""
    top = fp8_max(fmt)
    return (x.float() * scale).clamp(-top, top).to(fp8_dtype(fmt))


def cast_counts(x: Tensor, scale: Tensor, q: Tensor, fmt: str) -> Tensor:
    """(saturated, underflowed) counts of the cast ``q`` of ``x`` at ``scale``, a float64 device tensor (2,):
    beyond the range by more than the fp32 rounding of max / amax (an amax value lands on max ± 1 ulp), and
    nonzero values cast to 0. Two passes over ``x``; no host read."""
    top = fp8_max(fmt)
    sat = ((x.float() * scale).abs() > top * (1 + 2.0 ** -20)).sum()
    under = ((x != 0) & (q.float() == 0)).sum()
    return torch.stack([sat, under]).double()


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``q`` stands for: q / scale, in ``dtype``."""
    return (q.float() / scale).to(dtype)


def fp8_gemm(a8: Tensor, scale_a: Tensor, b8: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a · bᵀ with the scales undone: a8 (M, K), b8 (N, K) FP8, row-major in K; scale_a / scale_b the
    quantisation scales (scalars, or (M, 1) and (N, 1) rowwise). Returns (M, N) ``out_dtype``,
    accumulated in fp32 (``torch._scaled_mm``: cuBLASLt on Hopper, a reference loop on CPUs)."""
    if a8.shape[-1] != b8.shape[-1]:
        raise ValueError(f"fp8_gemm: a ({tuple(a8.shape)}) and b ({tuple(b8.shape)}) must share K")
    sa, sb = (1.0 / scale_a).float(), (1.0 / scale_b).float()
    if sb.dim() == 2:  # rowwise: b's row scales become the output's column scales
        sb = sb.reshape(1, -1)
    a8, b8 = a8.contiguous(), b8.contiguous()
    if (sa.numel() > 1 or sb.numel() > 1) and a8.device.type == "cpu" and not _cpu_takes_row_scales():
        # the scales factor out of every dot product: unit scales in the GEMM, undone on its fp32 output
        one = torch.ones((), dtype=torch.float32)
        y = torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.float32)
        return (y * sa * sb).to(out_dtype)
    return torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes per-row scales (2.14 does; 2.11's oneDNN path only takes
    per-tensor ones)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


__all__ = ["FORMATS", "cast_counts", "cast_to_fp8", "check_finite", "dequantize_fp8", "fp8_dtype", "fp8_gemm",
           "fp8_max", "fp8_tiny", "scale_from_amax"]
