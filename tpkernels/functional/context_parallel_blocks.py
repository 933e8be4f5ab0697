"""The math of one context-parallel rank: the zigzag layout of a sequence over the CP group, and the
attention-kernel calls of this rank's queries against one K/V block (any rank's), merged by
log-sum-exp.

No communication here (tpkernels.functional.context_parallel_algos moves the blocks) and no
masks: the calls come from the host plan of tpkernels.functional.context_parallel_plan (dense
calls on row ranges, varlen calls with ``cu_seqlens`` per document, windows as kernel arguments),
and each runs the attention kernels (Triton on GPUs, the reference on CPUs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpkernels.functional.attention import attention_bwd, attention_fwd, lse_dtype
from tpkernels.functional.context_parallel_plan import KernelCall

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


# ---- the calls of one block ----

class BlockOpts:
    """What every call of one op shares: the softmax scale and the soft cap (0: none)."""

    def __init__(self, scale: float, softcap: float):
        self.scale, self.softcap = scale, softcap


def acc_dtype(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, float64 for float64 inputs (the fp64 oracle stays exact)."""
    return lse_dtype(t.dtype)


def empty_out(q: Tensor) -> tuple[Tensor, Tensor]:
    """Accumulators: o (b, sq, h, d) zeros and lse (b, h, sq) -inf, in the accumulation dtype."""
    b, sq, h, d = q.shape
    a = acc_dtype(q)
    return (torch.zeros(b, sq, h, d, dtype=a, device=q.device),
            torch.full((b, h, sq), float("-inf"), dtype=a, device=q.device))


def merge_(out: Tensor, lse: Tensor, ob: Tensor, lb: Tensor) -> None:
    """out, lse ← the softmax-weighted union of (out, lse) and (ob, lb), in place, fp32."""
    new = torch.logaddexp(lse, lb)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(lse - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lb - safe).transpose(1, 2)[..., None]
    out.copy_(out * wa + ob * wb)
    lse.copy_(new)


def _pack(t: Tensor, runs) -> Tensor:
    """(total, heads, dim): the key runs (row, start, end) of ``t`` (b, s, heads, dim) one after another."""
    if len(runs) == 1:
        r, s, e = runs[0]
        return t[r, s:e]
    return torch.cat([t[r, s:e] for r, s, e in runs])


def _unpack_add_(acc: Tensor, packed: Tensor, runs) -> None:
    at = 0
    for r, s, e in runs:
        acc[r, s:e] += packed[at:at + e - s].to(acc.dtype)
        at += e - s


def _take_rows(t: Tensor, rows: slice) -> Tensor:
    """(b·m, ...) of rows ``rows`` of (b, s, ...): a view for one batch row, a copy otherwise."""
    return t[:, rows].reshape(-1, *t.shape[2:])


def _lse_rows(lse: Tensor, rows: slice) -> Tensor:
    """(h, b·m) varlen layout of lse (b, h, s) rows ``rows``."""
    return lse[:, :, rows].transpose(0, 1).reshape(lse.shape[1], -1)


def run_forward(out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, calls: list[KernelCall],
                o: BlockOpts) -> None:
    """Merge the attention of q's rows against k/v over ``calls`` into the running (out, lse)."""
    b, _, h, d = q.shape
    for c in calls:
        m = c.q_rows.stop - c.q_rows.start
        if c.varlen is None:
            ob, lb = attention_fwd(q[:, c.q_rows], k[:, c.k_rows], v[:, c.k_rows], o.scale, False, window=c.window,
                                   softcap=o.softcap)
        else:
            vl = c.varlen
            ob, lb = attention_fwd(_take_rows(q, c.q_rows), _pack(k, vl.k_runs), _pack(v, vl.k_runs), o.scale, False,
                                   vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, window=c.window, softcap=o.softcap)
            ob, lb = ob.view(b, m, h, d), lb.view(h, b, m).transpose(0, 1)
        merge_(out[:, c.q_rows], lse[:, :, c.q_rows], ob.to(out.dtype), lb.to(out.dtype))


def run_backward(dq: Tensor, dk: Tensor, dv: Tensor, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 lse: Tensor, calls: list[KernelCall], o: BlockOpts) -> None:
    """Add the gradients of ``calls`` (given the final out and lse) into dq, dk, dv (accumulation dtype)."""
    b, _, h, d = q.shape
    for c in calls:
        m = c.q_rows.stop - c.q_rows.start
        if c.varlen is None:
            g = attention_bwd(do[:, c.q_rows].contiguous(), q[:, c.q_rows], k[:, c.k_rows], v[:, c.k_rows],
                              out[:, c.q_rows].contiguous(), lse[:, :, c.q_rows].contiguous(), o.scale, False,
                              window=c.window, softcap=o.softcap)
            dk[:, c.k_rows] += g[1].to(dk.dtype)
            dv[:, c.k_rows] += g[2].to(dv.dtype)
            dq[:, c.q_rows] += g[0].to(dq.dtype)
            continue
        vl = c.varlen
        g = attention_bwd(_take_rows(do, c.q_rows).contiguous(), _take_rows(q, c.q_rows), _pack(k, vl.k_runs),
                          _pack(v, vl.k_runs), _take_rows(out, c.q_rows).contiguous(), _lse_rows(lse, c.q_rows).contiguous(),
                          o.scale, False, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, window=c.window, softcap=o.softcap)
        dq[:, c.q_rows] += g[0].view(b, m, h, d).to(dq.dtype)
        _unpack_add_(dk, g[1], vl.k_runs)
        _unpack_add_(dv, g[2], vl.k_runs)
