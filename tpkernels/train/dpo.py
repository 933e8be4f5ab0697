"""DPO in the trainer (``training.task dpo``): the step's pairs, the reference log-probs, the metrics.

    pairs = PairInfo.of(batch, target)            # host: the step's pairs, their sequences' ids per token
    ref = ReferenceLogps(trainer)                 # dpo.reference: cached (filled once), adapters or model (online)
    table = ref.table(trainer, step_batch)        # (num_pairs, 2) [chosen, rejected], or None (simpo)

The objective itself is :class:`tpkernels.models.preference.PreferenceObjective`, the last stage's
``loss_fn``; ``ParallelTransformer.step`` divides its sums by the step's pair count.

The reference (``dpo.reference``):
- ``cached`` (default): before the first step, one forward-only pass of the initial weights over every
  pair of the packed dataset (the layout's own pipeline, any TP/PP/CP/DP; LoRA and QLoRA with their
  adapters off, so the pass is the reference those runs would compute online), each pair's
  log-probs stored under its stable index (``TokenBatch.pair_sample``) in a :class:`ReferenceCache`
  keyed by everything that changes them (:func:`cache_key`); a later run with the same key reads it,
  at any layout. A step then costs one policy forward/backward, as SFT does. Rank 0 alone reads the
  cache's state (complete? which pairs are missing?) and opens, keys and finalises it; every rank acts
  on what it broadcasts: another run filling the same folder may complete it at any moment, and
  ranks that read the disk each for itself could disagree and wait in different collectives.
- ``adapters`` (LoRA): every step, a forward-only pass with the adapters turned off (scale 0: the
  base weights exactly), then the training pass: no second copy of the weights.
- ``model``: a frozen copy of the initial weights beside the policy (twice the weights' memory),
  a forward-only pass every step; for full fine-tuning when the cache cannot be used (a blend).
Reference-free losses (``simpo``) skip both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from pathlib import Path

import torch

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.preference import METRIC_NAMES, REFERENCE_FREE
from tpkernels.models.expert_lora import ExpertLoRA
from tpkernels.models.lora import LoRA
from tpkernels.models.preference import PreferenceObjective, SequenceLogps
from tpkernels.parallel import control
from tpkernels.parallel.raise_together import raise_together
from tpkernels.train import reference_cache as rc

# how far two runs' values of one pair may differ in the cache (other layouts round otherwise): fp32 and fp64
# sums differ by reduction order (~1e-7 relative), 16-bit and FP8 activations by their rounding (~1e-2)
REFERENCE_RTOL = {"fp64": 1e-6, "fp32": 1e-6, "bf16": 5e-2, "fp16": 5e-2, "fp8": 5e-2}
_CACHE_ERRORS = (rc.ReferenceCacheError, rc.ReferenceCacheKeyError, rc.ReferenceCacheCorruptError)


@dataclasses.dataclass
class PairInfo:
    """A step's preference pairs, on the host: ``doc`` (rows, seq) gives each position's sequence
    (2·pair chosen, 2·pair + 1 rejected, -1 filler); ``samples`` (num_pairs,) each pair's stable index
    in the packed dataset (-1: unknown); ``chosen_tokens``: supervised chosen targets (the SFT term's
    denominator)."""

    num_pairs: int
    chosen_tokens: int
    doc: torch.Tensor
    samples: torch.Tensor

    @staticmethod
    def of(batch, target: torch.Tensor) -> "PairInfo":
        pi, chosen = batch.pair_index, batch.chosen
        if pi is None or chosen is None:
            raise ValueError("training.task dpo needs preference data (prompt/chosen/rejected records); this "
                             "data.source gives no pairs")
        paired = pi >= 0
        if not bool(paired.any()):
            raise ValueError("training.task dpo: a step's batch holds no preference pair")
        num_pairs = int(pi.max()) + 1
        doc = torch.where(paired, 2 * pi + (~chosen).long(), torch.full_like(pi, -1))
        chosen_tokens = int(((target != IGNORE_INDEX) & chosen & paired).sum())
        samples = torch.full((num_pairs,), -1, dtype=torch.long)
        if batch.pair_sample is not None:
            samples[pi[paired]] = batch.pair_sample[paired]
        return PairInfo(num_pairs, chosen_tokens, doc, samples)


@contextlib.contextmanager
def adapters_off(model):
    """The model with every LoRA adapter's scale at 0 (its update exactly 0): the base model. The routed
    experts' adapters too (a MoE model's reference would otherwise hold their updates)."""
    mods = [m for m in model.modules() if isinstance(m, (LoRA, ExpertLoRA))]
    saved = [m.scale for m in mods]
    for m in mods:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(mods, saved):
            m.scale = s


def make_objective(trainer) -> PreferenceObjective | None:
    """The last stage's objective (None on the other stages)."""
    model, d = trainer.model, trainer.cfg.dpo
    if model.head is None:
        return None
    return PreferenceObjective(model.head, model.state, beta=d.beta, loss_type=d.loss_type,
                               label_smoothing=d.label_smoothing, sft_weight=d.sft_weight, simpo_gamma=d.simpo_gamma)


