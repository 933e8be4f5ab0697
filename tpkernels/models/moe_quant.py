"""A MoE layer's routed experts held as a frozen quantised base (QLoRA on experts, ``quant="nf4"``/``"int8"``).

The stacked expert weights ``w_gate_up`` (E/ep, H, 2F/tp) and ``w_down`` (E/ep, F/tp, H) are then meta
tensors that keep their shape, dtype, TP/EP tags and ``hf_view`` for whoever reads them (LoRA,
checkpoints), as a quantised TP linear's ``weight`` is; the codes live in a
:class:`~tpkernels.functional.grouped_quantized.GroupedQuantizedWeight` each (``moe.quantized[name]``),
one NF4 / int8 matrix per local expert, quantised from the Hugging Face tensors' TP rectangles.

:class:`QuantizedExperts` stands for one such weight in the interface the Hugging Face loader and the
exports use for a quantised TP linear (``weight``, ``quant``, ``qweight.dequantize()``,
``load_quantized_``, ``dequantize_``: :func:`tpkernels.models.hf_io.quantized_layers` lists both).
"""

from __future__ import annotations

import torch
from torch import nn

from tpkernels.functional.grouped_quantized import GroupedQuantizedWeight
from tpkernels.functional.quantized_weight import triton_shape_problem
from tpkernels.parallel.param_tags import tag

EXPERT_WEIGHTS = ("w_gate_up", "w_down")


def quantize_experts(moe, fmt: str) -> None:
    """Turn ``moe``'s stacked expert parameters (not loaded yet) into meta stand-ins plus empty quantised
    weights of format ``fmt`` (loaded by the Hugging Face loader, expert by expert)."""
    store = nn.ModuleDict()
    for name in EXPERT_WEIGHTS:
        p = getattr(moe, name)
        e, inp, out = p.shape
        if fmt == "nf4" and p.device.type == "cuda":  # the CUDA NF4 kernels step K one 64-block per row
            problem = triton_shape_problem(inp, f"quantised experts {name} ({out}×{inp} per expert and rank)")
            if problem:
                raise ValueError(problem)
        meta = tag(torch.empty(p.shape, device="meta", dtype=p.dtype), split_dim=p.tp_tag.split_dim,
                   expert_parallel=True)
        meta.hf_view = "experts"
        store[name] = GroupedQuantizedWeight(fmt, e, (out, inp), p.dtype, p.device)
        delattr(moe, name)
        setattr(moe, name, meta)
    moe.quantized = store


class QuantizedExperts:
    """One quantised stacked expert weight of a MoE layer, as the loader sees a quantised TP linear."""

    def __init__(self, moe, name: str):
        self.moe, self.name = moe, name

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.moe, self.name)

    @property
    def qweight(self) -> GroupedQuantizedWeight:
        return self.moe.quantized[self.name]

    @property
    def quant(self) -> str:
        return self.qweight.fmt

    def load_quantized_(self, weight: torch.Tensor, row_splits: list[int] | None = None) -> "QuantizedExperts":
        """Quantise this rank's stacked slice ``weight`` (E/ep, in, out); ``row_splits``: rows of each Hugging
        Face rectangle in the (E/ep · out, in) view, expert after expert."""
        self.qweight.load_(weight, row_splits)
        return self

    @torch.no_grad()
    def dequantize_(self, values: torch.Tensor | None = None) -> "QuantizedExperts":
        """Hold the dequantised values (or ``values``, this rank's stacked shape) as a frozen parameter again
        (then merge_lora_ and save_hf work as for full-precision experts)."""
        meta = self.weight
        if values is not None and values.shape != meta.shape:
            raise ValueError(f"values of shape {tuple(values.shape)} must have the experts' stacked shape "
                             f"{tuple(meta.shape)}")
        q = self.qweight
        w = q.dequantize() if values is None else values.to(q.device, q.dtype)
        p = nn.Parameter(w.contiguous(), requires_grad=False)
        p.tp_tag, p.hf_view = meta.tp_tag, meta.hf_view
        delattr(self.moe, self.name)
        setattr(self.moe, self.name, p)
        del self.moe.quantized[self.name]
        if not len(self.moe.quantized):
            self.moe.quantized = None
        return self


def quantized_weights(moe) -> dict[str, QuantizedExperts]:
    """``moe``'s expert weights held quantised, by parameter name (empty for full-precision experts)."""
    if getattr(moe, "quantized", None) is None:
        return {}
    return {name: QuantizedExperts(moe, name) for name in EXPERT_WEIGHTS if name in moe.quantized}


__all__ = ["EXPERT_WEIGHTS", "QuantizedExperts", "quantize_experts", "quantized_weights"]
