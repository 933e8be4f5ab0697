"""``layout: auto``: the planner picks TP, CP, PP, DP, virtual stages, micro-batching, SP, recompute
and ZeRO-1 for the world size and the device found, and the run uses its choice (CP only for long
sequences, or the ``parallel.cp`` the config sets).

GPUs: the planner's preset for the device name (calibrated on published runs). CPUs: the GEMM,
copy and gloo all-reduce rates measured here (``tpkernels plan --measure``). The global batch is
``training.global_batch`` sequences, default the config's own: micro_batch_size × num_microbatches ×
dp of its ``parallel`` section on this world (dp = world / (tp·cp·pp) when unset). The layout never
changes the optimisation: every layout the planner proposes, and the config's own tried by autotune,
trains that batch (a layout that cannot is not proposed, or is dropped saying why). At the end of
the run the trainer prints the prediction next to the measurement.
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
    gb, _ = run_global_batch(cfg, world)
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
    p.global_batch_from = run_global_batch(cfg, world)[1]
    return p.best, p


def run_global_batch(cfg: TrainConfig, world: int) -> tuple[int, str]:
    """(sequences per optimizer step of the run under ``layout: auto`` on ``world`` ranks, where that number
    comes from). ``training.global_batch`` when set; else the config's own layout's batch, micro_batch_size ×
    num_microbatches × dp (dp: ``parallel.dp``, or world / (tp·cp·pp)), so that switching a run to
    ``layout: auto`` keeps its loss curve. When the config's tp·cp·pp does not divide the world (its layout
    cannot run here) the batch is that of dp = world, said in the reason."""
    t, pc = cfg.training, cfg.parallel
    if t.global_batch is not None:
        return t.global_batch, "training.global_batch"
    per = pc.micro_batch_size * pc.num_microbatches
    model_ranks = pc.tp * pc.cp * pc.pp
    if pc.dp is not None:
        dp, how = pc.dp, f"parallel.dp {pc.dp}"
    elif world % model_ranks == 0:
        dp, how = world // model_ranks, f"dp {world // model_ranks} = world {world} / (tp·cp·pp {model_ranks})"
    else:
        dp, how = world, (f"dp {world} = the world: the config's tp·cp·pp ({model_ranks}) does not divide the world "
                          f"({world})")
    return per * dp, (f"the config's micro_batch_size {pc.micro_batch_size} × num_microbatches "
                      f"{pc.num_microbatches} × {how}; training.global_batch sets another")


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
    why = getattr(p, "global_batch_from", None)
    if why:
        text += f" Every layout trains the global batch of {p.train.global_batch} sequences ({why})."
    used = p.fit_used
    if used is not None:
        text += (f" (with this machine's measured corrections from {used[1].get('date', '?')}: {used[0].describe()};"
                 " autotune.cache false ignores them)")
    return text
