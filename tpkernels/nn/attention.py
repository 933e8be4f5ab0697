"""``FlashAttention``: the core attention of a Transformer layer (q, k, v -> out), no parameters.

Drop-in for code that calls ``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func`` or
``F.scaled_dot_product_attention`` inside its attention block; projections stay outside.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from tpkernels.functional.attention import flash_attn_func, flash_attn_varlen_func


class FlashAttention(nn.Module):
    """out = softmax(q·kᵀ·scale [+ causal mask]) · v per head, with GQA/MQA.

    Args:
        causal: bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q).
        softmax_scale: defaults to 1 / sqrt(headdim).

    Forward:
        dense:  q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim)
                -> (batch, seqlen_q, nheads, headdim)
        varlen: q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim) with
                cu_seqlens_q/k (batch + 1,) int32 and max_seqlen_q/k -> (total_q, nheads, headdim)
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None):
        super().__init__()
        if not isinstance(causal, bool):
            raise TypeError(f"causal ({causal!r}) must be a bool")
        if softmax_scale is not None and (not math.isfinite(softmax_scale) or softmax_scale <= 0):
            raise ValueError(f"softmax_scale ({softmax_scale}) must be a finite number > 0, or None")
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None = None,
                cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None) -> Tensor:
        if cu_seqlens_q is None and cu_seqlens_k is None:
            return flash_attn_func(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal)
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen attention needs all of cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k")
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=self.softmax_scale, causal=self.causal)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}"
