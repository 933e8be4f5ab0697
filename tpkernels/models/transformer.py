"""ParallelTransformer: a GPT-2 or Llama-family model at any TP × PP × DP layout, in one call.

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
which makes the same model at every layout from one seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tpkernels.functional.context_parallel import zigzag_indices
from tpkernels.functional.rotary import rotary_cache
from tpkernels.models.attention import kv_replica_groups
from tpkernels.models.block import TransformerBlock
from tpkernels.description import ModelConfig
from tpkernels.models.context import LayerContext
from tpkernels.models.embedding import Embedding
from tpkernels.models.grad_sync import DataParallelGradReduce, finish_grad_sync
from tpkernels.models.head import LMHead
from tpkernels.parallel.raise_together import raise_together
from tpkernels.models.hf_checkpoint import Part, RandomInit, TensorSource, assemble, open_source
from tpkernels.functional.vocab_parallel import out_of_range_targets, target_range_error
from tpkernels.models.sequence import SequenceInfo, default_positions, positions_from_cu_seqlens
from tpkernels.parallel import consistency
from tpkernels.parallel.config import ParallelConfig
from tpkernels.parallel.mappings import all_gather_dim
from tpkernels.parallel.param_tags import tag_of
from tpkernels.parallel.state import ParallelState
from tpkernels.pipeline.runtime import PipelineRuntime
from tpkernels.pipeline.schedules import forward_only, stage_owner
from tpkernels.pipeline.stages import stage_sizes


class TransformerChunk(nn.Module):
    """One virtual pipeline stage: [embedding] + consecutive layers + [final norm and head].

    forward(x): x is {"input_ids", "position_ids"[, "host_positions"]} on the first stage, else the previous
    stage's (delta, residual, position_ids, cu_seqlens or empty). Returns the same four, or on the
    last stage the normed hidden state (batch, seq[/TP], hidden) that ``head.loss`` takes."""

    def __init__(self, ctx: LayerContext, layers: list[int], first: bool, last: bool, tied: bool):
        super().__init__()
        mc = ctx.mc
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
        if self.embedding is not None:
            ids, pos = x["input_ids"], x["position_ids"]
            info = SequenceInfo.of(x["host_positions"]).on(pos) if "host_positions" in x else SequenceInfo.dense(pos)
            if "host_positions" in x and info.cu_seqlens is None:  # packed elsewhere in the CP group: rows as
                info = SequenceInfo.rows(pos)                      # boundaries, so every stage masks by document
            delta, residual = self.embedding(ids, pos), None
        else:
            delta, residual, pos, cu = x
            info = SequenceInfo.from_cu_seqlens(pos, cu)
        rope = (self.cos, self.sin) if self.rope else None
        for block in self.layers:
            delta, residual = block(delta, residual, info, rope)
        if self.head is not None:
            return self.head(delta, residual)
        return delta, residual, pos, info.boundaries()

    def parts(self, tp_rank: int) -> dict[str, list[Part]]:
        out = {}
        if self.embedding is not None:
            out.update({f"embedding.{k}": v for k, v in self.embedding.hf_parts(tp_rank).items()})
        for j, block in enumerate(self.layers):
            for child, mod in block.children_with_parts().items():
                out.update({f"layers.{j}.{child}.{k}": v for k, v in mod.hf_parts(tp_rank).items()})
        if self.head is not None:
            out.update({f"head.{k}": v for k, v in self.head.hf_parts(tp_rank).items()})
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        mods = ([self.embedding] if self.embedding is not None else []) + \
            [m for b in self.layers for m in b.children_with_parts().values()] + \
            ([self.head] if self.head is not None else [])
        return {k: v for m in mods for k, v in m.hf_shapes().items()}


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
    """

    def __init__(self, config: ModelConfig, state: ParallelState | None = None, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device=None, overlap_comm: bool = True, algo: str = "auto",
                 layer_counts=None, init: str | None = "random"):
        super().__init__()
        config.require_buildable()
        state = state or ParallelState.create(ParallelConfig())
        pc = state.config
        pc.validate(world_size=pc.world_size, **config.layout_rules(), layer_counts=layer_counts)
        self.config, self.state = config, state
        self.ctx = LayerContext(config, state.tp_group, state.tp_rank, pc.tp, pc.sequence_parallel, overlap_comm, algo,
                                None if device is None else torch.device(device), dtype, pc.recompute,
                                state.cp_group, state.cp_rank, pc.cp, pc.cp_algo)
        self.num_virtual = pc.pp * pc.virtual_stages
        self.stage_layers = stage_layers(config.num_layers, pc.pp, pc.virtual_stages, layer_counts)
        self.chunks = nn.ModuleList()
        self.chunk_stages = [c * pc.pp + state.pp_rank for c in range(pc.virtual_stages)]
        for vs in self.chunk_stages:
            self.chunks.append(TransformerChunk(self.ctx, self.stage_layers[vs], vs == 0, vs == self.num_virtual - 1,
                                                config.tied_embeddings))
        self.check_inputs, self._checked = True, {}  # see _agree_tp
        self.kv_group = None
        groups = kv_replica_groups(config.kv_heads, pc.tp)
        if groups is not None:
            self.kv_group = state.subgroups_of_tp(groups)
        if init == "random":
            self.init_weights_(seed)
        elif init is not None:
            raise ValueError(f"init ({init!r}) must be 'random' or None")

    # ---- construction from Hugging Face ----
    @classmethod
    def from_hf(cls, source, state: ParallelState | None = None, *, config: ModelConfig | None = None,
                drop_dropout: bool = False, **kwargs) -> "ParallelTransformer":
        """From a checkpoint folder (config.json + safetensors; each rank reads only its slices) or an
        in-memory ``transformers`` model."""
        if config is None:
            hf_cfg = source.config if isinstance(source, nn.Module) else source
            config = ModelConfig.from_hf(hf_cfg, drop_dropout=drop_dropout)
        kwargs.setdefault("dtype", torch.float32)
        model = cls(config, state, init=None, **kwargs)
        model.load_hf_(source)
        return model

    @property
    def head(self) -> LMHead | None:
        return self.chunks[-1].head

    def param_parts(self, tp_rank: int | None = None) -> dict[str, list[Part]]:
        """Our parameter name → the HF parts it is made of, for TP rank ``tp_rank`` (default: this rank)."""
        r = self.ctx.tp_rank if tp_rank is None else tp_rank
        return {f"chunks.{c}.{k}": v for c, chunk in enumerate(self.chunks) for k, v in chunk.parts(r).items()}

    @torch.no_grad()
    def load_hf_(self, source) -> "ParallelTransformer":
        """Copy this rank's slices of ``source`` (folder, state dict, module or TensorSource) into the model."""
        # every rank checks and reads its own tensors; a rank that finds a bad one stops them all
        with raise_together("loading Hugging Face weights", active=self.state.config.world_size > 1):
            src = source if isinstance(source, TensorSource) else open_source(source)
            parts = self.param_parts()
            params = dict(self.named_parameters())
            missing = sorted(set(params) - set(parts))
            if missing:
                raise RuntimeError(f"no Hugging Face mapping for {missing[:4]}")
            shapes = {k: v for chunk in self.chunks for k, v in chunk.shapes().items()}
            transposed = {part.name for ps in parts.values() for part in ps if part.transpose}
            src.check(shapes, transposed)
            for name, p in params.items():
                pieces = [src.read(part, p.dtype) for part in parts[name]]
                value = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                if value.shape != p.shape:
                    raise ValueError(f"{name}: the checkpoint gives shape {tuple(value.shape)}, the model at this "
                                     f"layout needs {tuple(p.shape)} (parts {parts[name]})")
                p.copy_(value)
        return self

    def init_weights_(self, seed: int) -> "ParallelTransformer":
        """Seeded initialisation, identical at every layout (each tensor made whole from (seed, name),
        then sliced)."""
        shapes = {k: v for chunk in self.chunks for k, v in chunk.shapes().items()}
        scaled = {n for n in shapes if self.config.family == "gpt2" and n.endswith("c_proj.weight")}
        return self.load_hf_(RandomInit(shapes, seed, self.config.initializer_range, scaled, self.config.num_layers))

    # ---- export ----
    @torch.no_grad()
    def to_hf_state_dict(self, which: str = "data") -> dict[str, torch.Tensor]:
        """The Hugging Face tensors of this rank's pipeline stage, full (gathered over TP), on the CPU.
        Collective over the TP group. A tied head on the last stage is left out (the embedding is it).
        ``which="grad"``: the gradients instead, in the same names (zeros where there is none)."""
        if which not in ("data", "grad"):
            raise ValueError(f"which ({which!r}) must be 'data' or 'grad'")
        tp = self.ctx.tp_size
        all_parts = [self.param_parts(r) for r in range(tp)]
        pieces = []
        for name, p in self.named_parameters():
            t = tag_of(p)
            if (t is not None and t.tied == "copy") or name not in all_parts[0]:  # LoRA adapters: merge_lora_ first
                continue
            t = p.detach() if which == "data" else (p.grad if p.grad is not None else torch.zeros_like(p))
            shards = [t] if tp == 1 else list(all_gather_dim(t.contiguous(), 0, self.ctx.tp_group).chunk(tp, dim=0))
            for r, shard in enumerate(shards):
                offset = 0
                for part in all_parts[r][name]:
                    rows = part.zero_shape[0] if part.name is None else (
                        part.rows[1] - part.rows[0] if part.rows else shard.shape[0])
                    pieces.append((part, shard[offset:offset + rows].cpu()))
                    offset += rows
        return assemble(pieces)

    def save_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + safetensors (one file per pipeline stage, with an index) that
        ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads. Collective over all ranks."""
        from safetensors.torch import save_file  # noqa: PLC0415

        folder = Path(folder)
        sd = self.to_hf_state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        st, pp = self.state, self.state.pp_size
        fname = "model.safetensors" if pp == 1 else f"model-{st.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
        writer = st.tp_rank == 0 and st.dp_rank == 0
        if writer:
            folder.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / fname), metadata={"format": "pt"})
        names = {k: fname for k in sd} if writer else {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, names)
            names = {k: v for d in every for k, v in d.items()}
        if st.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            self.config.to_hf().save_pretrained(str(folder))
            if pp > 1:
                (folder / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {}, "weight_map": dict(sorted(names.items()))}, indent=1))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return folder

    # ---- running ----
    def _device(self) -> torch.device:
        return self.ctx.device or next(self.parameters()).device

    def _batch(self, input_ids, position_ids=None, cu_seqlens=None) -> dict:
        """The first stage's inputs of a step, checked once for the whole step (ids in the vocabulary,
        positions in the position table, where documents start) and moved to the model's device. The
        checks read the tensors where they are: free for host tensors (the trainer's), one device→host
        sync per step otherwise; the layers then check nothing per micro-batch."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        self._agree_tp("input_ids", input_ids)
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids dtype ({input_ids.dtype}) must be an integer type")
        if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)}: the batch and the sequence length must "
                             "be >= 1")
        packed = cu_seqlens is not None
        if cu_seqlens is not None:
            if position_ids is not None:
                raise ValueError("give position_ids or cu_seqlens, not both")
            position_ids = positions_from_cu_seqlens(cu_seqlens, *input_ids.shape)
        elif position_ids is None and self.ctx.cp_size > 1:  # this CP rank's zigzag share of whole sequences
            ctx = self.ctx
            position_ids = zigzag_indices(input_ids.shape[1] * ctx.cp_size, ctx.cp_size, ctx.cp_rank).expand(
                input_ids.shape)
        elif position_ids is None:
            position_ids = default_positions(input_ids)
        else:  # the user's positions: packed when they restart inside a row
            packed = bool((position_ids[:, 1:] == 0).any())
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape "
                             f"{tuple(input_ids.shape)}")
        vocab, positions = self.config.vocab_size, self.config.max_position_embeddings
        bad_ids, bad_pos = torch.stack([((input_ids < 0) | (input_ids >= vocab)).any(),
                                        ((position_ids < 0) | (position_ids >= positions)).any()]).tolist()
        if bad_ids:
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0]
            raise IndexError(f"input_ids ({int(bad)}) must be in [0, vocab_size ({vocab}))")
        if bad_pos:
            raise ValueError(f"position_ids must be in [0, max_position_embeddings ({positions}))")
        device = self._device()
        if self.ctx.cp_size > 1:
            packed = self._packed_over_cp(position_ids, packed)
        batch = {"input_ids": input_ids.to(device, non_blocking=True),
                 "position_ids": position_ids.to(device, non_blocking=True).contiguous()}
        if packed:  # where documents start, found on the host: no device sync per micro-batch
            batch["host_positions"] = position_ids.cpu()
        return batch

    def _packed_over_cp(self, position_ids: torch.Tensor, packed: bool) -> bool:
        """Under CP a rank holds a zigzag share: the sequences are packed if any share's positions are
        not its global indices (a document starts somewhere): one tiny MAX over the CP group, so every
        CP rank masks by documents alike (see SelfAttention._doc_ids)."""
        ctx = self.ctx
        idx = zigzag_indices(position_ids.shape[1] * ctx.cp_size, ctx.cp_size, ctx.cp_rank)
        mine = packed or bool((position_ids.cpu() != idx[None]).any())
        nccl = dist.get_backend(ctx.cp_group) == "nccl"
        flag = torch.tensor([int(mine)], device=self._device() if nccl else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.cp_group)
        return bool(flag.item())

    def _agree_tp(self, what: str, t: torch.Tensor) -> None:
        """The TP ranks of a stage must be given the same shapes and dtypes (ranks that are not compute
        garbage, or abort inside gloo): checked with one small collective on the first call and
        whenever this rank's shape or dtype changes, while ``check_inputs`` is on (the default; the
        trainer, whose batches agree by construction, checks its first step)."""
        key = (tuple(t.shape), t.dtype)
        if self.check_inputs and self.state.tp_size > 1 and self._checked.get(what) != key:
            consistency.agree(self.state.tp_group, "ParallelTransformer inputs", force=True,
                              **{f"{what}.shape": key[0], f"{what}.dtype": key[1]})
            self._checked[what] = key

    def _target(self, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The last stage's targets of a step, checked once (ids in the vocabulary or ignore_index) where
        they are, and moved to the model's device."""
        self._agree_tp("target", target)
        if target.dim() != 2 or target.shape[0] < 1 or target.shape[1] < 1:
            raise ValueError(f"target shape {tuple(target.shape)}: must be (batch, seq), the batch and the sequence "
                             "length >= 1")
        bad = out_of_range_targets(target, self.config.vocab_size, ignore_index)
        if bool(bad.any()):
            raise target_range_error(target, bad, self.config.vocab_size, ignore_index)
        return target.to(self._device(), non_blocking=True)

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
        """A PipelineRuntime over this rank's chunks (the loss: the head's, or ``loss_fn(y, target)``).
        ZB-H1's order is built for this model's F : B : W cost ratios at ``seq_length`` (default:
        the model's maximum positions), from the planner's FLOP counts."""
        pc = self.state.config
        m = num_microbatches or pc.num_microbatches
        if pc.virtual_stages > 1 and schedule != "interleaved":
            raise ValueError(f"virtual_stages ({pc.virtual_stages}) > 1 needs schedule='interleaved', not {schedule!r}")
        device = self.ctx.device or next(self.parameters()).device
        loss_fn = loss_fn or (self.head.loss if self.head else None)
        costs = None
        if schedule == "zb-h1":
            seq = seq_length or min(self.config.max_position_embeddings, 8192)
            costs = self.config.weight_split_flops(seq, pc.micro_batch_size, pc.tp)
        return PipelineRuntime(list(self.chunks), schedule, m, loss_fn=loss_fn if self.head else None,
                               group=self.state.pp_group, device=device,
                               timeout_s=timeout_s, schedule_costs=costs)

    def step(self, input_ids: torch.Tensor | None, target: torch.Tensor | None, position_ids=None, cu_seqlens=None,
             *, schedule: str = "1f1b", num_microbatches: int | None = None, runtime: PipelineRuntime | None = None
             ) -> float:
        """Forward and backward of one step over micro-batches (gradients accumulate in .grad); returns
        the mean loss on every rank of the pipeline. input_ids are needed on the first stage, target on
        the last (None elsewhere), on the host or the device (host tensors are checked for free).
        Call :meth:`finish_grad_sync` before the optimizer step."""
        rt = runtime or self.pipeline(schedule, num_microbatches)
        last = stage_owner(self.num_virtual - 1, self.state.pp_size)[0] == self.state.pp_rank
        try:
            batch = self._batch(input_ids, position_ids, cu_seqlens) if self.state.is_first_stage else None
            target = self._target(target) if last and target is not None else None
        except Exception as e:
            rt.fail(e)  # the other stages would wait for this one's activations until the timeout
            raise
        return rt.step(batch, target)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor | None, target: torch.Tensor | None, position_ids=None,
                 cu_seqlens=None, *, num_microbatches: int | None = None, timeout_s: float = 300.0) -> float:
        """The mean loss over micro-batches, forwards only (any pipeline layout); inputs as :meth:`step`."""
        pc = self.state.config
        m = num_microbatches or pc.num_microbatches
        device = self.ctx.device or next(self.parameters()).device
        rt = PipelineRuntime(list(self.chunks), forward_only(pc.pp, m, pc.virtual_stages), m,
                             loss_fn=self.head.loss if self.head else None, group=self.state.pp_group, device=device,
                             timeout_s=timeout_s)
        return self.step(input_ids, target, position_ids, cu_seqlens, runtime=rt)

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
            DataParallelGradReduce(params, st.dp_cp_group, overlap=False).finish()

    def extra_repr(self) -> str:
        st = self.state
        return (f"{self.config.name or self.config.model_type}: layers {[self.stage_layers[v] for v in self.chunk_stages]} "
                f"of {self.config.num_layers} on {st.describe()}")
