"""The one weight-gradient mechanism of the package: dW = Σ dyᵀ·x of a linear layer, computed at
once (chunk by chunk, in the shadow of tensor-parallel communication) or deferred to a later W
action (zero-bubble pipeline schedules split backward into B, the input gradient, and W).

Every linear layer of the package (the column/row-parallel layers of ``tp_linear`` and, through
``tpkernels.pipeline.weight_grad.enable_weight_grad_split``, plain ``nn.Linear``) builds its
weight gradient with a :class:`WeightGrad`:

    gw = WeightGrad(weight, ctx.needs_input_grad[1])
    gw.add(dy_chunk, x_chunk)        # now, or queued when deferred
    return dx, gw.result(), ...      # the gradient, or None when it was queued

Outside ``defer_weight_grads(store)`` the chunks are multiplied as they come and summed (fp32 for
16-bit inputs, ``tpkernels.dtypes``), and autograd receives the result. Inside, the chunks are
kept (the layer's input and output gradient: the W owns them, so nothing the B step frees or
reuses can change them) and ``store.flush()`` (the W action) computes every queued gradient and
hands them to autograd with one ``torch.autograd.backward`` over the weights: the gradients land
through autograd's own accumulation (``AccumulateGrad``), so ``.grad`` accumulates across
micro-batches and ``register_post_accumulate_grad_hook`` hooks (data-parallel gradient bucketing)
fire, exactly as when the gradient is computed in B.

A forward run inside ``split_weight_grads()`` (the F actions of a zero-bubble schedule) keeps
each weight out of the autograd graph (the layer takes ``weight_for_graph(weight)``) and hands
the weight to its backward instead: B then never reaches the weight's ``AccumulateGrad``, whose
hooks would otherwise fire in B with no gradient (autograd runs them for an undefined gradient
too), and a data-parallel bucket would count the weight as ready before its W. Such a graph
backpropagated without a store still gets its weight gradients, at once, through autograd.
"""

from __future__ import annotations

import threading

import torch

from tpkernels.conventions import rows
from tpkernels._state import setting
from tpkernels.dtypes import accumulation_dtype

_STATE = threading.local()


class WeightGradStore:
    """The weight gradients queued during one B (one micro-batch of one model chunk)."""

    def __init__(self):
        self._queue: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], object]] = []
        self._work: list = []

    def put(self, weight: torch.Tensor, chunks: list[tuple[torch.Tensor, torch.Tensor]], product=None) -> None:
        """Queue weight.grad += Σ dyᵀ·x over ``chunks`` of (dy (..., out), x (..., in)); ``product(dy, x)``:
        the weight format's GEMM (None: the plain one)."""
        self._queue.append((weight, chunks, product))

    def defer(self, fn) -> None:
        """Queue other W work of a custom layer (called with no arguments at flush). To keep hooks and
        DP bucketing working, it should hand its gradients to ``torch.autograd.backward``."""
        self._work.append(fn)

    def __len__(self) -> int:
        return len(self._queue) + len(self._work)

    def flush(self) -> None:
        """Compute every queued gradient and accumulate them into the weights through autograd."""
        work, self._work = self._work, []
        for fn in work:
            fn()
        if not self._queue:
            return
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a weight used twice gets one sum
        for weight, chunks, product in self._queue:
            g = _sum_of_products(chunks, product)
            prev = grads.get(id(weight))
            grads[id(weight)] = (weight, g if prev is None else prev[1].add_(g))
        self._queue.clear()
        weights = [w for w, _ in grads.values()]
        torch.autograd.backward(weights, [g.to(w.dtype) for w, g in grads.values()])


def _accumulate(acc: torch.Tensor | None, dy: torch.Tensor, x: torch.Tensor, product=None) -> torch.Tensor:
    """acc + dyᵀ·x over all rows, acc in the accumulation dtype (created by the first chunk);
    ``product(dy, x)`` (a weight format's GEMM, in the accumulation dtype) instead of the plain one."""
    if product is not None:
        p = product(dy, x)
        return p if acc is None else acc.add_(p)
    dy2, x2 = rows(dy), rows(x)
    if acc is None:
        p = torch.matmul(dy2.t(), x2)
        return p.to(accumulation_dtype(p.dtype))
    if acc.dtype == dy2.dtype:
        return acc.addmm_(dy2.t(), x2)
    return acc.add_(torch.matmul(dy2.t(), x2))


