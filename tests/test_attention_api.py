"""Public attention API: flash_attn_func / flash_attn_varlen_func / nn.FlashAttention on the
reference (CPU) path, dispatch, validation errors, torch.library registration and torch.compile,
and FA2's memory contract (no seqlen² tensor is saved for backward)."""

import math

import pytest
import torch
import torch.nn.functional as F

import tpkernels
from attention_checks import check_dense, check_varlen, cu_seqlens, make_qkv, oracle, random_lengths
from tpkernels import backends
from tpkernels.functional import attention as attn
from tpkernels.kernels import reference


def api_dense(backend=None):
    def run(q, k, v, do, dlse, scale, causal, window=(-1, -1), softcap=0.0):
        o, lse = tpkernels.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                           softcap=softcap, return_lse=True, backend=backend)
        grads = torch.autograd.grad([o, lse], [q, k, v], [do, dlse.to(lse.dtype)])
        return (o, lse, *grads)

    return run


def api_varlen(backend=None):
    def run(q, k, v, cu_q, cu_k, max_q, max_k, do, dlse, scale, causal, window=(-1, -1), softcap=0.0):
        o, lse = tpkernels.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                  causal=causal, window_size=window, softcap=softcap,
                                                  return_lse=True, backend=backend)
        grads = torch.autograd.grad([o, lse], [q, k, v], [do, dlse.to(lse.dtype)])
        return (o, lse, *grads)

    return run


# ---- the reference (CPU) path: same semantics, any dtype the CPU has ----

