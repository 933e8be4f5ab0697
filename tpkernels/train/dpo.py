"""DPO in the trainer (``training.task dpo``): the step's pairs, the reference log-probs, the metrics.

    pairs = PairInfo.of(batch, target)            # host: the step's pairs, their sequences' ids per token
    ref = ReferenceLogps(trainer)                 # dpo.reference: cached (filled once), adapters or model (online)
    table = ref.table(trainer, step_batch)        # (num_pairs, 2) [chosen, rejected], or None (simpo)

The objective itself is :class:`tpkernels.models.preference.PreferenceObjective`, the last stage's
``loss_fn``; ``ParallelTransformer.step`` divides its sums by the step's pair count.

The reference (``dpo.reference``):
- ``cached`` (default): before the first step, one forward-only pass of the initial weights over every
  pair of the packed dataset (the layout's own pipeline, any TP/PP/CP/DP), each pair's log-probs
  stored under its stable index (``TokenBatch.pair_sample``) in a :class:`ReferenceCache` keyed by
  the model (checkpoint files, or the random init's seed and shape), the data and tokenizer files,
  the sequence length and the mask / packing settings; a later run with the same key reads it, at
  any layout. A step then costs one policy forward/backward, as SFT does.
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

from tpkernels.functional.preference import METRIC_NAMES, REFERENCE_FREE
from tpkernels.models.lora import LoRA
from tpkernels.models.preference import PreferenceObjective, SequenceLogps
from tpkernels.parallel import control
from tpkernels.train import reference_cache as rc

IGNORE_INDEX = -100


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
    """The model with every LoRA adapter's scale at 0 (its update exactly 0): the base model."""
    mods = [m for m in model.modules() if isinstance(m, LoRA)]
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


def cache_key(cfg, mc, source: str | None = None) -> rc.CacheKey:
    """What the reference log-probs of ``source`` (default: data.source) depend on (and nothing else:
    not the layout)."""
    d = cfg.data
    if not d.tokenizer:
        raise ValueError("dpo.reference cached: preference data needs data.tokenizer (its chat template and "
                         "vocabulary are part of the cache key)")
    model = cfg.model.init_from or {"random_init": {"seed": cfg.training.seed,
                                                     "config": dataclasses.asdict(mc)}}
    settings = {"format": d.format, "loss_on": d.loss_on, "overflow": d.overflow, "seed": cfg.training.seed,
                "precision": cfg.training.precision, "model_config": dataclasses.asdict(mc)}
    return rc.reference_cache_key(model=model, data=[source or d.source], tokenizer=d.tokenizer,
                                  seq_length=d.seq_length, settings=settings)


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
            key = cache_key(cfg, trainer.mc, source)
            self.cache = rc.ReferenceCache(_cache_root(trainer) / key.digest[:16], key)
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
        """Cached mode: compute the pairs the cache lacks (collective), finalise it; the count computed."""
        if self.mode != "cached" or self.cache.complete:
            return 0
        packed, st, pc = self.packed, trainer.state, trainer.pc
        total = packed.num_pairs
        missing = self.cache.missing(total)
        row_of = torch.full((total,), -1, dtype=torch.long)
        where = packed.sample >= 0
        row_of[packed.sample[where]] = torch.nonzero(where)[:, 0]
        rows = torch.unique(row_of[missing]) if missing.numel() else torch.zeros(0, dtype=torch.long)
        g = pc.global_batch_size
        writer = trainer.model.head is not None and st.tp_rank == 0 and st.cp_rank == 0
        todo = set(missing.tolist())
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
                if keep:
                    k = torch.tensor(keep)
                    self.cache.put(batch.pairs.samples[k], values[k, 0], values[k, 1])
        control.barrier()
        if st.rank == 0:
            self.cache.finalize(total)
        control.barrier()
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
