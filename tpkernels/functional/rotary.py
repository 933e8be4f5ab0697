"""Rotary position embedding (RoPE), as the Llama / Qwen / Mistral / GPT-NeoX / GPT-J families use it.

    cos, sin = rotary_cache(head_dim, max_positions, theta, scaling=config.rope_scaling)
    q, k = apply_rotary(q, k, cos, sin)                               # positions 0..seqlen-1
    q, k = apply_rotary(q, k, cos, sin, cu_seqlens=cu)                # packed: positions restart per sequence
    q, k = apply_rotary(q, k, cos, sin, position_ids=pos)             # any positions

Layouts are the attention's: q (batch, seqlen, nheads, head_dim), k (batch, seqlen, nheads_kv,
head_dim), or packed (total_tokens, nheads, head_dim) with ``cu_seqlens``; any token and head
strides (q and k straight from a packed QKV projection are read in place). cos, sin:
(max_positions, rotary_dim / 2) fp32, rotary_dim <= head_dim (the features past it pass through).
``interleaved=False`` rotates the halves (i, i + rotary_dim/2) (GPT-NeoX, Hugging Face Llama);
True rotates pairs (2i, 2i+1) (GPT-J). The backward is the inverse rotation of the gradient; no
activation is saved, and ``inplace=True`` rotates q and k in their own storage.

``rotary_cache`` computes the frequencies exactly as Hugging Face ``transformers`` does (fp32
inverse frequencies, fp32 angles), with its ``rope_scaling`` kinds "linear", "dynamic" (NTK) and
"llama3" (Llama 3.1's low/high frequency factors).

Layers: apply_rotary() → torch.ops.tpkernels.rotary (a custom op with a fake impl and autograd:
its backward is the same op with the opposite angles) → kernels: triton (kernels/triton/rotary.py), cpp (tpkernels._C: it beats the
PyTorch reference on the CPU, see the README's measured results), reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.kernels import reference

OP = "rotary"
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    return backends.triton_dtype_limits(device, dtype) if impl == "triton" else None


backends.register_op(OP, ("triton", "cpp", "reference"), check=_impl_limits)


# ---- the cos/sin cache ----

def _scaling_value(scaling: dict, key: str, rope_type: str) -> float:
    if key not in scaling:
        raise ValueError(f"rope_scaling ({scaling!r}) of rope_type {rope_type!r} needs {key!r}")
    value = scaling[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"rope_scaling[{key!r}] ({value!r}) must be a finite number > 0")
    return float(value)


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None,
                        seq_len: int | None = None, device=None) -> Tensor:
    """(rotary_dim / 2,) fp32 inverse frequencies, as Hugging Face computes them (``seq_len``: the
    sequence length the "dynamic" kind stretches to)."""
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type ({rope_type!r}) is not supported: choose one of {', '.join(ROPE_TYPES)}")
    base = float(theta)
    if rope_type == "dynamic":
        factor = _scaling_value(scaling, "factor", rope_type)
        original = _scaling_value(scaling, "original_max_position_embeddings", rope_type)
        length = max(seq_len or original, original)
        base = base * ((factor * length / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(device=device,
                                                                                     dtype=torch.float) / rotary_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / _scaling_value(scaling, "factor", rope_type)
    elif rope_type == "llama3":
        factor = _scaling_value(scaling, "factor", rope_type)
        low, high = (_scaling_value(scaling, k, rope_type) for k in ("low_freq_factor", "high_freq_factor"))
        old_context = _scaling_value(scaling, "original_max_position_embeddings", rope_type)
        if high <= low:
            raise ValueError(f"rope_scaling's high_freq_factor ({high}) must be > low_freq_factor ({low})")
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)  # long waves: / factor
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotary_cache(head_dim: int, max_positions: int, theta: float = 10000.0, scaling: dict | None = None, *,
                 rotary_dim: int | None = None, device=None) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (max_positions, rotary_dim / 2) fp32, of positions 0..max_positions-1.

    head_dim: the attention head size; rotary_dim (default head_dim, even, <= head_dim) the rotated
    features. theta: the base (Llama 2: 10000, Llama 3: 500000). scaling: a Hugging Face
    ``rope_scaling`` dict or None: {"rope_type": "linear", "factor"}, {"rope_type": "dynamic",
    "factor", "original_max_position_embeddings"} (NTK scaling for a sequence of max_positions),
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; any other rope_type is an error."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    for name, value in (("head_dim", head_dim), ("max_positions", max_positions), ("rotary_dim", rotary_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim})")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta ({theta!r}) must be a finite number > 1")
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"scaling ({scaling!r}) must be a rope_scaling dict or None")
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling, max_positions, device)
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.int64).float(), inv_freq)
    return angles.cos(), angles.sin()


# ---- applying it ----

def _check(x: Tensor, name: str, dims: int, head_dim: int | None = None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{name} dtype ({x.dtype}) must be float32, float16, bfloat16 or float64")
    layout = "(batch, seqlen, nheads, head_dim)" if dims == 4 else "(total_tokens, nheads, head_dim)"
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(x.shape)}")
    if head_dim is not None and x.shape[-1] != head_dim:
        raise ValueError(f"head_dim of {name} ({x.shape[-1]}) must equal head_dim of q ({head_dim})")


def _positions(q: Tensor, cos: Tensor, position_ids, cu_seqlens, check: bool = True) -> Tensor:
    """(tokens,) int64 positions on q's device; out-of-range positions are an error (a host read of
    the positions' range when they are not 0..seqlen-1, unless ``check`` is False)."""
    max_positions = cos.shape[0]
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("give position_ids or cu_seqlens, not both")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
                cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be a 1-D int32 tensor (batch + 1,) of sequence offsets")
        cu = cu_seqlens.to(q.device, torch.int64)
        offs = cu.tolist()
        if offs[0] != 0 or offs[-1] != q.shape[0] or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"cu_seqlens ({offs[:8]}{'…' if len(offs) > 8 else ''}) must start at 0, never "
                             f"decrease and end at the number of tokens ({q.shape[0]})")
        longest = max(b - a for a, b in zip(offs, offs[1:]))
        if longest > max_positions:
            raise ValueError(f"the longest sequence in cu_seqlens ({longest}) must be <= the positions of the cos/sin "
                             f"cache ({max_positions})")
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths, output_size=q.shape[0])
        return torch.arange(q.shape[0], device=q.device) - starts
    if q.dim() == 3:
        raise ValueError(f"packed q {tuple(q.shape)} needs cu_seqlens or position_ids")
    batch, seqlen = q.shape[0], q.shape[1]
    if position_ids is None:
        if seqlen > max_positions:
            raise ValueError(f"seqlen ({seqlen}) must be <= the positions of the cos/sin cache ({max_positions})")
        return torch.arange(seqlen, device=q.device).repeat(batch)
    if not isinstance(position_ids, Tensor) or position_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("position_ids must be an int tensor of shape (seqlen,) or (batch, seqlen)")
    pos = position_ids.to(q.device, torch.int64)
    if pos.shape not in ((seqlen,), (batch, seqlen)):
        raise ValueError(f"position_ids shape {tuple(pos.shape)} must be ({seqlen},) or ({batch}, {seqlen})")
    if check:
        lo, hi = torch.stack([pos.min(), pos.max()]).tolist()
        if lo < 0 or hi >= max_positions:
            raise ValueError(f"position_ids must be in [0, {max_positions}) (the cos/sin cache), got {lo}..{hi}")
    return pos.expand(batch, seqlen).reshape(-1)


