"""Split backward for zero-bubble schedules: B computes input gradients now, W the weight
gradients later.

Inside ``defer_weight_grads(store)``, every ``nn.Linear`` of a module prepared with
``enable_weight_grad_split`` computes dx (and the bias gradient, which is cheap) in backward and
queues the weight-gradient GEMM dW += dyᵀ·x in ``store``; ``store.flush()`` runs the queue (the W
action). Outside the context the layers behave exactly like ``nn.Linear``. The Linear weights
carry nearly all the FLOPs of a Transformer's weight gradient; other parameters (norms) get their
gradients in B. This is how the Zero Bubble paper's Megatron implementation splits backward.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

_STATE = threading.local()


class WeightGradStore:
    """Queued weight-gradient GEMMs of one micro-batch."""

    def __init__(self):
        self._queue: list = []

    def put(self, weight: torch.nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """Queue weight.grad += dyᵀ·x (rows = all leading dims)."""
        self._queue.append(lambda: _accumulate(weight, torch.matmul(dy.reshape(-1, dy.shape[-1]).t(),
                                                                    x.reshape(-1, x.shape[-1]))))

    def defer(self, fn) -> None:
        """Queue any weight-gradient work (custom layers)."""
        self._queue.append(fn)

    def __len__(self) -> int:
        return len(self._queue)

    def flush(self) -> None:
        for fn in self._queue:
            fn()
        self._queue.clear()


def _accumulate(weight: torch.nn.Parameter, gw: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = gw.to(weight.dtype)
    else:
        weight.grad.add_(gw)


def active_store() -> "WeightGradStore | None":
    """The store of the B being run, if weight gradients are being deferred (for custom layers)."""
    return getattr(_STATE, "store", None)


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore):
    prev = getattr(_STATE, "store", None)
    _STATE.store = store
    try:
        yield store
    finally:
        _STATE.store = prev


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = torch.matmul(dy, weight) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        store = getattr(_STATE, "store", None)
        dw = None
        if ctx.needs_input_grad[1]:
            if store is not None:
                store.put(weight, dy, x)  # W later
            else:
                dw = torch.matmul(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        return dx, dw, db


def _split_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _SplitLinearFn.apply(x, self.weight, self.bias)


def enable_weight_grad_split(module: nn.Module) -> nn.Module:
    """Make every nn.Linear in ``module`` able to defer its weight gradient (in place; returns module)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.forward = _split_forward.__get__(m, nn.Linear)
    return module
