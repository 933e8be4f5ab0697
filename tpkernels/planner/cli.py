"""`tpkernels plan`: a PlanConfig (flags, or a YAML/TOML file) → Plan → table / JSON / --explain.

The flags come from the same mechanism as ``tpkernels train``'s (:mod:`tpkernels.options`), and the
``model`` section is the trainer's (:class:`~tpkernels.description.source.ModelSection`): both
commands read ``--model X`` and its overrides alike, and accept and refuse the same models with
the same messages (what the models cannot build yet is planned, with the reason printed).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from tpkernels import options
from tpkernels.description import ModelConfig
from tpkernels.description.source import ModelSection
from tpkernels.options import Alias, opt, section
from tpkernels.planner.efficiency import calibrated_for
from tpkernels.planner.hardware import GPU_PRESETS, ClusterSpec, gpu_preset
from tpkernels.planner.memory import DEFAULT_MEMORY_MARGIN
from tpkernels.planner.report import format_explanation, format_plan, plan_as_dict
from tpkernels.planner.search import explain, parse_layout, plan
from tpkernels.planner.workload import (DPO_REFERENCES, KERNELS, MOE_DISPATCH, OPTIMIZERS, PRECISIONS,
                                        SELECTIVE_POLICIES, TASKS, TP_OVERLAP_STYLES, TrainingSetup)

EPILOG = """examples:
  tpkernels plan --model Qwen-14B --gpu A100-80GB --nodes 1 --global-batch 64 --seq-len 4096
  tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --seq-len 8192
  tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --explain TP=4,PP=4
  tpkernels plan --model path/to/config.json --gpu A10-24GB --model.finetune lora --global-batch 32
  tpkernels plan --model Llama-2-13B --gpu A10-24GB --nodes 4 --model.finetune lora --training.task dpo \
      --dpo.reference adapters
  tpkernels plan --model Llama-2-13B --gpu A10-24GB --nodes 4 --model.finetune qlora --model.quant nf4
  tpkernels plan --model Mixtral-8x7B --gpu H100-SXM --nodes 2 --global-batch 256 --seq-len 4096
  tpkernels plan --model Qwen3-30B-A3B --nodes 2 --global-batch 1024 --seq-len 4096 --fix EP=8,moe_chunks=4