def _tokens(x: Tensor) -> Tensor:
    """(batch, seqlen, heads, d) or (tokens, heads, d) -> a (tokens, heads, d) view (unit feature stride)."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _in_place_view(x: Tensor) -> Tensor:
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        raise ValueError(f"inplace=True needs q and k whose leading dims merge into one view (strides "
                         f"{x.stride()}); pass inplace=False") from None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool, conjugate: bool,
            backend: str | None, out: Tensor | None = None) -> Tensor:
    """Launcher: x (..., heads, d) -> rotated, shaped like x (``out``: where to write, e.g. x itself)."""
    x3 = _tokens(x)
    name = backends.select(OP, x.device, backend, dtype=x.dtype)
    if name in ("triton", "cpp"):
        o3 = torch.empty(x3.shape, dtype=x.dtype, device=x.device) if out is None else _in_place_view(out)
        if name == "triton":
            from tpkernels.kernels.triton import rotary as tk  # noqa: PLC0415  (triton import is slow)

            tk.rotary(x3, cos, sin, positions, interleaved, conjugate, o3)
        else:
            extension().rotary_cpu(x3, cos, sin, positions, interleaved, conjugate, o3)
    else:
        o3 = reference.rotary_fwd(x3, cos, sin, positions, interleaved, conjugate)
        if out is not None:
            _in_place_view(out).copy_(o3)
            return out
    return o3.view(x.shape) if out is None else out


@torch.library.custom_op("tpkernels::rotary", mutates_args=())
def _rotary_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool, conjugate: bool,
               backend: str) -> tuple[Tensor, Tensor]:
    """q and k rotated (``conjugate``: by the opposite angles, the backward of the rotation)."""
    b = backend or None
    return (_rotate(q, cos, sin, positions, interleaved, conjugate, b),
            _rotate(k, cos, sin, positions, interleaved, conjugate, b))


@_rotary_op.register_fake
def _(q, k, cos, sin, positions, interleaved, conjugate, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, positions, interleaved, conjugate, backend = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved, ctx.conjugate, ctx.backend = interleaved, conjugate, backend


def _backward(ctx, dq, dk):
    cos, sin, positions = ctx.saved_tensors
    dq_in, dk_in = _rotary_op(dq.contiguous(), dk.contiguous(), cos, sin, positions, ctx.interleaved,
                              not ctx.conjugate, ctx.backend)
    return dq_in, dk_in, None, None, None, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


class _RotaryInPlace(torch.autograd.Function):
    """q, k rotated in their own storage (eager only: torch.compile takes the out-of-place op)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, interleaved, backend):
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved, ctx.backend = interleaved, backend
        _rotate(q, cos, sin, positions, interleaved, False, backend, out=q)
        _rotate(k, cos, sin, positions, interleaved, False, backend, out=k)
        ctx.mark_dirty(q, k)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, positions = ctx.saved_tensors
        return (_rotate(dq, cos, sin, positions, ctx.interleaved, True, ctx.backend),
                _rotate(dk, cos, sin, positions, ctx.interleaved, True, ctx.backend), None, None, None, None, None)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, position_ids: Tensor | None = None,
                 cu_seqlens: Tensor | None = None, interleaved: bool = False, inplace: bool = False,
                 backend: str | None = None, check_positions: bool = True) -> tuple[Tensor, Tensor]:
    """Rotate q and k by the angles of their tokens' positions (see the module docstring).

    Args:
        q: (batch, seqlen, nheads, head_dim), or (total_tokens, nheads, head_dim) with cu_seqlens
           (or position_ids of shape (total_tokens,)). k: the same with nheads_kv heads.
        cos, sin: (max_positions, rotary_dim / 2), from :func:`rotary_cache`.
        position_ids: (seqlen,) or (batch, seqlen) ints; default 0..seqlen-1 (per sequence with
           cu_seqlens: positions restart at 0 for each packed sequence).
        cu_seqlens: (batch + 1,) int32 offsets of packed sequences.
        interleaved: GPT-J pairs (2i, 2i+1) instead of the halves (i, i + rotary_dim/2).
        inplace: write the result into q and k (autograd permitting; eager only).
        backend: "triton" or "reference" for this call (beats ``TPKERNELS_BACKEND``).
        check_positions: check position_ids against the cache (one host read); False when the caller
           checked them already (the models check a step's positions once, on the host).

    Returns:
        (q_rotated, k_rotated), shaped like q and k, their dtypes; fp32 math.
    """
    dims = 3 if cu_seqlens is not None or (position_ids is not None and q.dim() == 3) else 4
    _check(q, "q", dims)
    _check(k, "k", dims, q.shape[-1])
    if k.shape[:-2] != q.shape[:-2] or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k ({k.dtype} {tuple(k.shape)} on {k.device}) must match q ({q.dtype} {tuple(q.shape)} on "
                         f"{q.device}) but for its number of heads")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.device != q.device:
            raise ValueError(f"{name} must be a 2-D tensor (max_positions, rotary_dim / 2) on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos shape {tuple(cos.shape)} must equal sin shape {tuple(sin.shape)}")
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"rotary_dim (2 × {cos.shape[1]}) must be <= head_dim ({q.shape[-1]})")
    if not isinstance(interleaved, bool) or not isinstance(inplace, bool):
        raise TypeError("interleaved and inplace must be bools")
    positions = _positions(q, cos, position_ids, cu_seqlens, check_positions)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if inplace:
        return _RotaryInPlace.apply(q, k, cos, sin, positions, interleaved, backend)
    return _rotary_op(q, k, cos, sin, positions, interleaved, False, backend or "")


__all__ = ["apply_rotary", "inverse_frequencies", "rotary_cache"]
