"""Pure-PyTorch kernels: the CPU fallback of every op and the oracle of every test.

They compute in float32 (float64 for float64 inputs) and cast back, like the fused kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tpkernels.kernels.window import band
from tpkernels.quant.nf4 import NF4Weight, dequantize_nf4

# Constants of the GeLU formulas (see csrc/gelu/bias_gelu_math.h for their meaning).
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _opmath(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def gelu_grad(z: Tensor, approximate: str) -> Tensor:
    """d gelu(z)/dz, elementwise, in the dtype of ``z``."""
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _TANH_CUBIC * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * z * z)
    return 0.5 * (1 + torch.erf(z * _INV_SQRT2)) + z * _INV_SQRT_2PI * torch.exp(-0.5 * z * z)


def bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    """y = gelu(x + bias). x: (..., n), bias: (n,) -> y: (..., n), dtype of x."""
    z = _opmath(x) + _opmath(bias)
    return torch.nn.functional.gelu(z, approximate=approximate).to(x.dtype)


def bias_gelu_bwd(grad: Tensor, x: Tensor, bias: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_bias) of gelu(x + bias); grad_bias sums grad_x over all leading dims."""
    z = _opmath(x) + _opmath(bias)
    dx = (_opmath(grad) * gelu_grad(z, approximate)).to(x.dtype)
    db = _opmath(dx).reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return dx, db


# ---- RMSNorm (Llama family): y = h · rsqrt(mean(h²) + eps) · weight, h = x (+ residual) ----

def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None, Tensor]:
    """x, residual: (rows, n); weight: (n,) -> (y (rows, n), h = x + residual in x's dtype or None,
    rstd (rows,) fp32 (fp64 for fp64)). The statistics are taken on h as stored (rounded to x's
    dtype), the one the backward sees."""
    h = None if residual is None else (_opmath(x) + _opmath(residual)).to(x.dtype)
    hf = _opmath(x if h is None else h)
    rstd = torch.rsqrt(hf.square().mean(-1) + eps)
    y = (hf * rstd[:, None] * _opmath(weight)).to(x.dtype)
    return y, h, rstd


