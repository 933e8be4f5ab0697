"""LoRA on a MoE layer's routed experts: one (A, B) pair per expert and per matrix, stacked like the experts
and split over TP and EP like them (:mod:`tpkernels.models.lora` holds the TP linears' adapters).

    gate_up(x) = x · W_gu[e] + (alpha/r) · (x · A_gu[e]) · B_gu[e]        W_gu[e]: (H, 2F/tp) = [gate | up]
    down(a)    = a · W_d[e]  + (alpha/r) · (a · A_d[e])  · B_d[e]         W_d[e]:  (F/tp, H)

| factor | stacked shape | TP | like the dense adapter of |
|---|---|---|---|
| A_gu | (E/ep, H, r) | replicated; gradient a partial sum (B_gu is split): summed over TP | a column layer's A |
| B_gu | (E/ep, r, 2F/tp) | columns [gate \\| up] split like W_gu | a column layer's B |
| A_d | (E/ep, F/tp, r) | rows split like W_d | a row layer's A |
| B_d | (E/ep, r, H) | replicated; x·A_d is partial over TP, so is B_d's gradient: summed over TP | a row layer's B |

No communication of its own: the update of the down matrix is a partial sum over TP like the base's,
reduced with it after the combine. Every factor is tagged ``expert_parallel`` (the DP reduction, the
norm, ZeRO-1 and checkpoints treat it as the experts) and carries ``hf_view = "experts"``: its
checkpoint rectangles are those of PEFT's per-expert tensors ``lora_A.<expert's w1/w2/w3>`` (r, in)
and ``lora_B.<...>`` (out, r), so they reshard over TP and EP like the experts. The experts' MLP runs
unfused with adapters (grouped GEMMs, SwiGLU between), since the update enters before the activation.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from tpkernels.functional.grouped_gemm import grouped_gemm
from tpkernels.models.hf_checkpoint import Part
from tpkernels.parallel.param_tags import tag

FACTORS = ("A_gu", "B_gu", "A_d", "B_d")


class ExpertLoRA(nn.Module):
    """The adapters of one :class:`~tpkernels.models.moe.MoE` layer's local experts (module docstring)."""

    def __init__(self, moe, rank: int, alpha: float):
        super().__init__()
        e, h, f, tp = moe.num_local, moe.ctx.mc.hidden_size, moe.f, moe.ctx.tp_size
        self.rank, self.scale, self.f = rank, alpha / rank, f
        # a quantised base (QLoRA) keeps only a meta stand-in of the stacked weight: its codes say where it lives
        dev = moe.quantized["w_gate_up"].device if moe.quantized is not None else moe.w_gate_up.device
        kw = dict(device=dev, dtype=moe.w_gate_up.dtype)
        self.A_gu = tag(nn.Parameter(torch.empty(e, h, rank, **kw)), partial_grad=tp > 1, expert_parallel=True)
        self.B_gu = tag(nn.Parameter(torch.zeros(e, rank, 2 * f, **kw)), split_dim=2, expert_parallel=True)
        self.A_d = tag(nn.Parameter(torch.empty(e, f, rank, **kw)), split_dim=1, expert_parallel=True)
        self.B_d = tag(nn.Parameter(torch.zeros(e, rank, h, **kw)), partial_grad=tp > 1, expert_parallel=True)
        for p in (self.A_gu, self.B_gu, self.A_d, self.B_d):
            p.hf_view = "experts"

    def mlp(self, moe, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' SwiGLU MLP with the adapters over ``rows`` (M, H) grouped by local expert -> (M, H),
        partial over TP."""
        s = self.scale  # the base in its weight format (dense, or QLoRA's frozen NF4 / int8): moe.expert_gemm
        gate_up = moe.expert_gemm("w_gate_up", rows, counts) + \
            s * grouped_gemm(grouped_gemm(rows, self.A_gu, counts), self.B_gu, counts)
        a = F.silu(gate_up[:, :self.f]) * gate_up[:, self.f:]
        return moe.expert_gemm("w_down", a, counts) + s * grouped_gemm(grouped_gemm(a, self.A_d, counts), self.B_d,
                                                                       counts)

    @torch.no_grad()
    def merge_into(self, moe) -> None:
        """W += (alpha/r)·A·B expert by expert (this rank's shards), then B = 0."""
        if moe.quantized is not None:
            raise ValueError("merge_lora_ needs full-precision base weights; the routed experts hold a quantised "
                             "base: call dequantize_() on each of moe.quantized_weights() first (export-hf does)")
        moe.w_gate_up += (self.scale * torch.bmm(self.A_gu, self.B_gu)).to(moe.w_gate_up.dtype)
        moe.w_down += (self.scale * torch.bmm(self.A_d, self.B_d)).to(moe.w_down.dtype)
        self.B_gu.zero_()
        self.B_d.zero_()

    @torch.no_grad()
    def init_a(self, moe, seed: int) -> None:
        """Kaiming-uniform A of each expert's whole matrix, U(±1/sqrt(in)), from a generator keyed by the
        expert's tensor name (as the dense adapters): the same start at every TP × EP layout."""
        ctx = moe.ctx
        full_f = ctx.mc.expert_ffn
        for j in range(moe.num_local):
            e = ctx.ep_rank * moe.num_local + j
            for role, a, n_in in (("expert_gate", self.A_gu, ctx.mc.hidden_size), ("expert_down", self.A_d, full_f)):
                name = ctx.moe_hf(role, moe.layer, e)
                g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)
                full = (torch.rand(self.rank, n_in, generator=g) * 2 - 1) / math.sqrt(n_in)
                if role == "expert_down":
                    full = full[:, ctx.tp_rank * moe.f:(ctx.tp_rank + 1) * moe.f]
                a[j].copy_(full.t())

    def parts(self, moe) -> dict[str, list[Part]]:
        """Factor name -> the rectangles of PEFT's per-expert tensors it is made of (see the module docstring)."""
        ctx, r, f = moe.ctx, self.rank, moe.f
        h, i = ctx.mc.hidden_size, moe.layer
        rows = (ctx.tp_rank * f, (ctx.tp_rank + 1) * f)
        local = range(ctx.ep_rank * moe.num_local, (ctx.ep_rank + 1) * moe.num_local)

        def name(role, e):
            return "lora_{}." + ctx.moe_hf(role, i, e)

        return {"A_gu": [Part(name("expert_gate", e).format("A"), rows=(0, r), cols=(0, h)) for e in local],
                "B_gu": [Part(name(role, e).format("B"), rows=rows, cols=(0, r))
                         for e in local for role in ("expert_gate", "expert_up")],
                "A_d": [Part(name("expert_down", e).format("A"), rows=(0, r), cols=rows) for e in local],
                "B_d": [Part(name("expert_down", e).format("B"), rows=(0, h), cols=(0, r)) for e in local]}

    def shapes(self, moe) -> dict[str, tuple[int, int]]:
        """Full shapes of the adapters' per-expert tensors (for checkpoints)."""
        ctx, r = moe.ctx, self.rank
        h, f = ctx.mc.hidden_size, ctx.mc.expert_ffn
        out = {}
        for e in range(ctx.mc.num_experts):
            for role, (o, n_in) in (("expert_gate", (f, h)), ("expert_up", (f, h)), ("expert_down", (h, f))):
                name = ctx.moe_hf(role, moe.layer, e)
                out[f"lora_B.{name}"] = (o, r)
                if role != "expert_up":
                    out[f"lora_A.{name}"] = (r, n_in)
        return out


def experts_with_lora(self, rows, counts):
    """A MoE layer's ``_experts`` once it holds adapters (``self.lora``): the unfused MLP with the updates."""
    return self.lora.mlp(self, rows, counts)


__all__ = ["ExpertLoRA", "FACTORS", "experts_with_lora"]
