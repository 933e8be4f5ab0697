"""Checkpoints that reshard: saved at one TP × PP × DP layout, resumed at any other.

Storage is ``torch.distributed.checkpoint`` (DCP: every rank writes its own files, in parallel,
with one ``.metadata``). What is stored is layout independent: the pieces of the *Hugging Face*
tensors that each rank holds, keyed by tensor name and rectangle (rows and columns in our
(out, in) orientation), for the weights and AdamW's two moments; plus the optimizer step. The
same rectangle held by several ranks (DP replicas, replicated KV heads, replicated norms) has
one key, which DCP's planner writes once (from one of those ranks: so every rank offers the same
value; the step count is agreed over the ranks before the save). Only tensors are stored: a
checkpoint's ``.metadata`` that declares anything else is refused (:mod:`checkpoint_files`).

Loading at another layout: each rank reads the checkpoint's metadata, picks the stored
rectangles that overlap the rectangles it now needs, loads only those keys (DCP reads just
them) and copies the overlaps. Every element must be covered, or the load fails naming the
tensor. Why not DCP's own resharding: it reshards DTensors, whose shards are regular slices of
one tensor; our fused q/k/v and gate/up parameters are several HF tensors' slices concatenated,
in an order that depends on the TP size, so no DTensor describes them across layouts.

Atomic: a checkpoint is written to ``step_NNNNNNNN.tmp`` (the step in 8 digits) and renamed to ``step_NNNNNNNN`` by
rank 0 after every rank finished and ``meta.json`` (step, config, layout, model description, a
SHA-256 per file, sealed) is written; only renamed folders are ever loaded (``latest``), so a
half-written one is ignored. Before a load every file is verified (:mod:`checkpoint_files`); a
resume that finds its newest checkpoint damaged falls back to the one before, with a warning.
A save that fails (disk full, read-only storage) removes its ``.tmp`` folder and says how much
this rank had to write and how much space was free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tpkernels.description import ModelConfig
from tpkernels.models import ParallelTransformer
from tpkernels.models.hf_export_files import base_folder, write_standalone_files
from tpkernels.models.hf_io import dequantize_as_trained_at_, random_init
from tpkernels.models.lora import LoRASpec, apply_lora, lora_parts, lora_shapes, lora_spec, merge_lora_
from tpkernels.parallel import control
from tpkernels.parallel.param_tags import tag_of
from tpkernels.parallel.raise_together import raise_together
from tpkernels.train import checkpoint_files
from tpkernels.train.checkpoint_files import CheckpointError, digest_files, read_dcp_metadata, seal, verify
from tpkernels.train.config import TrainConfig
from tpkernels.train.output_paths import path_problem
from tpkernels.train.precision import DTYPES

KINDS = ("model", "exp_avg", "exp_avg_sq")
_SEP = "::"
# DCP says this on every save and load without a process group (a one-process run, export-hf, export-peft):
# one process is what we mean there, so the warning tells a user nothing. Hidden exactly, and only around our
# own calls of DCP (_quiet_dcp), never process-wide.
DCP_ONE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to"


def _dcp():
    """torch.distributed.checkpoint, imported on the first save or load (about 0.7 s with DTensor and
    sympy): a run that never saves, and the ranks a launch forks, do without it."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    return dcp


@contextlib.contextmanager
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_ONE_PROCESS, category=UserWarning)
        yield


def _key(kind: str, name: str, rows, cols) -> str:
    c = "all" if cols is None else f"{cols[0]}-{cols[1]}"
    return _SEP.join((kind, name, f"{rows[0]}-{rows[1]}", c))


def _parse(key: str):
    kind, name, rows, cols = key.split(_SEP)
    r = tuple(int(x) for x in rows.split("-"))
    c = None if cols == "all" else tuple(int(x) for x in cols.split("-"))
    return kind, name, r, c


class ExpertRows:
    """Rows ``[lo, hi)`` of a MoE layer's stacked experts (E/ep, in, out) read as their Hugging Face parts
    concatenate them, (E/ep · out, in) (:func:`tpkernels.models.hf_checkpoint.experts_view`): a part never
    spans two experts, so its rows are ``t[e, :, o0:o1]ᵀ``, a view (a load writes through it)."""

    def __init__(self, lo: int, hi: int, out: int):
        self.e, self.o0, self.o1 = lo // out, lo % out, lo % out + (hi - lo)
        if self.o1 > out:
            raise ValueError(f"rows {lo}-{hi} span two experts (each {out} rows)")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.e, :, self.o0:self.o1].transpose(0, 1)


