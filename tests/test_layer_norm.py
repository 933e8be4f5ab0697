"""LayerNorm (GPT-2), with the fused residual add and an optional bias, on every CPU backend (cpp,
reference, Triton under the interpreter): against float64 with the FlashAttention rule, outputs
poisoned with NaN, odd shapes, strided inputs, fp32/fp16 (+ bf16 on the C++ path; Triton's bf16 on
GPUs only), gradcheck in fp64, a large mean (the two-pass variance), determinism across thread
counts, what autograd saves, the dispatch rule, named errors, opcheck and torch.compile over a
GPT-2 pre-norm block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpkernels
from compile_checks import assert_compiled_block_matches_eager
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.kernels import reference
from tpkernels.testing.tolerance import assert_fa_close

CPU = torch.device("cpu")
OP = "layer_norm"
BACKENDS = [b for b in ("cpp", "reference", "triton") if backends.why_not(b, OP, CPU) is None]
NAN = float("nan")
EPS = 1e-5
ROWS, HIDDEN = (1, 17, 129), (1, 7, 96, 1023, 4097)  # odd on purpose
# the interpreter runs one program at a time: a subset of the cross product, every tile width
TRITON_SHAPES = [(1, 1), (17, 7), (129, 96), (17, 1023), (2, 4097), (1, 4097)]


def _shapes(backend):
    if backend == "triton":
        return TRITON_SHAPES
    return [(r, n) for r in ROWS for n in HIDDEN]


def _dtypes(backend):
    if backend == "triton":
        return [torch.float32, torch.float16]
    return [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every row a slice of a wider row: last-dim stride 1, row stride > width."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] + 5, dtype=t.dtype)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _inputs(shape, dtype, with_residual, with_bias, offset=0.0):
    n = shape[-1]
    x = (torch.randn(shape, dtype=torch.float64) + offset).to(dtype)
    w = (1 + 0.5 * torch.randn(n, dtype=torch.float64)).to(dtype)
    b = torch.randn(n, dtype=torch.float64).to(dtype) if with_bias else None
    res = torch.randn(shape, dtype=torch.float64).to(dtype) if with_residual else None
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    dh = torch.randn(shape, dtype=torch.float64).to(dtype) if with_residual else None
    return x, w, b, res, dy, dh


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _ln_lowp(x, w, b, residual, dy, dh):
    """LayerNorm as eager PyTorch runs it (h = x + residual, then F.layer_norm) in the input dtype: the
    FA rule's ref_lp. -> (y, h, dx, dweight, dbias); without a bias, dbias is Σ dy (what the kernels
    compute and the functional layer drops)."""
    xs, ws, bs, rs = map(_leaf, (x, w, b, residual))
    h = xs + rs if rs is not None else xs
    y = F.layer_norm(h, (x.shape[-1],), ws, bs, EPS)
    outs, grads = [y], [dy]
    if rs is not None:
        outs.append(h)
        grads.append(dh)
    torch.autograd.backward(outs, grads)
    db = bs.grad if bs is not None else dy.reshape(-1, x.shape[-1]).sum(0)
    return y.detach(), h.detach(), xs.grad, ws.grad, db


def _ln_64(x, w, b, residual, dy, dh):
    n = x.shape[-1]
    r2 = None if residual is None else residual.double().reshape(-1, n)
    y, h, mean, rstd = reference.layer_norm_fwd(x.double().reshape(-1, n), w.double(),
                                                None if b is None else b.double(), EPS, r2)
    hh = x.double().reshape(-1, n) if h is None else h
    dx, dw, db = reference.layer_norm_bwd(dy.double().reshape(hh.shape), hh, w.double(), mean, rstd,
                                          None if dh is None else dh.double().reshape(hh.shape))
    return y.view(x.shape), hh.view(x.shape), dx.view(x.shape), dw, db, rstd.max().item()


def _launch_poisoned(backend, x, w, b, residual, dy, dh):
    """The launchers of one backend with NaN-filled output buffers (every element must be written)."""
    shape, n = x.shape, x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    r2 = None if residual is None else residual.reshape(-1, n)
    dh2 = None if dh is None else dh.reshape(-1, n)
    y_out, h_out, dx_out = (torch.full(x2.shape, NAN, dtype=x.dtype) for _ in range(3))
    h_out = h_out if r2 is not None else None
    if backend == "triton":
        from tpkernels.kernels.triton import layer_norm as tk

        y, h, mean, rstd = tk.layer_norm_fwd(x2, w, b, EPS, r2, out=y_out, h_out=h_out)
        hh = h if h is not None else x2
        dx, dw, db = tk.layer_norm_bwd(dy2, hh, w, mean, rstd, dh2, dx_out=dx_out)
    elif backend == "cpp":
        y, h, mean, rstd = extension().layer_norm_fwd_cpu(x2, w, b, EPS, r2, y_out, h_out)
        hh = h if h is not None else x2
        dx, dw, db = extension().layer_norm_bwd_cpu(dy2, hh, w, mean, rstd, dh2, dx_out)
    else:
        y, h, mean, rstd = reference.layer_norm_fwd(x2, w, b, EPS, r2)
        hh = h if h is not None else x2
        dx, dw, db = reference.layer_norm_bwd(dy2, hh, w, mean, rstd, dh2)
        return y.view(shape), hh.view(shape), dx.view(shape), dw, db
    assert y.data_ptr() == y_out.data_ptr() and dx.data_ptr() == dx_out.data_ptr(), "out buffers not used"
    if r2 is not None:
        assert h.data_ptr() == h_out.data_ptr()
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert mean.dtype == rstd.dtype == stat and mean.shape == rstd.shape == (x2.shape[0],)
    return y.view(shape), hh.view(shape), dx.view(shape), dw, db


def _compare(ours, ref64, ref_lp, tag, rows, with_residual):
    assert_fa_close(ours[0], ref64[0], ref_lp[0], name=f"y {tag}")
    if with_residual:
        assert_fa_close(ours[1], ref64[1], ref_lp[1], name=f"h {tag}")
    # dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)): its terms are rstd · |g| large, so the rounding of
    # g = dy · w comes out rstd times larger in dx (FMA contraction rounds g once in one pass and not
    # in the other). Rows of near-constant h (hidden 1: rstd = 1/sqrt(eps) ≈ 316) widen the floor.
    assert_fa_close(ours[2], ref64[2], ref_lp[2], grad=True, ulps=8 * max(1.0, ref64[5]), name=f"dx {tag}")
    assert_fa_close(ours[3], ref64[3], ref_lp[3], grad=True, ulps=4 * rows ** 0.5, name=f"dweight {tag}")
    assert_fa_close(ours[4], ref64[4], ref_lp[4], grad=True, ulps=4 * rows ** 0.5, name=f"dbias {tag}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_layer_norm_matches_float64(backend, with_residual, with_bias):
    for shape in _shapes(backend):
        for dtype in _dtypes(backend):
            if backend == "triton" and shape[-1] > 1024 and dtype == torch.float16:
                continue  # the interpreter at 4097 columns: fp32 covers the wide tile, fp16 the narrow ones
            x, w, b, res, dy, dh = _inputs(shape, dtype, with_residual, with_bias)
            if shape[-1] == 1023:
                x, dy = _strided(x), _strided(dy)  # strided rows are read in place
            ours = _launch_poisoned(backend, x, w, b, res, dy, dh)
            _compare(ours, _ln_64(x, w, b, res, dy, dh), _ln_lowp(x, w, b, res, dy, dh),
                     f"{backend} {shape} {dtype}", shape[0], with_residual)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_a_large_mean(backend):
    """(batch, seq, hidden) through the public function; rows with |mean| = 300 std: a one-pass
    Σh² − n·mean² variance would lose most of fp32's digits here."""
    for dtype in (torch.float32,) + ((torch.float64,) if backend != "triton" else ()):
        x, w, b, res, dy, dh = _inputs((3, 43, 96), dtype, True, True, offset=300.0)
        leaves = [t.clone().requires_grad_() for t in (x, w, b, res)]
        y, h = tpkernels.layer_norm(*leaves[:3], EPS, residual=leaves[3], backend=backend)
        torch.autograd.backward([y, h], [dy, dh])
        ref64 = _ln_64(x, w, b, res, dy, dh)
        ref_lp = _ln_lowp(x, w, b, res, dy, dh)
        grads = [t.grad for t in leaves]
        ours = (y, h, grads[0], grads[1], grads[2])
        _compare(ours, ref64, ref_lp, f"{backend} offset {dtype}", 3 * 43, True)
        assert torch.equal(grads[0], grads[3])  # x and residual get the same gradient


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])  # Triton has no fp64
def test_layer_norm_gradcheck(backend):
    x = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    ln = tpkernels.layer_norm
    assert torch.autograd.gradcheck(lambda a, c, d: ln(a, c, d, 1e-5, backend=backend), (x, w, b))
    assert torch.autograd.gradcheck(lambda a, c: ln(a, c, None, 1e-5, backend=backend), (x, w))
    assert torch.autograd.gradcheck(lambda a: ln(a, None, None, 1e-5, backend=backend), (x,))
    assert torch.autograd.gradcheck(lambda a, c, d, e: ln(a, c, d, 1e-5, residual=e, backend=backend), (x, w, b, r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_weight_or_bias_it_is_torchs_layer_norm(backend):
    x = torch.randn(4, 5, 33, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(4, 5, 33)
    y = tpkernels.layer_norm(x, backend=backend)
    y.backward(g)
    y2 = F.layer_norm(x2, (33,))
    y2.backward(g)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_dweight_and_dbias_are_the_same_whatever_the_thread_count():
    x, dy = torch.randn(3000, 257), torch.randn(3000, 257)
    w, b = torch.randn(257), torch.randn(257)
    threads = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            y, _, mean, rstd = extension().layer_norm_fwd_cpu(x, w, b, 1e-5)
            out.append((y,) + extension().layer_norm_bwd_cpu(dy, x, w, mean, rstd))
    finally:
        torch.set_num_threads(threads)
    for a, c in zip(*out):
        assert torch.equal(a, c)


def test_saves_two_floats_per_row_and_no_normalised_output():
    x = torch.randn(6, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tpkernels.layer_norm(x, w, b)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(6,), (6,), (6, 16), (16,)], shapes  # mean, rstd, x itself (no copy), weight
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


def test_with_residual_is_a_prenorm_residual_step():
    # the two outputs feed a pre-norm layer: y into the sublayer, h into the next residual add
    x, res = torch.randn(4, 9, 24, requires_grad=True), torch.randn(4, 9, 24, requires_grad=True)
    w, b = torch.randn(24, requires_grad=True), torch.randn(24, requires_grad=True)
    y, h = tpkernels.layer_norm(x, w, b, 1e-5, residual=res)
    loss = (h + torch.tanh(y) @ torch.ones(24, 24)).square().mean()
    loss.backward()
    x2, r2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, res, w, b))
    h2 = x2 + r2
    y2 = F.layer_norm(h2, (24,), w2, b2, 1e-5)
    ((h2 + torch.tanh(y2) @ torch.ones(24, 24)).square().mean()).backward()
    for a, c in ((y, y2), (h, h2), (x.grad, x2.grad), (res.grad, r2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, res.grad)


# ---- the dispatch rule ----

def test_dispatch_rule(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert OP in backends.registered_ops() and backends.registered_ops()[OP] == ("triton", "cpp", "reference")
    x, w = torch.randn(3, 8), torch.randn(8)
    ran = []
    for name in ("layer_norm_fwd", "layer_norm_bwd"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    default = "cpp" if extension() is not None else "reference"
    assert backends.select(OP, CPU, dtype=torch.float32, n=8) == default
    monkeypatch.setenv(backends.ENV_VAR, "layer_norm=reference")  # the environment beats the default
    tpkernels.layer_norm(x.requires_grad_(), w).sum().backward()
    assert ran == ["layer_norm_fwd", "layer_norm_bwd"]
    ran.clear()
    if extension() is not None:  # an explicit argument beats the environment
        tpkernels.layer_norm(x, w, backend="cpp").sum().backward()
        assert ran == []
    monkeypatch.setenv(backends.ENV_VAR, "rms_norm=reference")  # another op's entry does not touch this one
    assert backends.select(OP, CPU, dtype=torch.float32, n=8) == default
    # a forced backend that cannot run says why, naming the op and where the choice came from
    monkeypatch.setenv(backends.ENV_VAR, "layer_norm=cuda")
    with pytest.raises(backends.BackendUnavailableError,
                       match=r"TPKERNELS_BACKEND=layer_norm=cuda cannot run layer_norm on cpu .*"
                             r"op layer_norm has no cuda implementation \(it has: triton, cpp, reference\)"):
        tpkernels.layer_norm(x, w)
    monkeypatch.delenv(backends.ENV_VAR)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(backends.BackendUnavailableError, match=r"backend argument cannot run layer_norm on cpu "
                                                               r"\(torch.float32\): Triton kernels need CUDA tensors"):
        tpkernels.layer_norm(x, w, backend="triton")


def test_triton_limits_are_part_of_the_rule(monkeypatch):
    from tpkernels.kernels.triton.layer_norm import MAX_N

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.why_not("triton", OP, CPU) is not None:
        pytest.skip("triton cannot run here")
    cuda = torch.device("cuda")
    assert backends.select(OP, cuda, dtype=torch.bfloat16, n=MAX_N) == "triton"
    assert backends.select(OP, cuda, dtype=torch.bfloat16, n=MAX_N + 1) == "reference"
    assert backends.select(OP, cuda, dtype=torch.float64, n=64) == "reference"
    with pytest.raises(backends.BackendUnavailableError, match=f"rows of at most {MAX_N} elements"):
        backends.select(OP, CPU, "triton", dtype=torch.float32, n=MAX_N + 1)
    with pytest.raises(backends.BackendUnavailableError, match="the Triton interpreter runs float16 and float32"):
        tpkernels.layer_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16),
                             backend="triton")


LN_ERRORS = [
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), torch.randn(5)), ValueError, r"weight shape \(5,\) must be \(4,\)"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), torch.randn(4), torch.randn(3)), ValueError,
     r"bias shape \(3,\) must be \(4,\), the last dim of x"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), torch.randn(4), torch.randn(4).half()), ValueError,
     r"bias \(torch.float16, cpu\) must match x \(torch.float32, cpu\)"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), torch.randn(4, 1)), ValueError, r"weight shape \(4, 1\)"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), [1.0] * 4), TypeError,
     r"x and weight must be tensors, got Tensor and list"),
    (lambda: tpkernels.layer_norm(torch.ones(3, 4, dtype=torch.int32)), TypeError,
     r"x dtype \(torch.int32\) must be float32, float16, bfloat16 or float64"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 0)), ValueError, r"x must be \(..., hidden\) with hidden >= 1"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), eps=float("nan")), ValueError,
     r"eps \(nan\) must be a finite number >= 0"),
    (lambda: tpkernels.layer_norm(torch.randn(3, 4), residual=torch.randn(4, 4)), ValueError,
     r"residual \(torch.float32 \(4, 4\) on cpu\) must be a tensor like x"),
]


