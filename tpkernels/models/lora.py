"""LoRA adapters on the TP-sharded linear layers (q/k/v, output, gate/up, down), sharded with them,
and (target ``experts``) on a MoE layer's routed experts (:mod:`tpkernels.models.expert_lora`).

    apply_lora(model, rank=16, alpha=32)     # base weights frozen; only A and B train
    model.merge_lora_()                       # W += alpha/r · B·A, shard by shard (then save_hf)

y = W·x + (alpha / r) · B·(A·x). How A (r × in) and B (out × r) are split follows the base layer,
so every rank's shard of the merged weight is its own B·A and nothing is gathered:

| base layer | A | B | the r-wide communication of the adapter path |
|---|---|---|---|
| column-parallel, W (out/P, in) | replicated | rows split like W | no SP: the gradient of A·x summed over TP; SP: A·x of this rank's tokens all-gathered (backward: reduce-scatter) |
| row-parallel, W (out, in/P) | columns split like W | replicated | no SP: A·x summed over TP; SP: reduce-scattered along the sequence |

The collectives carry r numbers per token, not hidden-size ones. Which split applies is read from
the base weight's TP tag (:mod:`tpkernels.parallel.param_tags`), and the factors are tagged in
turn: under SP the replicated factor (A of a column layer, B of a row layer) sees this rank's
tokens only, so its gradient is tagged TP-partial and summed over TP by ``finish_grad_sync``,
like the norms; B of a column layer inherits the base's replicated KV rows. Checkpoints store the
adapters under the base tensor's Hugging Face rows and columns ("lora_A.…", "lora_B.…"), so
they reshard with it. What the adapters are (rank, alpha, targets, the scaling rule: :class:`LoRASpec`)
is kept on the model and in the checkpoint's meta; a checkpoint resumes only into the same.
"""

from __future__ import annotations

import math
import types
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from tpkernels.models.expert_lora import ExpertLoRA, experts_with_lora
from tpkernels.models.hf_checkpoint import Part
from tpkernels.models.moe import MoE
from tpkernels.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.param_tags import tag, tag_of
from tpkernels.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)

TARGETS = ("qkv", "out", "gate_up", "up", "down")
EXPERTS = "experts"  # a MoE layer's routed experts (tpkernels.models.expert_lora), a target of MoE models
SCALING = "alpha/rank"  # the update is (alpha / rank)·B·A, not rsLoRA's alpha / sqrt(rank): part of their meaning