def cut(t: torch.Tensor, sl) -> torch.Tensor:
    """The rectangle ``sl`` (a row slice, or :class:`ExpertRows`) of ``t`` (a parameter or its moment), a view."""
    return sl(t) if callable(sl) else t[sl]


def rectangles(model):
    """(param, local rows: a slice or :class:`ExpertRows`, hf name, rows, cols | None) for every piece of every
    parameter; :func:`cut` cuts it. A MoE layer's experts are stored expert by expert under their HF names,
    so the keys do not depend on which EP rank holds an expert. A quantised base (QLoRA) is no parameter
    and is not stored: every run re-quantises it from the base checkpoint."""
    shapes = {k: v for c in model.chunks for k, v in c.shapes().items()}
    shapes.update(lora_shapes(model))
    params = dict(model.named_parameters())
    for pname, parts in {**model.param_parts(), **lora_parts(model)}.items():
        if pname not in params:
            continue
        p, off = params[pname], 0
        for part in parts:
            if part.name is None:
                off += part.zero_shape[0]
                continue
            full = shapes[part.name]
            rows = part.rows or (0, full[0])
            cols = (part.cols or (0, full[1])) if len(full) == 2 else None
            n = rows[1] - rows[0]
            stacked = p.dim() == 3 and getattr(p, "hf_view", None) == "experts"
            yield p, ExpertRows(off, off + n, p.shape[2]) if stacked else slice(off, off + n), part.name, rows, cols
            off += n


def local_optimizer(optimizer):
    """The optimizer that holds this rank's states: ZeRO-1's local shard, or the optimizer itself."""
    return getattr(optimizer, "optim", optimizer)


def _barrier():
    control.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RunState:
    """The run's state owners (FP8 scales and histories, ...) as one checkpoint entry: each owner has
    ``state_tensors()`` (name -> tensor, keys of its own and the same on every rank that holds them, so
    they reshard like the weights) and ``load_state_tensors(found)`` (the stored tensors of the keys the
    checkpoint holds; an owner fits another shape, and starts fresh for what is missing)."""

    def __init__(self, owners=()):
        self.owners = [o for o in owners if o is not None]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for owner in self.owners:
            mine = owner.state_tensors()
            clash = sorted(set(mine) & set(out))
            if clash:
                raise ValueError(f"run state owners share checkpoint keys {clash[:3]}: each owner keeps keys of its own")
            out.update(mine)
        return out

    def load_state_tensors(self, found: dict[str, torch.Tensor]) -> None:
        for owner in self.owners:
            owner.load_state_tensors({k: v for k, v in found.items() if k in owner.state_tensors()})


class PendingSave:
    """An asynchronous save in flight: ``finish()`` (collective) waits for it and makes it complete."""

    def __init__(self, future, tmp: Path, final: Path, meta: dict, sd: dict):
        self.future, self.tmp, self.final, self.meta, self.sd = future, tmp, final, meta, sd

    def finish(self) -> Path:
        dcp = _dcp()
        try:
            (self.future.result() if hasattr(self.future, "result") else self.future)
        except (OSError, dcp.api.CheckpointException) as e:
            raise _failed_save(self.tmp, self.sd, e) from e
        self.sd = None
        _barrier()
        _complete(self.tmp, self.final, self.meta)
        return self.final


def _complete(tmp: Path, final: Path, meta: dict) -> None:
    """The files' digests (the ranks hash a share each), the sealed meta.json, then the atomic rename
    (rank 0), once every rank's files are written."""
    meta = seal({**meta, "files": digest_files(tmp)})
    with raise_together("completing a checkpoint", types=(CheckpointSaveError,)):
        if _rank() == 0:
            try:
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except OSError as e:
                raise _failed_save(tmp, {}, e) from e
    _barrier()


class CheckpointSaveError(OSError):
    """A save that could not be written; its ``.tmp`` folder is removed."""


def _failed_save(tmp: Path, sd: dict, e: BaseException) -> CheckpointSaveError:
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    need = sum(t.numel() * t.element_size() for t in sd.values()) / 2 ** 20
    try:
        free = f"{shutil.disk_usage(tmp.parent).free / 2 ** 20:.1f} MiB free there"
    except OSError:
        free = "its free space unknown"
    cause = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    return CheckpointSaveError(f"could not write checkpoint {tmp.name.removesuffix('.tmp')} under {tmp.parent} "
                               f"(this rank's share: {need:.1f} MiB; {free}): {cause}. The unfinished folder is removed; the previous "
                               "checkpoints are untouched")


