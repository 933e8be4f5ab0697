"""Grouped GEMM over experts: every expert's rows times its own weight, in one call.

    y = grouped_gemm(x, w, counts)                              # x (N, K), w (E, K, M) -> (N, M)
    y = grouped_swiglu_mlp(x, w_gate_up, w_down, counts)        # the expert MLP of Mixtral / Qwen-MoE

Rows of ``x`` are grouped by expert (``permute``'s order): the first counts[0] rows belong to expert 0,
the next counts[1] to expert 1, and so on; an expert may have no row. Backward: dX = dY · W_eᵀ (a grouped
GEMM over the transposed weights) and dW_e = X_eᵀ · dY_e (a grouped reduction over each expert's rows;
zero for an empty expert).

``grouped_swiglu_mlp`` is the expert MLP y = (silu(x·W_gate) · (x·W_up)) · W_down with W_gate_up =
[W_gate | W_up] along the last dim (E, H, 2F). The Triton path fuses SwiGLU into the first GEMM's epilogue
(gate and up tiles in one program, the (N, F) activation written once); the autograd saves only the
inputs (x, the weights, counts) and the backward recomputes x·W_gate_up (one grouped GEMM of 4·N·H·F FLOPs:
forward + backward cost 22·N·H·F instead of 18·N·H·F) instead of
keeping the (N, 2F) pre-activation and the (N, F) activation alive from forward to backward: the memory of
an MoE layer's activations is its input alone. On Triton the backward's dh = dY·W_downᵀ carries SwiGLU's
backward in its epilogue (d[gate | up] and h written once, dh never stored).

``counts`` (E,) int: on the CPU it is checked (>= 0, sum N); a device tensor is trusted (no host read,
so the launch does not wait for the GPU) and the kernels never touch a row past N.

Layers: grouped_gemm()/grouped_swiglu_mlp() → torch.ops.tpkernels.grouped_gemm / grouped_swiglu_mlp
(custom ops with fake impls and autograd) → launchers below → kernels: triton
(kernels/triton/grouped_gemm.py: one launch over all experts with a device-built tile table), reference
(kernels/reference.py: one torch.matmul per expert, the CPU path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels import backends
from tpkernels.functional.swiglu import swiglu_bwd, swiglu_fwd
from tpkernels.kernels import reference

OP = "grouped_gemm"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The Triton grouped GEMM takes the tensor-core dtypes on a GPU (float32 CUDA tensors run the reference,
# cuBLAS per expert: an fp32 tl.dot would be either TF32, less exact than torch's default, or FMA, slow).
_TRITON_GPU = (torch.float16, torch.bfloat16)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    return backends.triton_dtype_limits(device, dtype, gpu=_TRITON_GPU) if impl == "triton" else None


backends.register_op(OP, ("triton", "reference"), check=_impl_limits)


def _select(t: Tensor, backend: str | None) -> str:
    return backends.select(OP, t.device, backend or None, dtype=t.dtype)


def _triton():
    from tpkernels.kernels.triton import grouped_gemm as tk  # noqa: PLC0415  (triton import is slow)

    return tk


# ---- launchers (no autograd) ----

def grouped_gemm_fwd(x: Tensor, w: Tensor, counts: Tensor, *, trans_w: bool = False,
                     backend: str | None = None) -> Tensor:
    """x (N, K), w (E, K, M) (or (E, M, K) read as its transpose when ``trans_w``) -> (N, M)."""
    impl = _select(x, backend)
    if impl == "triton":
        return _triton().grouped_gemm(x, w, counts.to(x.device), trans_w=trans_w)
    return reference.grouped_gemm(x, w, counts.tolist(), trans_w=trans_w)


def grouped_swiglu_fwd(x: Tensor, w_gate_up: Tensor, counts: Tensor, *, backend: str | None = None) -> Tensor:
    """silu(x·W_gate) · (x·W_up): x (N, H), w_gate_up (E, H, 2F) -> (N, F); fused epilogue on Triton."""
    impl = _select(x, backend)
    if impl == "triton":
        return _triton().grouped_gemm(x, w_gate_up, counts.to(x.device), swiglu=True)
    return reference.grouped_swiglu_gemm(x, w_gate_up, counts.tolist())


def grouped_gemm_wgrad(x: Tensor, dy: Tensor, counts: Tensor, *, backend: str | None = None) -> Tensor:
    """dW_e = x_eᵀ · dy_e: x (N, K), dy (N, M) -> (E, K, M) in x's dtype, zero for an empty expert."""
    impl = _select(x, backend)
    if impl == "triton":
        return _triton().grouped_wgrad(x, dy, counts.to(x.device))
    return reference.grouped_gemm_wgrad(x, dy, counts.tolist())


