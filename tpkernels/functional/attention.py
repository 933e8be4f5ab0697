"""FlashAttention-style attention with FlashAttention 2.x's interface: ``flash_attn_func`` and
``flash_attn_varlen_func``, forward and backward, GQA/MQA, bottom-right causal masks, sliding
windows (``window_size``) and score soft-capping (``softcap``).

The signatures are flash-attn 2.x's, positional order and keyword names both, so flash-attn code
(Hugging Face's included) switches with an import change:

    flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None)

``deterministic`` is accepted and always holds (no kernel uses atomics). Dropout, ALiBi and paged
KV (``block_table``) raise an error naming the argument.

Layers, top to bottom:
    flash_attn_func / flash_attn_varlen_func
                          public functions: validate shapes, dtypes and devices, call the op
    torch.ops.tpkernels.flash_attn_forward / flash_attn_backward
                          torch.library custom ops with fake impls (torch.compile traces them
                          as opaque calls) and registered autograd
    kernels               triton (kernels/triton/flash_attn.py) on CUDA tensors, or on CPU
                          tensors under TRITON_INTERPRET=1; reference (kernels/reference.py:
                          chunked PyTorch math, O(seqlen) memory) on any device

Memory (FlashAttention-2): the forward saves q, k, v, the output and the fp32 log-sum-exp
(batch, nheads, seqlen_q); never the (seqlen_q, seqlen_k) probabilities. The backward recomputes
them block by block.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import Tensor

from tpkernels import backends
from tpkernels.kernels import reference

OP = "flash_attn"
MAX_HEADDIM = 256


def _impl_limits(impl: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """The dtypes each implementation runs (the dispatch rule skips, or refuses when forced, the rest):
    on CUDA the Triton kernels take 16-bit inputs only (tl.dot would round fp32 to TF32)."""
    if impl != "triton":
        return None
    return backends.triton_dtype_limits(device, dtype, gpu=(torch.float16, torch.bfloat16))


backends.register_op(OP, ("triton", "reference"), check=_impl_limits)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- validation (every message names the parameter, its value and the rule) ----

def _check_scalars(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, return_lse) -> tuple[int, int]:
    """Checks flash-attn's scalar arguments; returns window_size as a (left, right) tuple."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0.0:
        raise ValueError(f"dropout_p ({dropout_p!r}) must be 0.0: attention dropout is not supported (modern LLM "
                         "training does not use it); apply dropout outside the attention if you need it")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale ({softmax_scale!r}) must be a finite number > 0, or None for 1/sqrt(headdim)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal ({causal!r}) must be a bool")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size ({window_size!r}) must be a pair (left, right) of ints >= -1 (-1: no limit)")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap ({softcap!r}) must be a finite number >= 0 (0: no soft-capping)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None: ALiBi position biases are not supported (use rotary "
                         "embeddings, or flash-attn itself)")
    for name, value in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs),
                        ("return_lse", return_lse)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} ({value!r}) must be a bool")
    return int(window_size[0]), int(window_size[1])