@pytest.mark.parametrize("call,exc,message", LN_ERRORS)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.skipif(extension() is None, reason="tpkernels._C is not built")
def test_cpp_entry_points_name_bad_arguments():
    ext, x = extension(), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"layer_norm: dtype Int is not supported on the CPU"):
        ext.layer_norm_fwd_cpu(x.int(), torch.ones(4, dtype=torch.int32), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"layer_norm: bias must be a contiguous Float CPU tensor of shape \(4,\)"):
        ext.layer_norm_fwd_cpu(x, torch.ones(4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match=r"layer_norm: eps \(-1\) must be a finite number >= 0"):
        ext.layer_norm_fwd_cpu(x, torch.ones(4), None, -1.0)
    _, _, mean, rstd = ext.layer_norm_fwd_cpu(x, torch.ones(4), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"layer_norm backward: mean must be a contiguous Float CPU tensor of shape"):
        ext.layer_norm_bwd_cpu(x, x, torch.ones(4), mean.double(), rstd)
    with pytest.raises(RuntimeError, match=r"layer_norm backward: dy must be 2-D of shape \[3, 4\]"):
        ext.layer_norm_bwd_cpu(x[:2], x, torch.ones(4), mean, rstd)


# ---- registration and torch.compile, inside a GPT-2 pre-norm MLP block ----

def test_custom_ops_pass_opcheck():
    x, w, b, r = torch.randn(4, 3, 16), torch.randn(16), torch.randn(16), torch.randn(4, 3, 16)
    for args in ((x, w, b, None, 1e-5, ""), (x, w, b, r, 1e-5, ""), (x, None, None, r, 1e-6, ""),
                 (x, w, None, None, 1e-5, "reference")):
        torch.library.opcheck(torch.ops.tpkernels.layer_norm_forward.default, args)
    y, h, mean, rstd = torch.ops.tpkernels.layer_norm_forward(x, w, b, r, 1e-5, "")
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.tpkernels.layer_norm_backward.default, (dy, h, w, mean, rstd, None, ""))
    torch.library.opcheck(torch.ops.tpkernels.layer_norm_backward.default, (dy, h, None, mean, rstd, dy, ""))


