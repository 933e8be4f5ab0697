"""nf4_linear: a linear layer over a frozen NF4 weight (QLoRA's base layer), y = x · Wᵀ (+ bias).

    y = nf4_linear(x, qweight, bias=None)      x (..., K), qweight: NF4Weight of a (N, K) weight

Gradients flow to x (dx = dy · W) and bias, never to the weight: a QLoRA base is frozen, and its
adapters are separate parameters. The weight is never materialised in full precision by the kernels
(the reference backend does: it is the oracle).

Layers, top to bottom:
    nf4_linear()               validate, call the op (autograd-aware)
    torch.ops.tpkernels.nf4_linear_{forward,backward}
                               torch.library custom ops with fake impls (opaque to torch.compile)
                               and registered autograd
    kernels                    triton (kernels/triton/nf4_linear.py: dequantised in registers inside the
                               GEMM, K % 64 == 0), cpp (tpkernels._C: csrc/quant/, panels dequantised into
                               a small buffer, then the ATen GEMM; any shape), reference
                               (kernels/reference.py: dequantise all, then matmul; any shape)

Dispatch: the one rule (tpkernels.backends): ``backend=``, else ``TPKERNELS_BACKEND=nf4_linear=...``,
else triton on CUDA tensors (cuda has no kernel of its own), cpp then reference on CPU tensors.
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
from tpkernels.quant.nf4 import ABSMAX_BLOCK, BLOCK, NF4Weight, dynamic_map, nf4_code

OP = "nf4_linear"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None, k: int | None = None) -> str | None:
    if impl != "triton":
        return None
    if k is not None and k % BLOCK:
        return (f"the Triton kernels take in_features (K) a multiple of {BLOCK} (one NF4 block per row per K "
                f"step), got K = {k}")
    return backends.triton_dtype_limits(device, dtype)


backends.register_op(OP, ("triton", "cpp", "reference"), check=_impl_limits)


def _parts(q: NF4Weight) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return q.packed, q.absmax_q, q.absmax_scale, q.absmax_offset


def _check(x: Tensor, qweight: NF4Weight, bias: Tensor | None) -> None:
    """x (..., K) float; qweight an NF4Weight of a 2-D (N, K) weight on x's device; bias (N,) like x."""
    if not isinstance(qweight, NF4Weight):
        raise TypeError(f"qweight must be an NF4Weight (tpkernels.quant.quantize_nf4), got {type(qweight).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"x dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")
    if len(qweight.shape) != 2:
        raise ValueError(f"qweight must hold a 2-D (out_features, in_features) weight, got shape {qweight.shape}")
    n, k = qweight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x shape {tuple(x.shape)} must end in in_features = {k} (qweight shape {qweight.shape})")
    if qweight.device != x.device:
        raise ValueError(f"qweight is on {qweight.device}, x on {x.device}: they must share a device")
    blocks = -(-n * k // BLOCK)
    want = {"packed": (torch.uint8, (n * k + 1) // 2), "absmax_q": (torch.uint8, blocks),
            "absmax_scale": (torch.float32, -(-blocks // ABSMAX_BLOCK)), "absmax_offset": (torch.float32, 1)}
    for name, t in zip(want, _parts(qweight)):
        dtype, numel = want[name]
        if not isinstance(t, Tensor) or t.dtype != dtype or t.numel() != numel or t.device != x.device:
            got = f"{t.dtype} with {t.numel()} elements on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"qweight.{name} ({got}) must be {dtype} with {numel} elements on {x.device} for a "
                             f"{qweight.shape} NF4 weight: not an NF4Weight from quantize_nf4")
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device:
            got = f"{bias.dtype} {tuple(bias.shape)} on {bias.device}" if isinstance(bias, Tensor) else \
                type(bias).__name__
            raise ValueError(f"bias ({got}) must be ({n},) {x.dtype} on {x.device}")


def _select(t: Tensor, k: int, backend: str | None) -> str:
    return backends.select(OP, t.device, backend, dtype=t.dtype, k=k)



def nf4_linear_fwd(x: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor, n: int,
                   *, backend: str | None = None) -> Tensor:
    """Forward launcher (no autograd, no bias): x (..., K) -> (..., n), x's dtype."""
    k = x.shape[-1]
    # detached: the kernels' worker threads do not inherit the caller's no-grad mode, and ATen's out=
    # GEMMs refuse an input that requires grad there (launchers are below autograd by contract)
    x2 = rows(x.detach())
    name = _select(x, k, backend)
    if name == "triton":
        from tpkernels.kernels.triton import nf4_linear as tk  # noqa: PLC0415  (triton import is slow)

        y = tk.nf4_linear_fwd(x2, packed, absmax_q, absmax_scale, absmax_offset, nf4_code(x.device),
                              dynamic_map(x.device), n)
    elif name == "cpp":
        y = extension().nf4_linear_fwd_cpu(x2, packed, absmax_q, absmax_scale, absmax_offset.reshape(1),
                                           nf4_code(x.device), dynamic_map(x.device), n)
    else:
        y = reference.nf4_linear_fwd(x2, packed, absmax_q, absmax_scale, absmax_offset, n)
    return y.view(*x.shape[:-1], n)


def nf4_linear_bwd(dy: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor, k: int,
                   *, backend: str | None = None) -> Tensor:
    """Input-gradient launcher: dy (..., N) -> dx (..., k) = dy · W, dy's dtype."""
    dy2 = rows(dy.detach())
    name = _select(dy, k, backend)
    if name == "triton":
        from tpkernels.kernels.triton import nf4_linear as tk  # noqa: PLC0415

        dx = tk.nf4_linear_bwd(dy2, packed, absmax_q, absmax_scale, absmax_offset, nf4_code(dy.device),
                               dynamic_map(dy.device), k)
    elif name == "cpp":
        dx = extension().nf4_linear_bwd_cpu(dy2, packed, absmax_q, absmax_scale, absmax_offset.reshape(1),
                                            nf4_code(dy.device), dynamic_map(dy.device), k)
    else:
        dx = reference.nf4_linear_bwd(dy2, packed, absmax_q, absmax_scale, absmax_offset, k)
    return dx.view(*dy.shape[:-1], k)


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----
# `backend` is "" for the dispatch rule, else a backend name.

@torch.library.custom_op("tpkernels::nf4_linear_forward", mutates_args=())
def _forward_op(x: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor,
                out_features: int, bias: Optional[Tensor], backend: str) -> Tensor:
    y = nf4_linear_fwd(x, packed, absmax_q, absmax_scale, absmax_offset, out_features, backend=backend or None)
    return y if bias is None else y.add_(bias)


@_forward_op.register_fake
def _(x, packed, absmax_q, absmax_scale, absmax_offset, out_features, bias, backend):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("tpkernels::nf4_linear_backward", mutates_args=())
def _backward_op(dy: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor,
                 in_features: int, backend: str) -> Tensor:
    return nf4_linear_bwd(dy, packed, absmax_q, absmax_scale, absmax_offset, in_features, backend=backend or None)


@_backward_op.register_fake
def _(dy, packed, absmax_q, absmax_scale, absmax_offset, in_features, backend):
    return dy.new_empty((*dy.shape[:-1], in_features))


def _setup_context(ctx, inputs, output):
    x, packed, absmax_q, absmax_scale, absmax_offset, out_features, bias, backend = inputs
    ctx.in_features, ctx.backend, ctx.has_bias = x.shape[-1], backend, bias is not None
    ctx.save_for_backward(packed, absmax_q, absmax_scale, absmax_offset)  # the NF4 weight only, never x


def _backward(ctx, dy):
    packed, absmax_q, absmax_scale, absmax_offset = ctx.saved_tensors
    need = ctx.needs_input_grad
    dy = dy.contiguous()
    dx = _backward_op(dy, packed, absmax_q, absmax_scale, absmax_offset, ctx.in_features, ctx.backend) \
        if need[0] else None
    db = None
    if ctx.has_bias and need[6]:
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=acc).to(dy.dtype)
    return dx, None, None, None, None, None, db, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def nf4_linear(x: Tensor, qweight: NF4Weight, bias: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """y = x · Wᵀ + bias with W the (out_features, in_features) weight that ``qweight`` holds in NF4.

    Args:
        x: (..., in_features), float32 / float16 / bfloat16 (float64 on the CPU paths); a copy only when
           the last dim is not unit-stride.
        qweight: :class:`tpkernels.quant.NF4Weight` of a 2-D weight (``quantize_nf4(w)``, w (N, K)), on
           x's device. Frozen: it gets no gradient.
        bias: (out_features,) like x, or None.
        backend: "triton" (CUDA tensors, or CPU ones under TRITON_INTERPRET=1; in_features a multiple
           of 64), "cpp" (CPU tensors) or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        (..., out_features) in x's dtype; the products of the weight's dequantised values (fp32 NF4
        level · block absmax, as bitsandbytes' ``dequantize_4bit``) with x, accumulated in fp32 (fp64
        for fp64). Gradients flow to x and bias.
    """
    _check(x, qweight, bias)
    n = qweight.shape[0]
    if x.numel() == 0:
        y = x.new_zeros((*x.shape[:-1], n))
        return y if bias is None else y + bias
    return _forward_op(x, *_parts(qweight), n, bias, backend or "")


def nf4_linear_flops(m: int, n: int, k: int) -> int:
    """FLOPs of one nf4_linear GEMM (forward or input gradient): 2·m·n·k."""
    return 2 * m * n * k


def nf4_linear_bytes(m: int, n: int, k: int, act_bytes: int = 2) -> float:
    """Bytes the forward must move at least: x and y once, the NF4 weight once (0.516 B a weight)."""
    weight = (n * k + 1) // 2 + math.ceil(n * k / BLOCK) + 4 * math.ceil(n * k / BLOCK / ABSMAX_BLOCK) + 4
    return act_bytes * (m * k + m * n) + weight


__all__ = ["nf4_linear", "nf4_linear_bwd", "nf4_linear_bytes", "nf4_linear_flops", "nf4_linear_fwd"]