def canonical_window(window_size: tuple[int, int], causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's normalisation: a side of at least seqlen_k (max_seqlen_k for varlen) is no limit
    (-1); causal sets the right side to 0."""
    left, right = window_size
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    return left, (0 if causal else right)


def _check_tensors(q, k, v, dims: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q dtype ({q.dtype}) must be float16, bfloat16 or float32 (float64 on the reference path)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype ({t.dtype}) must equal q dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name} device ({t.device}) must equal q device ({q.device})")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal v shape {tuple(v.shape)}")
    d, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"headdim of k ({k.shape[-1]}) must equal headdim of q ({d})")
    if not 1 <= d <= MAX_HEADDIM:
        raise ValueError(f"headdim ({d}) must be between 1 and {MAX_HEADDIM}")
    if nheads_kv < 1 or nheads < 1:
        raise ValueError(f"nheads ({nheads}) and nheads_kv ({nheads_kv}) must be >= 1")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be divisible by nheads_kv ({nheads_kv})")


def _check_dense(q, k, v) -> None:
    _check_tensors(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch of k ({k.shape[0]}) must equal batch of q ({q.shape[0]})")
    if q.shape[0] < 1:
        raise ValueError(f"batch ({q.shape[0]}) must be >= 1")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise ValueError(f"seqlen_q ({q.shape[1]}) and seqlen_k ({k.shape[1]}) must be >= 1")


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    _check_tensors(q, k, v, 3, "(total_tokens, nheads, headdim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            got = (f"{cu.dtype} shape {tuple(cu.shape)}" if isinstance(cu, Tensor) else type(cu).__name__)
            raise TypeError(f"{name} must be a 1-D int32 tensor (batch + 1,), got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} device ({cu.device}) must equal q device ({q.device})")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold batch + 1 >= 2 offsets, got {cu.numel()}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q ({cu_seqlens_q.numel()} offsets) and cu_seqlens_k ({cu_seqlens_k.numel()} "
                         "offsets) must describe the same number of sequences")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"{name} ({m!r}) must be an int >= 0")


# CUDA cu_seqlens tensors already checked: id -> (weakref, version, data_ptr, total, max_seqlen). A model
# reuses one cu_seqlens for all its layers, so the host copy (a device sync on GPUs) happens once per
# batch, not once per layer; the weakref, the version counter and the data pointer rule out stale hits.
# CPU tensors are read every time: the read costs no sync there, and a CPU tensor can share memory with
# a numpy array whose writes never move the version counter. (Writes to CUDA memory through a DLPack
# alias would not move it either; torch itself cannot see those.)
_CHECKED: dict = {}


def _cacheable(cu: Tensor) -> bool:
    return cu.device.type == "cuda"


def _checked_before(cu: Tensor, total: int, max_seqlen: int) -> bool:
    if not _cacheable(cu):
        return False
    entry = _CHECKED.get(id(cu))
    return entry is not None and entry[0]() is cu and entry[1:] == (cu._version, cu.data_ptr(), total, max_seqlen)


def check_cu_seqlens(cu: Tensor, total: int, max_seqlen: int, name: str) -> None:
    """The values of cu_seqlens (one small host copy; once per CUDA tensor): start at 0, never decrease,
    end at the token count, no sequence longer than max_seqlen (a longer one would be silently cut by
    the kernel grid)."""
    if _checked_before(cu, total, max_seqlen):
        return
    offs = cu.tolist()
    if offs[0] != 0:
        raise ValueError(f"{name}[0] ({offs[0]}) must be 0")
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(f"{name} must be non-decreasing, but {name}[{bad + 1}] ({offs[bad + 1]}) < "
                         f"{name}[{bad}] ({offs[bad]})")
    if offs[-1] != total:
        raise ValueError(f"{name}[-1] ({offs[-1]}) must equal the number of tokens ({total})")
    longest = max(lengths)
    max_name = "max_seqlen_" + name[-1]
    if longest > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) must be >= the longest sequence in {name} ({longest})")
    if _cacheable(cu):
        if len(_CHECKED) > 64:
            _CHECKED.clear()
        _CHECKED[id(cu)] = (weakref.ref(cu), cu._version, cu.data_ptr(), total, max_seqlen)


def trust_cu_seqlens(cu: Tensor, total: int, max_seqlen: int) -> Tensor:
    """Record a CUDA ``cu`` as checked without reading it: for boundaries made from values already
    checked on the host (the models find documents on the host, then copy the boundaries over), so
    varlen attention adds no device sync. Returns ``cu``."""
    if _cacheable(cu):
        if len(_CHECKED) > 64:
            _CHECKED.clear()
        _CHECKED[id(cu)] = (weakref.ref(cu), cu._version, cu.data_ptr(), total, max_seqlen)
    return cu


# ---- backend choice ----

def select_backend(q: Tensor, backend: str | None = None) -> str:
    """The kernel that runs attention on q's device and dtype, by the dispatch rule of
    :mod:`tpkernels.backends`: Triton for the dtypes it runs, else the reference path."""
    return backends.select(OP, q.device, backend, dtype=q.dtype)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp is float32, or float64 for float64 inputs (so the fp64 path stays exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_fwd(q, k, v, softmax_scale: float, causal: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, *, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, backend: str | None = None):
    """Forward launcher (no autograd) -> (o contiguous like q, lse (batch, nheads, seqlen_q) or
    (nheads, total_q), dtype ``lse_dtype(q.dtype)``). Checks cu_seqlens values (varlen) before any kernel
    runs. ``window`` (left, right), -1 for no bound, is applied as given (see ``canonical_window``)."""
    if cu_seqlens_q is not None:
        check_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        check_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    name = select_backend(q, backend)
    if name == "triton":
        from tpkernels.kernels.triton import flash_attn as tk  # noqa: PLC0415  (triton import is slow)

        return tk.flash_attn_fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, window=window, softcap=softcap)
    return reference.flash_attn_fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, window=window,
                                    softcap=softcap)


def attention_bwd(do, q, k, v, o, lse, softmax_scale: float, causal: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, dlse=None, *, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, backend: str | None = None):
    """Backward launcher -> (dq, dk, dv) contiguous like q, k, v."""
    q, k, v, do = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), _unit_last_stride(do)
    name = select_backend(q, backend)
    if name == "triton":
        from tpkernels.kernels.triton import flash_attn as tk  # noqa: PLC0415

        return tk.flash_attn_bwd(do, q, k, v, o, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, dlse=dlse, window=window, softcap=softcap)
    return reference.flash_attn_bwd(do, q, k, v, o, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, dlse,
                                    window=window, softcap=softcap)


# ---- torch.library registration: opaque to torch.compile, with fake impls and autograd ----
# `backend` is "" for the dispatch rule, else a backend name (op schemas take no None for str).

@torch.library.custom_op("tpkernels::flash_attn_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float, backend: str) -> tuple[Tensor, Tensor]:
    return attention_fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         window=(window_left, window_right), softcap=softcap, backend=backend or None)


@_forward_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right, softcap, backend):
    shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(shape, dtype=lse_dtype(q.dtype))


@torch.library.custom_op("tpkernels::flash_attn_backward", mutates_args=())
def _backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor],
                 cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                 backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return attention_bwd(do, q, k, v, o, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dlse, window=(window_left, window_right), softcap=softcap,
                         backend=backend or None)


@_backward_op.register_fake
def _(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = tuple(args)  # max_q, max_k, scale, causal, window_left, window_right, softcap, backend


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    n_inputs = 5 + len(ctx.args)
    if not any(ctx.needs_input_grad[:3]):
        return (None,) * n_inputs
    if do is None:
        do = torch.zeros_like(o)
    max_q, max_k, *rest = ctx.args
    dq, dk, dv = _backward_op(do, q, k, v, o, lse, dlse, cu_q, cu_k, max_q, max_k, *rest)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * (n_inputs - 3)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ---- public API ----

def _returns(out, lse, return_attn_probs: bool, return_lse: bool):
    """flash-attn's convention: out, or (out, softmax_lse, S_dmask) with return_attn_probs. S_dmask is
    None: flash-attn fills it only with dropout, which is not supported here."""
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
                    *, return_lse: bool = False, backend: str | None = None):
    """Attention with FlashAttention 2.x's interface and semantics, differentiable.

    Args (flash-attn's, in its order):
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim) with
           nheads % nheads_kv == 0 (GQA/MQA; K/V are never repeated). float16 / bfloat16 on CUDA
           (float32 runs on the reference path there); float16 / float32 / float64 on CPU. Any
           strides; a copy is made only when the last dim is not unit-stride.
        dropout_p: must be 0.0 (attention dropout is not supported).
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned, as
           FlashAttention >= 2.1); a query that sees no key outputs 0.
        window_size: (left, right): query i sees keys j in [i + seqlen_k - seqlen_q - left,
           i + seqlen_k - seqlen_q + right]; -1 (or a side >= seqlen_k) is no limit; causal sets
           right to 0. Key blocks entirely outside the window are skipped, not masked.
        softcap: > 0 caps the scores, s = softcap · tanh(softmax_scale · q·k / softcap) (Gemma 2).
        alibi_slopes: must be None (not supported).
        deterministic: accepted; the kernels are always deterministic.
        return_attn_probs: flash-attn's flag: return (out, softmax_lse, None).
    Keyword-only (ours):
        return_lse: return (out, lse); lse (batch, nheads, seqlen_q) fp32 (fp64 for fp64 inputs),
           natural log of the (capped) scores' sum, -inf for a query that sees no key; differentiable.
        backend: "triton" or "reference" for this call (beats ``TPKERNELS_BACKEND``).

    Returns:
        out (batch, seqlen_q, nheads, headdim), contiguous, dtype of q; or the tuples above.
    """
    window = _check_scalars(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                            return_attn_probs, return_lse)
    _check_dense(q, k, v)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = canonical_window(window, causal, k.shape[1])
    out, lse = _forward_op(q, k, v, None, None, q.shape[1], k.shape[1], scale, causal, left, right, float(softcap),
                           backend or "")
    return _returns(out, lse, return_attn_probs, return_lse)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None, *,
                           return_lse: bool = False, backend: str | None = None):
    """Attention over packed sequences (FlashAttention 2.x's varlen interface), differentiable.

    Args:
        q: (total_q, nheads, headdim), the tokens of all sequences concatenated; k, v:
           (total_k, nheads_kv, headdim).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, cumulative sequence
           starts: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]. No attention crosses a
           sequence boundary; causal masks and windows align each sequence's bottom-right corner.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (checked, one small host copy;
           a window side >= max_seqlen_k is no limit, as in flash-attn).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, return_lse, backend: as in :func:`flash_attn_func`.
        block_table: must be None (paged KV caches are for inference; not supported).

    Returns:
        out (total_q, nheads, headdim), contiguous, dtype of q; lse (nheads, total_q) when asked.
    """
    window = _check_scalars(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                            return_attn_probs, return_lse)
    if block_table is not None:
        raise ValueError("block_table must be None: paged KV caches are not supported")
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = canonical_window(window, causal, max_seqlen_k)
    out, lse = _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left,
                           right, float(softcap), backend or "")
    return _returns(out, lse, return_attn_probs, return_lse)


__all__ = ["attention_bwd", "attention_fwd", "canonical_window", "check_cu_seqlens", "flash_attn_func",
           "flash_attn_varlen_func", "select_backend", "trust_cu_seqlens"]