# ---- torch.library ops ----

@torch.library.custom_op("tpkernels::grouped_gemm", mutates_args=())
def _gemm_op(x: Tensor, w: Tensor, counts: Tensor, backend: str) -> Tensor:
    return grouped_gemm_fwd(x, w, counts, backend=backend)


@_gemm_op.register_fake
def _(x, w, counts, backend):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("tpkernels::grouped_gemm_backward", mutates_args=())
def _gemm_bwd_op(dy: Tensor, x: Tensor, w: Tensor, counts: Tensor, backend: str, need_dx: bool,
                 need_dw: bool) -> tuple[Tensor, Tensor]:
    dx = grouped_gemm_fwd(dy, w, counts, trans_w=True, backend=backend) if need_dx else x.new_empty(0)
    dw = grouped_gemm_wgrad(x, dy, counts, backend=backend) if need_dw else w.new_empty(0)
    return dx, dw


@_gemm_bwd_op.register_fake
def _(dy, x, w, counts, backend, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0)), (w.new_empty(w.shape) if need_dw else w.new_empty(0))


def _gemm_setup(ctx, inputs, output):
    x, w, counts, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x, w, counts)


def _gemm_backward(ctx, dy):
    x, w, counts = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw = _gemm_bwd_op(dy.contiguous(), x, w, counts, ctx.backend, need[0], need[1])
    return (dx if need[0] else None), (dw if need[1] else None), None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


@torch.library.custom_op("tpkernels::grouped_swiglu_mlp", mutates_args=())
def _mlp_op(x: Tensor, w_gate_up: Tensor, w_down: Tensor, counts: Tensor, backend: str) -> Tensor:
    h = grouped_swiglu_fwd(x, w_gate_up, counts, backend=backend)
    return grouped_gemm_fwd(h, w_down, counts, backend=backend)


@_mlp_op.register_fake
def _(x, w_gate_up, w_down, counts, backend):
    return x.new_empty(x.shape[0], w_down.shape[2])


@torch.library.custom_op("tpkernels::grouped_swiglu_mlp_backward", mutates_args=())
def _mlp_bwd_op(dy: Tensor, x: Tensor, w_gate_up: Tensor, w_down: Tensor, counts: Tensor,
                backend: str) -> tuple[Tensor, Tensor, Tensor]:
    impl = _select(x, backend)
    gu = grouped_gemm_fwd(x, w_gate_up, counts, backend=impl)  # recomputed: nothing was saved
    if impl == "triton":  # dh = dY·W_downᵀ with SwiGLU's backward in its epilogue: dh never reaches memory
        dgu, h = _triton().grouped_dswiglu(dy, w_down, gu, counts.to(x.device))
    else:
        h = swiglu_fwd(gu, backend="reference")
        dh = grouped_gemm_fwd(dy, w_down, counts, trans_w=True, backend=impl)
        dgu, _ = swiglu_bwd(dh, gu, backend="reference")
    dw_down = grouped_gemm_wgrad(h, dy, counts, backend=impl)
    dx = grouped_gemm_fwd(dgu, w_gate_up, counts, trans_w=True, backend=impl)
    dw_gate_up = grouped_gemm_wgrad(x, dgu, counts, backend=impl)
    return dx, dw_gate_up, dw_down


@_mlp_bwd_op.register_fake
def _(dy, x, w_gate_up, w_down, counts, backend):
    return x.new_empty(x.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape)


def _mlp_setup(ctx, inputs, output):
    x, w_gate_up, w_down, counts, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x, w_gate_up, w_down, counts)


def _mlp_backward(ctx, dy):
    x, w_gate_up, w_down, counts = ctx.saved_tensors
    dx, dwgu, dwd = _mlp_bwd_op(dy.contiguous(), x, w_gate_up, w_down, counts, ctx.backend)
    need = ctx.needs_input_grad
    return (dx if need[0] else None), (dwgu if need[1] else None), (dwd if need[2] else None), None, None


