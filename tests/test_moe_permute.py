"""MoE token permutation (tpkernels/functional/moe_permute.py): every backend against a brute-force
float64 oracle, with dropped slots, empty experts, odd expert counts and odd sizes; gradients for x,
y_sorted and the router weights; the Triton kernels with NaN-poisoned outputs."""

import pytest
import torch

from tpkernels.functional.moe_permute import permute, unpermute
from tpkernels.testing.tolerance import assert_fa_close

BACKENDS = ["reference", "triton"]


def _experts(t, k, e, drop=0.0):
    """(t, k) distinct experts per token, some ids left out entirely (empty experts), some slots dropped."""
    live = max(1, e - 1) if e > 2 else e  # the last expert gets no token when e > 2
    ids = torch.stack([torch.randperm(live)[:k] for _ in range(t)]) if k <= live else \
        torch.randint(0, live, (t, k))
    if drop:
        ids[torch.rand(t, k) < drop] = -1
    return ids


def _oracle_permute(x, experts, e):
    rows, slots = [], []
    k = experts.shape[1]
    for ex in range(e):
        for t in range(experts.shape[0]):
            for j in range(k):
                if experts[t, j] == ex:
                    rows.append(x[t])
                    slots.append(t * k + j)
    counts = torch.bincount(experts[experts >= 0].reshape(-1), minlength=e)
    xs = torch.stack(rows) if rows else x.new_empty(0, x.shape[1])
    return xs, counts, torch.tensor(slots, dtype=torch.int64)


