"""Grouped GEMM and the grouped SwiGLU expert MLP (tpkernels/functional/grouped_gemm.py): every backend
against float64 per-expert matmuls (the FlashAttention tolerance rule), odd expert counts, empty experts,
odd sizes; forward, dX and dW; the Triton kernels with NaN-poisoned outputs."""

import pytest
import torch

from tpkernels.functional.grouped_gemm import grouped_gemm, grouped_swiglu_mlp
from tpkernels.testing.tolerance import assert_fa_close

BACKENDS = ["reference", "triton"]
# (rows per expert; 0 = an empty expert), K, M
CASES = [([1], 17, 33), ([5, 0, 12], 17, 33), ([0, 3, 1, 0, 40, 7, 0], 16, 9)]


def _per_expert(x, w, counts, fn=lambda a, b: a @ b):
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(fn(x[start:start + c], w[e]))
        start += c
    return torch.cat(out)


def _mlp(x, wgu, wd, counts):
    f = wgu.shape[2] // 2

    def expert(a, e_w):
        gu = a @ e_w[0]
        return (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]) @ e_w[1]
    return _per_expert(x, list(zip(wgu, wd)), counts, expert)


def _leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_(True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts,k,m", CASES)
def test_grouped_gemm_against_per_expert_matmuls(backend, counts, k, m):
    e, n = len(counts), sum(counts)
    x, w = torch.randn(n, k, dtype=torch.float64), torch.randn(e, k, m, dtype=torch.float64) / k ** 0.5
    g = torch.randn(n, m, dtype=torch.float64)
    c = torch.tensor(counts)
    x64, w64 = _leaf(x, torch.float64), _leaf(w, torch.float64)
    ref64 = _per_expert(x64, w64, counts)
    (ref64 * g).sum().backward()
    for dtype in (torch.float32, torch.float16):
        xl, wl = _leaf(x, dtype), _leaf(w, dtype)
        y = grouped_gemm(xl, wl, c, backend=backend)
        xr, wr = _leaf(x, dtype), _leaf(w, dtype)
        ref_lp = _per_expert(xr, wr, counts)
        assert_fa_close(y, ref64, ref_lp, name=f"y {dtype}")
        (y * g.to(dtype)).sum().backward()
        (ref_lp * g.to(dtype)).sum().backward()
        assert_fa_close(xl.grad, x64.grad, xr.grad, grad=True, name=f"dx {dtype}")
        assert_fa_close(wl.grad, w64.grad, wr.grad, grad=True, name=f"dw {dtype}")
        for ex in range(e):
            if counts[ex] == 0:
                assert torch.equal(wl.grad[ex], torch.zeros_like(wl.grad[ex])), "an empty expert's dw is 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts,h,f", [([3], 17, 33), ([0, 9, 2], 8, 5), ([4, 0, 1, 13, 0, 2, 6], 16, 16)])
def test_grouped_swiglu_mlp_against_per_expert_mlps(backend, counts, h, f):
    e, n = len(counts), sum(counts)
    x = torch.randn(n, h, dtype=torch.float64)
    wgu = torch.randn(e, h, 2 * f, dtype=torch.float64) / h ** 0.5
    wd = torch.randn(e, f, h, dtype=torch.float64) / f ** 0.5
    g = torch.randn(n, h, dtype=torch.float64)
    c = torch.tensor(counts)
    leaves64 = [_leaf(t, torch.float64) for t in (x, wgu, wd)]
    ref64 = _mlp(*leaves64, counts)
    (ref64 * g).sum().backward()
    for dtype in (torch.float32, torch.float16):
        ours = [_leaf(t, dtype) for t in (x, wgu, wd)]
        lp = [_leaf(t, dtype) for t in (x, wgu, wd)]
        y = grouped_swiglu_mlp(*ours, c, backend=backend)
        ref_lp = _mlp(*lp, counts)
        assert_fa_close(y, ref64, ref_lp, name=f"y {dtype}")
        (y * g.to(dtype)).sum().backward()
        (ref_lp * g.to(dtype)).sum().backward()
        for name, a, b, r in zip(("dx", "dw_gate_up", "dw_down"), ours, leaves64, lp):
            assert_fa_close(a.grad, b.grad, r.grad, grad=True, name=f"{name} {dtype}")