@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [
    (2, 17, 17, 4, 2, 32, True), (1, 129, 64, 4, 1, 96, True), (2, 40, 129, 2, 2, 64, False),
    (1, 64, 17, 4, 4, 64, True), (1, 1, 1, 2, 1, 32, True), (3, 33, 65, 6, 3, 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("torch_kernel", [True, False], ids=["torch-cpu-kernel", "chunked-math"])
def test_reference_path_matches_oracle(b, sq, sk, h, hk, d, causal, dtype, torch_kernel, monkeypatch):
    # With the lse's gradient zero the backward runs torch's CPU kernel too; with it, the chunked math.
    monkeypatch.setattr(reference, "USE_TORCH_CPU_KERNEL", torch_kernel)
    check_dense(api_dense("reference"), b, sq, sk, h, hk, d, causal, dtype, "cpu", lse_grad=False)
    check_dense(api_dense("reference"), b, sq, sk, h, hk, d, causal, dtype, "cpu", lse_grad=True)


def test_reference_path_chunks_queries(monkeypatch):
    # Small chunks (7 rows here) exercise the O(seqlen)-memory loop, including a ragged last chunk.
    monkeypatch.setattr(reference, "USE_TORCH_CPU_KERNEL", False)
    monkeypatch.setattr(reference, "ATTN_CHUNK_ELEMENTS", 7 * 2 * 4 * 53)
    check_dense(api_dense("reference"), 2, 50, 53, 4, 2, 32, True, torch.float32, "cpu")


@pytest.mark.parametrize("nseq,causal", [(1, True), (3, False), (5, True)])
@pytest.mark.parametrize("torch_kernel", [True, False], ids=["torch-cpu-kernel", "chunked-math"])
def test_reference_varlen_matches_each_sequence_alone(nseq, causal, torch_kernel, monkeypatch):
    monkeypatch.setattr(reference, "USE_TORCH_CPU_KERNEL", torch_kernel)
    lens_q = random_lengths(nseq)
    lens_k = random_lengths(nseq) if nseq == 3 else lens_q
    check_varlen(api_varlen("reference"), api_dense("reference"), lens_q, lens_k, 4, 2, 32, causal, torch.float32,
                 "cpu")


@pytest.mark.parametrize("sq,sk,window,causal,softcap", [
    (33, 33, (8, -1), True, 0.0), (40, 29, (5, 7), False, 0.0), (29, 40, (0, 0), False, 0.0),
    (50, 17, (3, -1), True, 0.0),  # rows that see no key under a window
    (24, 24, (100, 100), False, 0.0),  # both sides >= seqlen_k: no limit, as flash-attn normalises
    (33, 33, (-1, -1), True, 6.0), (30, 41, (9, 2), False, 2.5),
], ids=str)
@pytest.mark.parametrize("torch_kernel", [True, False], ids=["torch-cpu-kernel", "chunked-math"])
def test_reference_path_windows_and_softcap(sq, sk, window, causal, softcap, torch_kernel, monkeypatch):
    monkeypatch.setattr(reference, "USE_TORCH_CPU_KERNEL", torch_kernel)
    for lse_grad in (False, True):
        check_dense(api_dense("reference"), 2, sq, sk, 4, 2, 32, causal, torch.float64, "cpu", lse_grad=lse_grad,
                    window=window, softcap=softcap, canonical=True)


@pytest.mark.parametrize("window", [(-1, -1), (2, -1)], ids=str)
@pytest.mark.parametrize("torch_kernel", [True, False], ids=["torch-cpu-kernel", "chunked-math"])
def test_reference_varlen_batches_documents_of_one_length(window, torch_kernel, monkeypatch):
    """The CPU path runs the documents of one (query, key) length as one batch: repeated lengths, in any
    order, a one-token document, with and without a window, still equal each sequence alone."""
    monkeypatch.setattr(reference, "USE_TORCH_CPU_KERNEL", torch_kernel)
    lens = [3, 5, 3, 1, 5, 3, 9, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    assert sorted(len(iq) for iq, _ in reference._same_length_batches(cu, cu)) == [1, 2, 2, 3]
    check_varlen(api_varlen("reference"), api_dense("reference"), lens, lens, 4, 2, 32, True, torch.float32, "cpu",
                 window=window)


def test_reference_varlen_window_matches_each_sequence_alone():
    lens = [17, 3, 40]
    check_varlen(api_varlen("reference"), api_dense("reference"), lens, lens, 4, 2, 32, True, torch.float32, "cpu",
                 window=(6, -1), softcap=3.0)


# flash-attn 2.x's signatures, positional order and keyword names (flash_attn/flash_attn_interface.py)
FA_DENSE = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
            "deterministic", "return_attn_probs"]
FA_VARLEN = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
             "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs",
             "block_table"]


def test_signatures_are_flash_attns():
    import inspect  # noqa: PLC0415

    for fn, names in ((tpkernels.flash_attn_func, FA_DENSE), (tpkernels.flash_attn_varlen_func, FA_VARLEN)):
        params = inspect.signature(fn).parameters
        positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert positional == names
        assert all(params[n].kind == params[n].KEYWORD_ONLY for n in ("return_lse", "backend"))


def test_called_as_flash_attn_documents_it():
    q, k, v = make_qkv((2, 21, 4, 32), (2, 21, 2, 32), torch.float32, "cpu", requires_grad=False)
    # the README's keyword call, and the same call positionally in flash-attn's order
    kw = tpkernels.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(7, 0),
                                   alibi_slopes=None, deterministic=False)
    pos = tpkernels.flash_attn_func(q, k, v, 0.0, None, True, (7, 0), 0.0, None, False, False)
    want = oracle(q, k, v, torch.zeros_like(q), torch.zeros(2, 4, 21), 1 / math.sqrt(32), True, torch.float64,
                  (7, 0))[0]
    assert torch.equal(kw, pos)
    torch.testing.assert_close(kw.double(), want, rtol=1e-5, atol=1e-5)
    # Hugging Face's call: dropout positional, the rest by keyword, flash_kwargs included
    hf = tpkernels.flash_attn_func(q, k, v, 0.0, softmax_scale=None, causal=True, window_size=(7, 7), softcap=0.0,
                                   deterministic=True)
    assert torch.equal(hf, kw)  # causal sets the right side to 0
    out, lse, probs = tpkernels.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 21)  # flash-attn fills S_dmask only with dropout

    lens = [9, 12]
    cu = cu_seqlens(lens, "cpu")
    qv, kv, vv = (t[0, :21] for t in (q, k, v))
    kw = tpkernels.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12,
                                          max_seqlen_k=12, dropout_p=0.0, softmax_scale=0.3, causal=True,
                                          window_size=(4, 0), softcap=0.0, alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, block_table=None)
    pos = tpkernels.flash_attn_varlen_func(qv, kv, vv, cu, cu, 12, 12, 0.0, 0.3, True, (4, 0), 0.0, None, False,
                                           False, None)
    assert torch.equal(kw, pos)  # the 8th positional is dropout_p, the 9th softmax_scale
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        alone = tpkernels.flash_attn_func(qv[None, a:b], kv[None, a:b], vv[None, a:b], 0.0, 0.3, True, (4, 0))
        torch.testing.assert_close(kw[a:b], alone[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"dropout_p \(0.3\) must be 0.0"):
        tpkernels.flash_attn_varlen_func(qv, kv, vv, cu, cu, 12, 12, 0.3)  # a dropout value is never a scale


def test_module_takes_window_and_softcap():
    q, k, v = make_qkv((1, 19, 2, 16), (1, 19, 2, 16), torch.float32, "cpu", requires_grad=False)
    attn_mod = tpkernels.nn.FlashAttention(causal=True, window_size=(5, 0), softcap=3.0)
    torch.testing.assert_close(attn_mod(q, k, v), tpkernels.flash_attn_func(q, k, v, causal=True, window_size=(5, 0),
                                                                             softcap=3.0))
    assert "window_size=(5, 0)" in repr(attn_mod)
    with pytest.raises(ValueError, match=r"window_size \(\(5,\)\) must be a pair"):
        tpkernels.nn.FlashAttention(window_size=(5,))


def test_matches_torch_sdpa():
    # Drop-in check against the peer: SDPA takes (b, h, s, d); causal agrees when seqlen_q == seqlen_k.
    q, k, v = make_qkv((2, 45, 8, 64), (2, 45, 2, 64), torch.float32, "cpu", requires_grad=False)
    ours = tpkernels.flash_attn_func(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-5)


def test_default_scale_and_return_types():
    q, k, v = make_qkv((1, 9, 2, 16), (1, 11, 2, 16), torch.float32, "cpu", requires_grad=False)
    out = tpkernels.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.is_contiguous()
    explicit = tpkernels.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(16))
    assert torch.equal(out, explicit)
    out2, lse = tpkernels.flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 9) and lse.dtype == torch.float32 and torch.equal(out, out2)


