"""Where context-parallel attention's work lies, decided on the host: the attention-kernel calls that
compute one CP rank's queries against one block of keys, for packed documents and sliding windows
alike. No tensor of size S² or (S/CP)² per head exists anywhere: every call is a FlashAttention
kernel call (Triton on GPUs, the reference on CPUs) on ranges of rows.

Why the host: a kernel launch needs its slice sizes as host ints, and reading them from device
tensors per block would stall the GPU once per block. Every CP rank therefore knows the global
document boundaries of each row (the model all-gathers the host positions once per step, beside
the flags it agreed on before; ``doc_ids`` on the device cost one host copy per call), and plans
are cached per (documents, layout, window), so the layers of a step plan once.

The decomposition (ring-flash-attention's zigzag varlen, generalised):

* A query range [Q0, Q1) against a key range [K0, K1) splits, per row, into the documents that
  meet both ranges. Documents are contiguous, so two disjoint chunks share at most one document
  per row (it holds the last key and the first query of the gap between them); a chunk against
  itself shares each document inside it.
* Each (document ∩ query range, document ∩ key range) is trimmed to the queries that see some key
  and the keys some query sees (:func:`tpkernels.kernels.window.band`); the sliding window then
  becomes the kernel's bottom-right window with the offset E = key end − query end. Pieces with
  the same E share one call: a chunk against itself has E = 0 for every document (one varlen call
  with ``cu_seqlens`` per document); a cross pair is one dense call when every row has the same
  piece (no documents, or one document over both chunks), else one varlen call over the rows.
* A varlen call takes the queries of one row span [qa, qz) of every row (a view for one row; rows
  without a piece become sequences with no keys, whose output merges as nothing), and the keys of
  its pieces packed in order (a view when they are one contiguous run).

A window no longer than the sequence reaches is no window (``no_op_window``; Mistral's 4096 at
4k tokens takes the plain path). Partial results merge by log-sum-exp in fp32 (context_parallel_blocks).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from tpkernels.functional.attention import trust_cu_seqlens
from tpkernels.kernels.window import Band, band

Rows = tuple[tuple[int, ...], ...]  # per row: document boundaries 0 = b0 < b1 < ... < bn = S


@dataclass(frozen=True)
class Varlen:
    """The varlen side of a call: cu_seqlens on the device, their maxima, and the key runs (row, start,
    end) in the key tensor whose concatenation is the packed keys."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    k_runs: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class KernelCall:
    """One attention-kernel call: query rows ``q_rows`` of every batch row against key rows ``k_rows``
    (dense) or the pieces of ``varlen``, under the kernel window ``window``."""

    q_rows: slice
    k_rows: slice | None
    window: tuple[int, int]
    varlen: Varlen | None = None


# ---- documents on the host ----

def rows_from_cu_seqlens(cu_seqlens: Tensor, batch: int, seqlen: int) -> Rows | None:
    """Per-row boundaries from ``cu_seqlens`` over the flattened global batch (batch rows of
    ``seqlen`` tokens; every row start a boundary); None when every row is one document."""
    offs = cu_seqlens.detach().to("cpu", torch.int64).reshape(-1).tolist()
    total = batch * seqlen
    if not offs or offs[0] != 0 or offs[-1] != total:
        raise ValueError(f"cu_seqlens ({offs[:6]}{' ...' if len(offs) > 6 else ''}) must start at 0 and end at "
                         f"batch × seqlen = {batch} × {seqlen} = {total}: the global documents of every row")
    bad = next((i for i in range(1, len(offs)) if offs[i] < offs[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad}] ({offs[bad]}) < "
                         f"cu_seqlens[{bad - 1}] ({offs[bad - 1]})")
    cuts = set(offs)
    missing = [i * seqlen for i in range(batch) if i * seqlen not in cuts]
    if missing:
        raise ValueError(f"cu_seqlens must contain every row start (multiples of seqlen = {seqlen}), missing "
                         f"{missing[:4]}: a document may not span two rows")
    rows = []
    for i in range(batch):
        lo, hi = bisect.bisect_left(offs, i * seqlen), bisect.bisect_right(offs, (i + 1) * seqlen)
        rows.append(tuple(sorted({x - i * seqlen for x in offs[lo:hi]})))
    return None if all(len(r) == 2 for r in rows) else tuple(rows)