@dataclass(frozen=True)
class LoRASpec:
    """Everything that gives a model's adapters their shape or meaning; a checkpoint's adapters resume only
    into a model of the same spec (tpkernels.train.checkpoint.check_same_adapters). ``alpha`` is resolved
    (its default 2 · rank written out), so an explicit alpha equal to the default is the same spec."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    scaling: str = SCALING

    @classmethod
    def of(cls, rank: int, alpha: float | None = None, targets=TARGETS) -> "LoRASpec":
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"lora_rank ({rank!r}) must be a positive integer")
        return cls(rank, float(alpha if alpha is not None else 2 * rank), tuple(targets))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "scaling": self.scaling}


class LoRA(nn.Module):
    """The adapter of one Column/RowParallelLinear: forward(x) is the update (alpha/r)·B·A·x in the
    layout of the base layer's output."""

    def __init__(self, base: nn.Module, rank: int, alpha: float):
        super().__init__()
        w = base.weight
        wt = tag_of(w, required=True, name=f"{type(base).__name__}.weight")
        self.column = wt.split_dim == 0  # output rows split (column-parallel); 1: input columns (row-parallel)
        self.group, self.tp, self.sp = base.tp_group, base.tp_size, base.sequence_parallel and base.tp_size > 1
        self.seq_dim, self.rank, self.scale = base.sequence_dim, rank, alpha / rank
        kw = dict(device=base.weight_device, dtype=w.dtype)  # a quantised base's weight is a meta stand-in
        in_local, out_local = w.shape[1], w.shape[0]
        self.A = nn.Parameter(torch.empty(rank, in_local, **kw))
        self.B = nn.Parameter(torch.zeros(out_local, rank, **kw))  # zero: training starts at the base model
        if self.column:  # B's rows follow W's, replicated KV rows included
            tag(self.A, partial_grad=self.sp)
            tag(self.B, split_dim=0, kv_replica_rows=wt.kv_replica_rows, kv_replicas=wt.kv_replicas)
        else:
            tag(self.A, split_dim=1)
            tag(self.B, partial_grad=self.sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x @ self.A.t()  # (..., r)
        if self.column:
            if self.tp > 1:
                u = gather_from_sequence_parallel(u, self.group, self.seq_dim) if self.sp else \
                    copy_to_tensor_parallel(u, self.group)
        elif self.tp > 1:
            u = reduce_scatter_to_sequence_parallel(u, self.group, self.seq_dim) if self.sp else \
                reduce_from_tensor_parallel(u, self.group)
        return (u @ self.B.t()) * self.scale

    def delta(self) -> torch.Tensor:
        """(alpha/r)·B·A: this rank's shard of the weight update."""
        return (self.B @ self.A) * self.scale


def _forward_with_lora(self, x):
    return self._lora_base_forward(x) + self.lora(x)


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=TARGETS, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` and add adapters to the named TP linears of its layers
    (B = 0; A drawn whole from (``seed``: the run's training.seed, tensor name) and sliced, so every
    layout starts alike). ``model.lora_spec`` records what they are. Returns the adapted layers' names."""
    spec = LoRASpec.of(rank, alpha, targets)
    rank, alpha = spec.rank, spec.alpha
    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and name.rsplit(".", 1)[-1] in targets:
            m.lora = LoRA(m, rank, alpha)
            m._lora_base_forward = m.forward
            m.forward = types.MethodType(_forward_with_lora, m)
            done.append(name)
        elif isinstance(m, MoE) and EXPERTS in targets:
            m.lora = ExpertLoRA(m, rank, alpha)
            m._experts = types.MethodType(experts_with_lora, m)
            done.append(f"{name}.experts")
    if not done:
        raise ValueError(f"no layer of the model matches lora targets {list(targets)}")
    model.lora_spec = spec
    _init_a(model, seed)
    return done


def lora_spec(model: nn.Module) -> LoRASpec | None:
    """What ``model``'s adapters are (:func:`apply_lora` recorded it), or None without adapters."""
    return getattr(model, "lora_spec", None)


@torch.no_grad()
def _init_a(model, seed: int) -> None:
    """Kaiming-uniform A of the whole layer, U(±1/sqrt(in_features)), from a generator keyed by its name."""
    base = model.param_parts()
    for name, m in model.named_modules():
        if isinstance(getattr(m, "lora", None), ExpertLoRA):
            m.lora.init_a(m, seed)
        if not isinstance(getattr(m, "lora", None), LoRA):
            continue
        part_list = base[f"{name}.weight"]
        lora, hf = m.lora, part_list[0].name
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(hf.encode())) % 2 ** 63)
        bound = 1.0 / math.sqrt(m.in_features)
        full = (torch.rand(lora.rank, m.in_features, generator=g) * 2 - 1) * bound
        if not lora.column:
            c0, c1 = part_list[0].cols
            full = full[:, c0:c1]
        lora.A.copy_(full)


@torch.no_grad()
def merge_lora_(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W += (alpha/r)·B·A) and zero B; returns how many."""
    n = 0
    for m in model.modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, ExpertLoRA):
            lora.merge_into(m)
            n += 1
        if isinstance(lora, LoRA):
            if getattr(m, "qweight", None) is not None:
                raise ValueError("merge_lora_ needs full-precision base weights; call dequantize_() on the quantised "
                                 "layers first (the merged weight is the dequantised base + alpha/r · B·A)")
            m.weight += lora.delta().to(m.weight.dtype)
            lora.B.zero_()
            n += 1
    return n


def lora_parts(model, tp_rank: int | None = None) -> dict[str, list[Part]]:
    """Our adapter parameter names -> their Hugging Face rectangles (derived from the base weight's):
    B of a column layer and A of a row layer follow the base's split; the other factor is whole."""
    base = model.param_parts(tp_rank)
    out = {}
    for name, m in model.named_modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, ExpertLoRA):  # this rank's experts at this layout's TP rank
            out.update({f"{name}.lora.{k}": v for k, v in lora.parts(m).items()})
        if not isinstance(lora, LoRA):
            continue
        wparts = base[f"{name}.weight"]
        r = lora.rank
        if lora.column:
            out[f"{name}.lora.B"] = [Part(f"lora_B.{p.name}", rows=p.rows, cols=(0, r)) for p in wparts]
            hf = wparts[0].name
            out[f"{name}.lora.A"] = [Part(f"lora_A.{hf}", rows=(0, r), cols=(0, m.in_features))]
        else:
            hf = wparts[0].name
            out[f"{name}.lora.A"] = [Part(f"lora_A.{hf}", rows=(0, r), cols=p.cols) for p in wparts]
            out[f"{name}.lora.B"] = [Part(f"lora_B.{hf}", rows=(0, m.out_features), cols=(0, r))]
    return out


def lora_shapes(model) -> dict[str, tuple[int, int]]:
    """Full shapes of the adapters' Hugging Face-named tensors (for checkpoints)."""
    full = {}
    base_shapes = {k: v for c in model.chunks for k, v in c.shapes().items()}
    base = model.param_parts()
    for name, m in model.named_modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, ExpertLoRA):
            full.update(lora.shapes(m))
        if not isinstance(lora, LoRA):
            continue
        for p in base[f"{name}.weight"]:
            if p.name is None:
                continue
            out_f, in_f = base_shapes[p.name]
            full[f"lora_B.{p.name}"] = (out_f, lora.rank)
            full[f"lora_A.{p.name}"] = (lora.rank, in_f)
    return full


__all__ = ["EXPERTS", "LoRA", "LoRASpec", "SCALING", "TARGETS", "apply_lora", "lora_parts", "lora_shapes", "lora_spec",
           "merge_lora_"]
