"""RMSNorm (with the fused residual add) and SwiGLU on every CPU backend (cpp, reference, Triton
under the interpreter): against float64 with the FlashAttention rule, outputs poisoned with NaN,
odd shapes, strided inputs, fp32/fp16 (bf16 on GPUs only), gradcheck in fp64, determinism across
thread counts, what autograd saves, opcheck and torch.compile over a pre-norm block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpkernels
from compile_checks import assert_compiled_block_matches_eager
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.functional.swiglu import _kernels as swiglu_kernels
from tpkernels.kernels import reference
from tpkernels.testing.tolerance import assert_fa_close

CPU = torch.device("cpu")
BACKENDS = [b for b in ("cpp", "reference", "triton") if backends.why_not(b, "rms_norm", CPU) is None]
NAN = float("nan")
SHAPES = [(1, 7), (17, 33), (3, 43, 129), (2, 4097), (129, 64)]  # rows × hidden, odd on purpose


def _dtypes(backend):
    return [torch.float32, torch.float16] + ([torch.float64] if backend != "triton" else [])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every row a slice of a wider row: last-dim stride 1, row stride > width."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] + 5, dtype=t.dtype)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _rms_lowp(x, w, eps, residual, dy, dh):
    """RMSNorm as eager PyTorch code writes it, in the input dtype (the FA rule's ref_lp)."""
    xs = [t.detach().clone().requires_grad_() for t in (x, w) + ((residual,) if residual is not None else ())]
    h = xs[0] + xs[2] if residual is not None else xs[0]
    hf = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    y = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)).to(h.dtype) * xs[1]
    outs, grads = [y], [dy]
    if residual is not None:
        outs.append(h)
        grads.append(dh)
    torch.autograd.backward(outs, grads)
    return y.detach(), h.detach(), xs[0].grad, xs[1].grad


def _rms_64(x, w, eps, residual, dy, dh):
    r2 = None if residual is None else residual.double().reshape(-1, x.shape[-1])
    y, h, rstd = reference.rms_norm_fwd(x.double().reshape(-1, x.shape[-1]), w.double(), eps, r2)
    hh = x.double().reshape(-1, x.shape[-1]) if h is None else h
    dx, dw = reference.rms_norm_bwd(dy.double().reshape(hh.shape), hh, w.double(), rstd,
                                    None if dh is None else dh.double().reshape(hh.shape))
    return y.view(x.shape), hh.view(x.shape), dx.view(x.shape), dw


def _launch_poisoned(backend, x, w, eps, residual, dy, dh):
    """The launchers of one backend with NaN-filled output buffers (every element must be written)."""
    shape, n = x.shape, x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    r2 = None if residual is None else residual.reshape(-1, n)
    dh2 = None if dh is None else dh.reshape(-1, n)
    y_out, h_out, dx_out = (torch.full(x2.shape, NAN, dtype=x.dtype) for _ in range(3))
    if backend == "triton":
        from tpkernels.kernels.triton import rms_norm as tk

        y, h, rstd = tk.rms_norm_fwd(x2, w, eps, r2, out=y_out, h_out=h_out if r2 is not None else None)
        hh = h if h is not None else x2
        dx, dw = tk.rms_norm_bwd(dy2, hh, w, rstd, dh2, dx_out=dx_out)
    elif backend == "cpp":
        y, h, rstd = extension().rms_norm_fwd_cpu(x2, w, eps, r2, y_out, h_out if r2 is not None else None)
        hh = h if h is not None else x2
        dx, dw = extension().rms_norm_bwd_cpu(dy2, hh, w, rstd, dh2, dx_out)
    else:
        y, h, rstd = reference.rms_norm_fwd(x2, w, eps, r2)
        hh = h if h is not None else x2
        dx, dw = reference.rms_norm_bwd(dy2, hh, w, rstd, dh2)
        return y.view(shape), hh.view(shape), dx.view(shape), dw
    assert y.data_ptr() == y_out.data_ptr() and dx.data_ptr() == dx_out.data_ptr(), "out buffers not used"
    assert rstd.dtype == torch.float32 or x.dtype == torch.float64
    return y.view(shape), hh.view(shape), dx.view(shape), dw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_float64(backend, shape, with_residual):
    for dtype in _dtypes(backend):
        if backend == "triton" and shape[-1] > 1024 and dtype == torch.float16:
            continue  # the interpreter at 4097 columns: fp32 covers the wide tile, fp16 the narrow ones
        x = torch.randn(shape, dtype=torch.float64).to(dtype)
        w = (1 + 0.5 * torch.randn(shape[-1], dtype=torch.float64)).to(dtype)
        res = torch.randn(shape, dtype=torch.float64).to(dtype) if with_residual else None
        dy = torch.randn(shape, dtype=torch.float64).to(dtype)
        dh = torch.randn(shape, dtype=torch.float64).to(dtype) if with_residual else None
        if shape[-1] == 129:
            x, dy = _strided(x), _strided(dy)  # strided rows are read in place
        ours = _launch_poisoned(backend, x, w, 1e-5, res, dy, dh)
        ref64 = _rms_64(x, w, 1e-5, res, dy, dh)
        ref_lp = _rms_lowp(x, w, 1e-5, res, dy, dh)
        rows = max(1, x.numel() // shape[-1])
        tag = f"{backend} {shape} {dtype}"
        assert_fa_close(ours[0], ref64[0], ref_lp[0], name=f"y {tag}")
        if with_residual:
            assert_fa_close(ours[1], ref64[1], ref_lp[1], name=f"h {tag}")
        assert_fa_close(ours[2], ref64[2], ref_lp[2], grad=True, ulps=8, name=f"dx {tag}")
        assert_fa_close(ours[3], ref64[3], ref_lp[3], grad=True, ulps=4 * rows ** 0.5, name=f"dweight {tag}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])  # Triton has no fp64
def test_rms_norm_gradcheck(backend):
    x = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tpkernels.rms_norm(a, b, 1e-6, backend=backend), (x, w))
    assert torch.autograd.gradcheck(lambda a, b, c: tpkernels.rms_norm(a, b, 1e-6, residual=c, backend=backend),
                                    (x, w, r))


def test_rms_norm_dweight_is_the_same_whatever_the_thread_count():
    x, dy = torch.randn(3000, 257), torch.randn(3000, 257)
    w = torch.randn(257)
    threads = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            y, _, rstd = extension().rms_norm_fwd_cpu(x, w, 1e-6)
            out.append(extension().rms_norm_bwd_cpu(dy, x, w, rstd)[1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0], out[1])


def test_rms_norm_saves_one_float_per_row_and_no_normalised_output():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tpkernels.rms_norm(x, w)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(6,), (6, 16), (16,)], shapes  # rstd, x itself (no copy), weight
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


