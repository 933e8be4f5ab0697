"""``layout: auto``: the planner picks TP, CP, PP, DP, virtual stages, micro-batching, SP, recompute
and ZeRO-1 for the world size and the device found, and the run uses its choice (CP only for long
sequences, or the ``parallel.cp`` the config sets).

GPUs: the planner's preset for the device name (calibrated on published runs). CPUs: the GEMM,
copy and gloo all-reduce rates measured here (``tpkernels plan --measure``). The global batch is
``global_batch`` sequences (default: what the config's micro-batching gives at the pure-DP
layout). At the end of the run the trainer prints the prediction next to the measurement.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tpkernels.train.config import TrainConfig


def plan_layout(cfg: TrainConfig, world: int):
    """(the planner's best Estimate, its Plan) for ``cfg`` on ``world`` ranks of this machine's device."""
    from tpkernels.planner import ClusterSpec, TrainingSetup, calibrated_for, gpu_preset, plan  # noqa: PLC0415
    from tpkernels.planner.fit import load as load_fit  # noqa: PLC0415
    from tpkernels.planner.fit import machine_key  # noqa: PLC0415
    from tpkernels.planner.measure import calibrate, measure, preset_for_device  # noqa: PLC0415

    spec = cfg.model_config()
    seq, pc = cfg.data.seq_length, cfg.parallel
    gb = cfg.training.global_batch or pc.micro_batch_size * pc.num_microbatches * world
    # fp8: the layout is planned as bf16 (which linears run FP8 is decided later, per linear)
    precision = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}.get(cfg.training.precision,
                                                     "bf16" if torch.cuda.is_available() else "fp32")
    # our trainer: bucketed DP gradient overlap (overlap_dp), torch's ZeRO-1 (weights gathered after
    # the step), blocking P2P
    # auto: the data decides, after the layout; SFT and a cached DPO reference cost what pre-training costs
    task = cfg.training.task if cfg.training.task != "auto" else "pretrain"
    train = TrainingSetup(gb, seq, precision=precision, finetune=cfg.model.finetune, quant=cfg.model.base_quant,
                          lora_rank=cfg.model.lora_rank,
                          overlap_grad_reduce=pc.overlap_dp, task=task, dpo_reference=cfg.dpo.reference)
    eff = None
    if torch.cuda.is_available():
        gpu = preset_for_device(torch.cuda.get_device_name())
        if gpu is None:
            raise ValueError(f"layout auto: the planner has no preset for {torch.cuda.get_device_name()!r}; "
                             "give parallel.tp/pp/dp by hand or add the GPU to tpkernels.planner.hardware")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
        cluster = ClusterSpec(gpu, gpus_per_node=per_node, nodes=max(1, world // per_node))
        eff = calibrated_for(gpu)
        key = machine_key(gpu.name, world)
    else:  # a CPU box: the planner runs on the rates measured here
        cluster = ClusterSpec(gpu_preset("A100-80GB"), gpus_per_node=world, nodes=1)
        cluster, eff, _ = calibrate(cluster, calibrated_for(cluster.gpu),
                                    measure(spec, train, micro_batch_size=pc.micro_batch_size, ranks=world))
        key = machine_key("cpu", world)
    cached = load_fit(key) if cfg.autotune.cache else None
    if cached is not None:  # what earlier autotune trials on this machine measured
        eff = cached[0].apply(eff)
    # CP is searched for long sequences; a cp the user set is kept (the planner picks the rest)
    fixed = {"cp": pc.cp, "cp_algo": pc.cp_algo} if pc.cp > 1 else None
    p = plan(spec, train, cluster, eff, fixed=fixed)
    if p.best is None:
        from tpkernels.planner.report import no_fit_message  # noqa: PLC0415

        raise ValueError(f"layout auto: {no_fit_message(p)}")
    p.machine_key, p.fit_used = key, cached
    return p.best, p


# what the planner does not choose: the user's (or the default) communication knobs stay
KEPT = ("overlap_comm", "overlap_dp", "bucket_mb")


def apply_plan(cfg: TrainConfig, best) -> TrainConfig:
    """``cfg`` with the planner's layout as its ``parallel`` section."""
    parallel = best.config.replace(**{f: getattr(cfg.parallel, f) for f in KEPT})
    return dataclasses.replace(cfg, layout="manual", parallel=parallel,
                               predicted={"step_s": best.step_time, "bubble": best.bubble_fraction,
                                          "comm_ratio": best.time.comm_ratio, "layout": parallel.short()})


def explain(p) -> str:
    from tpkernels.planner.report import explanation_paragraph  # noqa: PLC0415

    text = "layout auto: " + explanation_paragraph(p)
    used = p.fit_used
    if used is not None:
        text += (f" (with this machine's measured corrections from {used[1].get('date', '?')}: {used[0].describe()};"
                 " autotune.cache false ignores them)")
    return text