def rms_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of rms_norm at h (the normalised input) from the saved rstd; ``dh``: a gradient
    arriving at h directly (the residual stream), added to dx. dx (rows, n) dtype of h; dweight (n,)."""
    hf, dyf = _opmath(h), _opmath(dy)
    n = hf * rstd[:, None].to(hf.dtype)
    dn = dyf * _opmath(weight)
    dx = rstd[:, None].to(hf.dtype) * (dn - n * (dn * n).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + _opmath(dh)
    return dx.to(h.dtype), (dyf * n).sum(0).to(weight.dtype)


# ---- LayerNorm (GPT-2 family): y = (h − mean) · rstd · weight (+ bias), h = x (+ residual) ----

def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, residual: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """x, residual: (rows, n); weight, bias: (n,) -> (y (rows, n), h = x + residual in x's dtype or None,
    mean (rows,), rstd (rows,)), the statistics fp32 (fp64 for fp64) of h as stored (the backward's)."""
    h = None if residual is None else (_opmath(x) + _opmath(residual)).to(x.dtype)
    hf = _opmath(x if h is None else h)
    mean = hf.mean(-1)
    xc = hf - mean[:, None]
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    y = xc * rstd[:, None] * _opmath(weight)
    if bias is not None:
        y = y + _opmath(bias)
    return y.to(x.dtype), h, mean, rstd


def layer_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, dh: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of layer_norm at h from the saved mean and rstd; ``dh``: a gradient arriving
    at h directly (the residual stream), added to dx. dx (rows, n) dtype of h; dweight, dbias (n,)."""
    hf, dyf = _opmath(h), _opmath(dy)
    xhat = (hf - mean[:, None].to(hf.dtype)) * rstd[:, None].to(hf.dtype)
    g = dyf * _opmath(weight)
    dx = rstd[:, None].to(hf.dtype) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + _opmath(dh)
    return dx.to(h.dtype), (dyf * xhat).sum(0).to(weight.dtype), dyf.sum(0).to(weight.dtype)


# ---- SwiGLU (Llama MLP): y = silu(gate) · up ----

def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up: (..., f) -> (..., f), dtype of gate; math in fp32 (fp64 for fp64)."""
    g = _opmath(gate)
    return (g * torch.sigmoid(g) * _opmath(up)).to(gate.dtype)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) of silu(gate) · up."""
    g, u, d = _opmath(gate), _opmath(up), _opmath(dy)
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


# ---- rotary position embedding (RoPE) ----

def rotary_fwd(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool,
               conjugate: bool = False) -> Tensor:
    """Rotate the first 2·cos.shape[-1] features of each head of x by the angle of its token's position.

    x: (tokens, heads, head_dim); cos, sin: (max_positions, r/2) fp32; positions: (tokens,) int.
    Half-split (GPT-NeoX / Hugging Face Llama): pairs (i, i + r/2); interleaved (GPT-J): (2i, 2i+1).
    ``conjugate``: rotate by the opposite angle (the backward). Features past r pass through."""
    half = cos.shape[-1]
    c = _opmath(cos[positions])[:, None, :]  # (tokens, 1, r/2)
    s = _opmath(sin[positions])[:, None, :]
    if conjugate:
        s = -s
    xf = _opmath(x)
    out = xf.clone()
    if interleaved:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = x1 * c - x2 * s
        out[..., 1:2 * half:2] = x2 * c + x1 * s
    else:
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:2 * half] = x2 * c + x1 * s
    return out.to(x.dtype)


# ---- cross-entropy over a (vocabulary shard of) logits chunk ----

def ce_stats(z: Tensor, target: Tensor, lo: int) -> Tensor:
    """Per row of logits z (rows, V_local) whose columns are vocabulary ids [lo, lo + V_local):
    (4, rows) fp32 = (a pivot m, Σ exp(z − m), the target's logit if it is in this shard else 0,
    Σ z); the pivot is any value that keeps the exponentials finite (here the shard's logsumexp).
    fp64 for fp64 logits."""
    zf = _opmath(z)
    # logsumexp is one fused pass: (lse, 1) is a valid (m, Σ exp(z − m)) pair and combines the same way
    m = torch.logsumexp(zf, dim=-1)
    local = target - lo
    mine = (local >= 0) & (local < z.shape[-1])
    tz = zf.gather(-1, torch.where(mine, local, torch.zeros_like(local))[:, None])[:, 0]
    return torch.stack([m, torch.ones_like(m), torch.where(mine, tz, torch.zeros_like(tz)), zf.sum(-1)])


def ce_grad_(z: Tensor, target: Tensor, lo: int, lse: Tensor, row_scale: Tensor, vocab: int, smoothing: float,
             z_loss: float) -> Tensor:
    """z ← d loss / d z in place, for loss = lse − (1−ε)·z_target − ε/V·Σz + z_loss·lse², each row
    weighted by row_scale (0 for ignored rows). lse, row_scale: (rows,) fp32."""
    zf = _opmath(z)
    p = zf.sub_(lse[:, None].to(zf.dtype)) if zf is z else zf - lse[:, None].to(zf.dtype)  # in place when z is fp32
    p = p.exp_().mul_(1 + 2 * z_loss * lse[:, None].to(zf.dtype))
    if smoothing:
        p = p.sub_(smoothing / vocab)
    local = target - lo
    mine = (local >= 0) & (local < z.shape[-1])
    idx = torch.where(mine, local, torch.zeros_like(local))[:, None]
    p.scatter_add_(-1, idx, -(1.0 - smoothing) * mine.to(p.dtype)[:, None])
    p.mul_(row_scale[:, None].to(p.dtype))
    return p if p is z else z.copy_(p)


# ---- attention (FlashAttention semantics) ----
# Layout (FlashAttention's): q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_kv, d).
# Masks align to the bottom-right: with off = seqlen_k - seqlen_q, query i sees key j iff
#     j >= i + off - left   (unless left = -1)   and   j <= i + off + right   (unless right = -1),
# causal being right = 0 (FlashAttention's window_size). A query that sees no key outputs 0 with
# lse = -inf. softcap > 0 caps the scores: s = softcap · tanh(scale · q·k / softcap) (Gemma 2).

# Scores held at once per query chunk: batch·nheads·rows·seqlen_k fp32 values (64 MiB), so memory
# stays O(seqlen), like the kernels, instead of O(seqlen²).
ATTN_CHUNK_ELEMENTS = 1 << 24


def window_bounds(causal: bool, window: tuple[int, int] = (-1, -1)) -> tuple[int, int]:
    """(left, right), -1 for no bound, with causal folded in (right = 0, as FlashAttention does)."""
    left, right = window
    return left, (0 if causal else right)


def _attn_rows_per_chunk(batch: int, nheads: int, seqlen_k: int) -> int:
    return max(1, ATTN_CHUNK_ELEMENTS // max(1, batch * nheads * seqlen_k))


def _group_rows(t: Tensor, nheads_k: int) -> Tensor:
    """(b, c, h, d) -> (b, hk, g·c, d): the g query heads of a KV head stacked as rows, so one batched
    GEMM per KV head serves the whole group and K/V are never repeated."""
    b, c, h, d = t.shape
    return t.reshape(b, c, nheads_k, h // nheads_k, d).permute(0, 2, 3, 1, 4).reshape(b, nheads_k, -1, d)


def _ungroup_rows(t: Tensor, c: int) -> Tensor:
    """(b, hk, g·c, d) -> (b, c, h, d)."""
    b, hk, gc, d = t.shape
    return t.reshape(b, hk, gc // c, c, d).permute(0, 3, 1, 2, 4).reshape(b, c, -1, d)


def visible(i0: int, c: int, seqlen_q: int, seqlen_k: int, left: int, right: int, device) -> Tensor | None:
    """(c, seqlen_k) bool: which keys the query rows i0..i0+c-1 see; None when they see all of them."""
    if left < 0 and right < 0:
        return None
    rel = (torch.arange(seqlen_k, device=device)[None, :]
           - torch.arange(i0, i0 + c, device=device)[:, None] - (seqlen_k - seqlen_q))  # j - i - off
    keep = torch.ones(rel.shape, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    return keep


def _scores(qc: Tensor, k_t: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor | None]:
    """Scores of one query chunk and, with softcap, tanh(scale·q·k / softcap) for the backward."""
    s = torch.matmul(qc, k_t) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _probs(qc: Tensor, k_t: Tensor, scale: float, bounds: tuple[int, int], softcap: float, i0: int, c: int,
           seqlen_q: int, lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """P of one query chunk of c rows. qc: (b, hk, g·c, d), k_t: (b, hk, d, sk) -> (P (b, hk, g·c, sk),
    lse (b, hk, g·c), tanh of the softcap or None); ``lse`` given (backward) is reused."""
    s, t = _scores(qc, k_t, scale, softcap)
    b, hk, gc, sk = s.shape
    keep = visible(i0, c, seqlen_q, sk, *bounds, s.device)
    if keep is not None:
        s.view(b, hk, gc // c, c, sk).masked_fill_(~keep, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # rows that see no key: P = 0
    return torch.exp(s - safe[..., None]), lse, t


def _chunked_fwd(q, k, v, scale, bounds, softcap) -> tuple[Tensor, Tensor]:
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k_t = _opmath(k).permute(0, 2, 3, 1)  # (b, hk, d, sk)
    v_h = _opmath(v).permute(0, 2, 1, 3)  # (b, hk, sk, d)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                      device=q.device)
    step = _attn_rows_per_chunk(b, h, sk)
    for i0 in range(0, sq, step):
        c = min(step, sq - i0)
        p, lse_c, _ = _probs(_group_rows(_opmath(q[:, i0:i0 + c]), hk), k_t, scale, bounds, softcap, i0, c, sq, None)
        o[:, i0:i0 + c] = _ungroup_rows(torch.matmul(p, v_h), c).to(q.dtype)
        lse[:, :, i0:i0 + c] = lse_c.reshape(b, h, c)  # (b, hk, g, c) -> (b, h, c): head h = hk·g + j
    return o, lse


def _chunked_bwd(do, q, k, v, o, lse, scale, bounds, softcap, dlse) -> tuple[Tensor, Tensor, Tensor]:
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k32, v32 = _opmath(k), _opmath(v)
    k_t, k_h = k32.permute(0, 2, 3, 1), k32.permute(0, 2, 1, 3)  # (b, hk, d, sk), (b, hk, sk, d)
    v_t = v32.permute(0, 2, 3, 1)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros((b, hk, sk, k.shape[3]), dtype=k32.dtype, device=k.device)
    dv = torch.zeros_like(dk)
    delta = (_opmath(o) * _opmath(do)).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        delta = delta - dlse.to(delta.dtype)
    step = _attn_rows_per_chunk(b, h, sk)
    for i0 in range(0, sq, step):
        c = min(step, sq - i0)
        qc = _group_rows(_opmath(q[:, i0:i0 + c]), hk)
        doc = _group_rows(_opmath(do[:, i0:i0 + c]), hk)
        lse_c = lse[:, :, i0:i0 + c].reshape(b, hk, -1).to(qc.dtype)
        p, _, t = _probs(qc, k_t, scale, bounds, softcap, i0, c, sq, lse_c)
        dv += torch.matmul(p.transpose(-1, -2), doc)
        ds = p * (torch.matmul(doc, v_t) - delta[:, :, i0:i0 + c].reshape(b, hk, -1, 1))
        if t is not None:  # d(softcap·tanh(u/softcap))/du = 1 − tanh²
            ds = ds * (1 - t * t)
        dq[:, i0:i0 + c] = _ungroup_rows(torch.matmul(ds, k_h) * scale, c).to(q.dtype)
        dk += torch.matmul(ds.transpose(-1, -2), qc) * scale
    return dq, dk.transpose(1, 2).to(k.dtype).contiguous(), dv.transpose(1, 2).to(v.dtype).contiguous()


# On CPU tensors the dense case without softcap runs PyTorch's own fused attention kernel, the one
# SDPA uses on the CPU (tiled, multi-threaded, GQA-aware, returns the lse): 3-5x faster here than
# the chunked math above, which remains for other devices, softcap, a gradient flowing into the
# lse, and as a fallback.
USE_TORCH_CPU_KERNEL = True


def _torch_cpu_kernel():
    if not USE_TORCH_CPU_KERNEL:
        return None
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cpu_mask(bounds: tuple[int, int], seqlen_q: int, seqlen_k: int, like: Tensor):
    """(is_causal, attn_mask, rows that see some key or None) for torch's kernel, whose is_causal aligns
    to the top-left: a bottom-right causal mask with seqlen_q != seqlen_k, or a window, goes in as an
    explicit additive (sq, sk) mask (0 / -inf) in the inputs' dtype, as the kernel requires."""
    left, right = bounds
    if left < 0 and right < 0:
        return False, None, None
    if left < 0 and right == 0 and seqlen_q == seqlen_k:
        return True, None, None
    keep = visible(0, seqlen_q, seqlen_q, seqlen_k, left, right, like.device)
    mask = torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill_(~keep, float("-inf"))
    return False, mask, keep.any(-1)


def _bottom_right_causal(bounds: tuple[int, int], seqlen_q: int, seqlen_k: int) -> bool:
    """Causal, no window, fewer queries than keys: the keys before the last seqlen_q are seen whole and
    the last seqlen_q form a top-left causal square, two maskless calls of torch's kernel instead of
    one with an explicit (sq, sk) mask (several times slower; chunked prefill and context-parallel
    blocks ask for this shape)."""
    return bounds[0] < 0 and bounds[1] == 0 and 0 < seqlen_q < seqlen_k


def _cpu_fwd(q, k, v, scale, bounds) -> tuple[Tensor, Tensor]:
    sq, sk = q.shape[1], k.shape[1]
    if _bottom_right_causal(bounds, sq, sk):
        past = sk - sq
        o1, l1 = _cpu_fwd(q, k[:, :past], v[:, :past], scale, (-1, -1))
        o2, l2 = _cpu_fwd(q, k[:, past:], v[:, past:], scale, (-1, 0))
        lse = torch.logaddexp(l1, l2)  # every row sees its diagonal key: finite
        w1, w2 = (torch.exp(x - lse).transpose(1, 2)[..., None] for x in (l1, l2))
        return (o1 * w1 + o2 * w2).to(q.dtype).contiguous(), lse
    is_causal, mask, seen = _cpu_mask(bounds, sq, sk, q)
    o, lse = _torch_cpu_kernel()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, is_causal,
                                 attn_mask=mask, scale=scale)
    o = o.transpose(1, 2)  # laid out (b, s, h, d) already: no copy
    if seen is not None and not bool(seen.all()):  # rows that see no key: ours are o = 0, lse = -inf
        o = o.masked_fill(~seen[None, :, None, None], 0.0)
        lse = lse.masked_fill(~seen[None, None, :], float("-inf"))
    return o.contiguous(), lse.contiguous()