def test_rms_norm_with_residual_is_a_prenorm_residual_step():
    # the two outputs feed a pre-norm layer: y into the sublayer, h into the next residual add
    torch.manual_seed(0)
    x, res = torch.randn(4, 9, 24, requires_grad=True), torch.randn(4, 9, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    y, h = tpkernels.rms_norm(x, w, 1e-5, residual=res)
    loss = (h + torch.tanh(y) @ torch.ones(24, 24)).square().mean()
    loss.backward()
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, res, w))
    h2 = x2 + r2
    y2 = F.rms_norm(h2, (24,), w2, 1e-5)
    ((h2 + torch.tanh(y2) @ torch.ones(24, 24)).square().mean()).backward()
    for a, b in ((y, y2), (h, h2), (x.grad, x2.grad), (res.grad, r2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, res.grad)


RMS_ERRORS = [
    (lambda: tpkernels.rms_norm(torch.randn(3, 4), torch.randn(5)), ValueError, r"weight shape \(5,\) must be \(4,\)"),
    (lambda: tpkernels.rms_norm(torch.randn(3, 4), torch.randn(4).double()), ValueError,
     r"weight \(torch.float64, cpu\) must match x \(torch.float32, cpu\)"),
    (lambda: tpkernels.rms_norm(torch.randn(3, 4), torch.randn(4), eps=-1.0), ValueError,
     r"eps \(-1.0\) must be a finite number >= 0"),
    (lambda: tpkernels.rms_norm(torch.randn(3, 4), torch.randn(4), residual=torch.randn(3, 5)), ValueError,
     r"residual \(torch.float32 \(3, 5\) on cpu\) must be a tensor like x"),
    (lambda: tpkernels.rms_norm(torch.ones(3, 4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)), TypeError,
     r"x dtype \(torch.int32\) must be float32"),
    (lambda: tpkernels.swiglu(torch.randn(3, 5)), ValueError, r"gate_up's last dim \(5\) must be even"),
    (lambda: tpkernels.swiglu(torch.randn(3, 4), torch.randn(3, 5)), ValueError, r"up \(torch.float32 \(3, 5\)"),
]


@pytest.mark.parametrize("call,exc,message", RMS_ERRORS)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_rows_too_long_for_triton_run_the_reference(monkeypatch):
    from tpkernels.kernels.triton.rms_norm import MAX_N

    if "triton" not in BACKENDS:
        pytest.skip("triton cannot run here")
    assert backends.select("rms_norm", torch.device("cuda"), dtype=torch.bfloat16, n=MAX_N) == "triton"
    assert backends.select("rms_norm", torch.device("cuda"), dtype=torch.bfloat16, n=MAX_N + 1) == "reference"
    with pytest.raises(backends.BackendUnavailableError, match=f"rows of at most {MAX_N} elements"):
        backends.select("rms_norm", CPU, "triton", dtype=torch.float32, n=MAX_N + 1)


# ---- SwiGLU ----

def _swiglu_poisoned(backend, gate, up, dy):
    """(y, dgate, dup) from one backend's kernels, outputs NaN-filled first; ``up`` None: fused input."""
    fused = up is None
    g, u = (gate[:, :gate.shape[1] // 2], gate[:, gate.shape[1] // 2:]) if fused else (gate, up)
    y = torch.full(g.shape, NAN, dtype=g.dtype)
    dgu = torch.full((g.shape[0], 2 * g.shape[1]), NAN, dtype=g.dtype)
    dg, du = dgu[:, :g.shape[1]], dgu[:, g.shape[1]:]
    fwd, bwd = swiglu_kernels(backend)
    fwd(g, u, y)
    bwd(dy, g, u, dg, du)
    return y, dg, du


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,f", [(1, 1), (17, 33), (129, 64), (5, 4097)], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-gate-up"])
def test_swiglu_matches_float64(backend, rows, f, fused):
    for dtype in _dtypes(backend):
        gu = torch.randn(rows, 2 * f, dtype=torch.float64).mul_(3).to(dtype)
        dy = torch.randn(rows, f, dtype=torch.float64).to(dtype)
        gate, up = (gu, None) if fused else (_strided(gu[:, :f].contiguous()), gu[:, f:].contiguous())
        y, dg, du = _swiglu_poisoned(backend, gate, up, dy)
        g64, u64 = gu[:, :f].double(), gu[:, f:].double()
        y64 = reference.swiglu_fwd(g64, u64)
        dg64, du64 = reference.swiglu_bwd(dy.double(), g64, u64)
        gl, ul = (gu[:, :f].clone().requires_grad_(), gu[:, f:].clone().requires_grad_())
        yl = F.silu(gl) * ul
        yl.backward(dy)
        tag = f"{backend} {rows}x{f} {dtype}"
        assert_fa_close(y, y64, yl, name=f"y {tag}")
        assert_fa_close(dg, dg64, gl.grad, grad=True, name=f"dgate {tag}")
        assert_fa_close(du, du64, ul.grad, grad=True, name=f"dup {tag}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_swiglu_gradcheck(backend):
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tpkernels.swiglu(a, b, backend=backend), (g, u))
    gu = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: tpkernels.swiglu(a, backend=backend), (gu,))