def rows_from_ids(ids: Tensor) -> Rows | None:
    """Per-row boundaries from document ids (batch, S) on the host: a document is a run of equal ids;
    an id that comes back after another one is refused (documents are contiguous)."""
    rows = []
    for i, row in enumerate(ids.tolist()):
        cuts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
        if len(cuts) - 1 != len(set(row)):
            raise ValueError(f"doc_ids of row {i} repeat an id after another one: each document must be one "
                             "contiguous run of tokens")
        rows.append(tuple(cuts))
    return None if all(len(r) == 2 for r in rows) else tuple(rows)


# ---- kernel calls ----

def _pieces(bounds: tuple[int, ...] | None, q0: int, q1: int, k0: int, k1: int, window) -> list[Band]:
    """The bands of queries [q0, q1) against keys [k0, k1) within each document of one row."""
    left, right = window
    if bounds is None:
        b = band(q0, q1, k0, k1, left, right)
        return [] if b is None else [b]
    out = []
    i = bisect.bisect_right(bounds, q0) - 1
    while i < len(bounds) - 1 and bounds[i] < q1:
        ds, de = bounds[i], bounds[i + 1]
        ks, ke = max(k0, ds), min(k1, de)
        if ks < ke:
            b = band(max(q0, ds), min(q1, de), ks, ke, left, right)
            if b is not None:
                out.append(b)
        i += 1
    return out


def _device_ints(values: list[int], device, max_len: int) -> Tensor:
    cu = torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
    return trust_cu_seqlens(cu, values[-1], max_len)  # made from host values: no device read to check


def _varlen(rows: list[list[Band]], qa: int, qz: int, k0: int, ko: int, device) -> Varlen:
    """Every row's queries [qa, qz) as sequences (the pieces, and the gaps between them without keys)."""
    cu_q, cu_k, runs, max_q, max_k = [0], [0], [], 1, 1
    for r, pieces in enumerate(rows):
        at = qa
        for b in sorted(pieces, key=lambda p: p.qs):
            if b.qs > at:  # queries without keys in this call
                cu_q.append(cu_q[-1] + b.qs - at)
                cu_k.append(cu_k[-1])
            cu_q.append(cu_q[-1] + b.qe - b.qs)
            cu_k.append(cu_k[-1] + b.ke - b.ks)
            max_q, max_k, at = max(max_q, b.qe - b.qs, b.qs - at), max(max_k, b.ke - b.ks), b.qe
            s, e = b.ks - k0 + ko, b.ke - k0 + ko
            if runs and runs[-1][0] == r and runs[-1][2] == s:
                runs[-1] = (r, runs[-1][1], e)
            else:
                runs.append((r, s, e))
        if qz > at:
            cu_q.append(cu_q[-1] + qz - at)
            cu_k.append(cu_k[-1])
            max_q = max(max_q, qz - at)
    return Varlen(_device_ints(cu_q, device, max_q), _device_ints(cu_k, device, max_k), max_q, max_k, tuple(runs))


def _group_window(members: list[Band], window) -> tuple[int, int]:
    """The kernel window of pieces with one end offset E: a side binds if it binds any of them."""
    left, right = window
    end = members[0].ke - members[0].qe
    return (left + end if any(b.left >= 0 for b in members) else -1,
            right - end if any(b.right >= 0 for b in members) else -1)


