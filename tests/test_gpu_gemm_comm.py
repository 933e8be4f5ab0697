"""The fused GEMM-communication kernels on GPUs (benchmarks/gpu_check.sh).

One GPU: the virtual-TP harness runs world_size emulated ranks concurrently on one device (real
waits: consumers spin while producers run), bfloat16 and float16, odd M, a different M on every
call, poisoned workspaces, back-to-back calls, one rank delayed, both copy movers and both
reducers. Two or more GPUs: the public ops with algo="fused" on NCCL + torch symmetric memory
against the collective algorithm."""

from __future__ import annotations

import time

import pytest
import torch

from gemm_comm_checks import check_all_gather_matmul, check_matmul_all_reduce, check_matmul_reduce_scatter
from tpkernels.functional.virtual_tp import VirtualTP

pytestmark = pytest.mark.cuda
DTYPES = (torch.bfloat16, torch.float16)
MS = [257, 1, 1000]  # odd, one row, several tiles; one harness, so every call changes M
K, N = 512, 784  # N = 49·16: a partial column tile


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("copy", ["engine", "kernel"])
def test_virtual_all_gather_matmul(world, dtype, copy):
    check_all_gather_matmul(VirtualTP(world, "cuda", copy=copy), dtype, MS, K, [N, 64], chunks=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("reducer,rs_mode", [("triton", "pull"), ("cuda", "pull"), ("triton", "push")])
def test_virtual_matmul_reduce_scatter(world, dtype, reducer, rs_mode):
    check_matmul_reduce_scatter(VirtualTP(world, "cuda", reducer=reducer, rs_mode=rs_mode), dtype, MS, K, N)


@pytest.mark.parametrize("variant,reducer", [("one_shot", "triton"), ("one_shot", "cuda"), ("two_shot", "triton")])
@pytest.mark.parametrize("world", [2, 8])
def test_virtual_matmul_all_reduce(world, variant, reducer):
    check_matmul_all_reduce(VirtualTP(world, "cuda", reducer=reducer), torch.bfloat16, MS, K, N, variant)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_virtual_one_rank_delayed(op):
    vtp = VirtualTP(4, "cuda", delay=(2, 50_000_000))  # ~25 ms at H100 clocks: the others spin meanwhile
    if op == "ag":
        check_all_gather_matmul(vtp, torch.bfloat16, [129], K, [N])
    elif op == "rs":
        check_matmul_reduce_scatter(vtp, torch.bfloat16, [129], K, N)
    else:
        check_matmul_all_reduce(vtp, torch.bfloat16, [129], K, N, "two_shot")


def _real_worker(rank, world, seed):
    from tpkernels.functional.gemm_comm import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(seed + rank)
    errs = []
    for call, m in enumerate([257, 1, 1000, 64]):  # a different M on every call, back to back
        if rank == world - 1 and call == 1:
            time.sleep(0.2)
            torch.cuda._sleep(50_000_000)  # one rank late: the others wait on its signals
        a = torch.randn(m, K, device=dev, generator=g, dtype=torch.bfloat16)
        b = torch.randn(K, N, device=dev, generator=g, dtype=torch.bfloat16) / K ** 0.5
        full_f, (y_f,) = all_gather_matmul(a, [b], algo="fused")
        full_c, (y_c,) = all_gather_matmul(a, [b], algo="collective")
        assert torch.equal(full_f, full_c), "gathered A differs"
        errs.append(((y_f.float() - y_c.float()).abs().max() / y_c.float().abs().max()).item())
        x = torch.randn(world * m, K, device=dev, generator=g, dtype=torch.bfloat16)
        rs_f = matmul_reduce_scatter(x, b, algo="fused")
        rs_c = matmul_reduce_scatter(x, b, algo="collective")
        errs.append(((rs_f.float() - rs_c.float()).abs().max() / rs_c.float().abs().max()).item())
        ar_f = matmul_all_reduce(x, b, algo="fused")
        ar_c = matmul_all_reduce(x, b, algo="collective")
        errs.append(((ar_f.float() - ar_c.float()).abs().max() / ar_c.float().abs().max()).item())
        assert not torch.isnan(y_f).any() and not torch.isnan(rs_f).any() and not torch.isnan(ar_f).any()
    torch.cuda.synchronize()
    return max(errs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (NCCL + symmetric memory)")
def test_real_fused_ops_match_the_collective(fresh_seed):
    from tpkernels.testing.distributed import run_on_ranks

    world = min(torch.cuda.device_count(), 8)
    worst = run_on_ranks(_real_worker, world, fresh_seed, backend="nccl", timeout=300)
    # both sides sum float32 partials; they differ by the order of the sums and one bf16 rounding
    assert max(worst) < 2 ** -7, f"fused vs collective relative error {max(worst):.3g}"


def _tp_block_worker(rank, world, seed, sp):
    """A pre-norm residual MLP block with TP (+ SP): algo="fused" against "collective", forward and
    backward, from the same weights; and "auto" picks fused at a large GEMM on this NVLink group."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from tpkernels.functional.gemm_comm import choose_algo
    from tpkernels.nn import ColumnParallelLinear, RowParallelLinear

    dev = torch.device("cuda", rank)
    torch.manual_seed(seed)
    H, FFN, seq, batch = 256, 512, world * 37, 2
    norm = nn.LayerNorm(H).to(dev, torch.bfloat16)
    fc1, fc2 = nn.Linear(H, FFN).to(dev, torch.bfloat16), nn.Linear(FFN, H).to(dev, torch.bfloat16)
    x = torch.randn(seq, batch, H, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    got = {}
    for algo in ("fused", "collective"):
        kw = dict(sequence_parallel=sp, sequence_dim=0, algo=algo)
        up, down = ColumnParallelLinear.from_linear(fc1, None, **kw), RowParallelLinear.from_linear(fc2, None, **kw)
        rows = slice(rank * seq // world, (rank + 1) * seq // world) if sp else slice(None)
        xin = x[rows].clone().requires_grad_()
        y = xin + down(F.gelu(up(norm(xin))))
        y.backward(dy[rows])
        got[algo] = [y, xin.grad, up.weight.grad, down.weight.grad, down.bias.grad]
    worst = max(((f.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-6)).item()
                for f, c in zip(got["fused"], got["collective"]))
    picked = choose_algo("all_gather_matmul", "auto", world, 1e12, dev, dtype=torch.bfloat16, k=8192, n=8192,
                         group=dist.group.WORLD)
    return worst, picked


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (NCCL + symmetric memory)")
@pytest.mark.parametrize("sp", [True, False])
def test_tp_block_with_fused_comm_matches_collective(fresh_seed, sp):
    from tpkernels.testing.distributed import run_on_ranks

    world = min(torch.cuda.device_count(), 4)
    for worst, picked in run_on_ranks(_tp_block_worker, world, fresh_seed, sp, backend="nccl", timeout=300):
        assert worst < 2 ** -6, f"fused vs collective relative error {worst:.3g}"
        assert picked == "fused", f"auto picked {picked} for a 1e12-FLOP GEMM on {world} peer-connected GPUs"