class GPT2MLPBlock(torch.nn.Module):
    """y, h = layer_norm(x, residual); out = h + proj(bias_gelu(fc(y))): a pre-norm residual MLP step."""

    def __init__(self, hidden=32, ffn=48):
        super().__init__()
        self.ln_w = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.ln_b = torch.nn.Parameter(0.1 * torch.randn(hidden))
        self.fc = torch.nn.Linear(hidden, ffn, bias=False)
        self.fc_b = torch.nn.Parameter(0.1 * torch.randn(ffn))
        self.proj = torch.nn.Linear(ffn, hidden)

    def forward(self, x, residual):
        y, h = tpkernels.layer_norm(x, self.ln_w, self.ln_b, 1e-5, residual=residual)
        return h + self.proj(tpkernels.bias_gelu(self.fc(y), self.fc_b, "tanh"))


def test_torch_compile_fullgraph_over_a_prenorm_block():
    assert_compiled_block_matches_eager(GPT2MLPBlock(), torch.randn(2, 7, 32), torch.randn(2, 7, 32))


# ---- on a GPU: bf16 and fp16 through the Triton kernels (the interpreter computes bf16 wrongly) ----

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("rows,n", [(1, 7), (4099, 1600), (333, 8192), (17, 8193)], ids=str)
def test_layer_norm_on_gpu(dtype, rows, n):
    x, w, b, res, dy, dh = (t.cuda() for t in _inputs((rows, n), dtype, True, True, offset=2.0))
    leaves = [t.clone().requires_grad_() for t in (x, w, b, res)]
    y, h = tpkernels.layer_norm(*leaves[:3], EPS, residual=leaves[3])  # n = 8193: the reference path
    assert backends.select(OP, x.device, dtype=dtype, n=n) == ("triton" if n <= 8192 else "reference")
    torch.autograd.backward([y, h], [dy, dh])
    ref64 = _ln_64(x, w, b, res, dy, dh)
    ref_lp = _ln_lowp(x, w, b, res, dy, dh)
    ours = (y, h, leaves[0].grad, leaves[1].grad, leaves[2].grad)
    _compare(ours, ref64, ref_lp, f"cuda {rows}x{n} {dtype}", rows, True)
