"""Training step: ours (TP2 × PP2 with SP) vs the same Llama built torch-natively, on the same batch.

    python benchmarks/bench_train.py [--reps 5] [--layers 4] [--hidden 256] [--seq 256]

The torch-native stack: a plain Llama (nn.Linear, nn.RMSNorm, PyTorch rotary and SDPA), tensor
parallel with ``torch.distributed.tensor.parallel`` (Colwise/Rowwise + SequenceParallel, the
torchtitan plan) inside ``torch.distributed.pipelining`` stages under ``Schedule1F1B``. Ours:
``tpkernels.train.Trainer`` at the same layout, with TP overlap on and off, and each schedule.
Both take one optimizer-free step (forward + backward over the micro-batches) and are timed on
4 gloo ranks of this machine (GPUs: NCCL, one per rank, when 4 are visible). Median of ``reps``
steps after one warm-up; tokens/s = global batch tokens / step time. Writes
benchmarks/results/train_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402

TP, PP = 2, 2


class NativeBlock(nn.Module):
    def __init__(self, h, heads, kv, ffn):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, h // heads
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.q, self.k, self.v = nn.Linear(h, h, bias=False), nn.Linear(h, kv * self.hd, bias=False), \
            nn.Linear(h, kv * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up, self.down = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False), \
            nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b = x.shape[0]
        y = self.norm1(x)
        q, k, v = self.q(y), self.k(y), self.v(y)  # local shards after Colwise (use_local_output)
        s = q.shape[1]
        q = q.view(b, s, -1, self.hd).transpose(1, 2)
        k = k.view(b, s, -1, self.hd).transpose(1, 2)
        v = v.view(b, s, -1, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.silu(self.gate(self.norm2(x))) * self.up(self.norm2(x)))


def _rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class NativeStage(nn.Module):
    def __init__(self, blocks, h, vocab, first, last, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, h) if first else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(h, eps=1e-5) if last else None
        self.head = nn.Linear(h, vocab, bias=False) if last else None
        hd = blocks[0].hd
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat([ang.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([ang.sin()] * 2, -1), persistent=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def native_step_fn(rank, world, args):
    """Build the torch-native TP2 × PP2 model on this rank; return a function running one step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = DeviceMesh("cpu", torch.arange(world).reshape(PP, TP), mesh_dim_names=("pp", "tp"))
    tp_mesh, pp_rank = mesh["tp"], rank // TP
    torch.manual_seed(0)
    per = args.layers // PP
    blocks = [NativeBlock(args.hidden, args.heads, args.kv_heads, args.ffn) for _ in range(per)]
    stage = NativeStage(blocks, args.hidden, args.vocab, pp_rank == 0, pp_rank == PP - 1, args.seq)
    for blk in stage.blocks:
        blk.heads //= TP
        parallelize_module(blk, tp_mesh, {
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "q": ColwiseParallel(input_layouts=Shard(1)), "k": ColwiseParallel(input_layouts=Shard(1)),
            "v": ColwiseParallel(input_layouts=Shard(1)), "o": RowwiseParallel(output_layouts=Shard(1)),
            "gate": ColwiseParallel(input_layouts=Shard(1)), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
    plan = {}
    if stage.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.head is not None:
        plan["norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if plan:
        parallelize_module(stage, tp_mesh, plan)
    pp_group = mesh.get_group("pp")
    pstage = PipelineStage(stage, pp_rank, PP, torch.device("cpu"), group=pp_group)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    sched = Schedule1F1B(pstage, args.m, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.mbs * args.m, args.seq), generator=g)
    target = torch.roll(ids, -1, 1)

    def step():
        stage.zero_grad(set_to_none=True)
        if pp_rank == 0:
            sched.step(ids)
        elif pp_rank == PP - 1:
            sched.step(target=target)
        else:
            sched.step()
        dist.barrier()

    return step


def ours_step_fn(rank, world, args, **layout):
    import torch.distributed as dist

    from tpkernels.models import next_token_targets
    from tpkernels.train import TrainConfig, Trainer

    cfg = TrainConfig.from_values({
        "model": {"name": "Llama-2-7B", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "ffn": args.ffn, "vocab": args.vocab},
        "data": {"seq_length": args.seq}, "logging": {"progress": False},
        "parallel": {"micro_batch_size": args.mbs, "num_microbatches": args.m, "tp": TP, "pp": PP,
                     "sequence_parallel": True, **layout}})
    trainer = Trainer(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.mbs * args.m, args.seq), generator=g)
    target = next_token_targets(ids)

    def step():
        trainer.model.zero_grad(set_to_none=True)
        trainer.model.step(ids if trainer.state.is_first_stage else None, target, runtime=trainer.runtime)
        trainer.model.finish_grad_sync()
        dist.barrier()

    return step


def _time(step, reps):
    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank, world, args, variant):
    if variant == "torch-native":
        step = native_step_fn(rank, world, args)
    else:
        layout = {"ours (1f1b, overlap)": {}, "ours (1f1b, no overlap)": {"overlap_comm": False},
                  "ours (zb-h1)": {"schedule": "zb-h1"}, "ours (gpipe)": {"schedule": "gpipe"}}[variant]
        step = ours_step_fn(rank, world, args, **layout)
    return _time(step, args.reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--m", type=int, default=4)
    args = ap.parse_args()
    from tpkernels.parallel.local_ranks import RankPool

    rows = []
    tokens = args.mbs * args.m * args.seq
    with RankPool(TP * PP, timeout=900) as pool:
        for variant in ("torch-native", "ours (1f1b, overlap)", "ours (1f1b, no overlap)", "ours (zb-h1)",
                        "ours (gpipe)"):
            t = max(pool.run(worker, args, variant, timeout=900))
            rows.append({"variant": variant, "step_ms": f"{1e3 * t:.1f}", "tokens/s": f"{tokens / t:.0f}"})
    base = float(rows[0]["step_ms"])
    for r in rows:
        r["vs torch-native"] = f"{base / float(r['step_ms']):.2f}x"
    print(f"TP{TP} x PP{PP} with SP, 4 gloo ranks on this machine; {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads, ffn {args.ffn}, vocab {args.vocab}, {args.m} micro-batches of "
          f"{args.mbs} x {args.seq} tokens, fp32; median of {args.reps} steps (forward + backward)")
    print_table(rows, list(rows[0]))
    print("wrote", write_csv("train_cpu", rows))


if __name__ == "__main__":
    main()