# ---- dispatch ----

def test_cpu_tensors_use_the_reference_path_by_default(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    q = torch.randn(1, 3, 2, 16)
    assert attn.select_backend(q) == "reference"
    assert "flash_attn" in backends.registered_ops()


@pytest.mark.skipif(backends.why_not("triton", "flash_attn", torch.device("cpu")) is not None,
                    reason="needs TRITON_INTERPRET=1 and triton")
def test_forced_triton_on_cpu_runs_the_interpreter_and_agrees(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert attn.select_backend(torch.randn(1, 3, 2, 16)) == "triton"
    check_dense(api_dense(), 1, 29, 31, 4, 2, 32, True, torch.float32, "cpu")
    lens = random_lengths(3)
    check_varlen(api_varlen(), api_dense(), lens, lens, 2, 1, 32, True, torch.float32, "cpu")


def test_forced_triton_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 3, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(backends.BackendUnavailableError, match="computes bfloat16 wrongly"):
        tpkernels.flash_attn_func(q, q, q, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backends.BackendUnavailableError, match="need CUDA tensors"):
        tpkernels.flash_attn_func(q.float(), q.float(), q.float(), backend="triton")
    with pytest.raises(backends.BackendUnavailableError, match="has no cpp implementation"):
        tpkernels.flash_attn_func(q, q, q, backend="cpp")


# ---- validation: every message names the parameter, its value and the rule ----

def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _cu(*offsets, dtype=torch.int32):
    return torch.tensor(offsets, dtype=dtype)


BAD_DENSE = [
    (lambda: tpkernels.flash_attn_func(_t(2, 5, 12, 16), _t(2, 5, 5, 16), _t(2, 5, 5, 16)),
     ValueError, r"nheads \(12\) must be divisible by nheads_kv \(5\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), dropout_p=0.1),
     ValueError, r"dropout_p \(0.1\) must be 0.0: attention dropout is not supported"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 300), _t(1, 5, 2, 300), _t(1, 5, 2, 300)),
     ValueError, r"headdim \(300\) must be between 1 and 256"),
    (lambda: tpkernels.flash_attn_func(_t(5, 2, 16), _t(5, 2, 16), _t(5, 2, 16)),
     ValueError, r"q must be 4-D \(batch, seqlen, nheads, headdim\), got shape \(5, 2, 16\)"),
    (lambda: tpkernels.flash_attn_func(_t(2, 5, 2, 16), _t(3, 5, 2, 16), _t(3, 5, 2, 16)),
     ValueError, r"batch of k \(3\) must equal batch of q \(2\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 6, 2, 16)),
     ValueError, r"k shape \(1, 5, 2, 16\) must equal v shape \(1, 6, 2, 16\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 32), _t(1, 5, 2, 32)),
     ValueError, r"headdim of k \(32\) must equal headdim of q \(16\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 0, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16)),
     ValueError, r"seqlen_q \(0\) and seqlen_k \(5\) must be >= 1"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16, dtype=torch.float64),
                                       _t(1, 5, 2, 16, dtype=torch.float64)),
     TypeError, r"k dtype \(torch.float64\) must equal q dtype \(torch.float32\)"),
    (lambda: tpkernels.flash_attn_func(torch.ones(1, 5, 2, 16, dtype=torch.int32),
                                       torch.ones(1, 5, 2, 16, dtype=torch.int32),
                                       torch.ones(1, 5, 2, 16, dtype=torch.int32)),
     TypeError, r"q dtype \(torch.int32\) must be float16, bfloat16 or float32"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16).to("meta"), _t(1, 5, 2, 16).to("meta")),
     ValueError, r"k device \(meta\) must equal q device \(cpu\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), softmax_scale=-1.0),
     ValueError, r"softmax_scale \(-1.0\) must be a finite number > 0"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), causal="yes"),
     TypeError, r"causal \('yes'\) must be a bool"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), window_size=(4,)),
     ValueError, r"window_size \(\(4,\)\) must be a pair \(left, right\) of ints >= -1"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), window_size=(-2, 0)),
     ValueError, r"window_size \(\(-2, 0\)\) must be a pair \(left, right\) of ints >= -1 \(-1: no limit\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), softcap=-1.0),
     ValueError, r"softcap \(-1.0\) must be a finite number >= 0 \(0: no soft-capping\)"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), alibi_slopes=_t(2)),
     ValueError, r"alibi_slopes must be None: ALiBi position biases are not supported"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), 0.0, None, False, (-1, -1),
                                       0.0, None, False, "yes"),
     TypeError, r"return_attn_probs \('yes'\) must be a bool"),
    (lambda: tpkernels.flash_attn_func(_t(1, 5, 2, 16), _t(1, 5, 2, 16), _t(1, 5, 2, 16), deterministic=1),
     TypeError, r"deterministic \(1\) must be a bool"),
]

