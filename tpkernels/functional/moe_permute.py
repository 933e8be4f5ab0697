"""MoE token permutation: token copies sorted into contiguous per-expert groups, and back.

    x_sorted, counts, row_map = permute(x, routing.kept_experts, E)   # (N, H), (E,), (N,)
    y_sorted = grouped_swiglu_mlp(x_sorted, w_gate_up, w_down, counts)
    y = unpermute(y_sorted, row_map, routing.weights, T)              # (T, H)

Views. Token t's j-th assignment is slot s = t·k + j of ``experts.reshape(-1)``. ``row_map[i]`` is the
slot that sorted row i came from, so ``x_sorted[i] = x[row_map[i] // k]``; rows are grouped by expert
id (0 first) and, inside an expert, in token order (a stable sort). Dropped slots (expert -1) have no
row: N = T·k − dropped. ``unpermute`` sums each token's rows weighted by its router weights:
``y[t] = Σ_j weights[t, j] · y_sorted[pos(t, j)]``.

No Python loop over experts: one stable sort of the slots' expert ids, a bincount and index maps.
Both directions are gathers (the combine reads each token's k rows through the inverse map instead of
scattering with atomics), so results are deterministic on every backend. The forward of ``permute``
reads one host value (the number of kept rows, the output's size) together with the ids' bounds.

Layers: permute()/unpermute() → torch.ops.tpkernels.moe_permute_rows / moe_unpermute_rows (custom ops,
fake impls, autograd; backward through moe_gather_rows / moe_combine_rows / moe_combine_wgrad) →
kernels: triton (kernels/triton/moe_permute.py), reference (kernels/reference.py, the CPU path).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tpkernels import backends
from tpkernels.kernels import reference

OP = "moe_permute"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    return backends.triton_dtype_limits(device, dtype) if impl == "triton" else None


backends.register_op(OP, ("triton", "reference"), check=_impl_limits)


def _kernels(name: str):
    if name == "triton":
        from tpkernels.kernels.triton import moe_permute as tk  # noqa: PLC0415  (triton import is slow)

        return tk.gather_rows, tk.combine_rows, tk.combine_wgrad
    return reference.moe_gather_rows, reference.moe_combine_rows, reference.moe_combine_wgrad


def _select(t: Tensor, backend: str) -> str:
    return backends.select(OP, t.device, backend or None, dtype=t.dtype)


# ---- kernel ops (no autograd of their own: the backward of the two ops below) ----

@torch.library.custom_op("tpkernels::moe_gather_rows", mutates_args=())
def _gather_op(src: Tensor, index: Tensor, scale: Optional[Tensor], backend: str) -> Tensor:
    if index.numel() == 0:
        return src.new_empty(0, src.shape[1])
    return _kernels(_select(src, backend))[0](src, index, scale)


@_gather_op.register_fake
def _(src, index, scale, backend):
    return src.new_empty(index.shape[0], src.shape[1])


@torch.library.custom_op("tpkernels::moe_combine_rows", mutates_args=())
def _combine_op(y: Tensor, pos: Tensor, weights: Optional[Tensor], backend: str) -> Tensor:
    if pos.numel() == 0 or y.shape[0] == 0:
        return y.new_zeros(pos.shape[0], y.shape[1])
    return _kernels(_select(y, backend))[1](y, pos, weights)


@_combine_op.register_fake
def _(y, pos, weights, backend):
    return y.new_empty(pos.shape[0], y.shape[1])


@torch.library.custom_op("tpkernels::moe_combine_wgrad", mutates_args=())
def _wgrad_op(dout: Tensor, y: Tensor, pos: Tensor, backend: str) -> Tensor:
    if pos.numel() == 0 or y.shape[0] == 0:
        return torch.zeros(pos.shape, dtype=torch.float64 if y.dtype == torch.float64 else torch.float32,
                           device=y.device)
    return _kernels(_select(y, backend))[2](dout, y, pos)


@_wgrad_op.register_fake
def _(dout, y, pos, backend):
    return torch.empty(pos.shape, dtype=torch.float64 if y.dtype == torch.float64 else torch.float32,
                       device=y.device)


# ---- the autograd ops ----

@torch.library.custom_op("tpkernels::moe_permute_rows", mutates_args=())
def _permute_op(x: Tensor, tokens: Tensor, pos: Tensor, backend: str) -> Tensor:
    """x_sorted[i] = x[tokens[i]]; pos (T, k) is the inverse map the backward sums through."""
    return _gather_op(x, tokens, None, backend)


@_permute_op.register_fake
def _(x, tokens, pos, backend):
    return x.new_empty(tokens.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    _, _, pos, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(pos)


def _permute_backward(ctx, dy):
    (pos,) = ctx.saved_tensors
    return _combine_op(dy.contiguous(), pos, None, ctx.backend), None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("tpkernels::moe_unpermute_rows", mutates_args=())
def _unpermute_op(y: Tensor, row_map: Tensor, pos: Tensor, weights: Tensor, backend: str) -> Tensor:
    """out[t] = Σ_j weights[t, j] · y[pos[t, j]]."""
    return _combine_op(y, pos, weights, backend)


@_unpermute_op.register_fake
def _(y, row_map, pos, weights, backend):
    return y.new_empty(pos.shape[0], y.shape[1])


def _unpermute_setup(ctx, inputs, output):
    y, row_map, pos, weights, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(y, row_map, pos, weights)


def _unpermute_backward(ctx, dout):
    y, row_map, pos, weights = ctx.saved_tensors
    dout = dout.contiguous()
    k = pos.shape[1]
    need = ctx.needs_input_grad
    dy = dw = None
    if need[0]:  # dy[i] = w[slot] · dout[token of slot], slot = row_map[i]
        dy = _gather_op(dout, torch.div(row_map, k, rounding_mode="floor"), weights.reshape(-1)[row_map], ctx.backend)
    if need[3]:
        dw = _wgrad_op(dout, y, pos, ctx.backend).to(weights.dtype)
    return dy, None, None, dw, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# ---- public functions ----

def _check_x(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, hidden), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{name} dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")


def _inverse(row_map: Tensor, num_slots: int, k: int) -> Tensor:
    """pos (T, k): the sorted row of each slot, -1 where the slot has none."""
    pos = torch.full((num_slots,), -1, dtype=torch.int64, device=row_map.device)
    pos[row_map] = torch.arange(row_map.numel(), device=row_map.device)
    return pos.view(-1, k)


def sort_by_expert(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(row_map (N,), counts (E,)) of ``experts`` (T, k) int ids in [-1, E): the slots sorted by expert
    (stable: token order inside an expert), slots with -1 left out. One host read (N and the ids' bounds)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts ({num_experts!r}) must be an int >= 1")
    if not isinstance(experts, Tensor) or experts.dim() != 2 or experts.dtype.is_floating_point \
            or experts.dtype == torch.bool:
        raise ValueError(f"experts must be an integer tensor (tokens, k), got "
                         f"{tuple(experts.shape) if isinstance(experts, Tensor) else type(experts).__name__}"
                         f"{'' if not isinstance(experts, Tensor) else ' ' + str(experts.dtype)}")
    flat = experts.reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return flat.new_empty(0), flat.new_zeros(num_experts)
    key = torch.where(flat < 0, num_experts, flat)  # dropped slots sort last
    hist = torch.bincount(key.clamp(0, num_experts), minlength=num_experts + 1)
    lo, hi, dropped = torch.stack([flat.min(), flat.max(), hist[num_experts]]).tolist()
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"experts ids must lie in [-1, num_experts) = [-1, {num_experts}) (-1: dropped), "
                         f"got {lo if lo < -1 else hi}")
    order = torch.sort(key, stable=True).indices
    return order[:flat.numel() - dropped], hist[:num_experts]


def permute(x: Tensor, experts: Tensor, num_experts: int, *, backend: str | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Token copies grouped by expert.

    Args:
        x: (T, H) tokens, float32 / float16 / bfloat16 / float64.
        experts: (T, k) int expert ids in [0, E), or -1 for a dropped assignment (left out).
        num_experts: E.
        backend: "triton" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        x_sorted (N, H) (N = kept assignments), counts (E,) int64 rows per expert, row_map (N,) int64:
        ``x_sorted[i] = x[row_map[i] // k]``. Gradient flows to x (each token sums its copies' gradients).
    """
    _check_x(x, "x")
    if isinstance(experts, Tensor) and experts.dim() == 2 and experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts.shape[0] ({experts.shape[0]}) must equal x.shape[0] ({x.shape[0]}) tokens")
    row_map, counts = sort_by_expert(experts, num_experts)
    row_map, counts = row_map.to(x.device), counts.to(x.device)
    k = experts.shape[1]
    pos = _inverse(row_map, experts.numel(), k) if k else row_map.new_empty(x.shape[0], 0)
    tokens = torch.div(row_map, k, rounding_mode="floor") if k else row_map
    return _permute_op(x, tokens, pos, backend or ""), counts, row_map


