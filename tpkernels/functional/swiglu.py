"""SwiGLU, the gated MLP activation of the Llama family: y = silu(gate) · up.

    y = swiglu(gate, up)       gate, up: (..., ffn)
    y = swiglu(gate_up)        gate_up: (..., 2·ffn) = [gate | up], the output of one fused gate+up
                               GEMM (how a column-parallel gate+up layer hands it over), split in
                               the kernel: no copy of either half

Forward and backward are one pass each: the backward reads dy, gate and up and writes dgate and
dup (into one [dgate | dup] gradient for the fused input). Nothing is saved but the inputs (eager
PyTorch also saves silu(gate)). Math in fp32 (fp64 for fp64).

Layers: swiglu() → torch.ops.tpkernels.swiglu_forward / swiglu_backward (custom ops with fake
impls and autograd) → kernels: triton (kernels/triton/swiglu.py), cpp (tpkernels._C), reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tpkernels.conventions import rows
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.kernels import reference

OP = "swiglu"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    return backends.triton_dtype_limits(device, dtype) if impl == "triton" else None


backends.register_op(OP, ("triton", "cpp", "reference"), check=_impl_limits)


def _check(gate: Tensor, up: Tensor | None) -> None:
    if not isinstance(gate, Tensor):
        raise TypeError(f"gate must be a tensor, got {type(gate).__name__}")
    if gate.dtype not in _FLOAT:
        raise TypeError(f"gate dtype ({gate.dtype}) must be float32, float16, bfloat16 or float64")
    if gate.dim() < 1:
        raise ValueError(f"gate must have at least 1 dim (..., ffn), got a {gate.dim()}-D tensor")
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"gate_up's last dim ({gate.shape[-1]}) must be even: [gate | up] halves")
        return
    if not isinstance(up, Tensor):
        raise TypeError(f"up must be a tensor or None, got {type(up).__name__}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up ({up.dtype} {tuple(up.shape)} on {up.device}) must be like gate "
                         f"({gate.dtype} {tuple(gate.shape)} on {gate.device})")



def _halves(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    """(gate, up) as (rows, f) views; the fused [gate | up] is split in place."""
    if up is None:
        gu = rows(gate)
        f = gu.shape[-1] // 2
        return gu[:, :f], gu[:, f:]
    return rows(gate), rows(up)


def _kernels(name: str):
    if name == "triton":
        from tpkernels.kernels.triton import swiglu as tk  # noqa: PLC0415  (triton import is slow)

        return tk.swiglu_fwd, tk.swiglu_bwd
    if name == "cpp":
        ext = extension()
        return ext.swiglu_fwd_cpu, ext.swiglu_bwd_cpu

    def fwd(g, u, out):
        return out.copy_(reference.swiglu_fwd(g, u))

    def bwd(dy, g, u, dg, du):
        a, b = reference.swiglu_bwd(dy, g, u)
        return dg.copy_(a), du.copy_(b)

    return fwd, bwd


def swiglu_fwd(gate: Tensor, up: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """Forward launcher (no autograd): (..., f) [and (..., f)], or (..., 2f) fused -> (..., f)."""
    g, u = _halves(gate, up)
    shape = gate.shape[:-1] + (g.shape[-1],)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    fwd, _ = _kernels(backends.select(OP, gate.device, backend, dtype=gate.dtype))
    fwd(g, u, out)
    return out.view(shape)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor | None = None, *, backend: str | None = None
               ) -> tuple[Tensor, Tensor | None]:
    """Backward launcher -> (dgate, dup), or (d gate_up (..., 2f), None) for the fused input."""
    if gate.numel() == 0:  # no rows: autograd's dy may be a zero-stride view the kernels refuse
        return torch.zeros_like(gate), None if up is None else torch.zeros_like(up)
    g, u = _halves(gate, up)
    dy2 = rows(dy)
    _, bwd = _kernels(backends.select(OP, gate.device, backend, dtype=gate.dtype))
    if up is None:
        dgu = torch.empty((g.shape[0], 2 * g.shape[1]), dtype=gate.dtype, device=gate.device)
        f = g.shape[1]
        bwd(dy2, g, u, dgu[:, :f], dgu[:, f:])
        return dgu.view(gate.shape), None
    dg, du = torch.empty(g.shape, dtype=gate.dtype, device=gate.device), torch.empty_like(g)
    bwd(dy2, g, u, dg, du)
    return dg.view(gate.shape), du.view(up.shape)


# ---- torch.library registration ----

@torch.library.custom_op("tpkernels::swiglu_forward", mutates_args=())
def _forward_op(gate: Tensor, up: Optional[Tensor], backend: str) -> Tensor:
    return swiglu_fwd(gate, up, backend=backend or None)


@_forward_op.register_fake
def _(gate, up, backend):
    f = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    return gate.new_empty(gate.shape[:-1] + (f,))


@torch.library.custom_op("tpkernels::swiglu_backward", mutates_args=())
def _backward_op(dy: Tensor, gate: Tensor, up: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor]:
    dg, du = swiglu_bwd(dy, gate, up, backend=backend or None)
    return dg, (gate.new_empty(0) if du is None else du)


@_backward_op.register_fake
def _(dy, gate, up, backend):
    return gate.new_empty(gate.shape), (up.new_empty(up.shape) if up is not None else gate.new_empty(0))


def _setup_context(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.fused, ctx.backend = up is None, backend
    ctx.save_for_backward(gate, up)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = _backward_op(dy.contiguous(), gate, None if ctx.fused else up, ctx.backend)
    need = ctx.needs_input_grad
    return (dg if need[0] else None), (None if ctx.fused or not need[1] else du), None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """silu(gate) · up with autograd.

    Args:
        gate: (..., ffn); or, with ``up`` None, the fused (..., 2·ffn) = [gate | up].
        up: (..., ffn) like gate, or None.
        backend: "triton", "cpp" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        (..., ffn), contiguous, dtype of gate. float32 / float16 / bfloat16 (float64 on the CPU paths).
    """
    _check(gate, up)
    return _forward_op(gate, up, backend or "")


__all__ = ["swiglu", "swiglu_bwd", "swiglu_fwd"]
