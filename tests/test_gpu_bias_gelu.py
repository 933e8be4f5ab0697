"""GPU tests of the CUDA and Triton bias_gelu kernels (run by benchmarks/gpu_check.sh)."""

import pytest
import torch

from bias_gelu_checks import check_backward, check_forward

pytestmark = pytest.mark.cuda

SHAPES = [(1, 1), (3, 17), (129, 4097), (2, 7, 1024), (8192, 1000), (4, 2048, 3072)]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(backend, shape, dtype, approximate):
    check_forward(backend, shape, dtype, approximate, device="cuda")
    check_backward(backend, shape, dtype, approximate, device="cuda")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_unaligned_and_strided(backend):
    # Offset by one element: 16-byte packs are impossible, the scalar path must take over.
    base = torch.randn(1 + 33 * 130, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(33, 130)
    check_forward(backend, (33, 130), torch.bfloat16, "none", device="cuda", noncontiguous=True)
    from tpkernels.functional.bias_gelu import bias_gelu_fwd
    from tpkernels.kernels import reference

    b = torch.randn(130, device="cuda", dtype=torch.bfloat16)
    y = bias_gelu_fwd(x, b, backend=backend)
    torch.testing.assert_close(y.float(), reference.bias_gelu_fwd(x, b, "none").float(), rtol=2e-2, atol=2e-2)


def test_default_backend_on_gpu_is_cuda():
    from tpkernels import backends

    assert backends.select("bias_gelu", torch.device("cuda")) == "cuda"
