"""``FlashAttention``: the core attention of a Transformer layer (q, k, v -> out), no parameters.

Drop-in for code that calls ``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func`` or
``F.scaled_dot_product_attention`` inside its attention block; projections stay outside.
"""

from __future__ import annotations

from torch import Tensor, nn

from tpkernels.functional.attention import _check_scalars, flash_attn_func, flash_attn_varlen_func


class FlashAttention(nn.Module):
    """out = softmax(q·kᵀ·scale [+ causal / sliding-window mask]) · v per head, with GQA/MQA.

    Args:
        causal: bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q).
        softmax_scale: defaults to 1 / sqrt(headdim).
        window_size: (left, right) sliding window, -1 for no limit (Mistral: (4095, 0) with causal).
        softcap: > 0 soft-caps the scores (Gemma 2); see :func:`tpkernels.flash_attn_func`.

    Forward:
        dense:  q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim)
                -> (batch, seqlen_q, nheads, headdim)
        varlen: q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim) with
                cu_seqlens_q/k (batch + 1,) int32 and max_seqlen_q/k -> (total_q, nheads, headdim)
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0):
        super().__init__()
        self.window_size = _check_scalars(0.0, softmax_scale, causal, window_size, softcap, None, False, False,
                                          False)
        self.causal, self.softmax_scale, self.softcap = causal, softmax_scale, float(softcap)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None = None,
                cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None) -> Tensor:
        kw = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                  softcap=self.softcap)
        if cu_seqlens_q is None and cu_seqlens_k is None:
            return flash_attn_func(q, k, v, **kw)
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen attention needs all of cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k")
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, softmax_scale={self.softmax_scale}, window_size={self.window_size}, "
                f"softcap={self.softcap}")