BAD_VARLEN = [
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 7, dtype=torch.int64),
                                              _cu(0, 7), 7, 7),
     TypeError, r"cu_seqlens_q must be a 1-D int32 tensor \(batch \+ 1,\), got torch.int64"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 3, 7), _cu(0, 7),
                                              7, 7),
     ValueError, r"cu_seqlens_q \(3 offsets\) and cu_seqlens_k \(2 offsets\) must describe the same number"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(1, 7), _cu(0, 7), 7, 7),
     ValueError, r"cu_seqlens_q\[0\] \(1\) must be 0"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 5, 3, 7),
                                              _cu(0, 2, 4, 7), 7, 7),
     ValueError, r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] \(3\) < cu_seqlens_q\[1\] \(5\)"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 6), _cu(0, 7), 7, 7),
     ValueError, r"cu_seqlens_q\[-1\] \(6\) must equal the number of tokens \(7\)"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 2, 7), _cu(0, 3, 7),
                                              4, 5),
     ValueError, r"max_seqlen_q \(4\) must be >= the longest sequence in cu_seqlens_q \(5\)"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 7), _cu(0, 7), -1, 7),
     ValueError, r"max_seqlen_q \(-1\) must be an int >= 0"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(1, 7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 7), _cu(0, 7),
                                              7, 7),
     ValueError, r"q must be 3-D \(total_tokens, nheads, headdim\)"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 7), _cu(0, 7), 7, 7,
                                              dropout_p=0.1),
     ValueError, r"dropout_p \(0.1\) must be 0.0: attention dropout is not supported"),
    (lambda: tpkernels.flash_attn_varlen_func(_t(7, 2, 16), _t(7, 2, 16), _t(7, 2, 16), _cu(0, 7), _cu(0, 7), 7, 7,
                                              block_table=torch.zeros(1, 1, dtype=torch.int32)),
     ValueError, r"block_table must be None: paged KV caches are not supported"),
]