def _cpu_bwd(do, q, k, v, o, lse, scale, bounds) -> tuple[Tensor, Tensor, Tensor]:
    sq, sk = q.shape[1], k.shape[1]
    if _bottom_right_causal(bounds, sq, sk):  # each part's gradients given the whole softmax (o, lse)
        past = sk - sq
        dq1, dk1, dv1 = _cpu_bwd(do, q, k[:, :past], v[:, :past], o, lse, scale, (-1, -1))
        dq2, dk2, dv2 = _cpu_bwd(do, q, k[:, past:], v[:, past:], o, lse, scale, (-1, 0))
        dq = (dq1.to(lse.dtype) + dq2.to(lse.dtype)).to(q.dtype)  # lse: fp32, or fp64 for fp64
        return dq, torch.cat([dk1, dk2], 1), torch.cat([dv1, dv2], 1)
    is_causal, mask, seen = _cpu_mask(bounds, sq, sk, q)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # back to the kernel's convention
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2), lse, 0.0,
        is_causal, attn_mask=mask, scale=scale)
    dq, dk, dv = (g.transpose(1, 2) for g in grads)
    if seen is not None and not bool(seen.all()):
        dq = dq.masked_fill(~seen[None, :, None, None], 0.0)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _block_fwd(q, k, v, scale, bounds, softcap):
    if q.device.type == "cpu" and softcap == 0 and _torch_cpu_kernel() is not None:
        return _cpu_fwd(q, k, v, scale, bounds)
    return _chunked_fwd(q, k, v, scale, bounds, softcap)


