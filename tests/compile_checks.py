"""Shared check of the kernel tests: a block built from our ops traces under
``torch.compile(fullgraph=True)`` (the ops' fake implementations) and gives eager's outputs and
gradients."""

from __future__ import annotations

import torch


def assert_compiled_block_matches_eager(block: torch.nn.Module, *inputs: torch.Tensor) -> None:
    """block(*inputs) and its input and parameter gradients (loss: sum of squares), eager against
    ``torch.compile(block, fullgraph=True, backend="aot_eager")``."""
    torch._dynamo.reset()
    eager_in = [t.clone().requires_grad_() for t in inputs]
    out = block(*eager_in)
    out.square().sum().backward()
    eager_grads = [t.grad for t in eager_in] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    comp_in = [t.clone().requires_grad_() for t in inputs]
    out_c = compiled(*comp_in)
    out_c.square().sum().backward()
    torch.testing.assert_close(out_c, out)
    for got, want in zip([t.grad for t in comp_in] + [p.grad for p in block.parameters()], eager_grads, strict=True):
        torch.testing.assert_close(got, want)
