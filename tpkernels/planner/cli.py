"""`tpkernels plan`: arguments → Plan → table / JSON / --explain."""

from __future__ import annotations

import argparse
import json

from tpkernels.planner.efficiency import calibrated_for
from tpkernels.planner.hardware import GPU_PRESETS, ClusterSpec, gpu_preset
from tpkernels.planner.memory import DEFAULT_MEMORY_MARGIN
from tpkernels.planner.models import MODEL_PRESETS, ModelSpec, from_hf_config, model_preset
from tpkernels.planner.report import format_explanation, format_plan, plan_as_dict
from tpkernels.planner.search import explain, parse_layout, plan
from tpkernels.planner.workload import FINETUNE, OPTIMIZERS, PRECISIONS, TrainingSetup

EPILOG = """examples:
  tpkernels plan --model Qwen-14B --gpu A100-80GB --nodes 1 --global-batch 64 --seq-len 4096
  tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --seq-len 8192
  tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --explain TP=4,PP=4
  tpkernels plan --hf-config path/to/config.json --gpu A10-24GB --finetune lora --global-batch 32
"""


def add_parser(sub) -> argparse.ArgumentParser:
    ap = sub.add_parser("plan", help="recommend TP/PP/DP layouts with predicted memory and step time",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model (a preset, a Hugging Face config.json, or explicit shapes)")
    m.add_argument("--model", help=f"preset: {', '.join(MODEL_PRESETS)}")
    m.add_argument("--hf-config", help="path to a Hugging Face config.json")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{flag}", type=int)
    m.add_argument("--mlp", choices=("swiglu", "gelu"), default="swiglu", help="with explicit shapes")
    c = ap.add_argument_group("cluster")
    c.add_argument("--gpu", default="H100-SXM", help=f"preset: {', '.join(GPU_PRESETS)}")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--intra-link", choices=("nvlink", "pcie"))
    c.add_argument("--intra-node-gbs", type=float, help="per-GPU intra-node bandwidth, GB/s per direction")
    c.add_argument("--inter-node-gbs", type=float, help="per-GPU inter-node bandwidth, GB/s per direction")
    c.add_argument("--gpu-tflops", type=float, help="override the GPU's dense bf16 peak")
    c.add_argument("--gpu-memory-gib", type=float, help="override the GPU's memory")
    c.add_argument("--gpu-hbm-gbs", type=float, help="override the GPU's memory bandwidth")
    c.add_argument("--gpu-fp8-tflops", type=float, help="override the GPU's dense fp8 peak")
    t = ap.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    t.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context, at most 8192)")
    t.add_argument("--precision", choices=PRECISIONS, default="bf16")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    t.add_argument("--finetune", choices=FINETUNE, default="full")
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--no-flash-attention", action="store_true", help="attention stores the s×s scores")
    f = ap.add_argument_group("fixed choices (searched when omitted)")
    f.add_argument("--fix", default="", help="e.g. TP=8 or 'PP=4,SP=on,recompute=selective,ZeRO1=on'")
    o = ap.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    o.add_argument("--json", action="store_true")
    o.add_argument("--explain", metavar="LAYOUT", help="score one layout, e.g. TP=4,PP=2, and say what is wrong with it")
    o.add_argument("--memory-margin", type=float, default=DEFAULT_MEMORY_MARGIN,
                   help="fraction of GPU memory kept free (default %(default)s)")
    o.add_argument("--measure", action="store_true",
                   help="time one layer's GEMMs, memory copies and a collective here, and plan with those rates")
    return ap


