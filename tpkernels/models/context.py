"""What every layer of a model needs to know about its layout (one object, built once per model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpkernels.description import ModelConfig
from tpkernels.models.hf_names import HF_NAMES, MOE_NAMES, TRANSPOSED
from tpkernels.parallel.param_tags import tag


@dataclass(frozen=True, kw_only=True)
class LayerContext:
    """mc: the model; tp_group/tp_rank/tp_size: this rank's TP group; sequence_parallel: activations
    between the TP regions are sharded along the sequence (dim 1 of (batch, seq, hidden));
    overlap_comm/algo: the TP layers' communication overlap and GEMM-comm algorithm."""

    mc: ModelConfig
    tp_group: object
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    overlap_comm: bool = True
    algo: str = "auto"
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    recompute: str = "none"  # ParallelConfig.recompute: "none", "selective" (attention core), "full" (layer)
    cp_group: object = None  # context parallelism: this rank holds a zigzag share of each sequence
    cp_rank: int = 0
    cp_size: int = 1
    cp_algo: str = "ring"
    quant: str | None = None  # the layers' TP linears hold a frozen quantised base ("nf4", "int8"; QLoRA)
    ep_group: object = None  # expert parallelism: this rank holds experts ep_rank·E/ep ... of each MoE layer
    ep_rank: int = 0
    ep_size: int = 1
    dp_cp_group: object = None  # the ranks whose tokens the router's balancing losses average over
    moe_losses: object = None  # the model's RouterLosses (tpkernels.models.moe), shared by its MoE layers
    moe_chunks: int = 2  # ParallelConfig.moe_chunks: pieces of a MoE layer's token exchange over EP (overlapped with the GEMMs)

    @property
    def names(self) -> dict[str, str]:
        return HF_NAMES[self.mc.family]

    @property
    def transposed(self) -> bool:
        return TRANSPOSED[self.mc.family]

    def hf(self, role: str, layer: int | None = None, param: str = "weight") -> str:
        return self.names[role].format(i=layer) + "." + param

    def moe_hf(self, role: str, layer: int, expert: int | None = None, param: str = "weight") -> str:
        """The HF name of a MoE block's tensor (``MOE_NAMES``): ``expert`` for the routed experts'."""
        return MOE_NAMES[self.mc.model_type][role].format(i=layer, e=expert) + "." + param

    def tp_kwargs(self) -> dict:
        """Keyword arguments of Column/RowParallelLinear for this layout (batch-first: sequence dim 1)."""
        return dict(tp_group=self.tp_group, sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm,
                    sequence_dim=1, algo=self.algo, device=self.device, dtype=self.dtype, quant=self.quant)

    def factory(self) -> dict:
        return dict(device=self.device, dtype=self.dtype)


def replicated(param: torch.nn.Parameter, ctx: LayerContext) -> torch.nn.Parameter:
    """Tag a parameter replicated over TP; under SP it sees only this rank's slice of the sequence, so its
    gradient is a partial sum, completed over the TP group at the end of the step."""
    return tag(param, partial_grad=ctx.sequence_parallel and ctx.tp_size > 1)