def test_fullgraph_compile_and_opcheck():
    counts = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, 6, requires_grad=True)
    compiled = torch.compile(lambda a, b: grouped_gemm(a, b, counts), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), grouped_gemm(x, w, counts))
    torch.library.opcheck(torch.ops.tpkernels.grouped_gemm.default, (x, w, counts, ""))
    wgu, wd = torch.randn(3, 4, 6, requires_grad=True), torch.randn(3, 3, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.tpkernels.grouped_swiglu_mlp.default, (x, wgu, wd, counts, ""))


@pytest.mark.parametrize("call,match", [
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([2, 2])),
     r"counts \(\[2, 2\]\) must be >= 0 and sum to x.shape\[0\] \(5\)"),
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([6, -1])), r"got min -1"),
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([5])),
     r"counts has 1 entries, w has 2 experts"),
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 3, 3), torch.tensor([2, 3])),
     r"w.shape\[1\] \(3\) must equal x.shape\[1\] \(4\)"),
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 3).double(), torch.tensor([2, 3])),
     r"must have x's dtype"),
    (lambda: grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([2.0, 3.0])),
     r"counts must be a 1-D integer tensor"),
    (lambda: grouped_swiglu_mlp(torch.randn(5, 4), torch.randn(2, 4, 5), torch.randn(2, 2, 4), torch.tensor([2, 3])),
     r"w_gate_up's last dim \(5\) must be even"),
    (lambda: grouped_swiglu_mlp(torch.randn(5, 4), torch.randn(2, 4, 6), torch.randn(2, 2, 4), torch.tensor([2, 3])),
     r"w_down's shape \(2, 2, 4\) must start with \(experts, ffn\) = \(2, 3\)"),
])
def test_bad_inputs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_triton_tile_table_and_nan_poisoned_outputs():
    """Every output element is written (NaN-filled buffers come back finite), empty experts own no tile and
    get a zero dW, and the transposed read (dX) and the SwiGLU epilogue match the per-expert math."""
    from tpkernels.kernels import reference
    from tpkernels.kernels.triton import grouped_gemm as tk

    counts = [0, 3, 1, 0, 40, 7, 0]
    c = torch.tensor(counts)
    tile_expert, tile_row, ends, slots = tk.tile_table(c, sum(counts), 16)
    live = tile_expert >= 0
    assert slots == 4 + 7 and tile_expert[live].tolist() == [1, 2, 4, 4, 4, 5]
    assert tile_row[live].tolist() == [0, 3, 4, 20, 36, 44] and ends.tolist() == [0, 3, 4, 4, 44, 51, 51]
    n, k, m = sum(counts), 17, 10
    x, w = torch.randn(n, k), torch.randn(7, k, m)
    out = tk.grouped_gemm(x, w, c, out=torch.full((n, m), float("nan")))
    torch.testing.assert_close(out, reference.grouped_gemm(x, w, counts), rtol=1e-5, atol=1e-5)
    dy = torch.randn(n, m)
    dx = tk.grouped_gemm(dy, w, c, trans_w=True, out=torch.full((n, k), float("nan")))
    torch.testing.assert_close(dx, reference.grouped_gemm(dy, w, counts, trans_w=True), rtol=1e-5, atol=1e-5)
    dw = tk.grouped_wgrad(x, dy, c, out=torch.full((7, k, m), float("nan")))
    torch.testing.assert_close(dw, reference.grouped_gemm_wgrad(x, dy, counts), rtol=1e-5, atol=1e-5)
    assert torch.equal(dw[[0, 3, 6]], torch.zeros(3, k, m))
    h = tk.grouped_gemm(x, w, c, swiglu=True, out=torch.full((n, m // 2), float("nan")))
    torch.testing.assert_close(h, reference.grouped_swiglu_gemm(x, w, counts), rtol=1e-5, atol=1e-5)
    # device counts are not read on the host: counts past the rows that exist are cut, never read out of bounds
    cut = tk.rows_within(c, 40)
    assert cut.tolist() == [0, 3, 1, 0, 36, 0, 0]
    torch.testing.assert_close(tk.grouped_gemm(x[:40], w, c), reference.grouped_gemm(x[:40], w, cut.tolist()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tk.grouped_wgrad(x[:40], dy[:40], c),
                               reference.grouped_gemm_wgrad(x[:40], dy[:40], cut.tolist()), rtol=1e-5, atol=1e-5)
    # the backward's fused epilogue: d[gate | up] and h from dh = dY·W_downᵀ and the recomputed [gate | up]
    gu, w_down = torch.randn(n, m), torch.randn(7, m // 2, k)
    dgu, h2 = tk.grouped_dswiglu(x, w_down, gu, c, out=(torch.full((n, m), float("nan")),
                                                         torch.full((n, m // 2), float("nan"))))
    dh = reference.grouped_gemm(x, w_down, counts, trans_w=True)
    dg, du = reference.swiglu_bwd(dh, gu[:, :m // 2], gu[:, m // 2:])
    torch.testing.assert_close(dgu, torch.cat([dg, du], 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, reference.swiglu_fwd(gu[:, :m // 2], gu[:, m // 2:]), rtol=1e-5, atol=1e-5)


def test_the_dispatch_rule(monkeypatch):
    """Argument > TPKERNELS_BACKEND (op entry > bare name) > default; a choice that cannot run is named."""
    from tpkernels import backends
    from tpkernels.backends import BackendUnavailableError

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for op in ("grouped_gemm", "moe_permute"):
        assert backends.select(op, cpu, dtype=torch.float32) == "reference"  # CPU default: no C++ kernel
        assert backends.select(op, cuda, dtype=torch.bfloat16) == "triton"
    # float32 CUDA tensors: cuBLAS per expert (a Triton fp32 dot would be TF32 or FMA)
    assert backends.select("grouped_gemm", cuda, dtype=torch.float32) == "reference"
    assert "bfloat16" in backends.why_not("triton", "grouped_gemm", cuda, torch.float32)
    x, w, c = torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 3])
    monkeypatch.setenv(backends.ENV_VAR, "grouped_gemm=triton")
    ref = grouped_gemm(x, w, c, backend="reference")
    torch.testing.assert_close(grouped_gemm(x, w, c), ref)  # runs the interpreter's kernel
    with pytest.raises(BackendUnavailableError, match=r"TPKERNELS_BACKEND=grouped_gemm=triton cannot run .*float64"):
        grouped_gemm(x.double(), w.double(), c)
    with pytest.raises(BackendUnavailableError, match=r"op grouped_gemm has no cpp implementation"):
        grouped_gemm(x, w, c, backend="cpp")


@pytest.mark.cuda
def test_gpu_bf16_grouped_gemm_mlp_and_permutation_against_float64():
    """The compiled kernels (bf16 is GPU-only: the interpreter computes it on raw bits) at the production tile
    sizes: uneven experts, empty ones, an expert larger than one tile; weights in transformers' transposed
    layout (strided reads)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    counts = [0, 300, 17, 1000, 0, 5, 129, 64]
    e, n, h, f = len(counts), sum(counts), 512, 384
    c = torch.tensor(counts, device=dev)
    x = torch.randn(n, h, device=dev, dtype=torch.float64)
    wgu = (torch.randn(e, 2 * f, h, device=dev, dtype=torch.float64) / h ** 0.5).transpose(1, 2)
    wd = (torch.randn(e, h, f, device=dev, dtype=torch.float64) / f ** 0.5).transpose(1, 2)
    g = torch.randn(n, h, device=dev, dtype=torch.float64)
    leaves64 = [t.detach().requires_grad_(True) for t in (x, wgu, wd)]
    ref64 = _mlp(*leaves64, counts)
    (ref64 * g).sum().backward()
    ours = [t.detach().to(dtype).requires_grad_(True) for t in (x, wgu, wd)]
    lp = [t.detach().to(dtype).requires_grad_(True) for t in (x, wgu, wd)]
    y = grouped_swiglu_mlp(*ours, c, backend="triton")
    ref_lp = _mlp(*lp, counts)
    assert_fa_close(y, ref64, ref_lp, name="mlp y")
    (y * g.to(dtype)).sum().backward()
    (ref_lp * g.to(dtype)).sum().backward()
    for name, a, b, r in zip(("dx", "dw_gate_up", "dw_down"), ours, leaves64, lp):
        assert_fa_close(a.grad, b.grad, r.grad, grad=True, name=name)
    from tpkernels.functional.moe_permute import permute, unpermute

    t, k = 777, 2
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(dev)
    experts[torch.rand(t, k, device=dev) < 0.1] = -1
    xt = torch.randn(t, h, device=dev, dtype=dtype)
    xs, cnt, row_map = permute(xt, experts, e, backend="triton")
    assert torch.equal(xs, xt[row_map // k]) and int(cnt.sum()) == xs.shape[0]
    w = torch.rand(t, k, device=dev)
    out = unpermute(xs, row_map, w, t, backend="triton")
    ref = torch.zeros(t, h, device=dev, dtype=torch.float64).index_add_(
        0, row_map // k, xs.double() * w.reshape(-1)[row_map, None].double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