_mlp_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)


# ---- public functions ----

def _check(x: Tensor, w: Tensor, counts: Tensor, wname: str = "w") -> None:
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise TypeError(f"x and {wname} must be tensors, got {type(x).__name__} and {type(w).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"x dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")
    if w.dim() != 3:
        raise ValueError(f"{wname} must be 3-D (experts, in_features, out_features), got shape {tuple(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{wname} ({w.dtype} on {w.device}) must have x's dtype and device ({x.dtype} on {x.device})")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{wname}.shape[1] ({w.shape[1]}) must equal x.shape[1] ({x.shape[1]}): in_features")
    if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.dtype.is_floating_point \
            or counts.dtype == torch.bool:
        raise ValueError(f"counts must be a 1-D integer tensor (experts,), got "
                         f"{tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__}")
    if counts.shape[0] != w.shape[0]:
        raise ValueError(f"counts has {counts.shape[0]} entries, {wname} has {w.shape[0]} experts: they must agree")
    if counts.device.type == "cpu" and counts.numel() and not torch.compiler.is_compiling():  # no host read of a device tensor
        lo, total = int(counts.min()), int(counts.sum())
        if lo < 0 or total != x.shape[0]:
            raise ValueError(f"counts ({counts.tolist()}) must be >= 0 and sum to x.shape[0] ({x.shape[0]}), "
                             f"got min {lo}, sum {total}")
    elif counts.numel() == 0 and x.shape[0]:
        raise ValueError(f"counts is empty (no experts) but x has {x.shape[0]} rows")


def grouped_gemm(x: Tensor, w: Tensor, counts: Tensor, *, backend: str | None = None) -> Tensor:
    """Rows of expert e times w[e], for every expert at once, with autograd.

    Args:
        x: (N, K) rows grouped by expert, float32 / float16 / bfloat16 / float64.
        w: (E, K, M), x's dtype and device.
        counts: (E,) int rows per expert, summing to N (empty experts allowed).
        backend: "triton" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        (N, M) in x's dtype (fp32 accumulation). Gradients: dx (N, K), dw (E, K, M) (zero for an empty expert).
    """
    _check(x, w, counts)
    return _gemm_op(x.contiguous(), w, counts.to(torch.int64), backend or "")


def grouped_swiglu_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, counts: Tensor, *,
                       backend: str | None = None) -> Tensor:
    """The routed experts' SwiGLU MLP, each expert on its rows, with autograd.

    Args:
        x: (N, H) rows grouped by expert.
        w_gate_up: (E, H, 2F) = [gate | up] along the last dim (transformers' ``gate_up_proj`` layout
            of Mixtral / Qwen-MoE experts, transposed to in × out).
        w_down: (E, F, H_out) (H_out = H for a Transformer's MLP).
        counts: (E,) int rows per expert, summing to N.
        backend: "triton" or "reference" for this call.

    Returns:
        (N, H_out) = (silu(x·W_gate) · (x·W_up)) · W_down per expert. Gradients for x and both weights.
    """
    _check(x, w_gate_up, counts, "w_gate_up")
    if w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up's last dim ({w_gate_up.shape[2]}) must be even: [gate | up] halves")
    if not isinstance(w_down, Tensor) or w_down.dim() != 3:
        raise ValueError(f"w_down must be a 3-D tensor (experts, ffn, hidden), got "
                         f"{tuple(w_down.shape) if isinstance(w_down, Tensor) else type(w_down).__name__}")
    if w_down.dtype != x.dtype or w_down.device != x.device:
        raise ValueError(f"w_down ({w_down.dtype} on {w_down.device}) must have x's dtype and device "
                         f"({x.dtype} on {x.device})")
    if w_down.shape[:2] != (w_gate_up.shape[0], w_gate_up.shape[2] // 2):
        raise ValueError(f"w_down's shape {tuple(w_down.shape)} must start with (experts, ffn) = "
                         f"({w_gate_up.shape[0]}, {w_gate_up.shape[2] // 2}) of w_gate_up {tuple(w_gate_up.shape)}")
    return _mlp_op(x.contiguous(), w_gate_up, w_down, counts.to(torch.int64), backend or "")


__all__ = ["grouped_gemm", "grouped_gemm_fwd", "grouped_gemm_wgrad", "grouped_swiglu_fwd", "grouped_swiglu_mlp"]