def plan_calls(rows: Rows | None, batch: int, q_span, k_span, window, device) -> list[KernelCall]:
    """The kernel calls of queries ``q_span`` = (Q0, Q1, local row of Q0) against keys ``k_span`` =
    (K0, K1, local row of K0), global positions, under ``window`` (left, right; causal: right 0)."""
    (q0, q1, qo), (k0, k1, ko) = q_span, k_span
    per_row = [_pieces(None if rows is None else rows[r], q0, q1, k0, k1, window) for r in range(batch)]
    groups: dict[int, list[list[Band]]] = {}
    for r, pieces in enumerate(per_row):
        for b in pieces:
            groups.setdefault(b.ke - b.qe, [[] for _ in range(batch)])[r].append(b)
    calls = []
    for key in sorted(groups):
        members = groups[key]
        flat = [b for m in members for b in m]
        w = _group_window(flat, window)
        first = members[0][0] if members[0] else None
        if first is not None and all(len(m) == 1 and m[0][:4] == first[:4] for m in members):
            calls.append(KernelCall(slice(first.qs - q0 + qo, first.qe - q0 + qo),
                                    slice(first.ks - k0 + ko, first.ke - k0 + ko), w))
            continue
        qa, qz = min(b.qs for b in flat), max(b.qe for b in flat)
        calls.append(KernelCall(slice(qa - q0 + qo, qz - q0 + qo), None, w, _varlen(members, qa, qz, k0, ko, device)))
    return calls


class Geometry:
    """The kernel calls of one CP rank for a sequence of ``seqlen`` tokens over ``cp`` ranks (zigzag
    chunks of L = seqlen / (2·cp)), per K/V source; cached (see :func:`geometry`)."""

    def __init__(self, seqlen: int, cp: int, rank: int, window, rows: Rows | None, batch: int, device):
        self.seqlen, self.cp, self.rank, self.window, self.rows, self.batch = seqlen, cp, rank, window, rows, batch
        self.L = seqlen // (2 * cp)
        self.device = device
        self._cache: dict = {}

    def chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """(global start, end, local row) of a rank's two chunks."""
        L, n = self.L, self.cp
        return [(rank * L, rank * L + L, 0), ((2 * n - 1 - rank) * L, (2 * n - rank) * L, L)]

    def _calls(self, key, q_spans, k_spans) -> list[KernelCall]:
        if key not in self._cache:
            self._cache[key] = [c for qs in q_spans for ks in k_spans
                                for c in plan_calls(self.rows, self.batch, qs, ks, self.window, self.device)]
        return self._cache[key]

    def block(self, src: int) -> list[KernelCall]:
        """This rank's queries (its two chunks) against the K/V block of CP rank ``src``."""
        return self._calls(("block", src), self.chunks(self.rank), self.chunks(src))

    def gathered(self) -> list[KernelCall]:
        """This rank's queries against every key, in sequence order (all-gather)."""
        return self._calls("gathered", self.chunks(self.rank), [(0, self.seqlen, 0)])

    def whole(self) -> list[KernelCall]:
        """The whole sequence against itself, in sequence order (all-to-all: all heads' rows on h/cp heads)."""
        return self._calls("whole", [(0, self.seqlen, 0)], [(0, self.seqlen, 0)])

    def sequence_order(self) -> Tensor:
        """Device index that puts the ranks' shares, gathered rank-major, in sequence order."""
        if "perm" not in self._cache:
            pos = [p for r in range(self.cp) for a, b, _ in self.chunks(r) for p in range(a, b)]
            self._cache["perm"] = torch.argsort(torch.tensor(pos)).to(self.device, non_blocking=True)
        return self._cache["perm"]


@functools.lru_cache(maxsize=32)
def geometry(seqlen: int, cp: int, rank: int, window: tuple[int, int], rows: Rows | None, batch: int,
             device: torch.device) -> Geometry:
    """The cached :class:`Geometry`: every layer of a step asks for the same one."""
    return Geometry(seqlen, cp, rank, window, rows, batch, device)


def block_reached(seqlen: int, cp: int, window, dst: int, src: int) -> bool:
    """Whether any query of CP rank ``dst`` sees a key of rank ``src`` under ``window`` (positions only)."""
    g = Geometry(seqlen, cp, dst, window, None, 1, None)
    return any(band(a, b, c, d, *window) is not None for a, b, _ in g.chunks(dst) for c, d, _ in g.chunks(src))


__all__ = ["Geometry", "KernelCall", "Varlen", "block_reached", "geometry", "plan_calls", "rows_from_cu_seqlens",
           "rows_from_ids"]
