"""Hugging Face weights in and out of a ParallelTransformer: each rank reads and writes only its own
slices (the layers of its pipeline stage, the TP shard of each), through the ``Part`` mapping of
:mod:`tpkernels.models.hf_checkpoint`.

    model = from_hf(ParallelTransformer, "path/to/hf_checkpoint", state)   # = ParallelTransformer.from_hf
    load_hf_(model, source)          # folder, state dict, module or TensorSource
    init_weights_(model, seed)       # the same model at every layout from one seed
    dequantize_as_trained_at_(model, source, 4)   # a quantised base as a TP4 run computed with it (export)
    to_hf_state_dict(model)          # this stage's HF tensors, gathered over TP, on the CPU
    save_hf(model, "out/")           # what transformers.AutoModelForCausalLM.from_pretrained loads

The model's methods of the same names call these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tpkernels.description import ModelConfig
from tpkernels.functional.quantized_weight import QuantizedWeight
from tpkernels.models.hf_checkpoint import (
    Part,
    RandomInit,
    StateDictSource,
    TensorSource,
    assemble,
    experts_view,
    from_experts_view,
    open_source,
)
from tpkernels.parallel import control
from tpkernels.parallel.mappings import all_gather_dim
from tpkernels.parallel.param_tags import tag_of
from tpkernels.parallel.raise_together import raise_together


def from_hf(cls, source, state=None, *, config: ModelConfig | None = None, drop_dropout: bool = False, **kwargs):
    """A ``cls`` (ParallelTransformer) from a checkpoint folder (config.json + safetensors; each rank
    reads only its slices) or an in-memory ``transformers`` model."""
    if config is None:
        hf_cfg = source.config if isinstance(source, nn.Module) else source
        config = ModelConfig.from_hf(hf_cfg, drop_dropout=drop_dropout)
    kwargs.setdefault("dtype", torch.float32)
    model = cls(config, state, init=None, **kwargs)
    model.load_hf_(source)
    return model


def param_parts(model, tp_rank: int | None = None, tp_size: int | None = None,
                ep_rank: int | None = None) -> dict[str, list[Part]]:
    """Our parameter name → the HF parts it is made of, for TP rank ``tp_rank`` (default: this rank) of a
    layout of TP size ``tp_size`` (default: the model's; another describes that layout's shards, e.g. for
    an export that rebuilds them in one process); ``ep_rank``: whose experts (default this rank's)."""
    r = model.ctx.tp_rank if tp_rank is None else tp_rank
    return {f"chunks.{c}.{k}": v for c, chunk in enumerate(model.chunks)
            for k, v in chunk.parts(r, tp_size, ep_rank).items()}


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: v for chunk in model.chunks for k, v in chunk.shapes().items()}


@torch.no_grad()
def load_hf_(model, source):
    """Copy this rank's slices of ``source`` (folder, state dict, module or TensorSource) into ``model``."""
    # every rank checks and reads its own tensors; a rank that finds a bad one stops them all
    with raise_together("loading Hugging Face weights", active=model.state.config.world_size > 1):
        src = _checked_source(model, source)
        parts = param_parts(model)
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(parts))
        if missing:
            raise RuntimeError(f"no Hugging Face mapping for {missing[:4]}")
        for name, p in params.items():
            p.copy_(_read(src, name, parts[name], p)[0])
        # a quantised base: each tensor read in full precision, quantised, and dropped before the next
        for name, m in quantized_layers(model).items():
            value, rows = _read(src, name, parts[name], m.weight)
            m.load_quantized_(value, rows)
            del value
    return model


def _checked_source(model, source) -> TensorSource:
    """``source`` as a TensorSource whose tensors have the shapes ``model`` needs (checked before any read)."""
    src = source if isinstance(source, TensorSource) else open_source(source)
    transposed = {part.name for ps in param_parts(model).values() for part in ps if part.transpose}
    src.check(_shapes(model), transposed)
    return src


@torch.no_grad()
def dequantize_as_trained_at_(model, source, tp_size: int, dtype: torch.dtype | None = None):
    """Hold each quantised layer of ``model`` (QLoRA's base, not loaded yet) as the full-precision values a
    run at TP size ``tp_size`` computed with: that run's shards of ``source``'s tensors, each rank's
    quantised as that rank quantised it (its own pieces: NF4 blocks of 64 and the double quantisation's
    statistics, int8's row absmax, depend on the TP size), dequantised, put back together into this
    model's shard (``dequantize_``). ``dtype``: the run's (it read its shards in that dtype before
    quantising; default the layer's). Other parameters are left alone (an export loads them from the
    checkpoint). One layer at a time; an export calls it on a one-process model."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size ({tp_size!r}) must be a positive integer")
    src = _checked_source(model, source)
    parts = param_parts(model)
    shards = [param_parts(model, r, tp_size) for r in range(tp_size)]
    for name, m in quantized_layers(model).items():
        pieces = []
        for rank_parts in (s[name] for s in shards):
            values = [src.read(part, dtype or m.weight.dtype) for part in rank_parts]
            rows = [v.shape[0] for v in values]
            shard = torch.cat(values)
            qw = QuantizedWeight(m.quant, tuple(shard.shape), shard.dtype).load_(shard, rows)
            pieces += zip(rank_parts, qw.dequantize().split(rows))  # replicated KV heads: equal copies
        m.dequantize_(_read(StateDictSource(assemble(pieces)), name, parts[name], m.weight)[0])
    return model


def _read(src, name: str, parts: list[Part], like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """This rank's value of parameter ``name`` (shape and dtype of ``like``) and the rows of each part."""
    pieces = [src.read(part, like.dtype) for part in parts]
    value = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if getattr(like, "hf_view", None) == "experts" and value.numel() == like.numel():  # stacked experts
        value = from_experts_view(value, tuple(like.shape))
    if value.shape != like.shape:
        raise ValueError(f"{name}: the checkpoint gives shape {tuple(value.shape)}, the model at this "
                         f"layout needs {tuple(like.shape)} (parts {parts})")
    return value, [piece.shape[0] for piece in pieces]