def reference_pass(trainer, batch, model=None) -> torch.Tensor:
    """The pairs' (chosen, rejected) log-probs of a prepared step batch, forward only, under ``model``
    (default: the trainer's, as it is now): (num_pairs, 2) float64 on the last stage (zeros for the
    pairs of other DP replicas and on the other stages). Collective over the whole world, like a step."""
    model, st = model or trainer.model, trainer.state
    rec = SequenceLogps(model.head, st) if model.head is not None else None
    if rec is not None:
        rec.begin(batch.pairs.num_pairs)
    model.evaluate(batch.input_ids if st.is_first_stage else None, batch.target, batch.position_ids,
                   loss_fn=rec, num_targets=batch.pairs.num_pairs)
    return rec.result() if rec is not None else torch.zeros(batch.pairs.num_pairs, 2, dtype=torch.float64)


def _cache_root(trainer) -> Path:
    d = trainer.cfg.dpo.cache_dir
    if d:
        return Path(d)
    nodes = len(set(control.all_gather_objects(socket.gethostname())))
    if nodes > 1:
        raise ValueError(f"dpo.reference cached on {nodes} nodes needs dpo.cache_dir: a folder every node sees "
                         "(the default, ~/.cache/tpkernels/dpo_reference, is each node's own)")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tpkernels" / "dpo_reference"


def cache_key(cfg, mc, packed, source: str | None = None, *, tp: int = 1,
              fp8_linears: list[str] | None = None) -> rc.CacheKey:
    """What the reference log-probs of ``source`` (default: data.source; ``packed``: its packed pairs,
    :class:`~tpkernels.data.packing.PackedSamples`) depend on, and nothing else:
    - the base weights: ``model.init_from``'s files (:func:`~tpkernels.train.reference_cache.model_identity`),
      or the random init's seed and shape; ``model.finetune`` and the base's quantisation
      (``model.quant``), and for a quantised base ``tp``: its bytes depend on the TP size (each rank
      quantises its own pieces; the double quantisation's statistics are per piece);
    - the tokens: the data and tokenizer files (the chat template with them), and the packed
      dataset's own tensors (the encoding, truncation, packing and the pairs' numbering); the
      sequence length, the data settings, the seed (it orders the packing);
    - the compute dtype (``training.precision``) and, in FP8, the recipe (the ``fp8`` section's
      scaling keys) and ``fp8_linears``: the kinds of linear that run FP8 (the run's choice, which
      ``fp8.layers auto`` makes per machine).
    Not the layout (beyond a quantised base's TP size), not the preference loss, β, the LoRA rank or
    alpha (the reference runs with the adapters off): runs that differ only there share a cache."""
    d = cfg.data
    if not d.tokenizer:
        raise ValueError("dpo.reference cached: preference data needs data.tokenizer (its chat template and "
                         "vocabulary are part of the cache key)")
    ms = cfg.model
    model = ms.init_from or {"random_init": {"seed": cfg.training.seed, "config": dataclasses.asdict(mc)}}
    quant = ms.base_quant
    settings = {"format": d.format, "loss_on": d.loss_on, "overflow": d.overflow, "seed": cfg.training.seed,
                "precision": cfg.training.precision, "model_config": dataclasses.asdict(mc),
                "finetune": ms.finetune, "quant": quant, "quant_tp": tp if quant else None,
                "fp8": None if cfg.training.precision != "fp8" else {
                    "recipe": cfg.fp8.recipe, "history": cfg.fp8.history, "amax_reduction": cfg.fp8.amax_reduction,
                    "margin": cfg.fp8.margin, "linears": None if fp8_linears is None else list(fp8_linears)}}
    tokens = {"ids": packed.ids, "position_ids": packed.pos, "loss_mask": packed.mask, "chosen": packed.chosen,
              "pair_sample": packed.sample}
    return rc.reference_cache_key(model=model, data=[source or d.source], tokenizer=d.tokenizer,
                                  seq_length=d.seq_length, settings=settings, tokens=tokens)


def _on_rank0(trainer, what: str, fn):
    """``fn()`` on rank 0 alone, its result on every rank (an error there raised on every rank): one
    process reads and changes the cache folder, and all act on its answer."""
    out = None
    with raise_together(what, types=_CACHE_ERRORS):
        if trainer.state.rank == 0:
            out = fn()
    return control.broadcast_object(out)


