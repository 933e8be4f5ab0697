"""Example: replace `nn.Linear(bias=True) + nn.GELU()` in an existing model with tpkernels'
fused BiasGeLU, keeping the weights, and check that outputs and gradients match.

    python python/fuse_mlp_gelu.py
"""

import torch
from torch import nn

from tpkernels.nn import BiasGeLU


class MLP(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 33, 256)
    y_ref = model(x)
    y_ref.square().mean().backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # The swap: fc1 loses its bias to BiasGeLU (shared parameters, nothing copied).
    model.fc1 = BiasGeLU.fuse_linear(model.fc1, model.act)
    model.act = nn.Identity()
    print(model)

    y = model(x)
    y.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    print(f"max |output difference|: {(y - y_ref).abs().max().item():.2e}")
    renamed = {"fc1.0.weight": "fc1.weight", "fc1.1.bias": "fc1.bias"}
    for name, g in grads.items():
        ref = grads_ref[renamed.get(name, name)]
        print(f"max |grad difference| {name:14}: {(g - ref).abs().max().item():.2e}")
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    print("fused model matches the original")


if __name__ == "__main__":
    main()
