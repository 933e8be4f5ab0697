"""Shard a dense MLP over tensor-parallel ranks with sequence parallelism, check it against the
dense model, and save a Chrome trace of the communication/GEMM overlap.

    torchrun --nproc-per-node 2 python/tp_mlp_sequence_parallel.py [--trace tp_mlp_trace.json]
    python python/tp_mlp_sequence_parallel.py          # one rank (gloo), same code path

Every rank builds the same dense model (same seed), keeps its shard with ``from_linear``, runs
forward and backward on its 1/P of the sequence, and compares with the dense layer's output and
gradients. Uses gloo on CPUs and NCCL when each rank has a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.trace import CommTrace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="", help="write a Chrome trace (open in https://ui.perfetto.dev)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)

    torch.manual_seed(0)
    h = args.hidden
    fc1, fc2 = nn.Linear(h, 4 * h).to(dev), nn.Linear(4 * h, h).to(dev)
    x = torch.randn(args.seq, 2, h, device=dev)  # (seq, batch, hidden): Megatron's layout, SP shards dim 0
    col = ColumnParallelLinear.from_linear(fc1, None, sequence_parallel=True)
    row = RowParallelLinear.from_linear(fc2, None, sequence_parallel=True)

    x_shard = x.chunk(world, dim=0)[rank].clone().requires_grad_()
    with CommTrace() as tr:
        y_shard = row(F.gelu(col(x_shard)))
        y_shard.square().sum().backward()

    xd = x.clone().requires_grad_()
    yd = fc2(F.gelu(fc1(xd)))
    yd.square().sum().backward()
    torch.testing.assert_close(y_shard, yd.chunk(world, dim=0)[rank], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x_shard.grad, xd.grad.chunk(world, dim=0)[rank], rtol=1e-4, atol=1e-4)
    rows = slice(rank * col.out_per_rank, (rank + 1) * col.out_per_rank)
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad[rows], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad[:, rows], rtol=1e-4, atol=1e-4)
    if args.trace:
        tr.save_chrome_trace(args.trace)
    if rank == 0:
        print(f"{world} rank(s): sequence-parallel MLP matches the dense one (output and gradients); "
              f"{100 * tr.hidden_comm_fraction():.0f}% of rank 0's communication overlapped a GEMM"
              + (f"; trace in {args.trace}" if args.trace else ""))
    del col, row, tr  # gloo can abort at exit ("terminate called without an active exception") if objects holding the group outlive it
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