def save(folder: str | Path, model, optimizer, step: int, meta: dict, master_of: dict | None = None, *,
         async_group=None, asynchronous: bool = False, run_state=None):
    """Write the checkpoint of ``step`` under ``folder`` (collective); returns its path. ``master_of``
    (id(param) -> fp32 master, mixed precision) saves the masters the optimizer steps instead.
    ``asynchronous``: the tensors are copied now and written in the background (``dcp.async_save``
    over ``async_group``, a process group of its own so that training collectives do not mix with
    it); returns a :class:`PendingSave` to ``finish()`` later. ``run_state``: the run's state owners
    (:class:`RunState`), whose tensors are stored under their own layout-independent keys."""
    master_of = master_of or {}
    folder = Path(folder)
    final = folder / f"step_{step:08d}"
    tmp = folder / f"step_{step:08d}.tmp"
    with raise_together("creating the checkpoint folder", types=(CheckpointSaveError,)):
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointSaveError(f"could not create checkpoint folder {tmp}: {e.strerror or e}") from None
    _barrier()
    sd: dict[str, torch.Tensor] = {}
    opt_step = 0.0
    optimizer = local_optimizer(optimizer)
    for p, sl, name, rows, cols in rectangles(model):
        t = tag_of(p)
        if t is not None and t.tied == "copy":
            continue  # the tied head's copy of the embedding: the first stage writes those rectangles
        p = master_of.get(id(p), p)
        sd[_key("model", name, rows, cols)] = cut(p.detach(), sl).contiguous()
        st = optimizer.state.get(p, {})
        if st:
            sd[_key("exp_avg", name, rows, cols)] = cut(st["exp_avg"], sl).contiguous()
            sd[_key("exp_avg_sq", name, rows, cols)] = cut(st["exp_avg_sq"], sl).contiguous()
            opt_step = float(st["step"])
    # One key written by every rank, of which DCP keeps one rank's copy: a rank that owns no optimizer state
    # (ZeRO-1 with more DP×CP replicas than a stage has trainable parameters, e.g. LoRA) would offer 0. The
    # ranks agree on the count first (every owner holds the same one), so any copy kept is the right one.
    opt_step = control.all_reduce_values([opt_step], "max")[0]
    sd["optim::step"] = torch.tensor(opt_step, dtype=torch.float64)
    if run_state is not None:
        sd.update({k: v.detach() for k, v in run_state.state_tensors().items()})
    spec = lora_spec(model)  # what the adapters are: a resume refuses any other (check_same_adapters)
    meta = {**meta, "step": step, "adapters": spec.to_dict() if spec is not None else None}
    dcp = _dcp()
    if asynchronous:
        sd = {k: v.detach().clone().cpu() for k, v in sd.items()}  # the training step may now change the originals
        return PendingSave(dcp.async_save(sd, checkpoint_id=str(tmp), process_group=async_group), tmp, final, meta,
                           sd)
    try:  # DCP gathers every rank's write error and raises it on all of them
        with _quiet_dcp():
            dcp.save(sd, checkpoint_id=str(tmp))
    except (OSError, dcp.api.CheckpointException) as e:
        raise _failed_save(tmp, sd, e) from e
    _barrier()
    _complete(tmp, final, meta)
    return final


