"""Pick a TP/PP/DP layout for a model and cluster with the planner's Python API.

    python python/plan_parallel_layout.py [--config path/to/config.json] [--gpu H100-SXM] [--nodes 2]

Plans Llama-3-8B (or the Hugging Face config.json given) on `nodes` × 8 GPUs, prints the three
best layouts, then checks the ParallelConfig of the winner with the same validation the training
code uses, and asks the planner what is wrong with a hand-picked layout.
"""

from __future__ import annotations

import argparse

from tpkernels.planner import ClusterSpec, ModelConfig, TrainingSetup, explain, gpu_preset, model_preset, plan
from tpkernels.planner.report import format_explanation, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="Hugging Face config.json (default: the Llama-3-8B preset)")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=8192)
    args = ap.parse_args()

    model = ModelConfig.read_hf(args.config) if args.config else model_preset("Llama-3-8B")
    cluster = ClusterSpec(gpu_preset(args.gpu), gpus_per_node=8, nodes=args.nodes)
    train = TrainingSetup(global_batch=args.global_batch, seq_length=args.seq_len)
    p = plan(model, train, cluster)
    if p.best is None:
        raise SystemExit("no layout fits; try more nodes or --global-batch smaller")
    print(table(p.ranked[:3]))

    cfg = p.best.config  # a tpkernels.parallel.ParallelConfig: what the model builder takes
    cfg.validate(world_size=cluster.num_gpus, global_batch_size=train.global_batch,
                 **model.layout_rules(train.seq_length))
    print(f"\nbest: {cfg.short()}, {p.best.step_time:.2f} s per step, {100 * p.best.mfu:.0f}% MFU\n")
    print(format_explanation(explain(model, train, cluster, "TP=8,PP=2,SP=off")))


if __name__ == "__main__":
    main()