"""


@dataclass(frozen=True)
class ClusterSection:
    gpu: str = opt("H100-SXM", "preset: " + ", ".join(GPU_PRESETS))
    gpus_per_node: int = opt(8, "GPUs per node")
    nodes: int = opt(1, "nodes")
    intra_link: str | None = opt(None, "nvlink or pcie (default: the GPU's)", ("nvlink", "pcie"))
    intra_node_gbs: float | None = opt(None, "per-GPU intra-node bandwidth, GB/s per direction")
    inter_node_gbs: float | None = opt(None, "per-GPU inter-node bandwidth, GB/s per direction")
    gpu_tflops: float | None = opt(None, "override the GPU's dense bf16 peak")
    gpu_memory_gib: float | None = opt(None, "override the GPU's memory")
    gpu_hbm_gbs: float | None = opt(None, "override the GPU's memory bandwidth")
    gpu_fp8_tflops: float | None = opt(None, "override the GPU's dense fp8 peak")


@dataclass(frozen=True)
class WorkloadSection:
    global_batch: int = opt(512, "sequences per step")
    seq_length: int | None = opt(None, "tokens per sequence (default: the model's context, at most 8192)")
    precision: str = opt("bf16", "GEMM precision", PRECISIONS)
    optimizer: str = opt("adam", "adam or sgd", OPTIMIZERS)
    flash_attention: bool = opt(True, "attention never stores the s×s scores")
    task: str = opt("pretrain", "pretrain, sft (prompt tokens masked: the same compute) or dpo (pairs in the rows)",
                    TASKS)
    moe_imbalance: float = opt(1.0, "mixture of experts: the busiest EP rank's rows over its balanced share, in the "
                                    "step time (1: balanced routing)")
    moe_peak_imbalance: float = opt(2.0, "the same at its worst, sizing the dispatch buffers of a dropless model "
                                         "(a capacity factor bounds it instead)")
    moe_dispatch: str = opt("alltoall", "alltoall (each of a token's k copies to its expert's rank, as tpkernels "
                                        "train does) or dedup (once per rank and node: DeepEP, HybridEP)", MOE_DISPATCH)
    selective_policy: str = opt("attention", "what recompute=selective reruns: attention (the attention core: "
                                             "Megatron, tpkernels train) or every_other_matmul (torchtitan's "
                                             "per-op checkpointing: k, output and up projections and the "
                                             "memory-bound ops)", SELECTIVE_POLICIES)
    tp_overlap_style: str = opt("userbuffers", "how SP collectives overlap the GEMMs when overlap_comm is on: "
                                               "userbuffers (TransformerEngine: rings and bulk overlaps) or "
                                               "async_tp (PyTorch's micro-pipelined TP: the column-parallel "
                                               "input gradient's reduce-scatter exposed)", TP_OVERLAP_STYLES)
    kernels: str = opt("fused", "fused (TransformerEngine, torch.compile, tpkernels) or eager (one PyTorch op per "
                                "kernel: more memory traffic)", KERNELS)


@dataclass(frozen=True)
class DpoSection:
    reference: str = opt("cached", "DPO's reference log-probs: cached (one pass before training), adapters (LoRA "
                                   "off, every step) or model (a frozen copy, every step)", DPO_REFERENCES)


def _no_model() -> ModelSection:
    return ModelSection(name=None)  # plan asks for a model; train defaults to one


@dataclass(frozen=True)
class PlanConfig:
    model: ModelSection = section(_no_model, "the model (the same section as tpkernels train's)")
    cluster: ClusterSection = section(ClusterSection, "the cluster")
    training: WorkloadSection = section(WorkloadSection, "what is trained")
    dpo: DpoSection = section(DpoSection, "DPO (with training.task dpo)")
    fix: str = opt("", "fixed choices, e.g. TP=8 or 'PP=4,SP=on,recompute=selective,ZeRO1=on'")
    explain: str | None = opt(None, "score one layout, e.g. TP=4,PP=2, and say what is wrong with it")
    top: int = opt(10, "rows of the ranked table")
    json: bool = opt(False, "machine-readable output")
    memory_margin: float = opt(DEFAULT_MEMORY_MARGIN, "fraction of GPU memory kept free")
    measure: bool = opt(False, "time one layer's GEMMs, memory copies and a collective here, and plan with "
                               "those rates")
    no_cache: bool = opt(False, "ignore the corrections autotune trials measured on this machine "
                                "(tpkernels.planner.fit)")

    def errors(self) -> list[str]:
        """Each value that breaks its rule, naming the key (types were checked when read)."""
        c, t = self.cluster, self.training
        errs = self.model.errors("model.")
        for path, v in (("cluster.gpus_per_node", c.gpus_per_node), ("cluster.nodes", c.nodes),
                        ("training.global_batch", t.global_batch), ("training.seq_length", t.seq_length),
                        ("top", self.top)):
            if v is not None and v < 1:
                errs.append(f"{path} ({v}) must be a positive integer")
        for f in ("intra_node_gbs", "inter_node_gbs", "gpu_tflops", "gpu_memory_gib", "gpu_hbm_gbs", "gpu_fp8_tflops"):
            v = getattr(c, f)
            if v is not None and not v > 0:
                errs.append(f"cluster.{f} ({v}) must be a finite number > 0")
        for f in ("moe_imbalance", "moe_peak_imbalance"):
            v = getattr(t, f)
            if not (math.isfinite(v) and v >= 1):
                errs.append(f"training.{f} ({v}) must be a finite number >= 1 (the busiest expert-parallel rank's "
                            "rows over its balanced share)")
        if t.task == "dpo" and self.dpo.reference == "adapters" and not self.model.adapters:
            errs.append("dpo.reference (adapters) needs model.finetune lora or qlora (a full fine-tune has no "
                        "adapters to turn off): use cached or model")
        if not 0 <= self.memory_margin < 1:
            errs.append(f"memory_margin ({self.memory_margin}) must be a fraction in [0, 1) (the share of GPU "
                        "memory kept free)")
        return errs


ALIASES: dict[str, str | Alias] = {
    "model": "model.name", "hf_config": "model.name",
    **{k: f"model.{k}" for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "finetune", "quant",
                                 "lora_rank", "drop_dropout")},
    **{k: f"cluster.{k}" for k in ("gpu", "gpus_per_node", "nodes", "intra_link", "intra_node_gbs", "inter_node_gbs",
                                   "gpu_tflops", "gpu_memory_gib", "gpu_hbm_gbs", "gpu_fp8_tflops")},
    "global_batch": "training.global_batch", "seq_len": "training.seq_length", "seq_length": "training.seq_length",
    "precision": "training.precision", "optimizer": "training.optimizer", "task": "training.task",
    "no_flash_attention": Alias("training.flash_attention", "false"),
}


def add_parser(sub) -> argparse.ArgumentParser:
    ap = sub.add_parser("plan", help="recommend TP/PP/DP layouts with predicted memory and step time",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML or TOML file of plan keys (flags override it)")
    options.add_flags(ap, PlanConfig, ALIASES)
    options.suggest_unknown_flags(ap)  # '--gpus' -> did you mean '--gpu', as tpkernels train says
    return ap


def load(args) -> PlanConfig:
    """The PlanConfig of the command line (over ``--config``'s file), checked."""
    base = PlanConfig()
    if getattr(args, "config", None):
        values = options.flatten(options.read_file(args.config, "--config"), PlanConfig, where=args.config)
        base = options.build(PlanConfig, options.resolve_aliases(values, {k: v for k, v in ALIASES.items()
                                                                           if isinstance(v, str)}, where=args.config))
    cfg = options.build(PlanConfig, options.flag_values(args, PlanConfig), text=True, base=base)
    errs = cfg.errors()
    if errs:
        raise ValueError("; ".join(errs))
    return cfg


def _layout_flag(key: str, text: str) -> dict:
    try:
        return parse_layout(text)
    except ValueError as e:
        raise ValueError(f"{key} ({text!r}): {e}") from None


def model_of(cfg: PlanConfig) -> ModelConfig:
    if cfg.model.name is None:
        raise ValueError("model.name is not set: give --model, a preset or a Hugging Face config.json / "
                         "checkpoint folder (and --layers, --hidden, … to change its shape)")
    return cfg.model.config(buildable=False)


def cluster_of(cfg: PlanConfig) -> ClusterSpec:
    c = cfg.cluster
    gpu = gpu_preset(c.gpu)
    overrides = {k: v for k, v in (("peak_tflops_bf16", c.gpu_tflops), ("memory_gib", c.gpu_memory_gib),
                                   ("hbm_gbs", c.gpu_hbm_gbs), ("peak_tflops_fp8", c.gpu_fp8_tflops)) if v is not None}
    if overrides:
        gpu = gpu.replace(**overrides)
    return ClusterSpec(gpu, c.gpus_per_node, c.nodes, c.intra_link, c.intra_node_gbs, c.inter_node_gbs)


def run(args) -> int:
    cfg = load(args)
    fixed = _layout_flag("fix", cfg.fix)
    explain_layout = _layout_flag("explain", cfg.explain) if cfg.explain else None
    model = model_of(cfg)
    cluster = cluster_of(cfg)
    t = cfg.training
    seq_len = t.seq_length if t.seq_length is not None else min(model.max_position_embeddings, 8192)
    train = TrainingSetup(t.global_batch, seq_len, t.precision, t.optimizer, cfg.model.finetune, cfg.model.lora_rank,
                          quant=cfg.model.base_quant, flash_attention=t.flash_attention, task=t.task,
                          dpo_reference=cfg.dpo.reference, moe_imbalance=t.moe_imbalance,
                          moe_peak_imbalance=t.moe_peak_imbalance,
                          moe_dispatch=t.moe_dispatch, selective_policy=t.selective_policy,
                          tp_overlap_style=t.tp_overlap_style, kernels=t.kernels)
    if not cfg.json:
        for reason in model.build_errors():
            print(f"note: planned, but tpkernels train cannot build this model yet: {reason}")
    eff = calibrated_for(cluster.gpu)
    if cfg.measure:
        from tpkernels.planner.measure import calibrate, measure  # noqa: PLC0415

        meas = measure(model, train, ranks=cluster.num_gpus)
        cluster, eff, notes = calibrate(cluster, eff, meas)
        if not cfg.json:
            print("measured here: " + meas.describe())
            for n in notes:
                print("  " + n)
            print()
    from tpkernels.planner.fit import load as load_fit, machine_key  # noqa: PLC0415

    key = machine_key("cpu" if cluster.gpu.generation == "cpu" else cluster.gpu.name, cluster.num_gpus)
    cached = None if cfg.no_cache else load_fit(key)
    if cached is not None:
        eff = cached[0].apply(eff)
        if not cfg.json:
            print(f"using the corrections autotune measured on {key} ({cached[1].get('date', '?')}): "
                  f"{cached[0].describe()}; --no-cache ignores them\n")
    if explain_layout is not None:
        x = explain(model, train, cluster, cfg.explain, eff, cfg.memory_margin)
        if cfg.json:
            print(json.dumps({"requested": x.requested, "errors": x.errors, "fits": x.fits,
                              "estimate": x.estimate.as_dict() if x.estimate else None,
                              "best": x.best.as_dict() if x.best else None}, indent=2))
        else:
            print(format_explanation(x))
        return 0 if not x.errors else 2
    p = plan(model, train, cluster, eff, fixed=fixed, memory_margin=cfg.memory_margin)
    p.machine_key, p.fit_used = key, cached
    print(json.dumps(plan_as_dict(p, cfg.top), indent=2) if cfg.json else format_plan(p, cfg.top))
    return 0 if p.ranked else 3


__all__ = ["ALIASES", "ClusterSection", "PlanConfig", "WorkloadSection", "add_parser", "load", "run"]