def read_meta(path: str | Path) -> dict:
    """A complete checkpoint's meta.json (step, config, layout, model description)."""
    path = Path(path) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"checkpoint metadata {path} must be a mapping with an integer 'step' and a 'config'")
    return meta


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (a renamed folder with meta.json), or None.
    Half-written ones (``.tmp``, or without meta.json) are skipped with a warning."""
    found = complete(folder)
    return found[0] if found else None


def complete(folder: str | Path) -> list[Path]:
    """The complete checkpoints under ``folder``, newest first (see :func:`latest`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for d in folder.iterdir():
        if not d.is_dir() or not d.name.startswith("step_"):
            continue
        if d.name.endswith(".tmp") or not (d / "meta.json").is_file() or not (d / ".metadata").is_file():
            warnings.warn(f"ignoring incomplete checkpoint {d}", stacklevel=2)
            continue
        done.append(d)
    return sorted(done, key=lambda d: d.name, reverse=True)


def resume(folder: str | Path, model, optimizer=None, master_of: dict | None = None,
           run_state=None) -> tuple[Path, dict] | None:
    """Load the newest checkpoint under ``folder`` that verifies (collective): (its path, its meta), or
    None when there is none. A damaged one is skipped with a warning naming the file, and the one
    before it is tried; when every one is damaged, CheckpointError lists them."""
    refused = []
    for path in complete(folder):
        try:
            return path, load(path, model, optimizer, master_of, run_state)
        except CheckpointError as e:
            refused.append(str(e))
            if _rank() == 0:
                warnings.warn(f"{e}; trying the checkpoint before it", stacklevel=2)
    if refused:
        raise CheckpointError(f"no checkpoint under {folder} can be loaded: {' | '.join(refused)}. Remove them, or start "
                              "with checkpoint.resume false (or another save_dir)")
    return None


def load(path: str | Path, model, optimizer=None, master_of: dict | None = None, run_state=None) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``, if given; with ``master_of``,
    into the fp32 masters, the 16-bit weights following) at their current layout (collective);
    returns its meta (step, config, layout). ``run_state`` (a :class:`RunState`) gets the stored tensors
    of its keys that the checkpoint holds. A checkpoint of another model is refused
    (:func:`check_same_model`): the layout may change on load, the model may not."""
    master_of = master_of or {}
    path = Path(path)
    meta = read_meta(path)
    verify(path, meta)  # every file against its digest, before any weight is touched
    check_same_model(path, meta, model.config)
    check_same_base(path, meta, model)
    check_same_adapters(path, meta, model)
    md = read_dcp_metadata(path)
    stored: dict[tuple[str, str], list] = {}
    for key, tmd in md.state_dict_metadata.items():
        if key.count(_SEP) == 3:
            kind, name, r, c = _parse(key)
            stored.setdefault((kind, name), []).append((r, c, key, tuple(tmd.size)))
    want: dict[str, torch.Tensor] = {"optim::step": torch.zeros((), dtype=torch.float64)}
    state_keys = [k for k in (run_state.state_tensors() if run_state is not None else {})
                  if k in md.state_dict_metadata]
    biased = sorted(k for k in md.state_dict_metadata if k.startswith("moe:") and k.endswith(".expert_bias"))
    if biased and not any(k in state_keys for k in biased):
        # the layers route with these biases: loading the weights without them would silently change which
        # experts every token picks
        raise ValueError(f"checkpoint {str(path)!r} was trained with aux-loss-free balancing (training."
                         f"moe_expert_bias_rate > 0; its routing biases: {', '.join(biased[:2])}"
                         f"{', …' if len(biased) > 2 else ''}): resume it with training.moe_expert_bias_rate > 0, "
                         "or its MoE layers would route without the biases they were trained with")
    for key in state_keys:  # the stored shape and dtype: the owner fits them to its own (RunState)
        tmd = md.state_dict_metadata[key]
        want[key] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    optimizer = local_optimizer(optimizer)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    jobs = []
    has_moments = optimizer is not None and any(k[0] == "exp_avg" for k in stored)
    for p, sl, name, rows, cols in rectangles(model):
        p = master_of.get(id(p), p)
        kinds = KINDS if has_moments and id(p) in owned else KINDS[:1]
        for kind in kinds:
            if kind == "model":
                target = cut(p.data, sl)
            else:
                st = optimizer.state.setdefault(p, {})
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                target = cut(st[kind], sl)
            covered = torch.zeros(target.shape, dtype=torch.bool)
            for r, c, key, size in stored.get((kind, name), []):
                r0, r1 = max(r[0], rows[0]), min(r[1], rows[1])
                if r0 >= r1:
                    continue
                if cols is not None:
                    c0, c1 = max(c[0], cols[0]), min(c[1], cols[1])
                    if c0 >= c1:
                        continue
                else:
                    c0 = c1 = None
                if key not in want:
                    want[key] = torch.empty(size, dtype=target.dtype)
                jobs.append((target, covered, key, (r0 - rows[0], r1 - rows[0]), (r0 - r[0], r1 - r[0]),
                             None if cols is None else ((c0 - cols[0], c1 - cols[0]), (c0 - c[0], c1 - c[0]))))
            jobs.append((target, covered, None, name, kind, None))
    dcp = _dcp()
    try:
        with _quiet_dcp():
            dcp.load(want, storage_reader=checkpoint_files.SafeReader(str(path)),
                     planner=checkpoint_files.SafeLoadPlanner())  # never unpickles
    except dcp.api.CheckpointException as e:  # DCP gathers every rank's error: a refusal is the same on all ranks
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise CheckpointError(str(refused[0])) from None
        raise
    with torch.no_grad():
        for target, covered, key, dst, src, colmap in jobs:
            if key is None:  # the end of one target's list: check it is whole
                if not bool(covered.all()):
                    raise ValueError(f"checkpoint {path} lacks part of {src} of tensor {dst} (saved at layout "
                                     f"{meta.get('layout')})")
                continue
            piece = want[key]
            if colmap is None:
                target[dst[0]:dst[1]] = piece[src[0]:src[1]].to(target.device)
                covered[dst[0]:dst[1]] = True
            else:
                (d0, d1), (s0, s1) = colmap
                target[dst[0]:dst[1], d0:d1] = piece[src[0]:src[1], s0:s1].to(target.device)
                covered[dst[0]:dst[1], d0:d1] = True
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in master_of:
                p.copy_(master_of[id(p)])
    if run_state is not None:
        run_state.load_state_tensors({k: want[k] for k in state_keys})
    step = float(want["optim::step"])
    if has_moments:
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.setdefault(p, {})
                if "exp_avg" in st:
                    fused = group.get("fused") or False
                    st["step"] = torch.tensor(step, dtype=torch.float32, device=p.device if fused else "cpu")
    return meta




def _export_source(path: str | Path, out: str | Path):
    """(the checkpoint folder, its meta, its TrainConfig) for an export of ``path`` (a checkpoint, or a
    save_dir: its latest complete one) to the folder ``out``; a bad path is a named error."""
    problem = path_problem("out", out, "folder")
    if problem:
        raise ValueError(problem)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint ({str(path)!r}) does not exist")
    if not (path / "meta.json").is_file():
        found = latest(path)
        if found is None:
            raise ValueError(f"{str(path)!r} is neither a checkpoint nor a folder of complete checkpoints")
        path = found
    meta = read_meta(path)
    return path, meta, config_of(meta)


def export_hf(path: str | Path, out: str | Path) -> Path:
    """Write the weights of checkpoint ``path`` as a Hugging Face folder (config.json + safetensors)
    that ``transformers`` loads: the model the run trained (adapters merged); in one process, on the CPU.
    With the base's special-token ids and generation_config.json and the run's tokenizer and chat template
    (:mod:`tpkernels.models.hf_export_files`), so ``pipeline("text-generation", model=out)`` works alone."""
    path, meta, cfg = _export_source(path, out)
    _refuse_expert_bias("export-hf", path, cfg)
    model = _export_model(cfg, saved_adapters(path, meta))
    load(path, model)
    ms = cfg.model
    if ms.base_quant is not None:  # QLoRA: the checkpoint holds no base; rebuilt as the run computed with it
        source = ms.init_from or random_init(model, cfg.training.seed)
        dequantize_as_trained_at_(model, source, cfg.parallel.tp, DTYPES[cfg.training.precision])
    if lora_spec(model) is not None:
        merge_lora_(model)  # the merged weights: base + alpha/r · B·A
    model.save_hf(out)
    # the base's special ids and generation config, the run's tokenizer and chat template: a folder that stands alone
    write_standalone_files(out, base=base_folder(ms.init_from, ms.name), tokenizer=cfg.data.tokenizer,
                           vocab_size=model.config.vocab_size)
    return Path(out)


def _refuse_expert_bias(what: str, path, cfg: TrainConfig) -> None:
    """Refuse to export a run trained with aux-loss-free balancing: Mixtral / Qwen-MoE in transformers have
    no weight for the selection bias, and dropping it silently changes which experts the model picks
    (docs/moe.md, "Aux-loss-free balancing")."""
    rate = cfg.training.moe_expert_bias_rate
    if rate:
        raise ValueError(f"{what}: checkpoint {str(path)!r} was trained with training.moe_expert_bias_rate ({rate!r}): "
                         f"its MoE layers route with a learned per-expert selection bias, which "
                         f"{cfg.model_config().family} in transformers has no weight for, so the exported model "
                         "would choose other experts than the model trained. Generate from the checkpoint itself "
                         "(tpkernels generate), or train without the bias to export")


def _export_model(cfg: TrainConfig, adapters: LoRASpec | None):
    """The one-process model a checkpoint of ``cfg`` loads into, with its ``adapters``. A QLoRA base is
    left unloaded: the checkpoint does not hold it. Its export reads it from ``model.init_from`` (or the
    seed's weights) as the run computed with it at its TP size: each rank's shard quantised as that rank
    quantised it, dequantised, put back together (``dequantize_as_trained_at_``: NF4 blocks never span
    two ranks, so the values depend on the TP size)."""
    model = ParallelTransformer(cfg.model_config(), None, init=None, quant=cfg.model.base_quant)
    if adapters is not None:
        apply_lora(model, adapters.rank, adapters.alpha, adapters.targets)
    return model


def export_peft(path: str | Path, out: str | Path) -> Path:
    """Write the LoRA adapters of checkpoint ``path`` as a PEFT folder (adapter_config.json +
    adapter_model.safetensors) that ``peft.PeftModel.from_pretrained`` loads onto the Hugging Face
    base (``model.init_from``); in one process, on the CPU (tpkernels.models.peft_export)."""
    from tpkernels.models.peft_export import write_peft  # noqa: PLC0415

    path, meta, cfg = _export_source(path, out)
    ms, spec = cfg.model, saved_adapters(path, meta)
    _refuse_expert_bias("export-peft", path, cfg)
    if spec is None:
        raise ValueError(f"export-peft: checkpoint {str(path)!r} was trained with model.finetune {ms.finetune!r}: it "
                         "holds no adapters (export-hf writes its weights)")
    if "experts" in spec.targets:
        raise ValueError(f"export-peft: checkpoint {str(path)!r} holds adapters on a mixture-of-experts model's routed "
                         "experts, which PEFT cannot load onto transformers' fused experts (experts.gate_up_proj is "
                         "no Linear); export-hf writes the merged model")
    model = _export_model(cfg, spec)
    load(path, model)
    return write_peft(model, out, base_model=peft_base_path(ms.init_from), rank=spec.rank, alpha=spec.alpha)


def peft_base_path(init_from: str | None) -> str | None:
    """``base_model_name_or_path`` for a PEFT export: ``model.init_from`` as an absolute path (a path relative to
    the run's folder means nothing where the adapters are loaded), resolved from here; a warning when no Hugging
    Face folder is found there (edit adapter_config.json), or when the base was a seeded random init (None)."""
    if init_from is None:
        warnings.warn("export-peft: the run had no model.init_from (its base was the seed's random weights): "
                      "adapter_config.json's base_model_name_or_path is null; export-hf writes the merged model",
                      UserWarning, stacklevel=3)
        return None
    p = Path(init_from).expanduser().resolve()
    if not (p / "config.json").is_file():
        warnings.warn(f"export-peft: model.init_from ({init_from!r}) is not a Hugging Face folder from here "
                      f"({str(p)!r}); base_model_name_or_path is written as {str(p)!r}: edit adapter_config.json "
                      "if the base lives elsewhere", UserWarning, stacklevel=3)
    return str(p)


# What may differ between the model a checkpoint holds and the one it resumes into: names, and what only
# initialisation or padding uses. The position table counts only where it holds weights (learned positions).
_FREE_FIELDS = ("name", "dropout_source", "initializer_range", "vocab_pad_multiple")


def saved_model(meta: dict) -> ModelConfig:
    """The model description a checkpoint was saved with (older checkpoints: from their config)."""
    d = meta.get("model_config")
    if d is None:
        return config_of(meta).model_config()
    d = dict(d)
    if d.get("sliding_window_layers") is not None:
        d["sliding_window_layers"] = tuple(d["sliding_window_layers"])
    return ModelConfig(**d)


def model_mismatches(saved: ModelConfig, now: ModelConfig) -> list[str]:
    """``field (saved value in the checkpoint, requested value here)`` for each field that differs."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in _FREE_FIELDS or (f.name == "max_position_embeddings" and now.positions != "learned"
                                      and saved.positions != "learned"):
            continue
        a, b = getattr(saved, f.name), getattr(now, f.name)
        if a != b:
            out.append(f"{f.name} ({a!r} in the checkpoint, {b!r} here)")
    return out


def check_same_model(path: str | Path, meta: dict, now: ModelConfig) -> None:
    """Refuse to resume checkpoint ``path`` into another model: resharding changes the layout, never the
    model (the overlapping rectangles of another shape would load without a word)."""
    diffs = model_mismatches(saved_model(meta), now)
    if diffs:
        raise ValueError(f"checkpoint {path} holds another model: {'; '.join(diffs)}. Resuming changes the layout, "
                         "never the model: resume with the checkpoint's model settings, or start a new save_dir")


def check_same_base(path: str | Path, meta: dict, model) -> None:
    """Refuse adapters trained on another kind of base: a QLoRA checkpoint holds no base weights (each run
    re-quantises them from ``model.init_from``), so its base format must be this model's."""
    saved = config_of(meta).model
    was, now = saved.base_quant, model.ctx.quant
    if was != now:
        def say(q, finetune):
            return f"model.finetune {finetune} with model.quant {q}" if q else f"model.finetune {finetune}"
        raise ValueError(f"checkpoint {path} was saved with {say(was, saved.finetune)}; this run builds "
                         f"{'a ' + now + ' base' if now else 'a full-precision base'}: its adapters were trained on "
                         f"another base. Resume with the checkpoint's model.finetune / model.quant, or start a new "
                         "save_dir")


def saved_adapters(path: str | Path, meta: dict) -> LoRASpec | None:
    """What the adapters of checkpoint ``path`` are (its meta; older checkpoints: their config's
    model.finetune, lora_rank and lora_alpha), or None when it holds none."""
    if "adapters" not in meta:
        ms = config_of(meta).model
        return LoRASpec.of(ms.lora_rank, ms.lora_alpha) if ms.adapters else None
    d = meta["adapters"]
    if d is None:
        return None
    try:
        spec = LoRASpec(d["rank"], float(d["alpha"]), tuple(d["targets"]), d["scaling"])
        if not (isinstance(spec.rank, int) and all(isinstance(t, str) for t in spec.targets)
                and isinstance(spec.scaling, str)):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint metadata {Path(path) / 'meta.json'}: 'adapters' ({d!r}) must be null or a "
                              "mapping of rank (an integer), alpha (a number), targets (names) and scaling") from None
    return spec


