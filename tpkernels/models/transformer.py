"""ParallelTransformer: a GPT-2 or Llama-family model (Mixtral and Qwen2-MoE included: experts split over
``ParallelConfig.ep``, tpkernels.models.moe) at any TP × PP × DP × CP × EP layout, in one call.

    state = ParallelState.create(ParallelConfig(tp=2, pp=2, num_microbatches=4, sequence_parallel=True))
    model = ParallelTransformer.from_hf("path/to/hf_checkpoint", state)     # or (ModelConfig, state, seed=0)
    loss = model.step(input_ids, target, schedule="1f1b")   # forward + backward over the micro-batches
    model.finish_grad_sync()                                # SP / replicated-KV / tied / DP reductions
    model.save_hf("out/")                                   # transformers loads it back

Each rank builds only its own part: the layers of its pipeline stage (its chunks, for the
interleaved schedule), each linear layer holding its TP shard. The split is ``split_layers``'s
(even, or ``layer_counts``), the embedding on the first virtual stage, final norm + head + loss
on the last. Activations are batch-first, (batch, seq, hidden), sharded along seq under SP.

Weights come from a :class:`~tpkernels.models.hf_checkpoint.TensorSource`: a checkpoint folder
(each rank reads only its slices), an in-memory ``transformers`` model, or :class:`RandomInit`,
which makes the same model at every layout from one seed (tpkernels.models.hf_io). Every pipeline
stage takes one input type, ``StageInput``; the first stage's is made and checked once per step
(tpkernels.models.inputs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.rotary import rotary_cache
from tpkernels.models import hf_io, inputs
from tpkernels.models.attention import kv_replica_groups
from tpkernels.models.block import TransformerBlock
from tpkernels.description import ModelConfig
from tpkernels.models.context import LayerContext
from tpkernels.models.embedding import Embedding
from tpkernels.models.grad_sync import DataParallelGradReduce, finish_grad_sync, grad_of
from tpkernels.models.head import LMHead
from tpkernels.models.hf_checkpoint import Part
from tpkernels.models.inputs import StageInput
from tpkernels.models.moe import RouterLosses
from tpkernels.models.sequence import SequenceInfo
from tpkernels.parallel import control
from tpkernels.parallel.config import ParallelConfig
from tpkernels.parallel.param_tags import tag_of
from tpkernels.parallel.state import ParallelState
from tpkernels.pipeline.runtime import PipelineRuntime
from tpkernels.pipeline.schedules import forward_only, stage_owner
from tpkernels.pipeline.stages import stage_sizes


class TransformerChunk(nn.Module):
    """One virtual pipeline stage: [embedding] + consecutive layers + [final norm and head].

    forward(x): x is a stage input (``StageInput.astuple()``, the same form on every stage: the first
    stage's hidden is (input_ids,), a later one's the previous stage's (delta, residual)). Returns the
    next stage's input, or on the last stage the normed hidden state (batch, seq[/TP], hidden) that
    ``head.loss`` takes."""

    def __init__(self, ctx: LayerContext, layers: list[int], first: bool, last: bool, tied: bool):
        super().__init__()
        mc = ctx.mc
        self.cp_size = ctx.cp_size  # under CP the documents are the whole sequences' (seq · cp tokens)
        self.embedding = Embedding(ctx) if first else None
        self.layers = nn.ModuleList(TransformerBlock(ctx, i) for i in layers)
        tied_weight = self.embedding.tokens.weight if first and last and tied else None
        self.head = LMHead(ctx, tied_weight) if last else None
        self.rope = None
        if mc.positions == "rotary" and layers:
            cos, sin = rotary_cache(mc.dhead, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling,
                                    device=ctx.device)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            self.rope = True

    def forward(self, x):
        inp = StageInput.of(x)
        info = SequenceInfo.from_documents(inp.position_ids, inp.documents, self.cp_size)
        if self.embedding is not None:
            delta, residual = self.embedding(inp.hidden[0], inp.position_ids), None
        else:
            delta, residual = inp.hidden
        rope = (self.cos, self.sin) if self.rope else None
        for block in self.layers:
            delta, residual = block(delta, residual, info, rope)
        if self.head is not None:
            return self.head(delta, residual)
        return StageInput((delta, residual), inp.position_ids, info.documents).astuple()

    def parts(self, tp_rank: int, tp_size: int | None = None, ep_rank: int | None = None) -> dict[str, list[Part]]:
        """Our parameter name -> its HF parts at (``tp_rank``, ``ep_rank``: a MoE block's experts; default
        this rank's)."""
        out = {}
        if self.embedding is not None:
            out.update({f"embedding.{k}": v for k, v in self.embedding.hf_parts(tp_rank, tp_size).items()})
        for j, block in enumerate(self.layers):
            for child, mod in block.children_with_parts().items():
                kw = dict(ep_rank=ep_rank) if getattr(mod, "expert_parallel", False) else {}
                out.update({f"layers.{j}.{child}.{k}": v for k, v in mod.hf_parts(tp_rank, tp_size, **kw).items()})
        if self.head is not None:
            out.update({f"head.{k}": v for k, v in self.head.hf_parts(tp_rank, tp_size).items()})
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        mods = ([self.embedding] if self.embedding is not None else []) + \
            [m for b in self.layers for m in b.children_with_parts().values()] + \
            ([self.head] if self.head is not None else [])
        return {k: v for m in mods for k, v in m.hf_shapes().items()}


def is_expert(p: torch.Tensor) -> bool:
    """A MoE layer's routed-expert parameter (different on each EP rank)."""
    t = tag_of(p)
    return t is not None and t.expert_parallel


def stage_layers(num_layers: int, pp: int, v: int, layer_counts=None) -> list[list[int]]:
    """The layer indices of each virtual stage, in pipeline order (``split_layers``'s split)."""
    bounds = [0]
    for n in stage_sizes(num_layers, pp, v, layer_counts=layer_counts):
        bounds.append(bounds[-1] + n)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


class ParallelTransformer(nn.Module):
    """This rank's part of a GPT-2 / Llama-family model (see the module docstring).

    Args:
        config: the model. state: the layout's process groups (None: one process, no parallelism).
        overlap_comm / algo: the TP layers' comm overlap and GEMM-comm algorithm.
        layer_counts: layers per virtual stage (uneven pipelines); default an even split.
        init: "random" (seeded, layout independent) or None (leave for ``load_hf_``).
        quant: "nf4" or "int8": the layers' linears hold a frozen quantised base (QLoRA: each rank
            quantises its own shard as it is loaded, see tpkernels.functional.quantized_weight).
        The MoE layers' token exchange is cut into ``state.config.moe_chunks`` pieces, so that the expert
        GEMMs of one run while the next is in flight (tpkernels.functional.moe_dispatch; only with ep > 1).
    """

    def __init__(self, config: ModelConfig, state: ParallelState | None = None, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device=None, overlap_comm: bool = True, algo: str = "auto",
                 layer_counts=None, init: str | None = "random", quant: str | None = None):
        super().__init__()
        config.require_buildable()
        state = state or ParallelState.create(ParallelConfig())
        pc = state.config
        pc.validate(world_size=pc.world_size, **config.layout_rules(), layer_counts=layer_counts)
        self.config, self.state = config, state
        # the router losses of the MoE layers, for the trainer (tpkernels.models.moe.RouterLosses)
        self.moe_losses = RouterLosses(config.num_experts, config.router_aux_loss_coef, config.router_z_loss_coef,
                                       config.num_moe_layers) if config.num_experts else None
        self.ctx = LayerContext(mc=config, tp_group=state.tp_group, tp_rank=state.tp_rank, tp_size=pc.tp,
                                sequence_parallel=pc.sequence_parallel, overlap_comm=overlap_comm, algo=algo,
                                device=None if device is None else torch.device(device), dtype=dtype,
                                recompute=pc.recompute, cp_group=state.cp_group, cp_rank=state.cp_rank,
                                cp_size=pc.cp, cp_algo=pc.cp_algo, quant=quant, ep_group=state.ep_group,
                                ep_rank=state.ep_rank, ep_size=pc.ep, dp_cp_group=state.dp_cp_group,
                                moe_losses=self.moe_losses, moe_chunks=pc.moe_chunks)
        self.num_virtual = pc.pp * pc.virtual_stages
        self.stage_layers = stage_layers(config.num_layers, pc.pp, pc.virtual_stages, layer_counts)
        self.chunks = nn.ModuleList()
        self.chunk_stages = [c * pc.pp + state.pp_rank for c in range(pc.virtual_stages)]
        for vs in self.chunk_stages:
            self.chunks.append(TransformerChunk(self.ctx, self.stage_layers[vs], vs == 0, vs == self.num_virtual - 1,
                                                config.tied_embeddings))
        self.check_inputs, self._checked = True, {}  # see tpkernels.models.inputs.agree_tp
        self.kv_group = None
        groups = kv_replica_groups(config.kv_heads, pc.tp)
        if groups is not None:
            self.kv_group = state.subgroups_of_tp(groups)
        if init == "random":
            self.init_weights_(seed)
        elif init is not None:
            raise ValueError(f"init ({init!r}) must be 'random' or None")

    # ---- Hugging Face weights (tpkernels.models.hf_io) ----
    @classmethod
    def from_hf(cls, source, state: ParallelState | None = None, *, config: ModelConfig | None = None,
                drop_dropout: bool = False, **kwargs) -> "ParallelTransformer":
        """From a checkpoint folder (config.json + safetensors; each rank reads only its slices) or an
        in-memory ``transformers`` model."""
        return hf_io.from_hf(cls, source, state, config=config, drop_dropout=drop_dropout, **kwargs)

    @property
    def head(self) -> LMHead | None:
        return self.chunks[-1].head

    def param_parts(self, tp_rank: int | None = None, tp_size: int | None = None) -> dict[str, list[Part]]:
        """Our parameter name → the HF parts it is made of, for TP rank ``tp_rank`` (default: this rank) of a
        layout of TP size ``tp_size`` (default: this model's)."""
        return hf_io.param_parts(self, tp_rank, tp_size)

    def load_hf_(self, source) -> "ParallelTransformer":
        """Copy this rank's slices of ``source`` (folder, state dict, module or TensorSource) into the model."""
        return hf_io.load_hf_(self, source)

    def init_weights_(self, seed: int) -> "ParallelTransformer":
        """Seeded initialisation, identical at every layout."""
        return hf_io.init_weights_(self, seed)

    def to_hf_state_dict(self, which: str = "data") -> dict[str, torch.Tensor]:
        """This stage's Hugging Face tensors, gathered over TP, on the CPU (``which="grad"``: the gradients)."""
        return hf_io.to_hf_state_dict(self, which)

    def save_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + safetensors that transformers loads. Collective over all ranks."""
        return hf_io.save_hf(self, folder, dtype)

    # ---- running ----
    def _device(self) -> torch.device:
        return self.ctx.device or next(self.parameters()).device

    def _batch(self, input_ids, position_ids=None, cu_seqlens=None) -> tuple:
        """The first stage's checked input of a step (tpkernels.models.inputs.stage_batch)."""
        return inputs.stage_batch(self, input_ids, position_ids, cu_seqlens)

    def _target(self, target: torch.Tensor | dict, ignore_index: int = IGNORE_INDEX) -> torch.Tensor | dict:
        """The last stage's checked targets of a step (tpkernels.models.inputs.stage_target). A dict
        (a loss with per-position side inputs, e.g. the preference objective's ``doc``) has its
        ``"target"`` checked and every tensor moved to the device."""
        if isinstance(target, dict):
            if "target" not in target:
                raise ValueError(f"target dict (keys {sorted(target)}) must hold the next-token ids as 'target'")
            out = {k: v.to(self._device(), non_blocking=True) for k, v in target.items() if k != "target"}
            return {"target": inputs.stage_target(self, target["target"], ignore_index), **out}
        return inputs.stage_target(self, target, ignore_index)

    def _single_stage(self) -> None:
        if self.num_virtual > 1:
            raise RuntimeError("forward() runs a model without pipeline parallelism; with "
                               f"pp ({self.state.pp_size}) use step()")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, target: torch.Tensor | None = None) -> torch.Tensor:
        """Without pipeline parallelism: the loss if ``target`` (batch, seq) is given (next-token ids,
        ``tpkernels.models.next_token_targets``), else the logits (batch, seq, vocab_size).
        input_ids (batch, seq); packed documents: position_ids restarting at 0, or cu_seqlens. With
        context parallelism, input_ids is this CP rank's zigzag share (``zigzag_split(ids, cp, cp_rank)``)
        and the positions default to its global ones; the loss is this rank's part (the mean over
        the CP group is the whole sequences' token mean)."""
        self._single_stage()
        y = self.chunks[0](self._batch(input_ids, position_ids, cu_seqlens))
        return self.head.logits(y) if target is None else self.head.loss(y, self._target(target))

    def pipeline(self, schedule: str = "1f1b", num_microbatches: int | None = None,
                 timeout_s: float = 300.0, loss_fn=None, seq_length: int | None = None) -> PipelineRuntime:
        """A PipelineRuntime over this rank's chunks for :meth:`step`. Its loss is the head's token sum
        (``head.loss(y, target, reduction="sum")``), or ``loss_fn(y, target)``, which must also return
        a micro-batch's sum: :meth:`step` scales it by the step's count of targets. ZB-H1's order is
        built for this model's F : B : W cost ratios at ``seq_length`` (default: the model's maximum
        positions), from the planner's FLOP counts."""
        pc = self.state.config
        m = num_microbatches or pc.num_microbatches
        if pc.virtual_stages > 1 and schedule != "interleaved":
            raise ValueError(f"virtual_stages ({pc.virtual_stages}) > 1 needs schedule='interleaved', not {schedule!r}")
        device = self.ctx.device or next(self.parameters()).device
        loss_fn = loss_fn or (self._token_loss_sum if self.head else None)
        costs = None
        if schedule == "zb-h1":
            seq = seq_length or min(self.config.max_position_embeddings, 8192)
            costs = self.config.weight_split_flops(seq, pc.micro_batch_size, pc.tp)
        return PipelineRuntime(list(self.chunks), schedule, m, loss_fn=loss_fn if self.head else None,
                               group=self.state.pp_group, device=device,
                               timeout_s=timeout_s, schedule_costs=costs)

    def _token_loss_sum(self, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head.loss(y, target, reduction="sum")

    def step(self, input_ids: torch.Tensor | None, target: torch.Tensor | None, position_ids=None, cu_seqlens=None,
             *, schedule: str = "1f1b", num_microbatches: int | None = None, runtime: PipelineRuntime | None = None,
             num_targets: int | None = None, loss_scale: float = 1.0) -> float:
        """Forward and backward of one step over micro-batches (gradients accumulate in .grad). input_ids
        are needed on the first stage, target on the last (None elsewhere), on the host or the device
        (host tensors are checked for free). Call :meth:`finish_grad_sync` before the optimizer step.

        The loss is the sum of the token losses over the global batch (every micro-batch of every DP
        and CP replica) divided by ``num_targets``, the global count of targets that are not
        ignore_index: micro-batching, DP and CP never change it. The trainer counts it on the host
        before the step; None counts this call's targets over the DP×CP group (one small all-reduce).
        Gradients are those of ``loss_scale`` × that loss once :meth:`finish_grad_sync` (or the
        trainer's DP reduction) has averaged them over the replicas. Returns the loss (unscaled) on
        every rank."""
        rt = runtime or self.pipeline(schedule, num_microbatches)
        st = self.state
        last = stage_owner(self.num_virtual - 1, st.pp_size)[0] == st.pp_rank
        try:
            batch = self._batch(input_ids, position_ids, cu_seqlens) if st.is_first_stage else None
            if last and target is not None and num_targets is None:
                num_targets = self._count_targets(target["target"] if isinstance(target, dict) else target)
            target = self._target(target) if last and target is not None else None
        except Exception as e:
            rt.fail(e)  # the other stages would wait for this one's activations until the timeout
            raise
        replicas = st.dp_size * st.cp_size
        # each replica's sum over the global count, × replicas: the average over the replicas that
        # the gradient reduction takes is then the gradient of the global token mean
        scale = loss_scale * replicas / max(num_targets, 1) if last and num_targets is not None else None
        mine = rt.step(batch, target, loss_scale=scale) / (loss_scale * replicas)
        if getattr(rt.loss_fn, "replicated_over_cp", False):
            mine /= st.cp_size  # each CP rank computed the whole loss (a non-linear loss of CP-summed terms)
        if replicas == 1:
            return mine
        return control.all_reduce_values([mine], "sum", st.dp_cp_group)[0]

    def _count_targets(self, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
        """Targets that are not ``ignore_index`` over this rank's DP×CP group (the last stage's ranks)."""
        mine = int((target != ignore_index).sum())
        if self.state.dp_size * self.state.cp_size == 1:
            return mine
        return int(control.all_reduce_values([mine], "sum", self.state.dp_cp_group)[0])

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor | None, target: torch.Tensor | None, position_ids=None,
                 cu_seqlens=None, *, num_microbatches: int | None = None, timeout_s: float = 300.0,
                 num_targets: int | None = None, loss_fn=None) -> float:
        """The token-mean loss of the batch, forwards only (any layout); inputs as :meth:`step`;
        ``loss_fn`` as :meth:`pipeline`'s (default: the head's token sum)."""
        pc = self.state.config
        m = num_microbatches or pc.num_microbatches
        device = self.ctx.device or next(self.parameters()).device
        rt = PipelineRuntime(list(self.chunks), forward_only(pc.pp, m, pc.virtual_stages), m,
                             loss_fn=(loss_fn or self._token_loss_sum) if self.head else None, group=self.state.pp_group,
                             device=device, timeout_s=timeout_s)
        return self.step(input_ids, target, position_ids, cu_seqlens, runtime=rt, num_targets=num_targets)

    def finish_grad_sync(self, reduce_dp: bool = True) -> None:
        """The reductions of :mod:`tpkernels.models.grad_sync` (collective over every group involved);
        ``reduce_dp=False`` when a :class:`~tpkernels.models.grad_sync.DataParallelGradReduce` of the
        caller's did the DP average already (the trainer's, overlapped with the backward)."""
        st = self.state
        tied = self.config.tied_embeddings and st.pp_size > 1 and (st.is_first_stage or st.is_last_stage)
        params = list(self.parameters())
        finish_grad_sync(params, tp_group=st.tp_group, kv_group=self.kv_group,
                         embedding_group=st.embedding_group if tied else None)
        if reduce_dp and st.dp_size * st.cp_size > 1:  # CP ranks are replicas too: one reduction over both
            experts = [p for p in params if is_expert(p)] if st.ep_size > 1 else []
            DataParallelGradReduce([p for p in params if not (experts and is_expert(p))], st.dp_cp_group,
                                   overlap=False).finish()
            if experts:
                # an expert's gradient already sums its EP group's tokens (the combine's backward): summed over
                # the other EP groups' copies and divided by dp · cp, it is the average the others get
                DataParallelGradReduce(experts, st.edp_group, overlap=False).finish()
                for p in experts:
                    if grad_of(p) is not None:
                        grad_of(p).div_(st.ep_size)

    def extra_repr(self) -> str:
        st = self.state
        return (f"{self.config.name or self.config.model_type}: layers {[self.stage_layers[v] for v in self.chunk_stages]} "
                f"of {self.config.num_layers} on {st.describe()}")
