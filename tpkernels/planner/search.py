"""Enumerate every layout of a job, reject the invalid ones with the rule they break, score the
rest, and rank them (fastest step first)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field

from tpkernels import options
from tpkernels.parallel import CP_ALGOS, RECOMPUTE_CHOICES, SCHEDULES, ParallelConfig
from tpkernels.parallel.config import MOE_CHUNKS_DEFAULT, SHORT_NAMES
from tpkernels.planner.efficiency import Efficiency, calibrated_for
from tpkernels.planner.estimate import Estimate, estimate, layout_errors
from tpkernels.planner.hardware import ClusterSpec
from tpkernels.planner.memory import DEFAULT_MEMORY_MARGIN
from tpkernels.description import ModelConfig
from tpkernels.planner.workload import TrainingSetup

MAX_MICRO_BATCH = 16
MAX_VIRTUAL_STAGES = 8
FIXABLE = ("tp", "cp", "cp_algo", "pp", "dp", "ep", "virtual_stages", "micro_batch_size", "sequence_parallel",
           "recompute", "zero1", "schedule", "moe_chunks")
# Context parallelism is searched for long sequences only: below this, SP and recompute hold the
# activations and CP's K/V exchange costs more than it saves. Each CP rank keeps at least
# CP_MIN_TOKENS_PER_RANK tokens (fewer would leave the ring's hops nothing to hide behind).
CP_MIN_SEQ = 16384
CP_MIN_TOKENS_PER_RANK = 2048


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rule_of(message: str) -> str:
    """A rule's message with its numbers blanked, to count rejections per rule."""
    return re.sub(r"\(\S+?\)", "(…)", message)