def unpermute(y_sorted: Tensor, row_map: Tensor, weights: Tensor, num_tokens: int, *,
              backend: str | None = None) -> Tensor:
    """The weighted sum of each token's expert outputs.

    Args:
        y_sorted: (N, H) expert outputs in ``permute``'s order.
        row_map: (N,) int64 from ``permute``.
        weights: (T, k) combine weights (``Routing.weights``, float32); a dropped slot has no row and
            contributes nothing whatever its weight.
        num_tokens: T.

    Returns:
        (T, H) in y_sorted's dtype, ``y[t] = Σ_j weights[t, j] · y_sorted[pos(t, j)]`` (fp32 sums).
        Gradients flow to y_sorted and weights.
    """
    _check_x(y_sorted, "y_sorted")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens ({num_tokens!r}) must be an int >= 0")
    if not isinstance(weights, Tensor) or weights.dim() != 2 or weights.shape[0] != num_tokens \
            or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a float tensor (num_tokens, k) = ({num_tokens}, k), got "
                         f"{tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__}")
    if not isinstance(row_map, Tensor) or row_map.shape != (y_sorted.shape[0],) or row_map.dtype.is_floating_point:
        raise ValueError(f"row_map must be an integer tensor of shape (y_sorted.shape[0],) = ({y_sorted.shape[0]},), "
                         f"got {tuple(row_map.shape) if isinstance(row_map, Tensor) else type(row_map).__name__}")
    k = weights.shape[1]
    if row_map.numel() and k == 0:
        raise ValueError(f"weights has k = 0 columns but y_sorted has {row_map.numel()} rows")
    row_map = row_map.to(device=y_sorted.device, dtype=torch.int64)
    if row_map.device.type == "cpu" and not torch.compiler.is_compiling() and row_map.numel() \
            and int(row_map.min()) < 0:  # a device map (or a traced one): no host read
        raise ValueError(f"row_map's entries must be slots in [0, num_tokens·k) = [0, {num_tokens * k}), "
                         f"got {int(row_map.min())}")
    if k == 0:
        return y_sorted.new_zeros(num_tokens, y_sorted.shape[1])
    try:
        pos = _inverse(row_map, num_tokens * k, k)
    except (IndexError, RuntimeError) as e:
        raise ValueError(f"row_map's entries must be slots in [0, num_tokens·k) = [0, {num_tokens * k}): {e}") from e
    return _unpermute_op(y_sorted, row_map, pos, weights.to(y_sorted.device), backend or "")


__all__ = ["permute", "sort_by_expert", "unpermute"]
