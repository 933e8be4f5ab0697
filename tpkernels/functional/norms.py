"""The norms of pre-norm Transformers, fused with the residual add that every layer does twice.

RMSNorm (Llama family):
    y = rms_norm(x, weight, eps)                  y = x · rsqrt(mean(x²) + eps) · weight
    y, h = rms_norm(x, weight, eps, residual=r)   h = x + r (the residual stream), y = rms_norm(h)
LayerNorm (GPT-2 family):
    y = layer_norm(x, weight, bias, eps)          y = (x − mean(x)) · rsqrt(var(x) + eps) · weight + bias
    y, h = layer_norm(x, weight, bias, eps, residual=r)

Layers, top to bottom (the same for both norms):
    rms_norm() / layer_norm()  public functions: validate, call the op (autograd-aware)
    torch.ops.tpkernels.{rms_norm,layer_norm}_{forward,backward}
                               torch.library custom ops with fake impls (torch.compile traces them as
                               opaque calls) and registered autograd
    kernels                    triton (kernels/triton/rms_norm.py, layer_norm.py), cpp (tpkernels._C:
                               csrc/llama/, csrc/layer_norm/), reference (kernels/reference.py)

Memory: the forward saves h (x itself without a residual: no copy), the weight and the statistics:
rstd (RMSNorm) or mean and rstd (LayerNorm), one fp32 each per row; never the normalised output,
which the backward recomputes. The statistics are fp32 (fp64 for fp64 inputs). dweight (and dbias)
are reduced in two levels without atomics (per-program fp32 rows, then one fixed-order sum):
deterministic, on the CPU also across thread counts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from tpkernels.conventions import rows
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.kernels import reference

OP = "rms_norm"
LN_OP = "layer_norm"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None, n: int | None = None) -> str | None:
    if impl != "triton":
        return None
    # both norms' Triton kernels hold whole rows in the same tiles
    from tpkernels.kernels.triton.rms_norm import MAX_N  # noqa: PLC0415  (only when Triton is a candidate)

    if n is not None and n > MAX_N:
        return f"the Triton kernel holds whole rows of at most {MAX_N} elements, got rows of {n}"
    return backends.triton_dtype_limits(device, dtype)


backends.register_op(OP, ("triton", "cpp", "reference"), check=_impl_limits)
backends.register_op(LN_OP, ("triton", "cpp", "reference"), check=_impl_limits)


def _check(x: Tensor, eps: float, residual: Tensor | None, **params: Tensor) -> None:
    """x (..., hidden) float; each parameter in ``params`` (hidden,) like x (the caller leaves out the
    optional ones it was not given); eps finite >= 0; residual like x. Errors name the argument, its
    value and the rule."""
    named = {"x": x, **params}
    if not all(isinstance(v, Tensor) for v in named.values()):
        raise TypeError(f"{' and '.join(named)} must be tensors, got "
                        f"{' and '.join(type(v).__name__ for v in named.values())}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"x dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be (..., hidden) with hidden >= 1, got shape {tuple(x.shape)}")
    for name, p in named.items():
        if name == "x":
            continue
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise ValueError(f"{name} shape {tuple(p.shape)} must be ({x.shape[-1]},), the last dim of x")
        if p.dtype != x.dtype or p.device != x.device:
            raise ValueError(f"{name} ({p.dtype}, {p.device}) must match x ({x.dtype}, {x.device})")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps ({eps!r}) must be a finite number >= 0")
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.shape != x.shape or residual.dtype != x.dtype or \
                residual.device != x.device:
            got = (f"{residual.dtype} {tuple(residual.shape)} on {residual.device}" if isinstance(residual, Tensor)
                   else type(residual).__name__)
            raise ValueError(f"residual ({got}) must be a tensor like x ({x.dtype} {tuple(x.shape)} on {x.device})")



def _select(x: Tensor, backend: str | None, op: str = OP) -> str:
    return backends.select(op, x.device, backend, dtype=x.dtype, n=x.shape[-1])


def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *,
                 backend: str | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Forward launcher (no autograd). x, residual: (..., n); weight (n,) -> (y like x, h like x or
    None, rstd (rows,) fp32 (fp64 for fp64))."""
    shape, n = x.shape, x.shape[-1]
    x2, r2 = rows(x), None if residual is None else rows(residual)
    name = _select(x, backend)
    if name == "triton":
        from tpkernels.kernels.triton import rms_norm as tk  # noqa: PLC0415  (triton import is slow)

        y, h, rstd = tk.rms_norm_fwd(x2, weight.contiguous(), float(eps), r2)
    elif name == "cpp":
        y, h, rstd = extension().rms_norm_fwd_cpu(x2, weight.contiguous(), float(eps), r2)
    else:
        y, h, rstd = reference.rms_norm_fwd(x2, weight, float(eps), r2)
    return y.view(shape), (None if h is None else h.view(shape)), rstd


