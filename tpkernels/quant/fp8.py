"""FP8 casts and the scaling recipes of FP8 training (TransformerEngine's and torchao's).

    state = ScaleState("delayed", "e4m3", history=16, reduction="max", group=tp_group)
    x8, scale = state.cast(x)           # x8: float8_e4m3fn, x ≈ x8 / scale; stats counted
    y = fp8_gemm(x8, scale_x, w8, scale_w, torch.bfloat16)   # x · wᵀ with the scales undone

Formats: E4M3 (``float8_e4m3fn``, max 448, smallest subnormal 2⁻⁹) for weights and activations,
E5M2 (``float8_e5m2``, max 57344, smallest subnormal 2⁻¹⁶) for gradients; a recipe may put
gradients in E4M3 too (``grad_format``).

A cast is ``q = cast(clamp(x · scale, ±max))``: values beyond the format's range *saturate* to
±max (counted), nonzero values below half the smallest subnormal *underflow* to 0 (counted), NaN
and ±inf are refused by name (a NaN would reach every rank's scale through the amax reduction; on a
GPU at the step's end, from the counted amax, not per cast: that check would sync the host).
The scale maps the amax to the format's max: ``scale = max / amax / 2^margin`` (amax 0 or a
scale that would overflow fp32: scale 1).

Recipes (where the amax comes from):
  current   this tensor's amax (one reduction, before the cast): never saturates.
  delayed   the reduction (``max`` or ``most_recent``) of the amax history of the previous
            ``history`` casts of this tensor role (TransformerEngine's default: max over 1024;
            ours 16); this cast's amax is then pushed. The first cast, with an empty history,
            uses its own amax (TransformerEngine starts from scale 1 instead, which saturates
            any tensor whose amax exceeds 448 at the first step). It saves the amax pass
            before the cast on GPUs, at the price of saturating when a tensor grows.
  rowwise   one scale per row (``(rows, 1)``, from each row's amax; torchao's rowwise recipe):
            a GEMM operand is quantised along its rows, the non-contracted dimension, so the
            scales factor out of the dot products.

Tensor parallelism: a tensor sharded over TP (a weight shard, an SP activation shard) has its
amax (or its row amaxes, where a row spans ranks) MAX-reduced over ``group`` before the scale
is taken, so every rank casts with the same scale.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
RECIPES = ("current", "delayed", "rowwise")
REDUCTIONS = ("max", "most_recent")


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
    """fp32 scale(s) mapping ``amax`` to the format's max (elementwise for rowwise amaxes)."""
    amax = amax.float()
    scale = fp8_max(fmt) / (amax * 2.0 ** margin)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


@dataclass
class CastStats:
    """Counts of one or more casts: ``numel`` values (host int), ``saturated`` beyond the range,
    ``underflow`` nonzero values cast to 0, ``amax`` the largest |value| seen. The last three stay
    device tensors (0-d) until read: counting never syncs the host."""

    numel: int = 0
    saturated: Tensor | float = 0.0
    underflow: Tensor | float = 0.0
    amax: Tensor | float = 0.0

    def add(self, other: "CastStats") -> None:
        self.numel += other.numel
        self.saturated = self.saturated + other.saturated
        self.underflow = self.underflow + other.underflow
        self.amax = torch.maximum(torch.as_tensor(self.amax), torch.as_tensor(other.amax)) \
            if isinstance(self.amax, Tensor) or isinstance(other.amax, Tensor) else max(self.amax, other.amax)


def _check_finite(x: Tensor, name: str) -> None:
    """NaN / inf refused by name at once on the CPU; on a GPU the check would sync every cast, so a
    non-finite value shows in the counted amax instead, read once per step (the trainer names the layer)."""
    if x.device.type == "cuda":
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or infinite values: it has no FP8 code (and its amax would reach every "
                         "rank's scale); the step before produced them")


