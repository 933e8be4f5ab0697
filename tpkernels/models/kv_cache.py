"""A per-rank key/value cache for generation: each attention layer keeps the rotated keys and the
values of the tokens seen so far, for this rank's KV heads only (GQA-aware: a TP rank caches the KV
heads its query heads read, one replicated head when kv_heads < TP), so a decoding step runs each
layer on the new tokens alone.

    cache = KVCache(model, batch=3, capacity=80)       # zeros: (batch, capacity, kv heads/rank, head_dim)
    with cache.attached(model):                         # every SelfAttention reads and writes it
        cache.begin([5, 2, 7], packed=True)             # prefill: 3 prompts back to back in one row
        model.chunks[0](...)                            # positions restart at 0 per prompt
        cache.advance()
        cache.begin([1, 1, 1])                          # decode: one token per row, (3, 1) input
        ...

A step either starts every row from an empty cache (``packed``: the prompts back to back in one
row, document boundaries given by the positions, as training packs documents; attention then runs
exactly the training path, varlen for several prompts) or adds the same number of tokens to every
row (``(batch, n)`` input: one token per decoding step, or a chat turn appended to its
conversation). Those tokens attend to their row's cached tokens and to themselves through the same
attention kernel (``flash_attn_func``'s bottom-right causal mask: query i of n sees the cache and
the new tokens up to i; sliding windows alike). Rows of different lengths are read through the
varlen kernel over the rows' valid tokens (one gather of the cached keys and values per layer);
rows of equal length read a slice of the cache in place.

Why not flash-attn's ``flash_attn_with_kvcache`` / paged blocks: our kernels take dense or packed
(varlen) keys; a contiguous per-row cache fits both, and generation here serves a handful of
prompts, not a server's thousands.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from tpkernels.functional.attention import flash_attn_func, flash_attn_varlen_func, trust_cu_seqlens
from tpkernels.models.attention import SelfAttention


def attention_layers(model) -> list[SelfAttention]:
    """The SelfAttention modules of ``model`` (this rank's layers)."""
    return [m for m in model.modules() if isinstance(m, SelfAttention)]


class KVCache:
    """Keys and values of this rank's attention layers: ``k[layer]``, ``v[layer]`` (batch, capacity,
    kv heads of this rank, head_dim) in the model's dtype; ``lengths`` (batch,) host ints: the tokens
    cached per row. ``capacity`` bounds the tokens a row may hold (prompt + generated)."""

    def __init__(self, model, batch: int, capacity: int, *, dtype: torch.dtype | None = None, device=None):
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch ({batch!r}) must be a positive integer")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity ({capacity!r}) must be a positive integer")
        p = next(model.parameters())
        dtype, device = dtype or model.ctx.dtype or p.dtype, device or p.device
        self.batch, self.capacity = batch, capacity
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        for m in attention_layers(model):
            shape = (batch, capacity, m.nkv, m.hd)
            self.k[m.layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[m.layer] = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.lengths = [0] * batch
        self._new: list[int] | None = None

    @contextlib.contextmanager
    def attached(self, model):
        """Every attention layer of ``model`` reads and writes this cache inside the block (vLLM binds its
        caches to the attention layers the same way); training forwards never see one."""
        layers = attention_layers(model)
        for m in layers:
            m.kv_cache = self
        try:
            yield self
        finally:
            for m in layers:
                m.kv_cache = None

    def reset(self) -> None:
        """Forget every row (the buffers are reused)."""
        self.lengths = [0] * self.batch
        self._new = None

    def begin(self, new: list[int], packed: bool = False) -> None:
        """Announce the next forward: row i adds ``new[i]`` tokens. ``packed``: the input is one row of the
        prompts back to back (every row's cache must be empty); else it is (batch, n), the same n for every
        row. Precomputes where the new keys go and how the rows are read, once for all layers."""
        if len(new) != self.batch or any(not isinstance(n, int) or n < 1 for n in new):
            raise ValueError(f"new tokens per row ({new!r}) must be {self.batch} integers >= 1")
        if packed and any(self.lengths):
            raise ValueError("a packed forward starts every row from an empty cache (reset() first)")
        if not packed and len(set(new)) != 1:
            raise ValueError(f"new tokens per row ({new!r}) must be equal unless packed")
        ends = [a + n for a, n in zip(self.lengths, new)]
        if max(ends) > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens per row; row {ends.index(max(ends))} would "
                             f"reach {max(ends)}")
        dev = self.device
        rows = torch.repeat_interleave(torch.arange(self.batch), torch.tensor(new))
        cols = torch.cat([torch.arange(a, e) for a, e in zip(self.lengths, ends)])
        self._rows, self._cols = rows.to(dev), cols.to(dev)
        self._new, self._packed, self._ends = list(new), packed, ends
        self._fresh = packed or (not any(self.lengths) and len(set(ends)) == 1)
        self._gather = None
        if len(set(ends)) > 1:  # rows of different lengths: the varlen kernel over each row's valid tokens
            idx = torch.cat([r * self.capacity + torch.arange(e) for r, e in enumerate(ends)])
            cu_k = torch.tensor([0] + ends, dtype=torch.int64).cumsum(0).to(torch.int32)
            cu_q = torch.tensor([0] + new, dtype=torch.int64).cumsum(0).to(torch.int32)
            total_k, total_q = int(cu_k[-1]), int(cu_q[-1])
            self._gather = (idx.to(dev), trust_cu_seqlens(cu_q.to(dev), total_q, max(new)),
                            trust_cu_seqlens(cu_k.to(dev), total_k, max(ends)), max(new), max(ends))

    def store(self, layer: int, k: Tensor, v: Tensor) -> bool:
        """Write this step's keys and values (batch', seq', kv heads, head_dim) of ``layer``; returns True
        when the layer must read them back through :meth:`attend` (rows with earlier tokens), False
        when the step's own k and v are everything there is (a first forward: the usual attention)."""
        if self._new is None:
            raise RuntimeError("KVCache.begin() must announce the forward before the layers run")
        nkv, hd = k.shape[-2:]
        self.k[layer][self._rows, self._cols] = k.reshape(-1, nkv, hd)
        self.v[layer][self._rows, self._cols] = v.reshape(-1, nkv, hd)
        return not self._fresh

    def attend(self, layer: int, q: Tensor, window) -> Tensor:
        """q (batch, n, heads, head_dim) of the new tokens against their rows' cached tokens (themselves
        included, bottom-right causal) -> (batch, n, heads, head_dim)."""
        b, n, h, hd = q.shape
        K, V = self.k[layer], self.v[layer]
        if self._gather is None:  # every row holds the same number of tokens: a slice, read in place
            end = self._ends[0]
            return flash_attn_func(q, K[:, :end], V[:, :end], causal=True, window_size=window)
        idx, cu_q, cu_k, max_q, max_k = self._gather
        nkv = K.shape[2]
        kp = K.reshape(-1, nkv, hd).index_select(0, idx)
        vp = V.reshape(-1, nkv, hd).index_select(0, idx)
        o = flash_attn_varlen_func(q.reshape(b * n, h, hd), kp, vp, cu_q, cu_k, max_q, max_k, causal=True,
                                   window_size=window)
        return o.reshape(b, n, h, hd)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order): finished rows leave the batch, and their slots with them."""
        if self._new is not None:
            raise RuntimeError("KVCache.keep() between begin() and advance()")
        if not rows or any(not 0 <= r < self.batch for r in rows):
            raise ValueError(f"rows ({rows!r}) must be a non-empty list of rows in [0, {self.batch})")
        idx = torch.tensor(rows, device=self.device)
        for layer in self.k:
            self.k[layer] = self.k[layer].index_select(0, idx)
            self.v[layer] = self.v[layer].index_select(0, idx)
        self.batch, self.lengths = len(rows), [self.lengths[r] for r in rows]

    def advance(self) -> None:
        """The announced tokens are now cached."""
        if self._new is None:
            raise RuntimeError("KVCache.advance() without a forward announced by begin()")
        self.lengths, self._new = self._ends, None


__all__ = ["KVCache", "attention_layers"]
