"""Self-attention with TP: a fused column-parallel q/k/v GEMM, rotary, our FlashAttention
(dense or varlen for packed documents, GQA, sliding window), a row-parallel output GEMM.

Heads per TP rank: nq/TP query heads; KV heads split over TP when nkv ≥ TP, else each rank holds
the one KV head its query heads use (replicated over TP/nkv ranks, as vLLM and TransformerEngine
do). Rank r's slice of the fused q/k/v output is [q heads of r | k heads of r | v heads of r], so
one column-parallel GEMM (one all-gather under SP) serves all three. Replicated KV rows get
partial gradients (from this rank's query heads only); the model sums them over the ranks that
share the head at the end of the step (the weight's tag: ``kv_replica_rows``).

Qwen3's per-head q/k norms (``qk_norm``): q and k are RMS-normalised over each head's head_dim before
rotary, with two (head_dim,) weights shared by all heads (transformers' ``q_norm`` / ``k_norm``). The
weights are whole on every TP rank, but a rank's heads are its own, so its gradient covers them only:
tagged ``partial_grad`` and summed over TP at the end of the step (SP or not). The cache below holds
the normalised, rotated keys, as transformers' cache does.

Generation: ``kv_cache`` (None in training) is a :class:`~tpkernels.models.kv_cache.KVCache` bound
for the duration of a generate call; the layer then stores its rotated keys and values there and,
once a row holds earlier tokens, attends to them from the cache (one query per decoding step).
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.functional.attention import flash_attn_func, flash_attn_varlen_func
from tpkernels.functional.context_parallel import context_parallel_attention
from tpkernels.functional.norms import rms_norm
from tpkernels.functional.rotary import apply_rotary
from tpkernels.models.context import LayerContext
from tpkernels.models.hf_checkpoint import Part
from tpkernels.models.recompute import recomputed
from tpkernels.models.sequence import SequenceInfo
from tpkernels.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.param_tags import retag, tag


def kv_layout(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head of rank ``tp_rank``, KV heads per rank)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return tp_rank * per, per
    return tp_rank * num_kv_heads // tp_size, 1


def kv_replica_groups(num_kv_heads: int, tp_size: int) -> list[list[int]] | None:
    """TP ranks sharing one KV head (None when every rank has its own)."""
    if num_kv_heads >= tp_size:
        return None
    return [[r for r in range(tp_size) if r * num_kv_heads // tp_size == g] for g in range(num_kv_heads)]


class SelfAttention(nn.Module):
    """forward(x (batch, seq[/TP], hidden), info, rope (cos, sin) or None) -> like x."""

    def __init__(self, ctx: LayerContext, layer: int):
        super().__init__()
        mc = ctx.mc
        self.ctx, self.layer = ctx, layer
        self.hd = mc.dhead
        self.nq = mc.num_attention_heads // ctx.tp_size
        self.kv0, self.nkv = kv_layout(mc.kv_heads, ctx.tp_size, ctx.tp_rank)
        width = (self.nq + 2 * self.nkv) * self.hd
        kw = ctx.tp_kwargs()
        self.qkv = ColumnParallelLinear(mc.hidden_size, width * ctx.tp_size, bias=mc.qkv_bias, **kw)
        self.out = RowParallelLinear(mc.num_attention_heads * self.hd, mc.hidden_size, bias=mc.out_bias, **kw)
        self.window = mc.window(layer)
        self.selective_recompute = ctx.recompute == "selective"
        self.kv_cache = None  # a KVCache while generating (tpkernels.models.kv_cache), never in training
        if mc.kv_heads < ctx.tp_size:  # this rank's KV rows are shared with tp / kv_heads - 1 other ranks
            rows, replicas = (self.nq * self.hd, width), ctx.tp_size // mc.kv_heads
            for p in (self.qkv.weight, self.qkv.bias):
                if p is not None:
                    retag(p, kv_replica_rows=rows, kv_replicas=replicas)
        self.q_norm = self.k_norm = None
        if mc.qk_norm:  # (head_dim,) each; partial over TP: this rank's heads only (module docstring)
            self.norm_eps = mc.norm_eps
            self.q_norm = tag(nn.Parameter(torch.ones(self.hd, **ctx.factory())), partial_grad=ctx.tp_size > 1)
            self.k_norm = tag(nn.Parameter(torch.ones(self.hd, **ctx.factory())), partial_grad=ctx.tp_size > 1)

    def forward(self, x: torch.Tensor, info: SequenceInfo, rope) -> torch.Tensor:
        y = self.qkv(x)
        if self.selective_recompute and y.requires_grad:
            o = recomputed(self._core, y, info, rope)
        else:
            o = self._core(y, info, rope)
        return self.out(o)

    def _core(self, y: torch.Tensor, info: SequenceInfo, rope) -> torch.Tensor:
        """q/k/v split, rotary and attention: (batch, seq, width) -> (batch, seq, heads·head_dim)."""
        b, s = y.shape[:2]
        q, k, v = y.view(b, s, self.nq + 2 * self.nkv, self.hd).split([self.nq, self.nkv, self.nkv], dim=2)
        if self.q_norm is not None:  # (batch, seq, heads, head_dim) rows of head_dim, before rotary (Qwen3)
            q, k = rms_norm(q, self.q_norm, self.norm_eps), rms_norm(k, self.k_norm, self.norm_eps)
        if rope is not None:
            # positions were checked once for the step, on the host (ParallelTransformer)
            q, k = apply_rotary(q, k, rope[0], rope[1], position_ids=info.position_ids, check_positions=False)
        ctx = self.ctx
        if self.kv_cache is not None and self.kv_cache.store(self.layer, k, v):  # generation, rows with a past
            o = self.kv_cache.attend(self.layer, q, self.window)
        elif ctx.cp_size > 1:  # this rank holds a zigzag share; positions are global (rotary used them)
            o = context_parallel_attention(q, k, v, ctx.cp_group, algo=ctx.cp_algo, causal=True, window=self.window,
                                           cu_seqlens=info.cp_cu_seqlens)  # the global documents, on the host
        elif info.cu_seqlens is None:
            o = flash_attn_func(q, k, v, causal=True, window_size=self.window)
        else:
            cu, n = info.cu_seqlens, info.max_seqlen
            o = flash_attn_varlen_func(q.reshape(b * s, self.nq, self.hd), k.reshape(b * s, self.nkv, self.hd),
                                       v.reshape(b * s, self.nkv, self.hd), cu, cu, n, n, causal=True,
                                       window_size=self.window)
        return o.reshape(b, s, self.nq * self.hd)

    # ---- Hugging Face layout ----
    def _qkv_parts(self, tp_rank: int, param: str, tp_size: int) -> list[Part]:
        mc, ctx, hd, i = self.ctx.mc, self.ctx, self.hd, self.layer
        nq = mc.num_attention_heads // tp_size
        q0 = tp_rank * nq
        kv0, nkv = kv_layout(mc.kv_heads, tp_size, tp_rank)
        t = ctx.transposed and param == "weight"
        spans = [(q0 * hd, (q0 + nq) * hd), (kv0 * hd, (kv0 + nkv) * hd), (kv0 * hd, (kv0 + nkv) * hd)]
        if "qkv" in ctx.names:  # GPT-2: one fused c_attn, columns [q | k | v]
            name, offsets = ctx.hf("qkv", i, param), (0, mc.num_attention_heads * hd,
                                                      (mc.num_attention_heads + mc.kv_heads) * hd)
            return [Part(name, rows=(a + o, b + o), transpose=t) for (a, b), o in zip(spans, offsets)]
        return [Part(ctx.hf(role, i, param), rows=span, transpose=t) for role, span in zip("qkv", spans)]

    def hf_parts(self, tp_rank: int, tp_size: int | None = None) -> dict[str, list[Part]]:
        """Rank ``tp_rank``'s parts at TP size ``tp_size`` (default the model's: another serves an export that
        rebuilds each rank's shards in one process)."""
        ctx, i, hd = self.ctx, self.layer, self.hd
        tp = tp_size or ctx.tp_size
        nq = ctx.mc.num_attention_heads // tp
        cols = (tp_rank * nq * hd, (tp_rank + 1) * nq * hd)
        parts = {"qkv.weight": self._qkv_parts(tp_rank, "weight", tp),
                 "out.weight": [Part(ctx.hf("out", i), cols=cols, transpose=ctx.transposed)]}
        if self.qkv.bias is not None:
            parts["qkv.bias"] = self._qkv_parts(tp_rank, "bias", tp)
        if self.out.bias is not None:
            parts["out.bias"] = [Part(ctx.hf("out", i, "bias"))]
        if self.q_norm is not None:  # replicated: whole on every rank
            parts["q_norm"], parts["k_norm"] = [Part(ctx.hf("q_norm", i))], [Part(ctx.hf("k_norm", i))]
        return parts

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        mc, ctx, i = self.ctx.mc, self.ctx, self.layer
        h, q, kv = mc.hidden_size, mc.num_attention_heads * self.hd, mc.kv_heads * self.hd
        shapes = {ctx.hf("out", i): (h, q)}
        if "qkv" in ctx.names:
            shapes[ctx.hf("qkv", i)] = (q + 2 * kv, h)
            if mc.qkv_bias:
                shapes[ctx.hf("qkv", i, "bias")] = (q + 2 * kv,)
        else:
            for role, n in (("q", q), ("k", kv), ("v", kv)):
                shapes[ctx.hf(role, i)] = (n, h)
                if mc.qkv_bias:
                    shapes[ctx.hf(role, i, "bias")] = (n,)
        if mc.out_bias:
            shapes[ctx.hf("out", i, "bias")] = (h,)
        if mc.qk_norm:
            shapes[ctx.hf("q_norm", i)] = shapes[ctx.hf("k_norm", i)] = (self.hd,)
        return shapes