def cast_to_fp8(x: Tensor, scale: Tensor, fmt: str, *, name: str = "x", stats: CastStats | None = None,
                check: bool = True) -> Tensor:
    """``x`` (any float) · ``scale`` (a scalar or a (rows, 1) tensor), saturated to the range, in ``fmt``;
    adds the counts to ``stats`` when given."""
    if check:
        _check_finite(x, name)
    top = fp8_max(fmt)
    scaled = x.float() * scale
    q = scaled.clamp(-top, top).to(fp8_dtype(fmt))
    if stats is not None:
        # beyond the range by more than the fp32 rounding of max / amax (an amax value lands on max ± 1 ulp)
        stats.add(CastStats(x.numel(), (scaled.abs() > top * (1 + 2.0 ** -20)).sum().float(),
                            ((x != 0) & (q.float() == 0)).sum().float(),
                            x.detach().abs().max().float() if x.numel() else 0.0))
    return q


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``q`` stands for: q / scale, in ``dtype``."""
    return (q.float() / scale).to(dtype)


def _amax(x: Tensor, rowwise: bool, group, reduce_rows: bool) -> Tensor:
    a = x.detach().abs().float()
    a = a.reshape(-1, x.shape[-1]).amax(1, keepdim=True) if rowwise else a.amax()
    if (reduce_rows or not rowwise) and group_size(group) > 1:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def group_size(group) -> int:
    """Ranks in ``group`` (None: the default group; 1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class ScaleState:
    """The scale of one tensor role (a layer's input, weight or output gradient) under a recipe.

    recipe: current | delayed | rowwise; fmt: e4m3 | e5m2; history / reduction: delayed's window
    and how it is reduced; margin: powers of two of headroom; group: the TP group whose shards
    share the scale (None: this tensor is whole on this rank); rows_span_group: rowwise rows are
    split over ``group`` (a row-parallel shard's rows), so row amaxes are reduced too.
    """

    def __init__(self, recipe: str, fmt: str, *, history: int = 16, reduction: str = "max", margin: int = 0,
                 group=None, rows_span_group: bool = False):
        if recipe not in RECIPES:
            raise ValueError(f"fp8.recipe ({recipe!r}) must be one of {', '.join(RECIPES)}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"fp8.amax_reduction ({reduction!r}) must be one of {', '.join(REDUCTIONS)}")
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"fp8.history ({history!r}) must be a positive integer")
        fp8_dtype(fmt)
        self.recipe, self.fmt, self.reduction, self.margin = recipe, fmt, reduction, margin
        self.group, self.rows_span_group = group, rows_span_group
        self.history: deque[Tensor] = deque(maxlen=history)
        self.stats = CastStats()
        self.counting = True  # saturation / underflow counts (the guardrail's input): two extra passes

    def scale_for(self, x: Tensor) -> Tensor:
        """The scale this cast of ``x`` uses (delayed: pushes x's amax after taking it)."""
        if self.recipe == "rowwise":
            return scale_from_amax(_amax(x, True, self.group, self.rows_span_group), self.fmt, self.margin)
        amax = _amax(x, False, self.group, False)
        if self.recipe == "current":
            return scale_from_amax(amax, self.fmt, self.margin)
        if self.history:
            past = torch.stack(list(self.history))
            use = past.max() if self.reduction == "max" else past[-1]
        else:
            use = amax  # no history yet: this tensor's own amax (module docstring)
        self.history.append(amax)
        return scale_from_amax(use, self.fmt, self.margin)

    def cast(self, x: Tensor, name: str = "x") -> tuple[Tensor, Tensor]:
        """(fp8 tensor, its scale); a rowwise scale has shape (rows, 1) over x's rows (x.reshape(-1, K))."""
        _check_finite(x, name)
        scale = self.scale_for(x)
        if self.recipe == "rowwise":
            q = cast_to_fp8(x.reshape(-1, x.shape[-1]), scale, self.fmt, name=name, stats=self.live_stats, check=False)
            return q.view(x.shape), scale
        return cast_to_fp8(x, scale, self.fmt, name=name, stats=self.live_stats, check=False), scale

    @property
    def live_stats(self) -> CastStats | None:
        """Where casts count (None when counting is off)."""
        return self.stats if self.counting else None

    def take_stats(self) -> CastStats:
        s, self.stats = self.stats, CastStats()
        return s


def fp8_gemm(a8: Tensor, scale_a: Tensor, b8: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a · bᵀ with the scales undone: a8 (M, K), b8 (N, K) FP8, row-major in K; scale_a / scale_b the
    quantisation scales (scalars, or (M, 1) and (N, 1) rowwise). Returns (M, N) ``out_dtype``,
    accumulated in fp32 (``torch._scaled_mm``: cuBLASLt on Hopper, a reference loop on CPUs)."""
    if a8.shape[-1] != b8.shape[-1]:
        raise ValueError(f"fp8_gemm: a ({tuple(a8.shape)}) and b ({tuple(b8.shape)}) must share K")
    sa, sb = (1.0 / scale_a).float(), (1.0 / scale_b).float()
    if sb.dim() == 2:  # rowwise: b's row scales become the output's column scales
        sb = sb.reshape(1, -1)
    return torch._scaled_mm(a8.contiguous(), b8.contiguous().t(), sa, sb, out_dtype=out_dtype)


__all__ = ["group_size", "CastStats", "FORMATS", "RECIPES", "REDUCTIONS", "ScaleState", "cast_to_fp8", "dequantize_fp8", "fp8_dtype",
           "fp8_gemm", "fp8_max", "fp8_tiny", "scale_from_amax"]