def _oracle_unpermute(ys, row_map, w, t):
    out = torch.zeros(t, ys.shape[1], dtype=torch.float64)
    k = w.shape[1]
    for i, s in enumerate(row_map.tolist()):
        out[s // k] += w[s // k, s % k].double() * ys[i].double()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,k,e,h,drop", [(1, 1, 1, 17, 0.0), (29, 2, 3, 17, 0.3), (129, 3, 7, 8, 0.1)])
def test_permute_unpermute_against_oracle(backend, t, k, e, h, drop):
    x = torch.randn(t, h, dtype=torch.float64)
    experts = _experts(t, k, e, drop)
    xs_ref, counts_ref, map_ref = _oracle_permute(x, experts, e)
    w = torch.rand(t, k, dtype=torch.float32)
    for dtype in (torch.float32, torch.float16):
        xl = x.to(dtype).requires_grad_(True)
        xs, counts, row_map = permute(xl, experts, e, backend=backend)
        assert torch.equal(counts, counts_ref) and torch.equal(row_map, map_ref)
        assert torch.equal(xs, xs_ref.to(dtype))  # a gather is exact
        ys = torch.randn(xs.shape, dtype=torch.float64)
        ysl = ys.to(dtype).requires_grad_(True)
        wl = w.clone().requires_grad_(True)
        y = unpermute(ysl, row_map, wl, t, backend=backend)
        # oracle in float64 and the same math in the low precision dtype (the yardstick)
        ys64, w64 = ys.clone().requires_grad_(True), w.double().requires_grad_(True)
        ref64 = _oracle_unpermute(ys64, row_map, w64, t)
        ref_lp = _oracle_unpermute(ys.to(dtype), row_map, w, t).to(dtype)
        assert_fa_close(y, ref64, ref_lp, name=f"unpermute {dtype}")
        g = torch.randn(t, h, dtype=torch.float64)
        (y.double() * g).sum().backward()
        (ref64 * g).sum().backward()
        dys_lp = (g.to(dtype)[row_map // k].double() * w.reshape(-1)[row_map, None].double()).to(dtype)
        assert_fa_close(ysl.grad, ys64.grad, dys_lp, grad=True, name="d y_sorted")
        # d weights[slot] = dout[token] · y_sorted[row]: the same dot in the low precision dtype is the yardstick
        dw_lp = torch.zeros(t * k, dtype=dtype)
        dw_lp[row_map] = (g.to(dtype)[row_map // k] * ys.to(dtype)).sum(-1)
        assert_fa_close(wl.grad, w64.grad, dw_lp.view(t, k), grad=True, name="d weights", floor_dtype=dtype)
        # permute's backward: each token sums its copies' gradients
        gs = torch.randn(xs.shape, dtype=torch.float64)
        (xs.double() * gs).sum().backward()
        dx64 = torch.zeros_like(x).index_add_(0, row_map // k, gs)
        dx_lp = torch.zeros(x.shape, dtype=dtype).index_add_(0, row_map // k, gs.to(dtype))
        assert_fa_close(xl.grad, dx64, dx_lp, grad=True, name="d x")


def test_all_dropped_and_no_tokens():
    x = torch.randn(5, 4, requires_grad=True)
    experts = torch.full((5, 2), -1)
    xs, counts, row_map = permute(x, experts, 3)
    assert xs.shape == (0, 4) and counts.tolist() == [0, 0, 0] and row_map.numel() == 0
    y = unpermute(xs, row_map, torch.rand(5, 2), 5)
    assert torch.equal(y, torch.zeros(5, 4))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(5, 4))
    xs, counts, row_map = permute(torch.randn(0, 4), torch.zeros(0, 2, dtype=torch.long), 3)
    assert xs.shape == (0, 4) and counts.tolist() == [0, 0, 0]


def test_fullgraph_compile_and_opcheck():
    x = torch.randn(6, 5)
    experts = torch.tensor([[0, 2], [1, -1], [2, 0], [2, 1], [0, -1], [1, 2]])
    xs, counts, row_map = permute(x, experts, 3)
    w = torch.rand(6, 2)

    @torch.compile(fullgraph=True, backend="eager")
    def combine(ys, w):
        return unpermute(ys, row_map, w, 6)

    torch.testing.assert_close(combine(xs * 2, w), unpermute(xs * 2, row_map, w, 6))
    pos = torch.full((12,), -1, dtype=torch.long)
    pos[row_map] = torch.arange(row_map.numel())
    torch.library.opcheck(torch.ops.tpkernels.moe_unpermute_rows.default,
                          (xs.clone().requires_grad_(True), row_map, pos.view(6, 2), w.requires_grad_(True), ""))
    torch.library.opcheck(torch.ops.tpkernels.moe_permute_rows.default,
                          (x.clone().requires_grad_(True), row_map // 2, pos.view(6, 2), ""))


@pytest.mark.parametrize("call,match", [
    (lambda: permute(torch.randn(3, 4), torch.tensor([[0], [3], [1]]), 3), r"ids must lie in \[-1, num_experts\) = \[-1, 3\).*got 3"),
    (lambda: permute(torch.randn(3, 4), torch.tensor([[0], [-2], [1]]), 3), r"got -2"),
    (lambda: permute(torch.randn(3, 4), torch.zeros(2, 1, dtype=torch.long), 3), r"experts.shape\[0\] \(2\) must equal x.shape\[0\] \(3\)"),
    (lambda: permute(torch.randn(3, 4), torch.zeros(3, 1), 3), r"experts must be an integer tensor"),
    (lambda: permute(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long), 0), r"num_experts \(0\) must be an int >= 1"),
    (lambda: unpermute(torch.randn(2, 4), torch.tensor([0, 9]), torch.rand(3, 2), 3), r"row_map's entries must be slots in \[0, num_tokens·k\) = \[0, 6\)"),
    (lambda: unpermute(torch.randn(2, 4), torch.tensor([0, 1]), torch.rand(4, 2), 3), r"weights must be .* \(3, k\)"),
    (lambda: unpermute(torch.randn(2, 4), torch.tensor([0]), torch.rand(3, 2), 3), r"row_map must be .* \(2,\)"),
])
def test_bad_inputs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_triton_kernels_write_every_output_element():
    """NaN-filled output buffers come back equal to the reference: every row and column is written, dropped
    slots give 0 in the weight gradient, a token with no kept slot gives a zero row."""
    from tpkernels.kernels import reference
    from tpkernels.kernels.triton import moe_permute as tk

    t, k, h, n = 23, 2, 33, 30
    src, y, dout = torch.randn(t, h), torch.randn(n, h), torch.randn(t, h)
    index, scale = torch.randint(0, t, (n,)), torch.rand(n)
    pos = torch.full((t * k,), -1, dtype=torch.long)
    pos[torch.randperm(t * k)[:n]] = torch.arange(n)
    pos = pos.view(t, k)
    pos[0] = -1  # a token whose every slot was dropped
    w = torch.rand(t, k)
    nan = float("nan")
    torch.testing.assert_close(tk.gather_rows(src, index, scale, out=torch.full((n, h), nan)),
                               reference.moe_gather_rows(src, index, scale))
    got = tk.combine_rows(y, pos, w, out=torch.full((t, h), nan))
    torch.testing.assert_close(got, reference.moe_combine_rows(y, pos, w))
    assert torch.equal(got[0], torch.zeros(h))
    dw = tk.combine_wgrad(dout, y, pos, out=torch.full((t, k), nan))
    torch.testing.assert_close(dw, reference.moe_combine_wgrad(dout, y, pos), rtol=1e-5, atol=1e-5)
    assert torch.equal(dw[pos < 0], torch.zeros(int((pos < 0).sum())))


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_permute_experts_unpermute_against_transformers_mixtral_experts(backend):
    """route (exact ties, capacity dropping) -> permute -> grouped_swiglu_mlp -> unpermute equals transformers'
    MixtralExperts on the same choices and weights (a dropped slot: weight 0 there), values and gradients of
    x and both expert weights; float64 on the reference, float32 on the Triton interpreter."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from tpkernels.functional.grouped_gemm import grouped_swiglu_mlp
    from tpkernels.functional.moe_router import route

    t, h, f, e, k = 19, 16, 24, 5, 2
    dtype = torch.float64 if backend == "reference" else torch.float32
    hf = MixtralExperts(MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e)).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.normal_(std=h ** -0.5)
        hf.down_proj.normal_(std=f ** -0.5)
    logits = torch.randint(0, 3, (t, e)).double()  # exact ties between experts
    r = route(logits, k, capacity_factor=1.0)
    assert r.dropped.any()
    x = torch.randn(t, h, dtype=dtype, requires_grad=True)
    x_sorted, counts, row_map = permute(x, r.kept_experts, e, backend=backend)
    # transformers' layout (E, 2F, H) / (E, H, F) read transposed: no copy
    y_sorted = grouped_swiglu_mlp(x_sorted, hf.gate_up_proj.transpose(1, 2), hf.down_proj.transpose(1, 2), counts,
                                  backend=backend)
    y = unpermute(y_sorted, row_map, r.weights, t, backend=backend)
    x_hf = x.detach().clone().requires_grad_(True)
    y_hf = hf(x_hf, r.experts, r.weights.to(dtype))
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y, y_hf, **tol)
    g = torch.randn(t, h, dtype=dtype)
    ours = torch.autograd.grad(y, (x, hf.gate_up_proj, hf.down_proj), g)
    theirs = torch.autograd.grad(y_hf, (x_hf, hf.gate_up_proj, hf.down_proj), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **tol)