class ReferenceLogps:
    """Where a DPO run's reference log-probs come from (``dpo.reference``; see the module docstring)."""

    def __init__(self, trainer, data=None, source: str | None = None):
        """``data``/``source``: another source than the training data's (validation)."""
        cfg = trainer.cfg
        data, source = data or trainer.data, source or cfg.data.source
        self.mode = None if cfg.dpo.loss_type in REFERENCE_FREE else cfg.dpo.reference
        self.cache = self.frozen = None
        if self.mode == "model":  # a frozen copy of the initial weights, sharded like the policy
            self.frozen = trainer.build_model().requires_grad_(False)
        if self.mode == "cached":
            packed = getattr(data, "packed", None)
            if packed is None or not getattr(packed, "pairs", False):
                raise ValueError(f"dpo.reference cached needs one preference source (not a blend): "
                                 f"{source!r}; use dpo.reference model (or adapters with LoRA)")
            root, rtol = _cache_root(trainer), REFERENCE_RTOL[cfg.training.precision]
            opened = {}

            def open_cache() -> dict:  # rank 0: hash the inputs, create or check the folder
                key = cache_key(cfg, trainer.mc, packed, source, tp=trainer.pc.tp,
                                fp8_linears=trainer.fp8.kinds if trainer.fp8 is not None else None)
                opened["cache"] = rc.ReferenceCache(root / key.digest[:16], key, rtol=rtol)
                return key.fields

            key = rc.CacheKey(_on_rank0(trainer, "opening the DPO reference cache", open_cache))
            self.cache = opened.get("cache") or rc.ReferenceCache(root / key.digest[:16], key, rtol=rtol, create=False)
            self.packed = packed

    def table(self, trainer, batch) -> torch.Tensor | None:
        if self.mode is None:
            return None
        if self.mode == "adapters":
            with adapters_off(trainer.model):
                return reference_pass(trainer, batch)
        if self.mode == "model":
            return reference_pass(trainer, batch, self.frozen)
        samples = batch.pairs.samples
        chosen, rejected = self.cache.get(samples)
        return torch.stack([chosen, rejected], dim=1)

    def fill(self, trainer) -> int:
        """Cached mode: compute the pairs the cache lacks (collective), finalise it; the count computed.
        Another run may fill the same folder meanwhile: what it completes first is taken as is (same key,
        same values), and this run's late parts are dropped."""
        if self.mode != "cached":
            return 0
        packed, st, pc = self.packed, trainer.state, trainer.pc
        total = packed.num_pairs

        def todo_list():  # rank 0's view of the folder, the one every rank acts on
            return None if self.cache.complete else self.cache.missing(total).tolist()

        todo = _on_rank0(trainer, "reading the DPO reference cache", todo_list)
        if todo is None:
            return 0
        missing = torch.tensor(todo, dtype=torch.long)
        row_of = torch.full((total,), -1, dtype=torch.long)
        where = packed.sample >= 0
        row_of[packed.sample[where]] = torch.nonzero(where)[:, 0]
        rows = torch.unique(row_of[missing]) if missing.numel() else torch.zeros(0, dtype=torch.long)
        g = pc.global_batch_size
        writer = trainer.model.head is not None and st.tp_rank == 0 and st.cp_rank == 0
        todo, failure = set(todo), None
        # the reference of LoRA and QLoRA is the base alone: adapters off (at init they add exactly 0 anyway)
        with adapters_off(trainer.model):
            for start in range(0, rows.numel(), g):
                idx = rows[start:start + g]
                if idx.numel() < g:  # a full global batch for the layout's micro-batching: repeat rows
                    idx = torch.cat([idx, rows[torch.arange(g - idx.numel()) % rows.numel()]])
                batch = trainer.shard_batch(packed.packed_rows(idx))
                values = reference_pass(trainer, batch)
                if writer:  # this replica's pairs still missing, each once (a padded batch repeats rows)
                    keep = []
                    for p in torch.unique(batch.pairs.doc[batch.pairs.doc >= 0] // 2).tolist():
                        sample = int(batch.pairs.samples[p])
                        if sample in todo:
                            todo.discard(sample)
                            keep.append(p)
                    if keep and failure is None:
                        k = torch.tensor(keep)
                        try:
                            self.cache.put(batch.pairs.samples[k], values[k, 0], values[k, 1])
                        except (rc.ReferenceCacheError, OSError) as e:  # raised on every rank below
                            failure = e
        with raise_together("writing the DPO reference cache", types=_CACHE_ERRORS):  # and every part is on disk
            if failure is not None:
                raise failure
        _on_rank0(trainer, "finalising the DPO reference cache", lambda: self.cache.finalize(total))
        return int(missing.numel())


def metric_sums(trainer, objective) -> list[float]:
    """TRL's metrics summed over the pairs the objective saw since its ``begin_step``, then their count,
    on every rank: one sum over the world, each pair counted once (the last stage's TP/CP rank 0 of
    each DP replica contributes)."""
    st = trainer.state
    mine = torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64)
    if objective is not None and st.tp_rank == 0 and st.cp_rank == 0 and objective.metric_sums() is not None:
        mine = objective.metric_sums().double().cpu()
    return control.all_reduce_values(mine.tolist(), "sum")


def metric_means(sums: list[float]) -> dict[str, float]:
    count = max(sums[-1], 1.0)
    return {name: sums[i] / count for i, name in enumerate(METRIC_NAMES)}


def reduce_metrics(trainer, objective) -> dict[str, float]:
    """TRL's metrics of the step (means over its pairs), on every rank."""
    return metric_means(metric_sums(trainer, objective))


__all__ = ["PairInfo", "ReferenceLogps", "adapters_off", "cache_key", "make_objective", "metric_means", "metric_sums",
           "reduce_metrics", "reference_pass"]
