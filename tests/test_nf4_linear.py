"""nf4_linear (QLoRA's frozen base layer) on every CPU backend (cpp, reference, Triton under the
interpreter): forward and input gradient against the fp64 product with the dequantised weight
(FlashAttention rule), outputs poisoned with NaN, odd sizes, leading dims and strided rows, bias,
what autograd saves, the dispatch rule, the shapes the Triton kernels refuse, named errors and
opcheck of the custom ops."""

from __future__ import annotations

import pytest
import torch

import tpkernels
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.quant import NF4Weight, dequantize_nf4, dynamic_map, nf4_code, quantize_nf4
from tpkernels.testing.tolerance import assert_fa_close

CPU = torch.device("cpu")
OP = "nf4_linear"
BACKENDS = [b for b in ("cpp", "reference", "triton") if backends.why_not(b, OP, CPU) is None]
MS = (1, 17, 129)
# (N, K): K not a multiple of 64 (blocks straddle rows) on the paths that take any shape
ANY_NK = [(17, 130), (65, 64), (130, 203)]
TRITON_NK = [(17, 64), (130, 192), (65, 128)]  # the Triton kernels take K % 64 == 0 (any N)


def _dtypes(backend):
    if backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter computes bf16 wrongly (DESIGN.md)
    return [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _case(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * m + n + k)
    w = 0.05 * torch.randn(n, k, generator=g)
    q = quantize_nf4(w.to(torch.bfloat16))
    x = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return q, x, dy, bias


def _refs(q, x, dy, bias):
    """(y64, dx64, ref_lp y, ref_lp dx): fp64 with the dequantised weight, and the same in x's dtype."""
    w64 = dequantize_nf4(q, torch.float64)
    y64 = x.double() @ w64.T + bias.double()
    dx64 = dy.double() @ w64
    wlp = dequantize_nf4(q, x.dtype)
    return y64, dx64, x @ wlp.T + bias, dy @ wlp


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_input_gradient_match_fp64(backend):
    for dtype in _dtypes(backend):
        for n, k in TRITON_NK if backend == "triton" else ANY_NK:
            for m in MS:
                q, x, dy, bias = _case(m, n, k, dtype)
                y64, dx64, y_lp, dx_lp = _refs(q, x, dy, bias)
                xs, bs = x.clone().requires_grad_(), bias.clone().requires_grad_()
                y = tpkernels.nf4_linear(xs, q, bs, backend=backend)
                y.backward(dy)
                what = f"{backend} {dtype} M={m} N={n} K={k}"
                assert y.dtype == dtype and y.shape == (m, n)
                assert_fa_close(y, y64, y_lp, name=f"y {what}")
                assert_fa_close(xs.grad, dx64, dx_lp, grad=True, name=f"dx {what}")
                db64 = dy.double().sum(0)
                assert_fa_close(bs.grad, db64, dy.sum(0), grad=True, name=f"dbias {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_write_every_output_element(backend):
    """Outputs poisoned with NaN before the kernels run: an element they skip stays NaN."""
    if backend == "reference":
        pytest.skip("the reference returns fresh tensors")
    n, k = (65, 128) if backend == "triton" else (65, 130)
    for m in (1, 17, 129):
        q, x, dy, _ = _case(m, n, k, torch.float32)
        parts = (q.packed, q.absmax_q, q.absmax_scale)
        y_out = torch.full((m, n), float("nan"))
        dx_out = torch.full((m, k), float("nan"))
        if backend == "triton":
            from tpkernels.kernels.triton import nf4_linear as tk

            y = tk.nf4_linear_fwd(x, *parts, q.absmax_offset.reshape(1), nf4_code(), dynamic_map(), n, out=y_out)
            dx = tk.nf4_linear_bwd(dy, *parts, q.absmax_offset.reshape(1), nf4_code(), dynamic_map(), k, out=dx_out)
        else:
            y = extension().nf4_linear_fwd_cpu(x, *parts, q.absmax_offset.reshape(1), nf4_code(), dynamic_map(), n,
                                               out=y_out)
            dx = extension().nf4_linear_bwd_cpu(dy, *parts, q.absmax_offset.reshape(1), nf4_code(), dynamic_map(), k,
                                                out=dx_out)
        assert y.data_ptr() == y_out.data_ptr() and dx.data_ptr() == dx_out.data_ptr()
        w64 = dequantize_nf4(q, torch.float64)
        assert not y.isnan().any() and not dx.isnan().any()
        assert_fa_close(y, x.double() @ w64.T, x @ w64.float().T, name=f"{backend} y M={m}")
        assert_fa_close(dx, dy.double() @ w64, dy @ w64.float(), grad=True, name=f"{backend} dx M={m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_strided_rows_and_no_bias(backend):
    k = 128
    q, _, _, _ = _case(1, 33, k, torch.float32)
    wide = torch.randn(2, 5, k + 7)
    x = wide[..., :k]  # row stride k + 7, last-dim stride 1: read in place
    xs = x.clone().requires_grad_()
    y = tpkernels.nf4_linear(x, q, backend=backend)
    assert y.shape == (2, 5, 33)
    w64 = dequantize_nf4(q, torch.float64)
    assert_fa_close(y, x.double() @ w64.T, x @ w64.float().T)
    dy = torch.randn(2, 5, 33)
    tpkernels.nf4_linear(xs, q, backend=backend).backward(dy)
    assert_fa_close(xs.grad, dy.double() @ w64, dy @ w64.float(), grad=True)
    empty = tpkernels.nf4_linear(torch.zeros(0, k), q, backend=backend)
    assert empty.shape == (0, 33)


def test_autograd_saves_the_nf4_weight_only():
    """No copy of x, no dequantised weight: the backward needs only the 0.52 B/param base."""
    q, x, dy, bias = _case(17, 130, 192, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = tpkernels.nf4_linear(x.requires_grad_(), q, bias.requires_grad_())
    assert sum(t.numel() * t.element_size() for t in saved) == q.nbytes
    y.backward(dy)


def test_dispatch_rule(monkeypatch):
    q, x, _, _ = _case(3, 17, 64, torch.float32)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    default = backends.select(OP, CPU, dtype=torch.float32, k=64)
    assert default == ("cpp" if extension() is not None else "reference")
    monkeypatch.setenv(backends.ENV_VAR, "nf4_linear=reference")
    assert backends.select(OP, CPU, dtype=torch.float32, k=64) == "reference"
    assert backends.select(OP, CPU, "cpp", dtype=torch.float32, k=64) == "cpp"  # the argument beats the env
    monkeypatch.setenv(backends.ENV_VAR, "nf4_linear=cuda")
    with pytest.raises(backends.BackendUnavailableError, match="nf4_linear has no cuda implementation"):
        tpkernels.nf4_linear(x, q)


def test_triton_refuses_k_not_a_multiple_of_64(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, x, _, _ = _case(3, 17, 130, torch.float32)
    with pytest.raises(backends.BackendUnavailableError, match=r"in_features \(K\) a multiple of 64 .*, got K = 130"):
        tpkernels.nf4_linear(x, q, backend="triton")
    assert backends.why_not("triton", OP, CPU, torch.bfloat16, k=128).startswith("the Triton interpreter runs")


def _bad_cases():
    q, x, _, bias = _case(3, 17, 64, torch.float32)
    tampered = NF4Weight(q.packed[:-1], q.absmax_q, q.absmax_scale, q.absmax_offset, q.shape, q.dtype)
    return [
        (lambda: tpkernels.nf4_linear(x.long(), q), TypeError, r"x dtype \(torch.int64\)"),
        (lambda: tpkernels.nf4_linear(torch.randn(3, 65), q), ValueError, "must end in in_features = 64"),
        (lambda: tpkernels.nf4_linear(x, dequantize_nf4(q)), TypeError, "qweight must be an NF4Weight"),
        (lambda: tpkernels.nf4_linear(x, quantize_nf4(torch.randn(64))), ValueError, "2-D"),
        (lambda: tpkernels.nf4_linear(x, tampered), ValueError, r"qweight.packed .* not an NF4Weight"),
        (lambda: tpkernels.nf4_linear(x, q, bias[:5]), ValueError, r"bias .* must be \(17,\)"),
        (lambda: tpkernels.nf4_linear(x, q, bias.half()), ValueError, r"bias .* must be \(17,\) torch.float32"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_gets_a_clear_error(case):
    call, exc, message = _bad_cases()[case]
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.skipif(extension() is None, reason="the C++ extension is not built")
def test_cpp_checks_its_inputs():
    q, x, _, _ = _case(3, 17, 64, torch.float32)
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8 CPU tensor of 544 bytes"):
        extension().nf4_linear_fwd_cpu(x, q.packed[:-1], q.absmax_q, q.absmax_scale, q.absmax_offset.reshape(1),
                                       nf4_code(), dynamic_map(), 17)


def test_custom_ops_pass_opcheck():
    q, x, dy, bias = _case(5, 17, 64, torch.float32)
    parts = (q.packed, q.absmax_q, q.absmax_scale, q.absmax_offset)
    for backend in ("", "reference"):
        torch.library.opcheck(torch.ops.tpkernels.nf4_linear_forward.default,
                              (x.requires_grad_(), *parts, 17, bias.requires_grad_(), backend))
        torch.library.opcheck(torch.ops.tpkernels.nf4_linear_forward.default, (x, *parts, 17, None, backend))
        torch.library.opcheck(torch.ops.tpkernels.nf4_linear_backward.default, (dy, *parts, 64, backend))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_on_gpu_matches_fp64(dtype):
    """The GPU path in the dtypes the interpreter cannot check (bf16), at a Llama-like shape and odd M."""
    dev = torch.device("cuda")
    for m, n, k in ((1, 4096, 4096), (129, 1000, 512), (2048, 11008, 4096)):
        q, x, dy, bias = _case(m, n, k, dtype)
        q, x, dy, bias = q.to(dev), x.to(dev), dy.to(dev), bias.to(dev)
        y64, dx64, y_lp, dx_lp = _refs(q, x, dy, bias)
        xs = x.clone().requires_grad_()
        y = tpkernels.nf4_linear(xs, q, bias)
        y.backward(dy)
        assert_fa_close(y, y64, y_lp, name=f"y {dtype} M={m}")
        assert_fa_close(xs.grad, dx64, dx_lp, grad=True, name=f"dx {dtype} M={m}")