@dataclass
class Plan:
    model: ModelConfig
    train: TrainingSetup
    cluster: ClusterSpec
    efficiency: Efficiency
    ranked: list[Estimate]  # the best configuration of each (TP, CP, PP, DP, EP) layout that fits, fastest first
    evaluated: int = 0
    rejected: Counter = field(default_factory=Counter)  # rule -> configurations that broke it
    too_big: list[Estimate] = field(default_factory=list)  # valid layouts that do not fit, smallest first
    fixed: dict = field(default_factory=dict)
    machine_key: str | None = None  # the machine whose fitted corrections may apply (tpkernels.planner.fit)
    fit_used: tuple | None = None  # (Fit, its cache record) when the plan used them

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def cp_choices(train: TrainingSetup, ranks: int) -> list[int]:
    """Context-parallel sizes worth scoring when ``ranks`` GPUs are left after TP: 1, and for a
    sequence of at least CP_MIN_SEQ tokens each divisor that splits it into 2·cp equal chunks of
    at least CP_MIN_TOKENS_PER_RANK / 2 tokens."""
    if train.seq_length < CP_MIN_SEQ:
        return [1]
    return [c for c in divisors(ranks) if c == 1 or (train.seq_length % (2 * c) == 0
                                                     and train.seq_length // c >= CP_MIN_TOKENS_PER_RANK)]


def ep_choices(model: ModelConfig, dp: int, cp: int) -> list[int]:
    """Expert-parallel sizes worth scoring: 1, and for a mixture-of-experts model each divisor of
    dp · cp (EP folds into DP × CP) that divides the experts into whole experts per rank."""
    if not model.is_moe:
        return [1]
    return [e for e in divisors(dp * cp) if model.num_experts % e == 0]


def candidate_configs(model: ModelConfig, train: TrainingSetup, cluster: ClusterSpec, fixed: dict | None = None):
    """Yield every ParallelConfig of this job's search space (valid or not), honouring ``fixed``."""
    fixed = {k: v for k, v in (fixed or {}).items() if k != "schedule"}
    unknown = set(fixed) - set(FIXABLE)
    if unknown:
        raise ValueError(f"fixed choices {sorted(unknown)} are not layout fields; use {', '.join(FIXABLE)}")
    n = cluster.num_gpus

    def choices(name, default):
        return [fixed[name]] if name in fixed else default

    # With FlashAttention the scores are never stored, so "selective" would equal "none".
    rcs = [r for r in RECOMPUTE_CHOICES if not (train.flash_attention and r == "selective")]
    for tp in choices("tp", [d for d in divisors(n) if d <= cluster.gpus_per_node]):
        for cp in choices("cp", cp_choices(train, n // tp) if n % tp == 0 else [1]):
            rest = n // (tp * cp) if n % (tp * cp) == 0 else 0
            pps = [d for d in divisors(rest) if d <= model.num_layers] if rest else [1]
            algos = choices("cp_algo", list(CP_ALGOS) if cp > 1 else ["ring"])
            for pp, algo in itertools.product(choices("pp", pps), algos):
                # a fixed tp/cp/pp that does not divide n fails the world-size rule
                dp = max(1, n // (tp * cp * pp))
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                per_replica = train.global_batch // dp  # a remainder fails the global-batch rule
                knobs = (
                    choices("virtual_stages", [1] + [v for v in range(2, MAX_VIRTUAL_STAGES + 1)
                                                     if pp > 1 and model.num_layers % (pp * v) == 0]),
                    choices("micro_batch_size", [d for d in divisors(max(per_replica, 1)) if d <= MAX_MICRO_BATCH]),
                    choices("sequence_parallel", [False, True] if tp > 1 else [False]),
                    choices("recompute", rcs),
                    choices("zero1", [False, True] if dp * cp > 1 else [False]),
                )
                # moe_chunks is not searched: 2 hides at least as much as 1 in the model (expert_parallel.
                # chunked_exposed) at a few more launches, so the default, or the fixed value, is scored
                chunks = fixed.get("moe_chunks", MOE_CHUNKS_DEFAULT)
                for v, mbs, sp, rc, z, ep in itertools.product(*knobs, choices("ep", ep_choices(model, dp, cp))):
                    yield ParallelConfig(tp=tp, pp=pp, dp=dp, virtual_stages=v, micro_batch_size=mbs,
                                         num_microbatches=max(1, per_replica // mbs), sequence_parallel=sp,
                                         recompute=rc, zero1=z, cp=cp, cp_algo=algo, ep=ep, moe_chunks=chunks)


def schedules_for(cfg: ParallelConfig, fixed: dict | None = None) -> list[ParallelConfig]:
    """``cfg`` with each pipeline schedule worth scoring: the fixed one, or 1F1B and ZB-H1 (GPipe has
    1F1B's bubble with m micro-batches of activations alive, so it is never the better choice), or
    interleaved with virtual stages."""
    if fixed and "schedule" in fixed:
        return [cfg.replace(schedule=fixed["schedule"])]
    if cfg.pp == 1:
        return [cfg]
    return [cfg.replace(schedule=s) for s in (["interleaved"] if cfg.virtual_stages > 1 else ["1f1b", "zb-h1"])]


def plan(model: ModelConfig, train: TrainingSetup, cluster: ClusterSpec, eff: Efficiency | None = None,
         fixed: dict | None = None, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> Plan:
    """Score every valid configuration; keep per layout (TP, PP, DP) the fastest one that fits
    (virtual stages, micro-batch size, SP, recompute, ZeRO-1 and the schedule are that layout's
    knobs; with context parallelism the layout is (TP, CP, PP, DP) and the CP algorithm a knob; with
    experts, (TP, CP, PP, DP, EP): EP changes what each GPU holds and what crosses which link).
    ``eff`` defaults to the constants calibrated for the cluster's GPU generation."""
    eff = eff or calibrated_for(cluster.gpu)
    if fixed and "schedule" in fixed and fixed["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule ({fixed['schedule']!r}) must be one of {', '.join(SCHEDULES)}")
    result = Plan(model, train, cluster, eff, [], fixed=dict(fixed or {}))
    best: dict[tuple, Estimate] = {}
    smallest: dict[tuple, Estimate] = {}
    scored = (with_schedule for cfg in candidate_configs(model, train, cluster, fixed)
              for with_schedule in schedules_for(cfg, fixed))
    for cfg in scored:
        errs = layout_errors(model, train, cluster, cfg)
        if errs:
            for e in errs:
                result.rejected[rule_of(e)] += 1
            continue
        est = estimate(model, train, cluster, cfg, eff, memory_margin)
        result.evaluated += 1
        key = (cfg.tp, cfg.cp, cfg.pp, cfg.dp, cfg.ep)
        if est.fits:
            if key not in best or est.step_time < best[key].step_time:
                best[key] = est
        else:
            result.rejected["does not fit in GPU memory"] += 1
            if key not in smallest or est.memory.total < smallest[key].memory.total:
                smallest[key] = est
    result.ranked = sorted(best.values(), key=lambda e: (e.step_time, e.memory.total))
    result.too_big = sorted((e for k, e in smallest.items() if k not in best), key=lambda e: e.memory.total)
    return result


# The layout fields a layout string may fix, by every spelling it accepts (field names and SHORT_NAMES).
_SPELLINGS = sorted(set(FIXABLE) | {k for k, v in SHORT_NAMES.items() if v in FIXABLE})


def parse_layout(text: str) -> dict:
    """``"TP=4,PP=2,SP=on,recompute=selective"`` → {"tp": 4, "pp": 2, ...} (fields of ParallelConfig).
    Keys: a field's name or its short spelling (:data:`~tpkernels.parallel.config.SHORT_NAMES`), any case;
    each field once. Values are read by :func:`tpkernels.options.coerce` (loose: on/off, yes/no,
    true/false; a choice in any case); sizes are positive integers. Errors name the key as written."""
    keys = {k.path: k for k in options.keys_of(ParallelConfig) if k.path in FIXABLE}
    out, written = {}, {}
    for part in filter(None, (p.strip() for p in re.split(r"[,\s]+", text))):
        if "=" not in part:
            raise ValueError(f"layout item ({part!r}) must look like KEY=VALUE, e.g. TP=4")
        key, value = (s.strip() for s in part.split("=", 1))
        field_name = SHORT_NAMES.get(key.lower(), key.lower())
        if field_name not in keys:
            raise ValueError(f"layout key ({key!r}) must be one of {', '.join(_SPELLINGS)}")
        if field_name in written:
            raise ValueError(f"{key} is given twice ({written[field_name]}={out[field_name]!r} and {part}): give each "
                             "layout field once")
        written[field_name] = key
        # the field's type without "or none": a layout string fixes a value (dp none is the world's business)
        spec = dataclasses.replace(keys[field_name], path=key, type=keys[field_name].base)
        got = options.coerce(spec, value.lower() if spec.base is str else value, text=True, loose=True)  # SP=yes
        if spec.base is int and got < 1:
            raise ValueError(f"{key} ({got}) must be a positive integer")
        out[field_name] = got
    return out


@dataclass
class Explanation:
    requested: dict
    text: str  # the layout as the user wrote it
    errors: list[str]  # rules the layout breaks (empty when valid)
    estimate: Estimate | None  # best configuration of the layout (None when invalid)
    fits: bool
    best: Estimate | None  # best layout overall


def explain(model: ModelConfig, train: TrainingSetup, cluster: ClusterSpec, layout: dict | str,
            eff: Efficiency | None = None, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> Explanation:
    """Score the layout a user has in mind: unspecified knobs take their best value."""
    req = parse_layout(layout) if isinstance(layout, str) else dict(layout)
    label = layout if isinstance(layout, str) else ",".join(f"{k}={v}" for k, v in req.items())
    cfg_fields = dict(req)
    tp, pp, cp = req.get("tp", 1), req.get("pp", 1), req.get("cp", 1)
    if "dp" not in req and cluster.num_gpus % (tp * cp * pp) == 0:
        cfg_fields["dp"] = cluster.num_gpus // (tp * cp * pp)
    dp = cfg_fields.get("dp", 1)
    mbs = req.get("micro_batch_size", 1)
    m = train.global_batch // (dp * mbs) if train.global_batch % (dp * mbs) == 0 else 0
    probe = ParallelConfig(**{**cfg_fields, "num_microbatches": max(m, 1)})
    errors = layout_errors(model, train, cluster, probe)
    if "dp" not in cfg_fields and not probe.layout_errors():
        errors = [e for e in errors if not e.startswith("world_size")]
        errors.insert(0, f"world_size ({cluster.num_gpus}) must be divisible by tp ({tp}) × "
                         + (f"cp ({cp}) × " if cp > 1 else "") + f"pp ({pp}) = {tp * cp * pp}")
    if m == 0 and not any("global_batch_size" in e for e in errors):
        errors.append(f"global_batch_size ({train.global_batch}) must be divisible by micro_batch_size ({mbs}) × "
                      f"dp ({dp}) = {mbs * dp}")
    overall = plan(model, train, cluster, eff, memory_margin=memory_margin)
    if errors:
        return Explanation(req, label, errors, None, False, overall.best)
    scoped = plan(model, train, cluster, eff, fixed=cfg_fields,
                  memory_margin=memory_margin)
    est = scoped.best or (scoped.too_big[0] if scoped.too_big else None)
    if est is None:  # every knob setting broke a rule (e.g. interleaving with an incompatible batch)
        return Explanation(req, label, sorted(scoped.rejected), None, False, overall.best)
    return Explanation(req, label, [], est, est.fits, overall.best)