@pytest.mark.parametrize("call,exc,message", BAD_DENSE + BAD_VARLEN, ids=lambda x: "" if callable(x) else None)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_cu_seqlens_are_checked_once_per_tensor_and_again_after_a_change(monkeypatch):
    # The check copies cu_seqlens to the host (a sync on GPUs): once per CUDA tensor, not once per layer.
    # (The cache is for CUDA tensors; here it is switched on for a CPU one to run its logic.)
    monkeypatch.setattr(attn, "_cacheable", lambda cu: True)
    cu = cu_seqlens([4, 5], "cpu")
    attn.check_cu_seqlens(cu, 9, 5, "cu_seqlens_q")

    def no_host_copy():
        raise AssertionError("cu_seqlens copied to the host again")

    cu.tolist = no_host_copy
    attn.check_cu_seqlens(cu, 9, 5, "cu_seqlens_q")
    del cu.tolist
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] \(9\) must equal the number of tokens \(10\)"):
        attn.check_cu_seqlens(cu, 10, 5, "cu_seqlens_q")
    cu[1] = 2  # changed in place: its version counter moves, so it is checked again
    with pytest.raises(ValueError, match=r"max_seqlen_q \(5\) must be >= the longest sequence in cu_seqlens_q \(7\)"):
        attn.check_cu_seqlens(cu, 9, 5, "cu_seqlens_q")


def test_cpu_cu_seqlens_rewritten_through_numpy_are_checked_again():
    import numpy as np  # noqa: PLC0415

    offsets = np.array([0, 4, 9], dtype=np.int32)
    cu = torch.from_numpy(offsets)  # shares memory: numpy's writes do not move the version counter
    q = torch.randn(9, 2, 16)
    tpkernels.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    offsets[1] = 1  # now a sequence of 8 > max_seqlen 5: the kernel grid would silently cut it
    with pytest.raises(ValueError, match=r"max_seqlen_q \(5\) must be >= the longest sequence in cu_seqlens_q \(8\)"):
        tpkernels.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)


# ---- torch.library registration and torch.compile ----

