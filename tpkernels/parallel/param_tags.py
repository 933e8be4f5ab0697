"""What a parameter is across its tensor-parallel group, tagged once where the parameter is made.

    w = tag(nn.Parameter(torch.empty(out // tp, inp)), split_dim=0)     # rows split over TP
    b = tag(nn.Parameter(torch.zeros(hidden)), partial_grad=sp)        # replicated; under SP each rank
                                                                        # sees its tokens only
    tag_of(w).split_dim                                                 # 0

Everything that must know reads the tag, nothing guesses from module types: the global gradient
norm (and so clipping), the gradient sync (SP-partial sums, replicated KV rows, tied embeddings),
LoRA (how an adapter splits follows its base weight's tag) and checkpoints (a tied copy is
written by its original). A parameter without a tag is an error for the norm, so a new sharded
module cannot silently corrupt it (it must say what its parameters are).

Why not DTensor placements: the fused q/k/v and gate/up weights hold several tensors' slices
side by side, and replicated KV rows are replicated over a sub-group of TP: no placement of one
DTensor describes either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

TIED = (None, "embedding", "copy")


@dataclass(frozen=True)
class TPTag:
    """split_dim: the dim along which TP ranks hold different slices (None: every rank holds the same).
    partial_grad: replicated, but this rank's gradient covers only its slice of the sequence (SP):
        summed over the TP group at the end of the step.
    kv_replica_rows: (lo, hi) rows of a split weight that hold a KV head shared by ``kv_replicas``
        TP ranks (TP > KV heads): their gradients are summed over those ranks, counted once.
    tied: "embedding" (the input embedding, tied to a head on another stage) or "copy" (that head's
        copy of it): both summed over the embedding group; the copy counts 0 in the norm.
    expert_parallel: this EP rank's routed experts of a MoE layer (stacked along dim 0; split_dim 1 or
        2 is their TP split): the EP ranks hold different experts, so the norm sums their squares over
        the EP group too, the DP reduction runs over the expert-data-parallel group (the other EP
        groups' copies of the same experts; sum / (dp · cp), see ParallelTransformer.finish_grad_sync)
        and checkpoints gather them over EP."""

    split_dim: int | None = None
    partial_grad: bool = False
    kv_replica_rows: tuple[int, int] | None = None
    kv_replicas: int = 1
    tied: str | None = None
    expert_parallel: bool = False

    def __post_init__(self):
        if self.split_dim not in (None, 0, 1, 2):
            raise ValueError(f"split_dim ({self.split_dim!r}) must be None, 0, 1 or 2 (2: stacked experts)")
        if self.split_dim == 2 and not self.expert_parallel:
            raise ValueError("split_dim (2) is for stacked experts (E, in, out): it needs expert_parallel=True")
        if self.tied not in TIED:
            raise ValueError(f"tied ({self.tied!r}) must be one of {TIED}")
        if self.kv_replica_rows is not None and self.split_dim != 0:
            raise ValueError("kv_replica_rows need split_dim=0 (KV heads are rows of a column-parallel weight)")
        if self.partial_grad and self.split_dim is not None:
            raise ValueError("partial_grad is for replicated parameters (split_dim=None)")


def tag(param: torch.nn.Parameter, **fields) -> torch.nn.Parameter:
    """Tag ``param`` with :class:`TPTag` ``fields`` (replacing any tag it has); returns it."""
    param.tp_tag = TPTag(**fields)
    return param


def retag(param: torch.nn.Parameter, **changes) -> torch.nn.Parameter:
    """Change fields of ``param``'s tag (e.g. the attention marks the KV rows of its q/k/v weight)."""
    param.tp_tag = dataclasses.replace(tag_of(param, required=True), **changes)
    return param


def tag_of(param: torch.Tensor, *, required: bool = False, name: str = "") -> TPTag | None:
    t = getattr(param, "tp_tag", None)
    if t is None and required:
        raise ValueError(f"parameter {name or tuple(param.shape)} has no TP tag: create it with "
                         "tpkernels.parallel.param_tags.tag(param, split_dim=...) so the gradient norm, sync and "
                         "checkpoints know whether its TP ranks hold slices or copies")
    return t


def copy_tag(src: torch.Tensor, dst: torch.nn.Parameter) -> torch.nn.Parameter:
    """Give ``dst`` (e.g. an fp32 master weight) the tag of ``src``."""
    t = tag_of(src)
    if t is not None:
        dst.tp_tag = t
    return dst


__all__ = ["TIED", "TPTag", "copy_tag", "retag", "tag", "tag_of"]
