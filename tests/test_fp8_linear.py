"""FP8 on the TP linears: shapes and bases FP8 GEMMs cannot take are refused by name, NaN inputs too; the
column input's SP all-gather moves half of bf16's bytes. (Outputs and gradients of every recipe against a
float64 oracle at world 1–4: tests/test_tp_linear_formats.py.)"""

from __future__ import annotations

import pytest
import torch

from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.quant.fp8_state import Fp8Recipe

from test_tp_layers import _forced_algo


def test_fp8_refuses_shapes_and_bases_it_cannot_take():
    with pytest.raises(ValueError, match=r"in_features per rank \(40\) must be a multiple of 16"):
        ColumnParallelLinear(40, 64).enable_fp8()
    with pytest.raises(ValueError, match=r"out_features per rank \(24\) must be a multiple of 16"):
        RowParallelLinear(64, 24).enable_fp8()
    with pytest.raises(ValueError, match="FP8 training of a QLoRA base is not supported"):
        ColumnParallelLinear(64, 64, quant="nf4").enable_fp8()
    with pytest.raises(ValueError, match=r"fp8.recipe \('mxfp8'\) must be one of current, delayed, rowwise"):
        ColumnParallelLinear(64, 64).enable_fp8(Fp8Recipe("mxfp8"))
    with pytest.raises(ValueError, match=r"fp8.grad_format \('e3m4'\)"):
        ColumnParallelLinear(64, 64).enable_fp8(Fp8Recipe(grad_format="e3m4"))
    layer = ColumnParallelLinear(64, 64)
    layer.enable_fp8()
    with pytest.raises(ValueError, match="input holds NaN or infinite values"):
        layer(torch.full((2, 64), float("nan")))


def _gather_bytes_worker(rank, world, fp8):
    from tpkernels.parallel.trace import CommTrace

    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 32 * world, False, None, sequence_parallel=True, sequence_dim=1,
                                 dtype=torch.bfloat16)
    if fp8:
        layer.enable_fp8()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with _forced_algo("collective"), CommTrace() as tr:
        layer(x)
    return sum(s.args.get("bytes", 0) for s in tr.spans if s.name == "all_gather")


def test_fp8_all_gather_moves_half_the_bytes_of_bf16_in_the_trace(rank_pool):
    bf16 = rank_pool(2).run(_gather_bytes_worker, False)[0]
    fp8 = rank_pool(2).run(_gather_bytes_worker, True)[0]
    assert bf16 == 2 * 8 * 64 * 2 * 2 and fp8 * 2 == bf16