# Each numeric flag's rule: (test, the rule as the error states it). argparse turns text into
# numbers; these say what the numbers may be, in one line naming the flag and the value.
_POSITIVE_INT = (lambda v: isinstance(v, int) and v >= 1, "must be a positive integer")
_POSITIVE = (lambda v: v > 0 and v != float("inf"), "must be a finite number > 0")
_RULES = {
    "layers": _POSITIVE_INT, "hidden": _POSITIVE_INT, "heads": _POSITIVE_INT, "kv_heads": _POSITIVE_INT,
    "ffn": _POSITIVE_INT, "vocab": _POSITIVE_INT, "gpus_per_node": _POSITIVE_INT, "nodes": _POSITIVE_INT,
    "global_batch": _POSITIVE_INT, "seq_len": _POSITIVE_INT, "lora_rank": _POSITIVE_INT, "top": _POSITIVE_INT,
    "intra_node_gbs": _POSITIVE, "inter_node_gbs": _POSITIVE, "gpu_tflops": _POSITIVE, "gpu_memory_gib": _POSITIVE,
    "gpu_hbm_gbs": _POSITIVE, "gpu_fp8_tflops": _POSITIVE,
    "memory_margin": (lambda v: 0 <= v < 1, "must be a fraction in [0, 1) (the share of GPU memory kept free)"),
}


def check_args(args) -> None:
    """Raise ValueError naming the flag, its value and the rule, for the first flag that breaks its rule."""
    for name, (ok, rule) in _RULES.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} ({value}) {rule}")


def _layout_flag(flag: str, text: str) -> dict:
    try:
        return parse_layout(text)
    except ValueError as e:
        raise ValueError(f"{flag} ({text!r}): {e}") from None


def _model(args) -> ModelSpec:
    if args.model:
        return model_preset(args.model)
    if args.hf_config:
        return from_hf_config(args.hf_config, flag="--hf-config")
    shapes = {k: getattr(args, k.replace("-", "_")) for k in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab")}
    missing = [f"--{k}" for k, v in shapes.items() if v is None and k != "kv-heads"]
    if missing:
        raise ValueError("give --model, --hf-config, or every shape: missing " + ", ".join(missing))
    return ModelSpec("custom", shapes["layers"], shapes["hidden"], shapes["heads"], shapes["ffn"], shapes["vocab"],
                     num_kv_heads=shapes["kv-heads"], mlp=args.mlp, norm="rmsnorm" if args.mlp == "swiglu" else "layernorm")


def _cluster(args) -> ClusterSpec:
    gpu = gpu_preset(args.gpu)
    overrides = {k: v for k, v in (("peak_tflops_bf16", args.gpu_tflops), ("memory_gib", args.gpu_memory_gib),
                                   ("hbm_gbs", args.gpu_hbm_gbs),
                                   ("peak_tflops_fp8", args.gpu_fp8_tflops)) if v is not None}
    if overrides:
        gpu = gpu.replace(**overrides)
    return ClusterSpec(gpu, args.gpus_per_node, args.nodes, args.intra_link, args.intra_node_gbs, args.inter_node_gbs)


def run(args) -> int:
    check_args(args)
    fixed = _layout_flag("--fix", args.fix)
    explain_layout = _layout_flag("--explain", args.explain) if args.explain else None
    model = _model(args)
    cluster = _cluster(args)
    seq_len = args.seq_len if args.seq_len is not None else min(model.seq_length, 8192)
    train = TrainingSetup(args.global_batch, seq_len, args.precision, args.optimizer,
                          args.finetune, args.lora_rank, not args.no_flash_attention)
    eff = calibrated_for(cluster.gpu)
    if args.measure:
        from tpkernels.planner.measure import calibrate, measure  # noqa: PLC0415

        meas = measure(model, train)
        cluster, eff, notes = calibrate(cluster, eff, meas)
        if not args.json:
            print("measured here: " + meas.describe())
            for n in notes:
                print("  " + n)
            print()
    if explain_layout is not None:
        x = explain(model, train, cluster, args.explain, eff, args.memory_margin)
        if args.json:
            print(json.dumps({"requested": x.requested, "errors": x.errors, "fits": x.fits,
                              "estimate": x.estimate.as_dict() if x.estimate else None,
                              "best": x.best.as_dict() if x.best else None}, indent=2))
        else:
            print(format_explanation(x))
        return 0 if not x.errors else 2
    p = plan(model, train, cluster, eff, fixed=fixed, memory_margin=args.memory_margin)
    print(json.dumps(plan_as_dict(p, args.top), indent=2) if args.json else format_plan(p, args.top))
    return 0 if p.ranked else 3
