"""Public API of bias_gelu: dispatch, validation, autograd, torch.compile, the module."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkernels
from tpkernels import backends
from tpkernels.backends import BackendUnavailableError
from tpkernels.nn import BiasGeLU
from tpkernels.testing.tolerance import assert_fa_close

CPU_BACKENDS = [b for b in ("cpp", "reference", "triton") if backends.why_not(b, "bias_gelu", torch.device("cpu")) is None]


def test_default_backend_on_cpu_is_cpp():
    assert backends.select("bias_gelu", torch.device("cpu")) == "cpp"


def test_forced_backend_that_cannot_run_says_why(monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError,
                       match=r"TPKERNELS_BACKEND=cuda \(every op\) cannot run bias_gelu on cpu .*CUDA tensors"):
        tpkernels.bias_gelu(torch.randn(3, 4), torch.randn(4))


def test_unknown_forced_backend(monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", "metal")
    with pytest.raises(BackendUnavailableError, match=r"TPKERNELS_BACKEND \('metal'\) must name one of cuda, triton, "
                                                      r"cpp, reference, collective, ring"):
        tpkernels.bias_gelu(torch.randn(3, 4), torch.randn(4))


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = backends.why_not("triton", "bias_gelu", torch.device("cpu"))
    assert reason is not None and "TRITON_INTERPRET=1" in reason


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forced_backend_is_used(backend, monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", backend)
    calls = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda op, dev, b=None, **kw: calls.append(real(op, dev, b, **kw)) or calls[-1])
    x, b = torch.randn(5, 17), torch.randn(17)
    y = tpkernels.bias_gelu(x, b)
    assert calls == [backend]
    assert_fa_close(y, F.gelu(x.double() + b.double()), F.gelu(x + b))


@pytest.mark.parametrize("call, message", [
    (lambda: tpkernels.bias_gelu(torch.randn(3, 5), torch.randn(4)), r"bias.shape\[0\] \(4\) must equal x.shape\[-1\] \(5\)"),
    (lambda: tpkernels.bias_gelu(torch.randn(3, 4), torch.randn(4), "fast"), r"approximate \('fast'\) must be 'none' or 'tanh'"),
    (lambda: tpkernels.bias_gelu(torch.randn(3, 4), torch.randn(4, 1)), r"bias must be 1-D"),
    (lambda: tpkernels.bias_gelu(torch.randn(3, 4), torch.randn(4, dtype=torch.float64)), r"bias dtype \(torch.float64\) must equal x dtype \(torch.float32\)"),
    (lambda: tpkernels.bias_gelu(torch.randint(0, 3, (3, 4)), torch.randint(0, 3, (4,))), r"x dtype \(torch.int64\) must be float32"),
    (lambda: tpkernels.bias_gelu(torch.tensor(1.0), torch.randn(1)), r"at least 1 dim"),
    (lambda: BiasGeLU(0), r"features \(0\) must be a positive int"),
    (lambda: BiasGeLU(3, approximate="erf"), r"approximate \('erf'\) must be 'none' or 'tanh'"),
])
def test_bad_input_raises_clear_error(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_autograd_matches_torch(backend, approximate, monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", backend)
    x = torch.randn(2, 7, 33, requires_grad=True)
    b = torch.randn(33, requires_grad=True)
    g = torch.randn(2, 7, 33)
    tpkernels.bias_gelu(x, b, approximate).backward(g)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    F.gelu(x64 + b64, approximate=approximate).backward(g.double())
    xl, bl = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    F.gelu(xl + bl, approximate=approximate).backward(g)
    assert_fa_close(x.grad, x64.grad, xl.grad, grad=True, name="grad x")
    assert_fa_close(b.grad, b64.grad, bl.grad, grad=True, ulps=16, name="grad bias")


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "triton"])  # triton has no fp64
def test_gradcheck(backend, monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", backend)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: tpkernels.bias_gelu(x, b, "tanh"), (x, b))


def test_backend_argument_applies_to_forward_and_backward(monkeypatch):
    used = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda op, dev, b=None, **kw: used.append(real(op, dev, b, **kw)) or used[-1])
    x, b = torch.randn(4, 9, requires_grad=True), torch.randn(9, requires_grad=True)
    tpkernels.bias_gelu(x, b, backend="reference").sum().backward()
    assert used == ["reference", "reference"]
    with pytest.raises(BackendUnavailableError, match="backend argument cannot run bias_gelu on cpu"):
        tpkernels.bias_gelu(x, b, backend="cuda")


def test_only_bias_requires_grad():
    x = torch.randn(6, 5)
    b = torch.randn(5, requires_grad=True)
    tpkernels.bias_gelu(x, b).sum().backward()
    b64 = b.detach().double().requires_grad_()
    F.gelu(x.double() + b64).sum().backward()
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


def test_noncontiguous_and_transposed_inputs():
    x = torch.randn(33, 8).t()  # (8, 33), last-dim stride 8
    b = torch.randn(33)
    y = tpkernels.bias_gelu(x, b)
    assert y.is_contiguous()
    assert_fa_close(y, F.gelu(x.double() + b.double()), F.gelu(x + b))


class _MLP(nn.Module):
    def __init__(self, d=16, h=40):
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.act = BiasGeLU(h, approximate="tanh")
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    model = _MLP()
    with torch.no_grad():
        model.act.bias.normal_()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    x = torch.randn(3, 5, 16)
    y_eager = model(x)
    y_comp = compiled(x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    y_comp.sum().backward()
    g_comp = model.act.bias.grad.clone()
    model.zero_grad()
    y_eager.sum().backward()
    torch.testing.assert_close(g_comp, model.act.bias.grad, rtol=1e-5, atol=1e-5)


def test_opcheck_custom_ops():
    # torch.library's own consistency checks: schema, fake impl vs real, autograd registration.
    x, b = torch.randn(3, 11, requires_grad=True), torch.randn(11, requires_grad=True)
    torch.library.opcheck(torch.ops.tpkernels.bias_gelu.default, (x, b, "none", ""))
    g = torch.randn(3, 11)
    torch.library.opcheck(torch.ops.tpkernels.bias_gelu_backward.default, (g, x.detach(), b.detach(), "tanh", "cpp"))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fuse_linear_replaces_linear_plus_gelu(approximate):
    old = nn.Sequential(nn.Linear(12, 30), nn.GELU(approximate=approximate))
    new = BiasGeLU.fuse_linear(old[0], old[1])
    assert new[0].bias is None and new[0].weight is old[0].weight and new[1].bias is old[0].bias
    assert new[1].approximate == approximate
    x = torch.randn(4, 12)
    y_old, y_new = old(x), new(x)
    torch.testing.assert_close(y_new, y_old, rtol=1e-5, atol=1e-5)
    y_new.square().sum().backward()
    g_w, g_b = old[0].weight.grad.clone(), old[0].bias.grad.clone()  # shared params: grads land there
    old.zero_grad()
    old(x).square().sum().backward()
    torch.testing.assert_close(g_w, old[0].weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_b, old[0].bias.grad, rtol=1e-4, atol=1e-5)


def test_fuse_linear_rejects_bad_inputs():
    with pytest.raises(ValueError, match="no bias to fuse"):
        BiasGeLU.fuse_linear(nn.Linear(3, 4, bias=False), nn.GELU())
    with pytest.raises(TypeError, match="gelu must be nn.GELU"):
        BiasGeLU.fuse_linear(nn.Linear(3, 4), nn.ReLU())


def test_module_repr_and_state_dict():
    m = BiasGeLU(7, approximate="tanh")
    assert "features=7" in repr(m) and "tanh" in repr(m)
    assert list(m.state_dict()) == ["bias"]


def test_import_without_extension_falls_back_to_reference():
    # A fresh interpreter where tpkernels._C cannot be imported (as after a failed build).
    code = r'''
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tpkernels._C":
            raise ImportError("simulated: no compiled extension")
sys.meta_path.insert(0, Block())
import torch, tpkernels
from tpkernels import backends
assert backends.select("bias_gelu", torch.device("cpu")) == "reference"
x, b = torch.randn(3, 5), torch.randn(5)
torch.testing.assert_close(tpkernels.bias_gelu(x, b), torch.nn.functional.gelu(x + b))
try:
    backends.select("bias_gelu", torch.device("cpu"), "cpp")
except backends.BackendUnavailableError as e:
    assert "simulated: no compiled extension" in str(e), e
else:
    raise AssertionError("forced cpp backend without _C did not raise")
print(tpkernels.build_info()["error"])
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "simulated" in r.stdout


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (2, 0, 5), (0,)], ids=str)
def test_empty_inputs_give_empty_outputs(backend, shape):
    x = torch.randn(*shape, requires_grad=True)
    b = torch.randn(shape[-1], requires_grad=True)
    y = tpkernels.bias_gelu(x, b, backend=backend)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.backward(torch.randn_like(y))
    assert x.grad.shape == x.shape
    assert b.grad.shape == b.shape and not b.grad.isnan().any() and bool((b.grad == 0).all())  # no rows: 0