def rms_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None = None, *,
                 backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Backward launcher: dy, h, dh (..., n); rstd (rows,) -> (dx like h, dweight (n,))."""
    shape = h.shape
    if h.numel() == 0:  # no rows: autograd's dy may be a zero-stride view the kernels refuse
        return torch.zeros_like(h), torch.zeros_like(weight)
    args = (rows(dy), rows(h), weight.contiguous(), rstd.contiguous(), None if dh is None else rows(dh))
    name = _select(h, backend)
    if name == "triton":
        from tpkernels.kernels.triton import rms_norm as tk  # noqa: PLC0415

        dx, dw = tk.rms_norm_bwd(*args)
    elif name == "cpp":
        dx, dw = extension().rms_norm_bwd_cpu(*args)
    else:
        dx, dw = reference.rms_norm_bwd(*args)
    return dx.view(shape), dw


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----
# `backend` is "" for the dispatch rule, else a backend name. h is an empty tensor without a residual.

def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("tpkernels::rms_norm_forward", mutates_args=())
def _forward_op(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps: float,
                backend: str) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = rms_norm_fwd(x, weight, eps, residual, backend=backend or None)
    return y, (x.new_empty(0) if h is None else h), rstd


@_forward_op.register_fake
def _(x, weight, residual, eps, backend):
    rows = math.prod(x.shape[:-1])
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=_stat_dtype(x.dtype))


@torch.library.custom_op("tpkernels::rms_norm_backward", mutates_args=())
def _backward_op(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Optional[Tensor],
                 backend: str) -> tuple[Tensor, Tensor]:
    return rms_norm_bwd(dy, h, weight, rstd, dh, backend=backend or None)


@_backward_op.register_fake
def _(dy, h, weight, rstd, dh, backend):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, backend = inputs
    _, h, rstd = output
    ctx.has_residual, ctx.backend = residual is not None, backend
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw = _backward_op(dy.contiguous(), h, weight, rstd, dh if ctx.has_residual else None, ctx.backend)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw if need[1] else None, dx if ctx.has_residual and need[2] else None,
            None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
             backend: str | None = None):
    """RMSNorm as Llama/Qwen/Mistral define it, with autograd, optionally fused with the residual add.

    Args:
        x: (..., hidden), float32 / float16 / bfloat16 (float64 on the CPU paths); any strides (a copy
           only when the last dim is not unit-stride).
        weight: (hidden,), the same dtype and device as x.
        eps: added to the mean square (Llama: 1e-5 or 1e-6, from the model's ``rms_norm_eps``).
        residual: (..., hidden) like x, or None. Given, the function computes h = x + residual (in
           x's dtype, as the unfused code stores it) and normalises h.
        backend: "triton", "cpp" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        y = h · rsqrt(mean(h²) + eps) · weight, (..., hidden), contiguous, dtype of x; with a
        residual, (y, h): h is the residual stream the next layer adds to. Gradients flow into
        both; x and residual get the same gradient.
    """
    _check(x, eps, residual, weight=weight)
    y, h, _ = _forward_op(x, weight, residual, float(eps), backend or "")
    return y if residual is None else (y, h)


# ---- LayerNorm (GPT-2 family) ----

def _ones_if_none(weight: Tensor | None, like: Tensor) -> Tensor:
    """No weight (torch's ``elementwise_affine=False``): the kernels multiply by ones (n elements, read
    from cache) rather than carry a variant of their own; the dweight they compute is dropped."""
    return like.new_ones(like.shape[-1]) if weight is None else weight.contiguous()


def layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, residual: Tensor | None = None,
                   *, backend: str | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Forward launcher (no autograd). x, residual: (..., n); weight, bias (n,) or None -> (y like x,
    h like x or None, mean (rows,), rstd (rows,)), the statistics fp32 (fp64 for fp64)."""
    shape = x.shape
    x2, r2 = rows(x), None if residual is None else rows(residual)
    w, b = _ones_if_none(weight, x), None if bias is None else bias.contiguous()
    name = _select(x, backend, LN_OP)
    if name == "triton":
        from tpkernels.kernels.triton import layer_norm as tk  # noqa: PLC0415  (triton import is slow)

        y, h, mean, rstd = tk.layer_norm_fwd(x2, w, b, float(eps), r2)
    elif name == "cpp":
        y, h, mean, rstd = extension().layer_norm_fwd_cpu(x2, w, b, float(eps), r2)
    else:
        y, h, mean, rstd = reference.layer_norm_fwd(x2, w, b, float(eps), r2)
    return y.view(shape), (None if h is None else h.view(shape)), mean, rstd


def layer_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, dh: Tensor | None = None,
                   *, backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Backward launcher: dy, h, dh (..., n); mean, rstd (rows,) -> (dx like h, dweight (n,), dbias (n,)),
    dweight and dbias in the dtype of h (dweight of the ones when weight is None)."""
    shape = h.shape
    w = _ones_if_none(weight, h)
    if h.numel() == 0:  # no rows: autograd's dy may be a zero-stride view the kernels refuse
        return torch.zeros_like(h), torch.zeros_like(w), torch.zeros_like(w)
    args = (rows(dy), rows(h), w, mean.contiguous(), rstd.contiguous(), None if dh is None else rows(dh))
    name = _select(h, backend, LN_OP)
    if name == "triton":
        from tpkernels.kernels.triton import layer_norm as tk  # noqa: PLC0415

        dx, dw, db = tk.layer_norm_bwd(*args)
    elif name == "cpp":
        dx, dw, db = extension().layer_norm_bwd_cpu(*args)
    else:
        dx, dw, db = reference.layer_norm_bwd(*args)
    return dx.view(shape), dw, db


@torch.library.custom_op("tpkernels::layer_norm_forward", mutates_args=())
def _ln_forward_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
                   backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, h, mean, rstd = layer_norm_fwd(x, weight, bias, eps, residual, backend=backend or None)
    return y, (x.new_empty(0) if h is None else h), mean, rstd


@_ln_forward_op.register_fake
def _(x, weight, bias, residual, eps, backend):
    rows = math.prod(x.shape[:-1])
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    stat = _stat_dtype(x.dtype)
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=stat), x.new_empty((rows,), dtype=stat)


@torch.library.custom_op("tpkernels::layer_norm_backward", mutates_args=())
def _ln_backward_op(dy: Tensor, h: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor, dh: Optional[Tensor],
                    backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return layer_norm_bwd(dy, h, weight, mean, rstd, dh, backend=backend or None)


@_ln_backward_op.register_fake
def _(dy, h, weight, mean, rstd, dh, backend):
    return h.new_empty(h.shape), h.new_empty(h.shape[-1:]), h.new_empty(h.shape[-1:])


def _ln_setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, backend = inputs
    _, h, mean, rstd = output
    ctx.has_residual, ctx.backend = residual is not None, backend
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)


def _ln_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw, db = _ln_backward_op(dy.contiguous(), h, weight, mean, rstd, dh if ctx.has_residual else None,
                                 ctx.backend)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
            dx if ctx.has_residual and need[3] else None, None, None)


_ln_forward_op.register_autograd(_ln_backward, setup_context=_ln_setup_context)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
               residual: Tensor | None = None, backend: str | None = None):
    """LayerNorm over the last dim as ``torch.nn.LayerNorm`` (GPT-2's ``ln_1`` / ``ln_2`` / ``ln_f``)
    computes it, with autograd, optionally fused with the residual add.

    Args:
        x: (..., hidden), float32 / float16 / bfloat16 (float64 on the CPU paths); any strides (a copy
           only when the last dim is not unit-stride).
        weight: (hidden,) or None (``elementwise_affine=False``: no scale), the dtype and device of x.
        bias: (hidden,) or None, like weight.
        eps: added to the variance (GPT-2: ``layer_norm_epsilon`` = 1e-5).
        residual: (..., hidden) like x, or None. Given, the function computes h = x + residual (in
           x's dtype, as the unfused code stores it) and normalises h.
        backend: "triton", "cpp" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        y = (h − mean(h)) · rsqrt(var(h) + eps) · weight + bias, the biased variance over the last
        dim, statistics in fp32 (fp64 for fp64); (..., hidden), contiguous, dtype of x. With a
        residual, (y, h): h is the residual stream the next layer adds to. Gradients flow into all
        of them; x and residual get the same gradient.
    """
    _check(x, eps, residual, **{k: v for k, v in (("weight", weight), ("bias", bias)) if v is not None})
    y, h, _, _ = _ln_forward_op(x, weight, bias, residual, float(eps), backend or "")
    return y if residual is None else (y, h)


__all__ = ["layer_norm", "layer_norm_bwd", "layer_norm_fwd", "rms_norm", "rms_norm_bwd", "rms_norm_fwd"]