def _block_bwd(do, q, k, v, o, lse, scale, bounds, softcap, dlse):
    if q.device.type == "cpu" and softcap == 0 and _torch_cpu_kernel() is not None and (
            dlse is None or not bool(dlse.any())):
        return _cpu_bwd(do, q, k, v, o, lse, scale, bounds)
    return _chunked_bwd(do, q, k, v, o, lse, scale, bounds, softcap, dlse)


# ---- windows: query blocks against their key band ----
# A window that no maskless path covers (a left side, a right side other than the causal corner, or
# more queries than keys) runs per block of BAND_ROWS queries against the keys that block sees, each
# call with its own small mask: O(seqlen · (window + BAND_ROWS)) work and memory instead of a
# (seqlen_q, seqlen_k) mask. The rows per block follow the window (64 to 512): the masked-out corners
# of a band cost about rows²/2 scores, the window's own work rows · window.
BAND_ROWS = (64, 512)


def _banded(bounds: tuple[int, int], seqlen_q: int, seqlen_k: int) -> bool:
    left, right = bounds
    if left < 0 and right < 0:
        return False
    return not (left < 0 and right == 0 and seqlen_q <= seqlen_k)  # the causal corner has maskless paths


def _bands(bounds: tuple[int, int], seqlen_q: int, seqlen_k: int):
    """Yield (query rows, key columns, the block's own bounds) of each block that sees some key."""
    left, right = bounds
    rows = min(BAND_ROWS[1], max(BAND_ROWS[0], max(left, 0) + max(right, 0)))
    off = seqlen_k - seqlen_q  # query i stands at key position i + off
    for i0 in range(0, seqlen_q, rows):
        b = band(i0 + off, min(i0 + rows, seqlen_q) + off, 0, seqlen_k, left, right)
        if b is not None:
            yield slice(b.qs - off, b.qe - off), slice(b.ks, b.ke), (b.left, b.right)


