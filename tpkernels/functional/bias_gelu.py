"""Fused bias + GeLU: ``y = gelu(x + bias)``, forward and backward, on every backend.

Layers, top to bottom:
    bias_gelu()                 public function: validates, calls the op (autograd-aware)
    torch.ops.tpkernels.bias_gelu / bias_gelu_backward
                                torch.library custom ops with fake impls (torch.compile traces
                                them as opaque calls) and registered autograd
    bias_gelu_fwd/bias_gelu_bwd launchers: flatten to (rows, cols), pick a backend, run it
    kernels                     cpp / cuda (tpkernels._C), triton, reference

Backward saves ``x`` and ``bias`` (not the output) and recomputes ``x + bias`` in the kernel:
one activation of memory, as eager saves ``x + bias``. grad_bias is reduced over all leading
dims in two levels: per-program partial sums in fp32 inside the kernel, then one small pass over
the (programs, cols) partials; no atomics, so results are deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels.conventions import rows
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.kernels import reference

OP = "bias_gelu"
APPROXIMATIONS = ("none", "tanh")
def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    if impl == "cuda" and dtype == torch.float64:
        return f"the cuda kernels take float32, float16 and bfloat16, got {dtype}"
    if impl == "triton":
        return backends.triton_dtype_limits(device, dtype)
    return None


backends.register_op(OP, ("cuda", "triton", "cpp", "reference"), check=_impl_limits)


def _check(x: Tensor, bias: Tensor, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate ({approximate!r}) must be 'none' or 'tanh'")
    if not isinstance(x, Tensor) or not isinstance(bias, Tensor):
        raise TypeError(f"x and bias must be tensors, got {type(x).__name__} and {type(bias).__name__}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim (..., features), got a {x.dim()}-D tensor")
    if bias.dim() != 1:
        raise ValueError(f"bias must be 1-D (features,), got shape {tuple(bias.shape)}")
    if bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias.shape[0] ({bias.shape[0]}) must equal x.shape[-1] ({x.shape[-1]})")
    if x.dtype != bias.dtype:
        raise TypeError(f"bias dtype ({bias.dtype}) must equal x dtype ({x.dtype})")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"x dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")
    if x.device != bias.device:
        raise ValueError(f"bias device ({bias.device}) must equal x device ({x.device})")



def _launchers(backend: str):
    if backend == "cpp":
        ext = extension()
        return (lambda x, b, a, out: ext.bias_gelu_fwd_cpu(x, b, a == "tanh", out),
                lambda g, x, b, a, dx, db: ext.bias_gelu_bwd_cpu(g, x, b, a == "tanh", dx, db))
    if backend == "cuda":
        ext = extension()
        return (lambda x, b, a, out: ext.bias_gelu_fwd_cuda(x, b, a == "tanh", out),
                lambda g, x, b, a, dx, db: ext.bias_gelu_bwd_cuda(g, x, b, a == "tanh", dx, db))
    if backend == "triton":
        from tpkernels.kernels.triton import bias_gelu as tk  # noqa: PLC0415  (triton import is slow)

        return tk.bias_gelu_fwd, tk.bias_gelu_bwd

    def ref_fwd(x, b, a, out):
        y = reference.bias_gelu_fwd(x, b, a)
        return y if out is None else out.copy_(y)

    def ref_bwd(g, x, b, a, dx_out, db_out):
        dx, db = reference.bias_gelu_bwd(g, x, b, a)
        return (dx if dx_out is None else dx_out.copy_(dx)), (db if db_out is None else db_out.copy_(db))

    return ref_fwd, ref_bwd


def bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str = "none", *, backend: str | None = None,
                  out: Tensor | None = None) -> Tensor:
    """Forward launcher (no autograd). x: (..., n), bias: (n,) -> y: (..., n), contiguous.

    ``backend`` overrides the dispatch rule of :mod:`tpkernels.backends`; ``out`` (contiguous,
    shape of x) receives the result.
    """
    _check(x, bias, approximate)
    n = x.shape[-1]
    fwd, _ = _launchers(backends.select(OP, x.device, backend, dtype=x.dtype))
    if x.numel() == 0:  # no rows or no features: nothing to launch (and (-1, 0) cannot be reshaped)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    out2 = None if out is None else out.view(-1, n)
    return fwd(rows(x), bias.contiguous(), approximate, out2).view(x.shape)


def bias_gelu_bwd(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none", *,
                  backend: str | None = None, grad_x_out: Tensor | None = None,
                  grad_bias_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Backward launcher. grad, x: (..., n), bias: (n,) -> (grad_x (..., n), grad_bias (n,))."""
    _check(x, bias, approximate)
    if grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device:
        raise ValueError(f"grad ({tuple(grad.shape)}, {grad.dtype}, {grad.device}) must match x "
                         f"({tuple(x.shape)}, {x.dtype}, {x.device})")
    n = x.shape[-1]
    _, bwd = _launchers(backends.select(OP, x.device, backend, dtype=x.dtype))
    if x.numel() == 0:  # the bias saw no rows: its gradient is 0
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if grad_x_out is None else grad_x_out
        db = torch.zeros_like(bias) if grad_bias_out is None else grad_bias_out.zero_()
        return dx, db
    dx_out2 = None if grad_x_out is None else grad_x_out.view(-1, n)
    dx, db = bwd(rows(grad), rows(x), bias.contiguous(), approximate, dx_out2, grad_bias_out)
    return dx.view(x.shape), db


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----

# `backend` is "" for the dispatch rule, else a backend name (a str: op schemas take no None).

@torch.library.custom_op("tpkernels::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: Tensor, approximate: str, backend: str) -> Tensor:
    return bias_gelu_fwd(x, bias, approximate, backend=backend or None)


@_bias_gelu_op.register_fake
def _(x: Tensor, bias: Tensor, approximate: str, backend: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpkernels::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(grad: Tensor, x: Tensor, bias: Tensor, approximate: str,
                           backend: str) -> tuple[Tensor, Tensor]:
    return bias_gelu_bwd(grad, x, bias, approximate, backend=backend or None)


@_bias_gelu_backward_op.register_fake
def _(grad: Tensor, x: Tensor, bias: Tensor, approximate: str, backend: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, bias, approximate, backend = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate, ctx.backend = approximate, backend


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None, None, None, None
    dx, db = _bias_gelu_backward_op(grad.contiguous(), x, bias, ctx.approximate, ctx.backend)
    return (dx if ctx.needs_input_grad[0] else None), (db if ctx.needs_input_grad[1] else None), None, None


_bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none", *, backend: str | None = None) -> Tensor:
    """Fused ``gelu(x + bias)`` with autograd.

    Args:
        x: (..., features), float32 / float16 / bfloat16 (float64 on the CPU paths); any
           strides (non-contiguous inputs are handled; a copy is made only when the last dim
           is not unit-stride after flattening).
        bias: (features,), same dtype and device as ``x``.
        approximate: ``"none"`` (exact, erf) or ``"tanh"`` (GPT-2 / Megatron approximation),
           as in :func:`torch.nn.functional.gelu`.

    Returns:
        (..., features), contiguous, dtype of ``x``. Math is fp32 (fp64 for fp64 inputs).

        backend: ``"cuda"``, ``"triton"``, ``"cpp"`` or ``"reference"`` to pick a kernel for
           this call (forward and backward); by default :mod:`tpkernels.backends` decides
           (``TPKERNELS_BACKEND`` forces one globally).
    """
    _check(x, bias, approximate)
    return _bias_gelu_op(x, bias, approximate, backend or "")
