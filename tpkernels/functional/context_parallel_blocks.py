"""The math of one context-parallel rank: the zigzag layout of a sequence over the CP group, and the
attention of this rank's queries against one K/V block (any rank's), merged by log-sum-exp.

No communication here (tpkernels.functional.context_parallel_algos moves the blocks). A plain block
(causal or full, no window, no documents) runs the attention kernels (Triton on GPUs, the
reference on CPUs) per pair of zigzag halves: diagonal → the causal kernel, past → full, future →
skipped. A window or packed documents need a per-pair mask: the masked fp32 math of
:func:`_masked_block_fwd`, O(L²) scores per block (the kernel's window cannot express the offset
between two halves); blocks that no query can see are skipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels.functional.attention import attention_bwd, attention_fwd, lse_dtype

# ---- the zigzag layout ----

def zigzag_indices(seqlen: int, cp: int, rank: int, device=None) -> Tensor:
    """Global positions (2L,) of CP rank ``rank``'s tokens: chunks ``rank`` and ``2·cp−1−rank``."""
    check_zigzag(seqlen, cp)
    L = seqlen // (2 * cp)
    a, b = rank * L, (2 * cp - 1 - rank) * L
    return torch.cat([torch.arange(a, a + L, device=device), torch.arange(b, b + L, device=device)])


def check_zigzag(seqlen: int, cp: int) -> None:
    if cp < 1:
        raise ValueError(f"cp ({cp}) must be >= 1")
    if seqlen % (2 * cp) != 0:
        raise ValueError(f"the sequence length ({seqlen}) must be divisible by 2 × cp ({2 * cp}): context "
                         "parallelism splits it into 2·cp equal chunks (two per rank, for load balance)")


def zigzag_split(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's share of a full sequence along ``dim`` (see :func:`zigzag_indices`)."""
    idx = zigzag_indices(x.shape[dim], cp, rank, device=x.device)
    return x.index_select(dim, idx)


def zigzag_merge(parts: list[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's share (rank order), the inverse of :func:`zigzag_split`."""
    cp = len(parts)
    L = parts[0].shape[dim] // 2
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        first, second = p.split(L, dim)
        chunks[r], chunks[2 * cp - 1 - r] = first, second
    return torch.cat(chunks, dim)


# ---- one block: queries of this rank against one K/V block ----

def _visible(q_idx: Tensor, k_idx: Tensor, q_doc: Tensor | None, k_doc: Tensor | None, causal: bool,
             window: tuple[int, int]) -> Tensor:
    """(b or 1, sq, sk) bool: which keys each query sees, from global positions and documents."""
    diff = q_idx[:, None] - k_idx[None, :]  # query position − key position
    ok = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    left, right = window
    if causal:
        ok &= diff >= 0
    if left >= 0:
        ok &= diff <= left
    if right >= 0 and not causal:
        ok &= diff >= -right
    ok = ok[None]
    if q_doc is not None:
        ok = ok & (q_doc[:, :, None] == k_doc[:, None, :])
    return ok


def nothing_visible(q_idx: Tensor, k_idx: Tensor, causal: bool, window: tuple[int, int]) -> bool:
    """No query can see any key of the block (decided from the index ranges alone)."""
    q0, q1, k0, k1 = int(q_idx.min()), int(q_idx.max()), int(k_idx.min()), int(k_idx.max())
    if causal and k0 > q1:
        return True
    left, right = window
    if left >= 0 and q0 - k1 > left:
        return True
    return right >= 0 and not causal and k0 - q1 > right


def acc_dtype(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, float64 for float64 inputs (the fp64 oracle stays exact)."""
    return lse_dtype(t.dtype)


def _expand_kv(t: Tensor, h: int) -> Tensor:
    return t.repeat_interleave(h // t.shape[2], dim=2) if t.shape[2] != h else t


def _scores(q: Tensor, k: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(b, h, sq, sk) fp32 scores (softcapped) and tanh of the capped part (for the backward)."""
    a = acc_dtype(q)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(a), _expand_kv(k, q.shape[2]).to(a)) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _masked_block_fwd(q, k, v, mask, scale, softcap) -> tuple[Tensor, Tensor]:
    """(o (b, sq, h, d) fp32, lse (b, h, sq) fp32; -inf where a query sees nothing)."""
    s, _ = _scores(q, k, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).to(p.dtype))
    return o, lse


def _masked_block_bwd(do, q, k, v, o, lse, mask, scale, softcap) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the final o and lse (fp32; dk, dv summed over a KV head's group)."""
    h, hk = q.shape[2], k.shape[2]
    s, t = _scores(q, k, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: lse -inf, p 0
    a = s.dtype
    dof, ve = do.to(a), _expand_kv(v, h).to(a)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, ve)
    delta = (dof * o.to(a)).sum(-1).transpose(1, 2)  # (b, h, sq)
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, h).to(a)) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(a)) * scale
    if hk != h:
        g = h // hk
        dk = dk.reshape(*dk.shape[:2], hk, g, dk.shape[-1]).sum(3)
        dv = dv.reshape(*dv.shape[:2], hk, g, dv.shape[-1]).sum(3)
    return dq, dk, dv