def _dense_fwd(q, k, v, scale, bounds, softcap):
    sq, sk = q.shape[1], k.shape[1]
    if not _banded(bounds, sq, sk):
        return _block_fwd(q, k, v, scale, bounds, softcap)
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=_opmath(q[:0]).dtype, device=q.device)
    for rows, cols, sub in _bands(bounds, sq, sk):
        o[:, rows], lse[:, :, rows] = _block_fwd(q[:, rows], k[:, cols], v[:, cols], scale, sub, softcap)
    return o, lse


def _dense_bwd(do, q, k, v, o, lse, scale, bounds, softcap, dlse):
    sq, sk = q.shape[1], k.shape[1]
    if not _banded(bounds, sq, sk):
        return _block_bwd(do, q, k, v, o, lse, scale, bounds, softcap, dlse)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    acc = _opmath(k[:0]).dtype
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for rows, cols, sub in _bands(bounds, sq, sk):
        g = _block_bwd(do[:, rows], q[:, rows], k[:, cols], v[:, cols], o[:, rows], lse[:, :, rows], scale, sub,
                       softcap, None if dlse is None else dlse[:, :, rows])
        dq[:, rows] = g[0]
        dk[:, cols] += g[1]
        dv[:, cols] += g[2]
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _same_length_batches(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The non-empty sequences grouped by (query length, key length): per group the (n, lq) query and
    (n, lk) key positions, so each group runs as one dense batch. Packed chat rows hold dozens of short
    documents of a few distinct lengths: one kernel call per length instead of per document (the
    per-call cost dominated a step)."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:
            groups.setdefault((q1 - q0, k1 - k0), []).append((q0, k0))
    out = []
    for (lq, lk), starts in groups.items():
        st = torch.tensor(starts, dtype=torch.long, device=cu_seqlens_q.device)
        out.append((st[:, :1] + torch.arange(lq, device=st.device), st[:, 1:] + torch.arange(lk, device=st.device)))
    return out


def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                   cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None, *,
                   window: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention forward, exact math in fp32 (fp64 for fp64), memory O(seqlen): torch's fused CPU
    kernel on CPU tensors without softcap, else PyTorch math over query chunks.

    Dense: q (b, sq, h, d), k/v (b, sk, hk, d) -> (o like q, lse (b, h, sq)).
    Varlen: q (total_q, h, d), k/v (total_k, hk, d), cu_seqlens (n + 1,) -> (o like q, lse (h, total_q)).
    window: (left, right), -1 for no bound (see the masks above); softcap: 0 for none.
    """
    bounds = window_bounds(causal, window)
    if cu_seqlens_q is None:
        return _dense_fwd(q, k, v, softmax_scale, bounds, softcap)
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device,
                     dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for iq, ik in _same_length_batches(cu_seqlens_q, cu_seqlens_k):  # (n, lq), (n, lk) positions
        o_i, lse_i = _dense_fwd(q[iq], k[ik], v[ik], softmax_scale, bounds, softcap)
        o[iq], lse[:, iq] = o_i, lse_i.transpose(0, 1)  # lse_i (n, h, lq) -> (h, n, lq)
    return o, lse


def flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, softmax_scale: float,
                   causal: bool, cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                   dlse: Tensor | None = None, *, window: tuple[int, int] = (-1, -1),
                   softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward from the saved lse (P recomputed per query chunk) -> (dq, dk, dv) like q, k, v.
    ``dlse`` (shaped like lse) is the gradient flowing into the log-sum-exp, if any."""
    bounds = window_bounds(causal, window)
    if cu_seqlens_q is None:
        return _dense_bwd(do, q, k, v, o, lse, softmax_scale, bounds, softcap, dlse)
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for iq, ik in _same_length_batches(cu_seqlens_q, cu_seqlens_k):
        g = _dense_bwd(do[iq], q[iq], k[ik], v[ik], o[iq], lse[:, iq].transpose(0, 1), softmax_scale, bounds, softcap,
                       None if dlse is None else dlse[:, iq].transpose(0, 1))
        dq[iq], dk[ik], dv[ik] = g[0], g[1], g[2]
    return dq, dk, dv


def attention_naive(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, *,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """The test oracle: textbook attention in the inputs' dtype, differentiable, O(seqlen²) memory, K/V
    repeated for GQA. q (b, sq, h, d), k/v (b, sk, hk, d) -> (o like q, lse (b, h, sq))."""
    group = q.shape[2] // k.shape[2]
    kr = k.repeat_interleave(group, dim=2).transpose(1, 2)  # (b, h, sk, d)
    vr = v.repeat_interleave(group, dim=2).transpose(1, 2)
    s = torch.matmul(q.transpose(1, 2), kr.transpose(-1, -2)) * softmax_scale  # (b, h, sq, sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    keep = visible(0, q.shape[1], q.shape[1], k.shape[1], *window_bounds(causal, window), q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = ~torch.isinf(lse)
    p = torch.where(seen[..., None], torch.softmax(s.masked_fill(~seen[..., None], 0.0), dim=-1),
                    torch.zeros_like(s))
    return torch.matmul(p, vr).transpose(1, 2), lse


# ---- nf4_linear: y = x · Wᵀ over an NF4 weight (tpkernels/quant/nf4.py), and dx = dy · W ----

def _nf4_weight(packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor, n: int, k: int,
                dtype: torch.dtype) -> Tensor:
    q = NF4Weight(packed, absmax_q, absmax_scale, absmax_offset, (n, k), dtype)
    return dequantize_nf4(q, dtype)


def nf4_linear_fwd(x: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor,
                   n: int) -> Tensor:
    """x (M, K) -> y (M, n): the whole (n, K) weight dequantised in x's dtype, then x · Wᵀ."""
    return x @ _nf4_weight(packed, absmax_q, absmax_scale, absmax_offset, n, x.shape[1], x.dtype).T


def nf4_linear_bwd(dy: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, absmax_offset: Tensor,
                   k: int) -> Tensor:
    """dy (M, N) -> dx (M, k) = dy · W, W dequantised in dy's dtype."""
    return dy @ _nf4_weight(packed, absmax_q, absmax_scale, absmax_offset, dy.shape[1], k, dy.dtype)


# ==== MoE (issue 42): token permutation and grouped GEMM. Pure PyTorch, any device. ====
# Permutation views: a token copy i of the expert-sorted rows came from assignment slot row_map[i] = t·k + j
# (token t, its j-th expert); pos (T, k) is the inverse map, the sorted row of slot (t, j) or -1 (dropped).

def moe_gather_rows(src: Tensor, index: Tensor, scale: Tensor | None = None) -> Tensor:
    """out[i] = scale[i] · src[index[i]]: src (T, H), index (N,), scale (N,) or None -> (N, H), dtype of src."""
    out = src.index_select(0, index)
    if scale is None:
        return out
    return (_opmath(out) * _opmath(scale)[:, None]).to(src.dtype)


def moe_combine_rows(y: Tensor, pos: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = Σ_j w[t, j] · y[pos[t, j]] over the slots with pos >= 0: y (N, H), pos (T, k), weights
    (T, k) or None (1) -> (T, H), dtype of y; math in fp32 (fp64 for fp64)."""
    valid = pos >= 0
    rows = _opmath(y.index_select(0, pos.clamp_min(0).reshape(-1))).view(*pos.shape, y.shape[1])
    w = valid.to(rows.dtype) if weights is None else torch.where(valid, _opmath(weights).to(rows.dtype), 0.0)
    return (rows * w[..., None]).sum(1).to(y.dtype)


def moe_combine_wgrad(dout: Tensor, y: Tensor, pos: Tensor) -> Tensor:
    """dw[t, j] = dout[t] · y[pos[t, j]] (0 where pos < 0): dout (T, H), y (N, H), pos (T, k) -> (T, k) fp32
    (fp64 for fp64)."""
    rows = _opmath(y.index_select(0, pos.clamp_min(0).reshape(-1))).view(*pos.shape, y.shape[1])
    dw = (rows * _opmath(dout)[:, None, :]).sum(-1)
    return torch.where(pos >= 0, dw, 0.0)


def grouped_gemm(x: Tensor, w: Tensor, counts: list[int], trans_w: bool = False) -> Tensor:
    """x (N, K) rows grouped by expert, w (E, K, M) (or (E, M, K) read transposed when ``trans_w``),
    counts: E ints summing to N -> (N, M) in x's dtype: one matmul per expert."""
    m = w.shape[1] if trans_w else w.shape[2]
    out = x.new_empty(x.shape[0], m)
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start:start + c] = x[start:start + c] @ (w[e].T if trans_w else w[e])
        start += c
    return out


def grouped_gemm_wgrad(x: Tensor, dy: Tensor, counts: list[int]) -> Tensor:
    """dW_e = x_eᵀ · dy_e: x (N, K), dy (N, M) -> (E, K, M) in x's dtype, zero for an empty expert."""
    out = x.new_zeros(len(counts), x.shape[1], dy.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[e] = x[start:start + c].T @ dy[start:start + c]
        start += c
    return out


def grouped_swiglu_gemm(x: Tensor, w_gate_up: Tensor, counts: list[int]) -> Tensor:
    """silu(gate) · up of gu = grouped_gemm(x, w_gate_up), w_gate_up (E, H, 2F) = [gate | up] -> (N, F)."""
    f = w_gate_up.shape[2] // 2
    gu = grouped_gemm(x, w_gate_up, counts)
    return swiglu_fwd(gu[:, :f], gu[:, f:])
