"""Triton kernels: under TRITON_INTERPRET=1 on the CPU (fp32, fp16), on the GPU when present.

bf16 is GPU-only: the interpreter computes bf16 on raw bits (the kernels upcast right after
each load, but the interpreter's bf16 stores are still wrong), see DESIGN.md.
"""

import pytest
import torch

from bias_gelu_checks import check_backward, check_forward
from tpkernels import backends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(backends.why_not("triton", "bias_gelu", torch.device(DEVICE)) is not None,
                                reason=f"triton cannot run here: {backends.why_not('triton', 'bias_gelu', torch.device(DEVICE))}")

# Column counts cover every BLOCK_N (16..256) plus ragged edges; row counts cover partial tiles.
SHAPES = [(1, 1), (17, 1), (3, 17), (129, 33), (2, 3, 100), (5, 257), (1, 4097)]
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(shape, dtype, approximate):
    check_forward("triton", shape, dtype, approximate, device=DEVICE)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward(shape, dtype, approximate):
    check_backward("triton", shape, dtype, approximate, device=DEVICE)


def test_backward_many_row_programs():
    # More rows than one program takes: several (programs_m) partial-sum rows to reduce.
    check_backward("triton", (1031, 20), torch.float32, "none", device=DEVICE)


def test_noncontiguous_input():
    check_forward("triton", (9, 65), torch.float32, "tanh", device=DEVICE, noncontiguous=True)
    check_backward("triton", (9, 65), torch.float32, "none", device=DEVICE, noncontiguous=True)
