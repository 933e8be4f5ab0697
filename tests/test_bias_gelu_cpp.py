"""C++ CPU kernels (tpkernels._C) against the float64 reference."""

import pytest
import torch

from bias_gelu_checks import check_backward, check_forward
from tpkernels import bias_gelu
from tpkernels._extension import extension

pytestmark = pytest.mark.skipif(extension() is None, reason="tpkernels._C is not built")

SHAPES = [(1, 1), (1, 17), (17, 1), (3, 17), (5, 129), (2, 4097), (2, 3, 33), (4, 1, 2, 65)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(shape, dtype, approximate):
    check_forward("cpp", shape, dtype, approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward(shape, dtype, approximate):
    check_backward("cpp", shape, dtype, approximate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_noncontiguous_input(dtype, approximate):
    check_forward("cpp", (7, 129), dtype, approximate, noncontiguous=True)
    check_backward("cpp", (3, 5, 33), dtype, approximate, noncontiguous=True)


def test_large_rows_many_chunks():
    # More than 64 row chunks' worth of data: exercises the two-level grad_bias reduction.
    check_backward("cpp", (2049, 513), torch.float32, "none")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_float64(approximate, monkeypatch):
    monkeypatch.setenv("TPKERNELS_BACKEND", "cpp")
    x = torch.randn(3, 4, 17, dtype=torch.float64, requires_grad=True)
    b = torch.randn(17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: bias_gelu(x, b, approximate), (x, b))


def test_grad_bias_deterministic_across_thread_counts():
    from tpkernels.functional.bias_gelu import bias_gelu_bwd

    x, b, g = (torch.randn(1000, 300), torch.randn(300), torch.randn(1000, 300))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, db1 = bias_gelu_bwd(g, x, b, backend="cpp")
        torch.set_num_threads(max(2, threads))
        _, db2 = bias_gelu_bwd(g, x, b, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(db1, db2)