def quantized_layers(model) -> dict[str, nn.Module]:
    """Our weight name -> what holds it quantised: a TP linear (``layer.qweight``), or a MoE layer's stacked
    experts (:class:`tpkernels.models.moe_quant.QuantizedExperts`, the same interface)."""
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "qweight", None) is not None:
            out[f"{name}.weight"] = m
        if hasattr(m, "quantized_weights"):
            out.update({f"{name}.{k}": v for k, v in m.quantized_weights().items()})
    return out


def init_weights_(model, seed: int):
    """Seeded initialisation, identical at every layout (each tensor made whole from (seed, name), then
    sliced)."""
    return load_hf_(model, random_init(model, seed))


def random_init(model, seed: int) -> RandomInit:
    """The seeded source of ``model``'s initial weights (:func:`init_weights_` loads it)."""
    shapes = _shapes(model)
    cfg = model.config
    scaled = {n for n in shapes if cfg.family == "gpt2" and n.endswith("c_proj.weight")}
    return RandomInit(shapes, seed, cfg.initializer_range, scaled, cfg.num_layers)


@torch.no_grad()
def to_hf_state_dict(model, which: str = "data") -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of this rank's pipeline stage, full (gathered over TP), on the CPU.
    Collective over the TP group. A tied head on the last stage is left out (the embedding is it).
    ``which="grad"``: the gradients instead, in the same names (zeros where there is none)."""
    if which not in ("data", "grad"):
        raise ValueError(f"which ({which!r}) must be 'data' or 'grad'")
    tp, ep = model.ctx.tp_size, model.ctx.ep_size
    # [tp rank][ep rank]: a MoE layer's experts differ over EP (gathered below), the rest is the same there
    all_parts = [[param_parts(model, r, ep_rank=q) for q in range(ep)] for r in range(tp)]
    pieces = []
    # a quantised base counts as its dequantised values (no gradient: zeros)
    tensors = [(name, p, p.detach() if which == "data" else p.grad) for name, p in model.named_parameters()]
    tensors += [(name, m.weight, m.qweight.dequantize() if which == "data" else None)
                for name, m in quantized_layers(model).items()]
    for name, p, t in tensors:
        tt = tag_of(p)
        if (tt is not None and tt.tied == "copy") or name not in all_parts[0][0]:  # LoRA adapters: merge_lora_ first
            continue
        t = t if t is not None else torch.zeros(p.shape, dtype=p.dtype, device=model._device())
        shards = [t] if tp == 1 else list(all_gather_dim(t.contiguous(), 0, model.ctx.tp_group).chunk(tp, dim=0))
        expert = tt is not None and tt.expert_parallel
        for r, tp_shard in enumerate(shards):
            if expert and ep > 1:
                ep_shards = enumerate(all_gather_dim(tp_shard.contiguous(), 0, model.ctx.ep_group).chunk(ep, dim=0))
            else:
                ep_shards = [(model.ctx.ep_rank, tp_shard)]
            for q, shard in ep_shards:
                if getattr(p, "hf_view", None) == "experts":
                    shard = experts_view(shard)
                offset = 0
                for part in all_parts[r][q][name]:
                    rows = part.zero_shape[0] if part.name is None else (
                        part.rows[1] - part.rows[0] if part.rows else shard.shape[0])
                    pieces.append((part, shard[offset:offset + rows].cpu()))
                    offset += rows
    return assemble(pieces)


def save_hf(model, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + safetensors (one file per pipeline stage, with an index) that
    ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads. Collective over all ranks."""
    from safetensors.torch import save_file  # noqa: PLC0415

    folder = Path(folder)
    sd = to_hf_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    st, pp = model.state, model.state.pp_size
    fname = "model.safetensors" if pp == 1 else f"model-{st.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    writer = st.tp_rank == 0 and st.dp_rank == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / fname), metadata={"format": "pt"})
    names = {k: fname for k in sd} if writer else {}
    names = {k: v for d in control.all_gather_objects(names) for k, v in d.items()}
    if st.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        model.config.to_hf().save_pretrained(str(folder))
        if pp > 1:
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": dict(sorted(names.items()))}, indent=1))
    control.barrier()
    return folder


__all__ = ["dequantize_as_trained_at_", "from_hf", "init_weights_", "load_hf_", "param_parts", "quantized_layers",
           "random_init", "save_hf", "to_hf_state_dict"]
