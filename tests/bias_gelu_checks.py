"""Shared numerical checks of bias_gelu kernels against the float64 reference (FA rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpkernels.functional.bias_gelu import bias_gelu_bwd, bias_gelu_fwd
from tpkernels.kernels import reference
from tpkernels.testing.tolerance import assert_fa_close


def make_inputs(shape, dtype, device="cpu", noncontiguous=False):
    n = shape[-1]
    if noncontiguous:
        # Same logical shape, strided storage: every other column of a twice-as-wide tensor.
        x = torch.randn(*shape[:-1], 2 * n, device=device).to(dtype)[..., ::2]
    else:
        x = torch.randn(*shape, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    g = torch.randn(*shape, device=device).to(dtype)
    return x, b, g


def torch_lowp(x, b, g, approximate):
    """The same math in PyTorch at the input precision (the FA rule's ref_lp)."""
    xl = x.detach().clone().requires_grad_()
    bl = b.detach().clone().requires_grad_()
    y = F.gelu(xl + bl, approximate=approximate)
    y.backward(g)
    return y.detach(), xl.grad, bl.grad


def check_forward(backend, shape, dtype, approximate, device="cpu", noncontiguous=False):
    x, b, _ = make_inputs(shape, dtype, device, noncontiguous)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)  # poison: every element must be written
    y = bias_gelu_fwd(x, b, approximate, backend=backend, out=out)
    assert y.data_ptr() == out.data_ptr(), "out= was not used"
    ref64 = reference.bias_gelu_fwd(x.double(), b.double(), approximate)
    # ref_lp is PyTorch's own GeLU in the input dtype, float64 included: in float64 it differs from
    # the reference formula by a few ulps, which is the rounding noise ours is allowed too.
    y_lp = F.gelu(x + b, approximate=approximate)
    assert_fa_close(y, ref64, y_lp, name=f"{backend} y {tuple(shape)} {dtype}")


def check_backward(backend, shape, dtype, approximate, device="cpu", noncontiguous=False):
    x, b, g = make_inputs(shape, dtype, device, noncontiguous)
    dx_out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    db_out = torch.full((shape[-1],), float("nan"), dtype=dtype, device=device)
    dx, db = bias_gelu_bwd(g, x, b, approximate, backend=backend, grad_x_out=dx_out, grad_bias_out=db_out)
    assert dx.data_ptr() == dx_out.data_ptr() and db.data_ptr() == db_out.data_ptr(), "out buffers not used"
    dx64, db64 = reference.bias_gelu_bwd(g.double(), x.double(), b.double(), approximate)
    _, dx_lp, db_lp = torch_lowp(x, b, g, approximate)  # float64 too (see check_forward)
    # grad_bias sums `rows` terms: allow the floor to grow like sqrt(rows) ulps.
    rows = max(1, x.numel() // shape[-1])
    assert_fa_close(dx, dx64, dx_lp, grad=True, name=f"{backend} grad_x {tuple(shape)} {dtype}")
    assert_fa_close(db, db64, db_lp, grad=True, ulps=4 * rows**0.5, name=f"{backend} grad_bias {tuple(shape)} {dtype}")