def test_swiglu_saves_only_its_inputs():
    gu = torch.randn(5, 12, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tpkernels.swiglu(gu)
    assert len(saved) == 1 and saved[0].data_ptr() == gu.data_ptr()


# ---- registration and torch.compile, inside a pre-norm Llama MLP block ----

def test_custom_ops_pass_opcheck():
    x, w, r = torch.randn(4, 3, 16), torch.randn(16), torch.randn(4, 3, 16)
    for args in ((x, w, None, 1e-6, ""), (x, w, r, 1e-5, "")):
        torch.library.opcheck(torch.ops.tpkernels.rms_norm_forward.default, args)
    y, h, rstd = torch.ops.tpkernels.rms_norm_forward(x, w, r, 1e-5, "")
    torch.library.opcheck(torch.ops.tpkernels.rms_norm_backward.default, (torch.randn_like(y), h, w, rstd, None, ""))
    gu = torch.randn(4, 3, 20)
    torch.library.opcheck(torch.ops.tpkernels.swiglu_forward.default, (gu, None, ""))
    torch.library.opcheck(torch.ops.tpkernels.swiglu_forward.default, (gu[..., :10], gu[..., 10:], ""))


class LlamaMLPBlock(torch.nn.Module):
    """h, y = rms_norm(x, residual); out = h + down(swiglu(gate_up(y))): a pre-norm residual MLP step."""

    def __init__(self, hidden=32, ffn=48):
        super().__init__()
        self.norm_w = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, residual):
        y, h = tpkernels.rms_norm(x, self.norm_w, 1e-5, residual=residual)
        return h + self.down(tpkernels.swiglu(self.gate_up(y)))


def test_torch_compile_fullgraph_over_a_prenorm_block():
    torch.manual_seed(0)
    assert_compiled_block_matches_eager(LlamaMLPBlock(), torch.randn(2, 7, 32), torch.randn(2, 7, 32))
