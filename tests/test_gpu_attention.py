"""GPU tests of the Triton FlashAttention kernels (run by benchmarks/gpu_check.sh).

The grid is the interpreter's plus bf16 and long sequences (up to 8k), against the float64 oracle
computed on the GPU. Kernels run at their default config (TPKERNELS_FLASH_AUTOTUNE=0) so the run
compiles one config per variant; test_autotuned_path covers the tuner.
"""

import os

import pytest
import torch

from attention_checks import check_dense, check_varlen, random_lengths

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def default_configs(monkeypatch):
    monkeypatch.setenv("TPKERNELS_FLASH_AUTOTUNE", "0")


def kernels():
    from tpkernels.kernels.triton import flash_attn as tk

    return tk


def triton_dense(q, k, v, do, dlse, scale, causal, window=(-1, -1), softcap=0.0):
    tk = kernels()
    q, k, v = q.detach(), k.detach(), v.detach()
    b, sq, h, _ = q.shape
    out, lse = torch.full_like(q, float("nan")), torch.full((b, h, sq), float("nan"), device=q.device)
    o, lse = tk.flash_attn_fwd(q, k, v, scale, causal, out=out, lse=lse, window=window, softcap=softcap)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    return (o, lse, *tk.flash_attn_bwd(do, q, k, v, o, lse, scale, causal, dlse=dlse, dq=grads[0], dk=grads[1],
                                       dv=grads[2], window=window, softcap=softcap))


def triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, do, dlse, scale, causal, window=(-1, -1), softcap=0.0):
    tk = kernels()
    q, k, v = q.detach(), k.detach(), v.detach()
    o, lse = tk.flash_attn_fwd(q, k, v, scale, causal, cu_q, cu_k, max_q, max_k, window=window, softcap=softcap)
    return (o, lse, *tk.flash_attn_bwd(do, q, k, v, o, lse, scale, causal, cu_q, cu_k, max_q, max_k, dlse=dlse,
                                       window=window, softcap=softcap))


DTYPES = (torch.bfloat16, torch.float16)
GRID = [(dt, d, c, s, g) for dt in DTYPES for d in (64, 128) for c in (False, True)
        for s, g in ((1, 1), (129, 2), (1000, 4))]
GRID += [(torch.bfloat16, d, True, 333, 2) for d in (32, 96, 256)]


@pytest.mark.parametrize("dtype,headdim,causal,seqlen,group", GRID, ids=str)
def test_grid(dtype, headdim, causal, seqlen, group):
    check_dense(triton_dense, 2, seqlen, seqlen, 2 * group, 2, headdim, causal, dtype, "cuda")


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_8k(causal):
    check_dense(triton_dense, 1, 8192, 8192, 4, 1, 128, causal, torch.bfloat16, "cuda")


@pytest.mark.parametrize("sq,sk", [(17, 1029), (1029, 17), (4000, 3001)])
def test_seqlen_q_differs_from_seqlen_k(sq, sk):
    check_dense(triton_dense, 1, sq, sk, 4, 2, 128, True, torch.bfloat16, "cuda")


# two new kernel variants (a left bound; softcap), so gpu_check.sh's compile budget holds
@pytest.mark.parametrize("window,causal,softcap", [((256, -1), True, 0.0), ((-1, -1), True, 30.0)], ids=str)
def test_windows_and_softcap_bf16(window, causal, softcap):
    check_dense(triton_dense, 2, 1500, 1500, 8, 2, 128, causal, torch.bfloat16, "cuda", window=window,
                softcap=softcap)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal):
    lens = random_lengths(4, 1, 700) + [2049]
    check_varlen(triton_varlen, triton_dense, lens, lens, 8, 2, 128, causal, torch.bfloat16, "cuda")


def test_autotuned_path(monkeypatch):
    monkeypatch.setenv("TPKERNELS_FLASH_AUTOTUNE", "1")
    check_dense(triton_dense, 2, 700, 700, 8, 2, 64, True, torch.float16, "cuda")


def test_backward_is_deterministic():
    import tpkernels

    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    runs = []
    for _ in range(2):
        out = tpkernels.flash_attn_func(q, k, v, causal=True)
        runs.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_memory_is_linear_in_seqlen():
    import tpkernels

    s, h, d = 16384, 4, 128
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = tpkernels.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 64 * q.numel() * q.element_size(), f"peak {peak / 2**20:.0f} MiB: a seqlen² buffer?"
    assert peak < s * s * h  # any (s, s) per-head buffer would need >= s²·h bytes


def test_dispatch_on_gpu():
    import tpkernels
    from tpkernels.functional import attention as attn

    os.environ.pop("TPKERNELS_BACKEND", None)
    assert attn.select_backend(torch.empty(1, device="cuda", dtype=torch.bfloat16)) == "triton"
    # fp32 CUDA tensors run the reference path (exact fp32, no TF32), same semantics
    assert attn.select_backend(torch.empty(1, device="cuda", dtype=torch.float32)) == "reference"
    q, k, v = (torch.randn(1, 77, 4, 64, device="cuda") for _ in range(3))
    ref = tpkernels.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), causal=True)
    torch.testing.assert_close(tpkernels.flash_attn_func(q, k, v, causal=True).cpu(), ref, rtol=1e-4, atol=1e-4)