class BlockOpts:
    """What every block of one call shares."""

    def __init__(self, scale, causal, window, softcap, L, plain):
        self.scale, self.causal, self.window, self.softcap, self.L, self.plain = \
            scale, causal, window, softcap, L, plain


def _pairs(q_idx: Tensor, k_idx: Tensor, o: BlockOpts):
    """(q rows, k rows, causal) of the kernel calls of one plain block: the zigzag halves of both
    sides, each pair diagonal (causal), past (full) or future (skipped)."""
    L = o.L
    for a in (0, 1):
        qa = int(q_idx[a * L])
        for b in (0, 1):
            kb = int(k_idx[b * L])
            if o.causal and kb > qa:
                continue
            yield slice(a * L, (a + 1) * L), slice(b * L, (b + 1) * L), o.causal and kb == qa


def _block_mask(q_idx, k_idx, q_doc, k_doc, o: BlockOpts):
    """None when no query of the block sees a key; else the (b or 1, sq, sk) mask, or True for a
    plain block (the kernels mask it themselves)."""
    if nothing_visible(q_idx, k_idx, o.causal, o.window):
        return None
    if o.plain:
        return True
    mask = _visible(q_idx, k_idx, q_doc, k_doc, o.causal, o.window)
    return mask if bool(mask.any()) else None


def block_fwd(q, k, v, q_idx, k_idx, q_doc, k_doc, o: BlockOpts):
    """(o fp32, lse fp32) of queries against one K/V block, or None when nothing is visible."""
    mask = _block_mask(q_idx, k_idx, q_doc, k_doc, o)
    if mask is None:
        return None
    if not o.plain:
        return _masked_block_fwd(q, k, v, mask, o.scale, o.softcap)
    out, lse = empty_out(q)
    _pairs_into(out, lse, q, k, v, q_idx, k_idx, o)
    return out, lse


def accumulate_block(out, lse, q, k, v, q_idx, k_idx, q_doc, k_doc, o: BlockOpts) -> None:
    """Merge the attention of queries against one K/V block into the running (out, lse): a plain
    block's kernel calls merge straight into them (no block-sized temporary and second merge)."""
    if o.plain:
        if _block_mask(q_idx, k_idx, q_doc, k_doc, o) is not None:
            _pairs_into(out, lse, q, k, v, q_idx, k_idx, o)
        return
    res = block_fwd(q, k, v, q_idx, k_idx, q_doc, k_doc, o)
    if res is not None:
        merge_(out, lse, *res)


def _pairs_into(out, lse, q, k, v, q_idx, k_idx, o: BlockOpts) -> None:
    for qs, ks, causal in _pairs(q_idx, k_idx, o):
        ob, lb = attention_fwd(q[:, qs], k[:, ks], v[:, ks], o.scale, causal, softcap=o.softcap)
        merge_(out[:, qs], lse[:, :, qs], ob.to(out.dtype), lb.to(out.dtype))


def empty_out(q: Tensor) -> tuple[Tensor, Tensor]:
    """Accumulators: o (b, sq, h, d) zeros and lse (b, h, sq) -inf, in the accumulation dtype."""
    b, sq, h, d = q.shape
    a = acc_dtype(q)
    return (torch.zeros(b, sq, h, d, dtype=a, device=q.device),
            torch.full((b, h, sq), float("-inf"), dtype=a, device=q.device))


def block_bwd(do, q, k, v, out, lse, q_idx, k_idx, q_doc, k_doc, o: BlockOpts):
    """(dq, dk, dv) fp32 of one block, or None when nothing is visible."""
    mask = _block_mask(q_idx, k_idx, q_doc, k_doc, o)
    if mask is None:
        return None
    if not o.plain:
        return _masked_block_bwd(do, q, k, v, out, lse, mask, o.scale, o.softcap)
    a = acc_dtype(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=a, device=t.device) for t in (q, k, v))
    o_cast = out.to(q.dtype)
    lse_k = lse.to(lse_dtype(q.dtype))
    for qs, ks, causal in _pairs(q_idx, k_idx, o):
        g = attention_bwd(do[:, qs].contiguous(), q[:, qs], k[:, ks], v[:, ks], o_cast[:, qs].contiguous(),
                          lse_k[:, :, qs].contiguous(), o.scale, causal, softcap=o.softcap)
        dq[:, qs] += g[0].to(a)
        dk[:, ks] += g[1].to(a)
        dv[:, ks] += g[2].to(a)
    return dq, dk, dv


def merge_(out: Tensor, lse: Tensor, ob: Tensor, lb: Tensor) -> None:
    """out, lse ← the softmax-weighted union of (out, lse) and (ob, lb), in place, fp32."""
    new = torch.logaddexp(lse, lb)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(lse - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lb - safe).transpose(1, 2)[..., None]
    out.copy_(out * wa + ob * wb)
    lse.copy_(new)