def test_custom_ops_pass_opcheck():
    # Schema, fake impls (shapes, dtypes, strides), autograd registration, all checked by PyTorch.
    # Arguments after the cu_seqlens: max_q, max_k, scale, causal, window_left, window_right, softcap, backend.
    q, k, v = make_qkv((2, 9, 4, 16), (2, 11, 2, 16), torch.float32, "cpu")
    torch.library.opcheck(torch.ops.tpkernels.flash_attn_forward.default,
                          (q, k, v, None, None, 9, 11, 0.25, True, -1, 0, 0.0, ""))
    torch.library.opcheck(torch.ops.tpkernels.flash_attn_forward.default,
                          (q, k, v, None, None, 9, 11, 0.25, False, 3, 2, 5.0, ""))
    lens = [5, 0, 4]
    qv, kv, vv = make_qkv((9, 4, 16), (9, 2, 16), torch.float32, "cpu")
    cu = cu_seqlens(lens, "cpu")
    torch.library.opcheck(torch.ops.tpkernels.flash_attn_forward.default,
                          (qv, kv, vv, cu, cu, 5, 5, 0.25, False, -1, -1, 0.0, ""))
    o, lse = torch.ops.tpkernels.flash_attn_forward(q, k, v, None, None, 9, 11, 0.25, True, -1, 0, 0.0, "")
    torch.library.opcheck(torch.ops.tpkernels.flash_attn_backward.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), None,
                           None, None, 9, 11, 0.25, True, -1, 0, 0.0, ""))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def block(x, wq, wk, wv):  # projections around the opaque attention op
        b, s, _ = x.shape
        q = (x @ wq).view(b, s, 4, 16)
        k = (x @ wk).view(b, s, 2, 16)
        v = (x @ wv).view(b, s, 2, 16)
        return tpkernels.flash_attn_func(q, k, v, causal=True).reshape(b, s, -1).square().sum()

    x = torch.randn(2, 13, 32)
    ws = [torch.randn(32, n, requires_grad=True) / 6 for n in (64, 32, 32)]
    ws = [w.detach().requires_grad_() for w in ws]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss_c = compiled(x, *ws)
    grads_c = torch.autograd.grad(loss_c, ws)
    loss_e = block(x, *ws)
    grads_e = torch.autograd.grad(loss_e, ws)
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


# ---- memory: FA2 saves O(seqlen), never the probabilities ----

def test_backward_saves_no_seqlen_squared_tensor():
    b, sq, sk, h, hk, d = 1, 96, 80, 4, 2, 16
    q, k, v = make_qkv((b, sq, h, d), (b, sk, hk, d), torch.float32, "cpu")
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tpkernels.flash_attn_func(q, k, v, causal=True)
    assert max(saved) < b * h * sq * sk, f"a saved tensor holds {max(saved)} elements: the (sq, sk) scores?"
    # exactly q, k, v, out and the lse
    assert sum(saved) == q.numel() + k.numel() + v.numel() + out.numel() + b * h * sq, saved
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.parametrize("window, softcap", [((128, 0), 0.0), ((100, 60), 0.0), ((128, 0), 5.0)])
def test_the_reference_window_runs_query_blocks_against_their_key_band(window, softcap):
    """No (sq, sk) mask or score tensor on the reference path for a sliding window: every tensor made
    (forward and backward, torch's CPU kernel and the chunked math) is O(seqlen · (window + rows))."""
    from tpkernels.live_bytes import LiveTensorBytes  # noqa: PLC0415

    s = 4096
    q, k, v = make_qkv((1, s, 2, 16), (1, s, 1, 16), torch.float32, "cpu", requires_grad=True)
    with LiveTensorBytes() as mem:
        o = tpkernels.flash_attn_func(q, k, v, causal=window[1] == 0, window_size=window, softcap=softcap,
                                      backend="reference")
        o.sum().backward()
    assert mem.largest_elements < s * s // 8, mem.largest_elements


# ---- the module ----

def test_module_is_the_function():
    mod = tpkernels.nn.FlashAttention(causal=True, softmax_scale=0.2)
    assert "causal=True" in repr(mod) and "softmax_scale=0.2" in repr(mod)
    assert list(mod.parameters()) == []
    q, k, v = make_qkv((2, 7, 4, 16), (2, 9, 2, 16), torch.float32, "cpu", requires_grad=False)
    assert torch.equal(mod(q, k, v), tpkernels.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True))
    lens = [3, 4]
    qv, kv, vv = q[0], k[0, :7], v[0, :7]
    cu = cu_seqlens(lens, "cpu")
    assert torch.equal(mod(qv, kv, vv, cu, cu, 4, 4),
                       tpkernels.flash_attn_varlen_func(qv, kv, vv, cu, cu, 4, 4, softmax_scale=0.2, causal=True))
    with pytest.raises(ValueError, match="needs all of cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k"):
        mod(qv, kv, vv, cu)
    with pytest.raises(ValueError, match=r"softmax_scale \(0\) must be a finite number > 0"):
        tpkernels.nn.FlashAttention(softmax_scale=0)