def check_same_adapters(path: str | Path, meta: dict, model) -> None:
    """Refuse to resume adapters of another shape or meaning: another rank's overlapping rectangles would
    load truncated (adapters and moments) without a word, another alpha or scaling would change the model
    silently, other targets or none at all would drop or invent adapters. Every rank decides alike (the
    same meta, the same config), before any tensor is read."""
    was, now = saved_adapters(path, meta), lora_spec(model)
    if was == now:
        return
    saved = config_of(meta).model.finetune
    if was is None or now is None:
        here = "full" if now is None else ("qlora" if model.ctx.quant else "lora")
        raise ValueError(f"checkpoint {path} was saved with model.finetune {saved} ({'no' if was is None else 'LoRA'} "
                         f"adapters); this run has model.finetune {here} ({'no' if now is None else 'LoRA'} adapters). "
                         f"Adapters resume as they were trained: resume with model.finetune {saved}, or start a new "
                         "save_dir (export-hf writes a checkpoint's merged model to fine-tune from)")
    diffs = [f"{key} ({a!r} in the checkpoint, {b!r} here)" for key, a, b in (
        ("model.lora_rank", was.rank, now.rank), ("model.lora_alpha", was.alpha, now.alpha),
        ("the adapted layers", list(was.targets), list(now.targets)), ("the LoRA scaling", was.scaling, now.scaling))
        if a != b]
    raise ValueError(f"checkpoint {path} holds other adapters: {'; '.join(diffs)}. Adapters resume as they were "
                     "trained (a resume changes the layout, never their shape or meaning): resume with the "
                     "checkpoint's values, or start a new save_dir")


def config_of(meta: dict) -> TrainConfig:
    """The TrainConfig a checkpoint was saved with (its meta.json; older checkpoints stored it flat)."""
    values = {k: v for k, v in meta["config"].items() if k != "predicted"}
    return TrainConfig.from_values(values)


__all__ = ["CheckpointError", "CheckpointSaveError", "RunState", "check_same_adapters", "check_same_base", "check_same_model",
           "complete", "config_of", "export_hf",
           "latest", "load", "resume", "local_optimizer", "model_mismatches",
           "read_meta", "rectangles", "save", "saved_adapters", "saved_model"]
