"""tpkernels.functional.moe_expert_tp: uneven row blocks over a TP group (the MoE layer's expert TP),
forward and backward against each rank's own float64 arithmetic on every rank's data, on 2 gloo ranks:
odd sizes, a rank with no rows, every rank with none, and bad sizes named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpkernels.functional.moe_expert_tp import even_sizes, gather_rows, reduce_scatter_rows, split_rows

H = 5


def _worker(rank, world, seed):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(seed)
    out = []
    for case in ("odd", "one empty", "all empty"):
        sizes = [int(torch.randint(1, 9, (), generator=g)) for _ in range(world)]
        if case == "one empty":
            sizes[int(torch.randint(0, world, (), generator=g))] = 0
        if case == "all empty":
            sizes = [0] * world
        n, lo = sum(sizes), sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])
        # every rank draws every rank's tensors: the oracle is plain arithmetic on them
        xs = [torch.randn(s, H, generator=g, dtype=torch.float64) for s in sizes]
        gs = [torch.randn(n, H, generator=g, dtype=torch.float64) for _ in range(world)]
        ys = [torch.randn(n, H, generator=g, dtype=torch.float64) for _ in range(world)]
        hs = [torch.randn(s, H, generator=g, dtype=torch.float64) for s in sizes]
        full = torch.cat(xs)

        x = xs[rank].clone().requires_grad_()
        y = gather_rows(x, sizes, group)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        y.backward(gs[rank])
        torch.testing.assert_close(x.grad, sum(gg[mine] for gg in gs), rtol=1e-14, atol=1e-14)

        x = xs[rank].clone().requires_grad_()
        gather_rows(x, sizes, group, reduce_grad=False).backward(gs[rank])
        torch.testing.assert_close(x.grad, gs[rank][mine], rtol=0, atol=0)

        yy = ys[rank].clone().requires_grad_()
        r = reduce_scatter_rows(yy, sizes, group)
        torch.testing.assert_close(r, sum(t[mine] for t in ys), rtol=1e-14, atol=1e-14)
        r.backward(hs[rank])
        torch.testing.assert_close(yy.grad, torch.cat(hs), rtol=0, atol=0)

        xx = full.clone().requires_grad_()
        s = split_rows(xx, sizes, group)
        torch.testing.assert_close(s, full[mine], rtol=0, atol=0)
        s.backward(hs[rank])
        torch.testing.assert_close(xx.grad, torch.cat(hs), rtol=0, atol=0)
        out.append(case)
    errors = []
    for bad in ([1], [-1, 2], [3, 3]):
        try:
            gather_rows(torch.zeros(2, H), bad, group)
        except ValueError as e:
            errors.append(str(e))
    return out, errors


def test_rows_over_the_tp_group(rank_pool, fresh_seed):
    for cases, errors in rank_pool(2).run(_worker, fresh_seed):
        assert cases == ["odd", "one empty", "all empty"]
        assert errors[0] == "sizes ([1]) must hold one non-negative row count per rank of the group (2)"
        assert errors[1] == "sizes ([-1, 2]) must hold one non-negative row count per rank of the group (2)"
        assert errors[2].startswith("x has 2 rows but sizes ([3, 3]) say 3")


@pytest.mark.parametrize("n, world", [(7, 2), (2, 4), (0, 3), (12, 4)])
def test_even_sizes_is_tensor_split(n, world):
    assert even_sizes(n, world) == [len(t) for t in torch.tensor_split(torch.arange(n), world)]
