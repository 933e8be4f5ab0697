"""Column → tanh → row over quantised weights (NF4, int8) at world sizes 1–4, with and without SP, the
ring and the collective around the dequantising GEMM, receive buffers poisoned with NaN: output and
input gradient equal the dense pair in float64 on the dequantised weights (each rank quantises its
own shard: the reference is built from the shards' dequantised values, gathered)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkernels.functional.gemm_comm import poison_receive_buffers
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.mappings import all_gather_dim

from test_tp_layers import _forced_algo, _shard

WORLD_SIZES = [1, 2, 3, 4]


def _worker(rank, world, seed, quant, sp, bias, force, split_rows):
    torch.manual_seed(seed)
    h, f, s, b = 70, 17 * world, 3 * world, 2  # shards of 17 rows and 17 columns: short NF4 blocks everywhere
    fc1, fc2 = nn.Linear(h, f, bias=bias).double(), nn.Linear(f, h, bias=bias).double()
    x64 = torch.randn(b, s, h, dtype=torch.float64)
    dy64 = torch.randn_like(x64)
    kw = dict(sequence_parallel=sp, sequence_dim=1, quant=quant)
    col = ColumnParallelLinear(h, f, bias, None, dtype=torch.float64, **kw)
    row = RowParallelLinear(f, h, bias, None, dtype=torch.float64, **kw)
    rows = slice(rank * col.out_per_rank, (rank + 1) * col.out_per_rank)
    # a fused layer's shard is several tensors' rows, each quantised alone (split_rows: two pieces)
    col.load_quantized_(fc1.weight[rows], [5, col.out_per_rank - 5] if split_rows else None)
    row.load_quantized_(fc2.weight[:, rows])
    with torch.no_grad():
        if bias:
            col.bias.copy_(fc1.bias[rows])
            row.bias.copy_(fc2.bias)
    # the reference: the dense pair on the dequantised shards
    w1 = all_gather_dim(col.qweight.dequantize(), 0, None) if world == 1 else \
        all_gather_dim(col.qweight.dequantize().contiguous(), 0, col.tp_group)
    w2 = all_gather_dim(row.qweight.dequantize().t().contiguous(), 0, row.tp_group).t()
    x_ref = x64.clone().requires_grad_()
    y_ref = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x_ref, w1, fc1.bias if bias else None)),
                                       w2, fc2.bias if bias else None)
    y_ref.backward(dy64)
    x = (_shard(x64, 1, rank, world) if sp else x64).clone().requires_grad_()
    with poison_receive_buffers(), _forced_algo(force):
        y = row(torch.tanh(col(x)))
        y.backward(_shard(dy64, 1, rank, world) if sp else dy64)
    torch.testing.assert_close(y, _shard(y_ref, 1, rank, world) if sp else y_ref, rtol=1e-10, atol=1e-12)
    want_dx = _shard(x_ref.grad, 1, rank, world) if sp else x_ref.grad
    torch.testing.assert_close(x.grad, want_dx, rtol=1e-10, atol=1e-12)
    # the base is dequantised, not the dense weights: NF4 / int8 moved them
    assert not torch.equal(w1, fc1.weight)
    assert (w1 - fc1.weight).abs().max() <= fc1.weight.abs().max() / (4 if quant == "nf4" else 100)
    assert [n for n, _ in col.named_parameters()] == (["bias"] if bias else [])
    return True


MODES = [  # quant, sp, bias, forced algo, split rows
    ("nf4", False, True, None, False),
    ("nf4", True, True, "ring", True),
    ("nf4", True, False, "collective", False),
    ("int8", True, True, "ring", False),
    ("int8", False, False, None, True),
]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}-sp{int(m[1])}-b{int(m[2])}-{m[3] or 'auto'}-"
                         f"split{int(m[4])}")
def test_quantized_pair_matches_dense_on_dequantised_weights(rank_pool, fresh_seed, world, mode):
    assert rank_pool(world).run(_worker, fresh_seed, *mode) == [True] * world


def test_fused_gemm_comm_is_refused_for_a_quantised_weight_through_the_environment(monkeypatch):
    from tpkernels.functional.gemm_comm import choose_algo

    with pytest.raises(Exception, match="quantised"):
        choose_algo("all_gather_matmul", "fused", 2, 1e12, torch.device("cpu"), quantized=True)


def test_dequantize_and_to_linear_return_the_dequantised_dense_layer():
    lin = nn.Linear(64, 40)
    col = ColumnParallelLinear.from_linear(lin, None, quant="nf4")
    dense = col.to_linear()
    torch.testing.assert_close(dense.weight, col.qweight.dequantize(), rtol=0, atol=0)
    col.dequantize_()
    assert col.qweight is None and isinstance(col.weight, nn.Parameter) and not col.weight.requires_grad
    torch.testing.assert_close(col.weight, dense.weight, rtol=0, atol=0)


def test_nf4_layer_trains_with_several_cpu_threads():
    """The C++ kernels' worker threads do not inherit no-grad mode: an input that requires grad must not
    reach ATen's out= GEMM there (it raised with more than one thread)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        col = ColumnParallelLinear.from_linear(nn.Linear(512, 512), None, quant="nf4")
        x = torch.randn(64, 512, requires_grad=True)
        col(x).sum().backward()
        want = torch.ones(64, 512) @ col.qweight.dequantize()
        torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)
