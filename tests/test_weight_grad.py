"""The one weight-gradient mechanism (tpkernels.functional.weight_grad), single process: at once,
deferred to a W flush, kept out of B's graph under a zero-bubble forward; gradients always land
through autograd's accumulation (post-accumulate hooks fire once per gradient, never with none)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tpkernels.functional.weight_grad import (
    WeightGradStore,
    defer_weight_grads,
    linear,
    split_weight_grads,
)
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.pipeline.weight_grad import enable_weight_grad_split


class Block(nn.Module):
    """x + fc2(tanh(fc1(norm(x)))) with the package's linears (plain, or TP at one rank)."""

    def __init__(self, kind: str):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        fc1, fc2 = nn.Linear(6, 11), nn.Linear(11, 6)
        if kind == "tp":
            self.fc1, self.fc2 = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
        else:
            self.fc1, self.fc2 = enable_weight_grad_split(fc1), enable_weight_grad_split(fc2)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _hooked(model):
    fired = {}
    for name, prm in model.named_parameters():
        prm.register_post_accumulate_grad_hook(
            lambda p, n=name: fired.setdefault(n, []).append(None if p.grad is None else p.grad.clone()))
    return fired


@pytest.mark.parametrize("kind", ["linear", "tp"])
def test_deferred_equals_immediate_and_lands_through_autograd(kind):
    torch.manual_seed(0)
    ref = Block(kind).double()
    model = copy.deepcopy(ref)
    x = torch.randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    ref(x).sum().backward()  # at once, no store
    fired = _hooked(model)
    store = WeightGradStore()
    with split_weight_grads():
        y = model(x)
    with defer_weight_grads(store):
        y.sum().backward()
    weights = {n for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n}
    assert all(model.get_parameter(n).grad is None for n in weights), "weight gradients landed in B"
    assert weights.isdisjoint(fired), "a weight's hook fired in B, with no gradient"
    assert len(store) == 2
    store.flush()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12, msg=name)
        assert len(fired[name]) == 1 and fired[name][0] is not None, name


def test_a_split_graph_without_a_store_still_gets_its_gradients():
    torch.manual_seed(1)
    ref = Block("linear")
    model = copy.deepcopy(ref)
    fired = _hooked(model)
    x = torch.randn(4, 6)
    with split_weight_grads():
        y = model(x)
    y.square().sum().backward()  # no defer_weight_grads: the weights get theirs at once (nested backward)
    ref(x).square().sum().backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=name)
        assert len(fired[name]) == 1


def test_flush_accumulates_into_existing_grads_and_runs_custom_work():
    w = nn.Parameter(torch.randn(3, 4))
    w.grad = torch.ones(3, 4)
    ran = []
    store = WeightGradStore()
    x, dy = torch.randn(7, 4), torch.randn(7, 3)
    with split_weight_grads():
        out = linear(x, w)
    with defer_weight_grads(store):
        out.backward(dy)
    store.defer(lambda: ran.append(True))
    store.flush()
    torch.testing.assert_close(w.grad, 1 + dy.t() @ x)
    assert ran == [True] and len(store) == 0


def test_16_bit_weight_gradients_sum_chunks_in_fp32():
    w = nn.Parameter(torch.randn(8, 16).to(torch.bfloat16))
    chunks = [(torch.randn(33, 8).to(torch.bfloat16), torch.randn(33, 16).to(torch.bfloat16)) for _ in range(6)]
    store = WeightGradStore()
    store.put(w, chunks)
    store.flush()
    exact = sum(dy.double().t() @ x.double() for dy, x in chunks)
    # one bf16 rounding of each chunk's product and one of the sum: a bf16 running sum would drift more
    naive = sum((dy.t() @ x for dy, x in chunks), torch.zeros(8, 16, dtype=torch.bfloat16))
    err, naive_err = (w.grad.double() - exact).abs().max(), (naive.double() - exact).abs().max()
    assert w.grad.dtype == torch.bfloat16 and err <= naive_err


@pytest.mark.parametrize("kind", ["linear", "tp"])
def test_a_first_layer_on_data_without_bias_keeps_its_weight_gradient(kind):
    # with the weight detached, nothing else of this layer needs a gradient: the graph must still reach it
    torch.manual_seed(2)
    dense = nn.Linear(5, 4, bias=False)
    layer = ColumnParallelLinear.from_linear(copy.deepcopy(dense)) if kind == "tp" else \
        enable_weight_grad_split(copy.deepcopy(dense))
    x = torch.randn(3, 5)  # data: no gradient
    store = WeightGradStore()
    with split_weight_grads():
        y = layer(x)
    assert y.requires_grad
    with defer_weight_grads(store):
        y.sum().backward()
    store.flush()
    dense(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad)