def _sum_of_products(chunks, product=None) -> torch.Tensor:
    acc = None
    for dy, x in chunks:
        acc = _accumulate(acc, dy, x, product)
    return acc


def active_store() -> WeightGradStore | None:
    """The store weight gradients are being deferred to (inside ``defer_weight_grads``), else None."""
    return getattr(_STATE, "store", None)


def split_weight_grads(enabled: bool = True):
    """Forward passes inside the block build graphs whose weight gradients come from W only."""
    return setting(_STATE, "split", enabled)


def splitting() -> bool:
    """Whether forwards run now keep weights out of the graph (a recomputation must do the same)."""
    return bool(getattr(_STATE, "split", False))


class SplitWeight:
    """The weight a W will accumulate into, handed to a Function as a plain object (a tensor argument
    would give autograd an edge to it)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


# A zero-size leaf that requires grad, passed to every Function whose weight was kept out of the
# graph: with the weight detached, a layer whose other inputs need no gradient (the first Linear of a
# model, on data, without bias) would otherwise produce an output outside autograd, and its weight
# gradient would be lost. Its own gradient is always None, so nothing accumulates into it.
_ANCHOR = torch.empty(0, requires_grad=True)


def graph_anchor(split: SplitWeight | None) -> torch.Tensor | None:
    """The tensor a Function takes so that its output stays in the graph when its weight is split."""
    return _ANCHOR if split is not None else None


def weight_for_graph(weight: torch.Tensor) -> tuple[torch.Tensor, SplitWeight | None]:
    """(the weight a layer passes to its autograd Function, what its W will need or None). Inside
    ``split_weight_grads()`` a weight that requires grad is passed detached, out of B's graph."""
    if getattr(_STATE, "split", False) and weight.requires_grad:
        return weight.detach(), SplitWeight(weight)
    return weight, None


def defer_weight_grads(store: WeightGradStore):
    """Inside the block, the package's linear layers queue their weight gradients in ``store``."""
    return setting(_STATE, "store", store)


class WeightGrad:
    """The weight gradient of one linear layer in one backward (see the module docstring).

    weight: (out, in); each ``add(dy, x)`` is a chunk of rows: dy (..., out), x (..., in).
    ``split``: what ``weight_for_graph`` returned for a weight it kept out of the graph, if any;
    ``product(dy, x)``: the weight format's GEMM for dyᵀ·x (FP8), None for the plain one."""

    def __init__(self, weight: torch.Tensor, needed: bool = True, split: SplitWeight | None = None, product=None):
        self.product = product
        self.weight, self.needed = (split.weight, True) if split is not None else (weight, needed)
        self.store = active_store() if self.needed else None
        self._now = None  # a split weight outside any store: its own store, flushed by result()
        if split is not None and self.store is None:
            self.store = self._now = WeightGradStore()
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._acc: torch.Tensor | None = None

    @property
    def deferred(self) -> bool:
        return self.store is not None

    def add(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        if not self.needed:
            return
        if self.deferred:
            self._chunks.append((dy, x))
        else:
            self._acc = _accumulate(self._acc, dy, x, self.product)

    def result(self) -> torch.Tensor | None:
        """The gradient for autograd to accumulate; None when not needed or queued for W."""
        if not self.needed:
            return None
        if self.deferred:
            if self._chunks:
                self.store.put(self.weight, self._chunks, self.product)
            if self._now is not None:
                self._now.flush()  # a nested backward over the weight alone
            return None
        if self._acc is None:
            return torch.zeros_like(self.weight)
        return self._acc.to(self.weight.dtype)


class LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b whose weight gradient goes through :class:`WeightGrad` (deferrable).
    x: (..., in), weight: (out, in), bias: (out,) or None -> (..., out)."""

    @staticmethod
    def forward(ctx, x, weight, bias, split_weight, anchor):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.split_weight = bias is not None, split_weight
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = torch.matmul(dy, weight) if ctx.needs_input_grad[0] else None
        db = rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gw = WeightGrad(weight, ctx.needs_input_grad[1], ctx.split_weight)
        gw.add(dy, x)
        return dx, gw.result(), db, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight gradient can be deferred to a zero-bubble W action."""
    w, split = weight_for_graph(weight)
    return LinearFunction.apply(x, w, bias, split, graph_anchor(split))
