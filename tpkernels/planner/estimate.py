"""Score one layout: validity, memory, step time, throughput, and what to watch out for."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec
from tpkernels.planner.memory import DEFAULT_MEMORY_MARGIN, GIB, MemoryBreakdown, fits, peak_memory
from tpkernels.description import ModelConfig
from tpkernels.planner.step_time import StepTime, step_time
from tpkernels.planner.workload import TrainingSetup

COMM_RATIO_LIMIT = 0.30  # practitioners' rule: above ~30% communication/compute, lower TP


def layout_errors(model: ModelConfig, train: TrainingSetup, cluster: ClusterSpec, cfg: ParallelConfig) -> list[str]:
    """Every rule ``cfg`` (with its schedule) breaks for this model, cluster and batch (empty when valid)."""
    errs = cfg.layout_errors()
    if errs:
        return errs
    errs += cfg.job_errors(world_size=cluster.num_gpus, global_batch_size=train.global_batch)
    errs += cfg.model_errors(**model.layout_rules(train.seq_length))  # with the expert rules of a MoE model
    if cluster.gpus_per_node % cfg.tp:
        errs.append(f"tp ({cfg.tp}) must divide gpus_per_node ({cluster.gpus_per_node}): "
                    "TP communicates every layer, so each TP group must sit inside one node")
    try:
        cluster.gpu.peak_tflops(train.precision)
    except ValueError as e:
        errs.append(str(e))
    return errs


@dataclass
class Estimate:
    config: ParallelConfig
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    model_flops: float  # per step, whole job, without recompute
    hardware_flops: float  # per step, whole job, with recompute
    num_gpus: int
    peak_tflops: float
    memory_capacity_gib: float
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return self.time.total

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu / self.peak_tflops

    @property
    def bubble_fraction(self) -> float:
        return self.time.bubble / self.step_time

    def as_dict(self) -> dict:
        c = self.config
        return {
            "layout": c.short(),
            "tp": c.tp, "cp": c.cp, "cp_algo": c.cp_algo, "pp": c.pp, "dp": c.dp, "ep": c.ep,
            "virtual_stages": c.virtual_stages,
            "micro_batch_size": c.micro_batch_size, "num_microbatches": c.num_microbatches,
            "sequence_parallel": c.sequence_parallel, "recompute": c.recompute, "zero1": c.zero1,
            "schedule": self.time.schedule, "fits": self.fits, "step_time_s": self.step_time,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction, "comm_ratio": self.time.comm_ratio,
            "memory_gib": self.memory.as_gib(), "memory_stage": self.memory.stage,
            "memory_capacity_gib": self.memory_capacity_gib,
            "time_s": self.time.as_dict(), "notes": list(self.notes),
        }


def estimate(model: ModelConfig, train: TrainingSetup, cluster: ClusterSpec, cfg: ParallelConfig,
             eff: Efficiency, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> Estimate:
    """Memory and step time of a layout that passed ``layout_errors``, run with its pipeline schedule
    (``cfg.pipeline_schedule``: 1F1B, or interleaved with virtual stages, unless ``cfg.schedule`` says)."""
    t = step_time(model, train, cfg, cluster, eff)
    mem = peak_memory(model, train, cfg)
    model_flops, lin, core = _flops(model, train.global_batch, train.seq_length)
    if train.adapters:
        model_flops -= model.num_layers * lin  # frozen linears compute no weight gradient
    recompute = {"full": lin + core, "selective": 0.0 if train.flash_attention else core, "none": 0.0}[cfg.recompute]
    capacity = cluster.gpu.memory_gib
    est = Estimate(cfg, mem, t, fits(mem, capacity, memory_margin), model_flops,
                   model_flops + model.num_layers * recompute, cluster.num_gpus,
                   cluster.gpu.peak_tflops(train.precision), capacity)
    est.notes = _notes(est, memory_margin)
    if cfg.ep > 1 and cfg.ep * cfg.tp > cluster.gpus_per_node:
        est.notes.append(f"the EP group spans nodes (ep × tp = {cfg.ep} × {cfg.tp} > {cluster.gpus_per_node} GPUs per "
                         "node): its all-to-all crosses the network")
    return est


def _flops(model: ModelConfig, batch: int, seq: int) -> tuple[float, float, float]:
    """(model FLOPs per step, linear and attention-core FLOPs of one layer's forward): the same for every
    layout of a search, and a sum over the layers for a MoE model, so computed once per model."""
    try:
        return _flops_of(model, batch, seq)
    except TypeError:  # a model with an unhashable field (a rope_scaling dict)
        return _flops_of.__wrapped__(model, batch, seq)


@functools.lru_cache(maxsize=64)
def _flops_of(model: ModelConfig, batch: int, seq: int) -> tuple[float, float, float]:
    return (model.model_flops_per_step(batch, seq), *model.forward_flops_per_layer(batch, seq))


def _notes(est: Estimate, margin: float) -> list[str]:
    cfg, notes = est.config, []
    if not est.fits:
        notes.append(f"does not fit: {est.memory.total / GIB:.1f} GiB on pipeline stage {est.memory.stage} "
                     f"> {100 * (1 - margin):.0f}% of {est.memory_capacity_gib:g} GiB")
    notes += cfg.warnings()
    if est.time.comm_ratio > COMM_RATIO_LIMIT:
        t = est.time
        hint = ""  # the dimension whose communication is the largest share
        if cfg.ep > 1 and t.ep_comm >= t.tp_comm:
            hint = ": lower ep, or more moe_chunks to hide the all-to-all"
        elif cfg.tp > 1:
            hint = ": lower tp"
        notes.append(f"communication/compute ratio {100 * t.comm_ratio:.1f}% > {100 * COMM_RATIO_LIMIT:.0f}%" + hint)
    if cfg.pp > 1 and est.bubble_fraction > 0.15:
        notes.append(f"pipeline bubble is {100 * est.bubble_fraction:.0f}% of the step: more micro-batches "
                     "or virtual stages would shrink it")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.append("sequence_parallel off: activations of norms/dropout are replicated on every TP rank "
                     "and TP communication cannot overlap the GEMMs")
    return notes
