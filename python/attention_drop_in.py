"""Switch a Llama-style attention block to tpkernels' FlashAttention with an import change.

    python python/attention_drop_in.py

1. A GQA attention block (8 query heads, 2 KV heads) written for `flash_attn.flash_attn_func`
   runs with `tpkernels.flash_attn_func` instead: same call, same (batch, seqlen, nheads, headdim)
   layout. Its output and gradients are checked against torch's scaled_dot_product_attention.
2. Packed sequences (SFT with packing): `flash_attn_varlen_func` over 3 concatenated sequences
   equals running each sequence alone; no token attends across a boundary.
Runs on a GPU (bf16, Triton kernels) when there is one, else on the CPU (fp32, reference path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# before: from flash_attn import flash_attn_func, flash_attn_varlen_func
from tpkernels import flash_attn_func, flash_attn_varlen_func


class Attention(nn.Module):
    """Llama-style self-attention with GQA. x: (batch, seqlen, hidden) -> (batch, seqlen, hidden)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, hidden // n_heads
        self.wq = nn.Linear(hidden, n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(hidden, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, hidden, bias=False)

    def qkv(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k, v = self.wkv(x).view(b, s, 2, self.n_kv, self.head_dim).unbind(2)  # strided views: no copy
        return q, k, v

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.wo(flash_attn_func(q, k, v, causal=True).flatten(2))

    def forward_sdpa(self, x):  # the peer, for the check
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
                       .flatten(2))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.manual_seed(0)
    block = Attention(hidden=256, n_heads=8, n_kv_heads=2).to(device, dtype)
    x = torch.randn(2, 129, 256, device=device, dtype=dtype)

    ours = block(x)
    ours.float().square().mean().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    peer = block.forward_sdpa(x)
    peer.float().square().mean().backward()
    torch.testing.assert_close(ours, peer, rtol=tol, atol=tol)
    for g, p in zip(grads, block.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=tol, atol=tol)
    print(f"GQA block on {device} ({dtype}): output and weight gradients match scaled_dot_product_attention")

    # packing: 3 sequences of 37, 5 and 87 tokens in one (129, heads, dim) batch
    lengths = [37, 5, 87]
    cu = torch.tensor([0, 37, 42, 129], dtype=torch.int32, device=device)
    q, k, v = block.qkv(x[:1])
    q, k, v = q[0], k[0], v[0]
    packed = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    starts = cu.tolist()
    for i, n in enumerate(lengths):
        a, b = starts[i], starts[i + 1]
        alone = flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)[0]
        torch.testing.assert_close(packed[a:b], alone, rtol=tol, atol=tol)
    print(f"varlen: {len(lengths)} packed sequences {lengths} equal each sequence run alone")


if __name__ == "__main__":
    main()
