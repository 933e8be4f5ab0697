"""Checks of the fused GEMM-communication kernels through the virtual-TP harness, shared by the CPU
tests (interpreter, float16) and the cuda-marked ones (bfloat16 and float16 on one GPU).

Every check: fresh random inputs, odd sizes, workspaces poisoned (0xFF bytes: NaN data, signals
-1) between calls, several back-to-back calls with a different M on one harness, the float64
dense result as reference with the FlashAttention rule."""

from __future__ import annotations

import torch

from tpkernels.functional.virtual_tp import VirtualTP
from tpkernels.testing.tolerance import assert_fa_close


def poison(vtp: VirtualTP) -> None:
    """Fill every emulated rank's arenas with 0xFF: float data reads NaN, signals read -1 (below every epoch)."""
    for arenas in vtp._arenas.values():
        for arena in arenas:
            arena.buffers[arena.rank].fill_(255)


def summed_references(a64, b64, dtype, reduce_op: str = "sum"):
    """(float64, low-precision) references of Σ_r a64[r] @ b64[r] (mean for "avg"): the low-precision one
    multiplies in ``dtype`` and sums the ranks in float32, as every algorithm does; float32."""
    ref64 = sum(a @ b for a, b in zip(a64, b64))
    ref_lp = sum((a.to(dtype) @ b.to(dtype)).float() for a, b in zip(a64, b64))
    if reduce_op == "avg":
        ref64, ref_lp = ref64 / len(a64), ref_lp / len(a64)
    return ref64, ref_lp


def _randn(*shape, device, generator=None):
    return torch.randn(*shape, dtype=torch.float64, generator=generator).to(device)


def check_all_gather_matmul(vtp: VirtualTP, dtype, ms, K: int, ns, chunks: int = 2) -> None:
    """For each m of ``ms``: per-rank shards (m, K); every rank's gathered A is the concatenation and
    every rank's product matches A_full · b for each b (widths ``ns``)."""
    dev, world = vtp.device, vtp.world
    for m in ms:
        full64 = _randn(world * m, K, device=dev)
        bs64 = [_randn(K, n, device=dev) for n in ns]
        shards = [full64[r * m:(r + 1) * m].to(dtype) for r in range(world)]
        poison(vtp)
        results = vtp.all_gather_matmul(shards, [b.to(dtype) for b in bs64], chunks=chunks)
        for r, (a_full, outs) in enumerate(results):
            assert torch.equal(a_full, full64.to(dtype)), f"rank {r}: gathered A differs (m={m})"
            for j, (b64, out) in enumerate(zip(bs64, outs)):
                assert_fa_close(out, full64 @ b64, full64.to(dtype) @ b64.to(dtype),
                                name=f"rank {r} out[{j}] world={world} m={m}")


def check_matmul_reduce_scatter(vtp: VirtualTP, dtype, ms, K: int, N: int, reduce_op: str = "sum") -> None:
    dev, world = vtp.device, vtp.world
    for m in ms:
        a64 = [_randn(world * m, K, device=dev) for _ in range(world)]
        b64 = [_randn(K, N, device=dev) for _ in range(world)]
        ref64, ref_lp = summed_references(a64, b64, dtype, reduce_op)
        ref_lp = ref_lp.to(dtype)
        poison(vtp)
        outs = vtp.matmul_reduce_scatter([a.to(dtype) for a in a64], [b.to(dtype) for b in b64], reduce_op)
        for r, out in enumerate(outs):
            rows = slice(r * m, (r + 1) * m)
            assert_fa_close(out, ref64[rows], ref_lp[rows], name=f"rank {r} world={world} m={m} {reduce_op}")


def check_matmul_all_reduce(vtp: VirtualTP, dtype, ms, K: int, N: int, variant: str, reduce_op: str = "sum") -> None:
    dev, world = vtp.device, vtp.world
    for M in ms:
        a64 = [_randn(M, K, device=dev) for _ in range(world)]
        b64 = [_randn(K, N, device=dev) for _ in range(world)]
        ref64, ref_lp = summed_references(a64, b64, dtype, reduce_op)
        ref_lp = ref_lp.to(dtype)
        poison(vtp)
        outs = vtp.matmul_all_reduce([a.to(dtype) for a in a64], [b.to(dtype) for b in b64], reduce_op, variant)
        for r, out in enumerate(outs):
            assert torch.equal(out, outs[0]), f"rank {r} differs from rank 0 (world={world} M={M} {variant})"
        assert_fa_close(outs[0], ref64, ref_lp, name=f"world={world} M={M} {variant} {reduce_op}")
