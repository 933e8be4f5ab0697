"""The fused GEMM + communication kernels on emulated tensor-parallel ranks.

    python python/fused_gemm_comm_virtual_tp.py [--tp 4] [--rows 1000]

tpkernels.functional.virtual_tp.VirtualTP runs N ranks in one process on one device with the same
Triton kernels that algo="fused" runs over torch symmetric memory on real GPUs: on a GPU, every
emulated rank's kernels run at once (the consumers really wait on the producers' signals); on a
CPU, under TRITON_INTERPRET=1 (set here), one launch after another. Each op is checked against the
dense float64 result.

On real GPUs the same kernels are one argument away (torchrun, NCCL, one GPU per rank):

    x_full, [y] = tpkernels.all_gather_matmul(x_shard, [w], tp_group, algo="fused")
    y_shard = tpkernels.matmul_reduce_scatter(h, w2, tp_group, algo="fused")
    y = tpkernels.matmul_all_reduce(h, w2, tp_group, algo="fused")
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tpkernels' Triton kernels are imported

from tpkernels.functional.virtual_tp import VirtualTP  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=4, help="emulated ranks")
    ap.add_argument("--rows", type=int, default=None, help="rows of each rank's shard (default: 1000 GPU, 37 CPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)  # the interpreter: no bf16
    m = args.rows or (1000 if cuda else 37)
    k, n = (1024, 2048) if cuda else (32, 48)
    tp = args.tp
    vtp = VirtualTP(tp, dev)
    torch.manual_seed(0)

    shards = [torch.randn(m, k, dtype=torch.float64) for _ in range(tp)]
    w = torch.randn(k, n, dtype=torch.float64) / k ** 0.5
    t0 = time.perf_counter()
    gathered = vtp.all_gather_matmul([s.to(dev, dtype) for s in shards], [w.to(dev, dtype)])
    ag_s = time.perf_counter() - t0
    dense = torch.cat(shards) @ w
    ag_err = max((out.double().cpu() - dense).abs().max().item() for _, (out,) in gathered)

    parts = [torch.randn(tp * m, k, dtype=torch.float64) for _ in range(tp)]
    ws = [torch.randn(k, n, dtype=torch.float64) / k ** 0.5 for _ in range(tp)]
    total = sum(p @ q for p, q in zip(parts, ws))
    lp = ([p.to(dev, dtype) for p in parts], [q.to(dev, dtype) for q in ws])
    shards_out = vtp.matmul_reduce_scatter(*lp)
    rs_err = max((o.double().cpu() - total[r * m:(r + 1) * m]).abs().max().item() for r, o in enumerate(shards_out))
    sums = vtp.matmul_all_reduce(*lp, variant="two_shot")
    ar_err = max((o.double().cpu() - total).abs().max().item() for o in sums)
    same = all(torch.equal(o, sums[0]) for o in sums)

    scale = max(dense.abs().max().item(), total.abs().max().item())
    print(f"{tp} emulated rank(s) on {dev} ({dtype}), shards of {m} rows, K={k}, N={n}; all-gather GEMM "
          f"{ag_s * 1e3:.0f} ms (a first call: on a GPU it includes compiling)")
    print(f"max |error| / max |result|: all_gather_matmul {ag_err / scale:.1e}, matmul_reduce_scatter "
          f"{rs_err / scale:.1e}, matmul_all_reduce {ar_err / scale:.1e} (identical on every rank: {same})")
    tol = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -8
    assert max(ag_err, rs_err, ar_err) / scale < tol and same, "fused ops differ from the dense GEMM"
    print(f"{tp} emulated rank(s): fused all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce match "
          "the dense GEMM")


if __name__ == "__main__":
    main()
