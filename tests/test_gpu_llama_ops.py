"""The Llama-family ops on a GPU in bf16 and fp16 (the interpreter computes bf16 wrongly, so these
run only in benchmarks/gpu_check.sh): Triton kernels against float64 with the FlashAttention rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpkernels
from tpkernels.kernels import reference
from tpkernels.testing.tolerance import assert_fa_close

pytestmark = pytest.mark.cuda
DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 7), (4099, 4096), (333, 8192), (17, 8193)], ids=str)
def test_rms_norm(dtype, rows, n):
    x = torch.randn(rows, n, device="cuda", dtype=torch.float64)
    res, dy, dh = torch.randn_like(x), torch.randn_like(x), torch.randn_like(x)
    w = 1 + 0.3 * torch.randn(n, device="cuda", dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, res)]
    y, h = tpkernels.rms_norm(*leaves[:2], 1e-5, residual=leaves[2])  # n = 8193: the reference path
    torch.autograd.backward([y, h], [dy.to(dtype), dh.to(dtype)])
    r64 = [t.to(dtype).double().requires_grad_() for t in (x, w, res)]
    h64 = r64[0] + r64[2]
    y64 = F.rms_norm(h64, (n,), r64[1], 1e-5)
    torch.autograd.backward([y64, h64], [dy.to(dtype).double(), dh.to(dtype).double()])
    lp = [t.to(dtype).requires_grad_() for t in (x, w, res)]
    hl = lp[0] + lp[2]
    yl = (hl.float() * torch.rsqrt(hl.float().square().mean(-1, keepdim=True) + 1e-5)).to(dtype) * lp[1]
    torch.autograd.backward([yl, hl], [dy.to(dtype), dh.to(dtype)])
    assert_fa_close(y, y64, yl, name="y")
    assert_fa_close(leaves[0].grad, r64[0].grad, lp[0].grad, grad=True, name="dx")
    assert_fa_close(leaves[1].grad, r64[1].grad, lp[1].grad, grad=True, ulps=4 * rows ** 0.5, name="dweight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_fused(dtype):
    gu = (3 * torch.randn(2049, 2 * 14336, device="cuda", dtype=torch.float64)).to(dtype).requires_grad_()
    dy = torch.randn(2049, 14336, device="cuda", dtype=torch.float64).to(dtype)
    tpkernels.swiglu(gu).backward(dy)
    g64 = gu.detach().double().requires_grad_()
    a, b = g64.chunk(2, -1)
    (F.silu(a) * b).backward(dy.double())
    gl = gu.detach().clone().requires_grad_()
    a, b = gl.chunk(2, -1)
    (F.silu(a) * b).backward(dy)
    assert_fa_close(gu.grad, g64.grad, gl.grad, grad=True, name="d gate_up")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary(dtype, interleaved):
    cos, sin = tpkernels.rotary_cache(128, 4096, 500000.0, device="cuda")
    q = torch.randn(2, 1031, 32, 128, device="cuda", dtype=torch.float64).to(dtype)
    k = torch.randn(2, 1031, 8, 128, device="cuda", dtype=torch.float64).to(dtype)
    qr, kr = tpkernels.apply_rotary(q, k, cos, sin, interleaved=interleaved)
    pos = torch.arange(1031, device="cuda").repeat(2)
    for x, out in ((q, qr), (k, kr)):
        x3 = x.reshape(-1, x.shape[2], 128)
        ref64 = reference.rotary_fwd(x3.double(), cos.double(), sin.double(), pos, interleaved).view(x.shape)
        ref_lp = reference.rotary_fwd(x3, cos.to(dtype), sin.to(dtype), pos, interleaved).view(x.shape)
        assert_fa_close(out, ref64, ref_lp, name="rotated")


def test_linear_cross_entropy_bf16_llama3_vocab():
    h = (torch.randn(2048, 4096, device="cuda") / 8).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(128256, 4096, device="cuda") / 8).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 128256, (2048,), device="cuda")
    t[::7] = -100
    loss = tpkernels.linear_cross_entropy(h, w, t, label_smoothing=0.1)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).float(), t, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(h.grad.float(), h2.grad.float(), rtol=3e-2, atol=3e-3)
    torch.testing.assert_close(w.grad.float(), w2.grad.float(), rtol=3e-2, atol=3e-3)
