"""FP8 column- and row-parallel linears at world sizes 1–4, with and without SP, the ring and the
collective, every recipe's first step: output, input gradient and weight gradient against float64
GEMMs on the same FP8-rounded operands, rounded here from the whole tensors (so the column input's
FP8 all-gather must equal quantise-then-gather, and every shard's scale must be the whole tensor's).
The fp32 accumulation order is the only difference allowed."""

from __future__ import annotations

import pytest
import torch

from tpkernels.functional.fp8_linear import Fp8Options
from tpkernels.functional.gemm_comm import poison_receive_buffers
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.quant.fp8 import cast_to_fp8, dequantize_fp8, scale_from_amax

from test_tp_layers import _forced_algo, _shard

WORLD_SIZES = [1, 2, 3, 4]


def _q(t: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
    """The FP8 rounding of the whole (2-D) tensor ``t``, back in float64."""
    amax = t.abs().amax(1, keepdim=True) if rowwise else t.abs().amax()
    scale = scale_from_amax(amax, fmt)
    return dequantize_fp8(cast_to_fp8(t, scale, fmt), scale, torch.float64)


def _worker(rank, world, seed, column, sp, recipe, force):
    torch.manual_seed(seed)
    k, n, s, b = 32, 16 * world, 2 * world, 3
    rowwise = recipe == "rowwise"
    if column:
        w = torch.randn(n, k)
        layer = ColumnParallelLinear(k, n, False, None, sequence_parallel=sp, sequence_dim=1)
        mine = slice(rank * layer.out_per_rank, (rank + 1) * layer.out_per_rank)
        with torch.no_grad():
            layer.weight.copy_(w[mine])
        x = torch.randn(b, s, k) * 3
        dy = torch.randn(b, s, n) / 7
    else:
        w = torch.randn(k, n)
        layer = RowParallelLinear(n, k, False, None, sequence_parallel=sp, sequence_dim=1)
        mine = slice(rank * layer.in_per_rank, (rank + 1) * layer.in_per_rank)
        with torch.no_grad():
            layer.weight.copy_(w[:, mine])
        x = torch.randn(b, s, n) * 3
        dy = torch.randn(b, s, k) / 7
    layer.enable_fp8(Fp8Options(recipe))
    # the reference: whole tensors rounded to FP8 once, float64 GEMMs; rowwise rounds each GEMM's
    # operand along the rows it has in that GEMM
    x2, dy2 = x.reshape(-1, x.shape[-1]).double(), dy.reshape(-1, dy.shape[-1]).double()
    y_ref = _q(x2, "e4m3", rowwise) @ _q(w.double(), "e4m3", rowwise).t()
    wq = _q(w.double().t().contiguous(), "e4m3", rowwise).t() if rowwise else _q(w.double(), "e4m3", False)
    dx_ref = _q(dy2, "e5m2", rowwise) @ wq
    dw_ref = (_q(dy2.t().contiguous(), "e5m2", True) @ _q(x2.t().contiguous(), "e4m3", True).t()) if rowwise else \
        _q(dy2, "e5m2", False).t() @ _q(x2, "e4m3", False)
    y_ref, dx_ref = y_ref.view(b, s, -1), dx_ref.view(b, s, -1)
    # this rank's inputs
    xin = (_shard(x, 1, rank, world) if sp and column else x[..., mine] if not column else x).clone()
    if not column and not sp:
        xin = x[..., mine].clone()
    if not column and sp:
        xin = x[..., mine].clone()  # the row input is whole along the sequence, split along features
    xin.requires_grad_()
    dyin = dy[..., mine] if column else (_shard(dy, 1, rank, world) if sp else dy)
    with poison_receive_buffers(), _forced_algo(force):
        y = layer(xin)
        y.backward(dyin.contiguous())
    want_y = y_ref[..., mine] if column else (_shard(y_ref, 1, rank, world) if sp else y_ref)
    want_dx = (_shard(dx_ref, 1, rank, world) if sp else dx_ref) if column else dx_ref[..., mine]
    want_dw = dw_ref[mine] if column else dw_ref[:, mine]
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(xin.grad.double(), want_dx, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), want_dw, **tol)
    # FP8 really rounded something: the fp64 product of the unrounded tensors is farther away
    exact = (x2 @ w.double().t()).view(b, s, -1)
    exact = exact[..., mine] if column else (_shard(exact, 1, rank, world) if sp else exact)
    assert (exact - want_y).abs().max() > 1e-3
    stats = layer.fp8.take_stats()
    assert stats["x"].numel > 0 and stats["dy"].numel > 0 and int(stats["x"].saturated) == 0
    return True


MODES = [  # column, sp, recipe, forced algo
    (True, False, "current", None),
    (True, True, "current", "ring"),
    (True, True, "delayed", "collective"),
    (True, True, "rowwise", None),
    (False, False, "current", None),
    (False, True, "current", "ring"),
    (False, True, "rowwise", None),
    (False, False, "rowwise", None),
]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{'col' if m[0] else 'row'}-sp{int(m[1])}-{m[2]}-{m[3] or 'auto'}")
def test_fp8_layer_equals_fp64_on_the_fp8_rounded_operands(rank_pool, fresh_seed, world, mode):
    assert rank_pool(world).run(_worker, fresh_seed, *mode) == [True] * world


def test_fp8_refuses_shapes_and_bases_it_cannot_take():
    with pytest.raises(ValueError, match=r"in_features per rank \(40\) must be a multiple of 16"):
        ColumnParallelLinear(40, 64).enable_fp8()
    with pytest.raises(ValueError, match=r"out_features per rank \(24\) must be a multiple of 16"):
        RowParallelLinear(64, 24).enable_fp8()
    with pytest.raises(ValueError, match="FP8 training of a QLoRA base is not supported"):
        ColumnParallelLinear(64, 64, quant="nf4").enable_fp8()
    with pytest.raises(ValueError, match=r"fp8.recipe \('mxfp8'\) must be one of current, delayed, rowwise"):
        ColumnParallelLinear(64, 64).enable_fp8(Fp8Options("mxfp8"))
    with pytest.raises(ValueError, match=r"fp8.grad_format \('e3m4'\)"):
        ColumnParallelLinear(64, 64).enable_fp8(Fp8Options(grad_format="e3m4"))
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
