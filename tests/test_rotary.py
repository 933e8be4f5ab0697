"""Rotary embedding: the kernels against float64 (FA rule, NaN-poisoned outputs, half-split and
interleaved, partial rotary, strided q/k from a packed QKV, fp32/fp16), the cache and the rotation
equal to Hugging Face transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (default, linear,
dynamic and llama3 scaling; built locally from a config), packed sequences equal each sequence
alone, position ids, in place, gradcheck, errors, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

import tpkernels
from tpkernels import backends
from tpkernels._extension import extension
from tpkernels.functional.rotary import inverse_frequencies
from tpkernels.kernels import reference
from tpkernels.testing.tolerance import assert_fa_close

CPU = torch.device("cpu")
BACKENDS = [b for b in ("cpp", "reference", "triton") if backends.why_not(b, "rotary", CPU) is None]
NAN = float("nan")


def _naive(x, cos, sin, positions, interleaved):
    """Textbook RoPE in x's dtype, on complex numbers (an independent formulation)."""
    half = cos.shape[-1]
    r = 2 * half
    c, s = cos[positions].to(x.dtype)[:, None, :], sin[positions].to(x.dtype)[:, None, :]
    rot = x[..., :r]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([out, x[..., r:]], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim,heads", [(64, 64, 3), (64, 32, 5), (128, 128, 1), (16, 2, 4)], ids=str)
def test_kernels_match_float64(backend, interleaved, head_dim, rotary_dim, heads):
    cos, sin = tpkernels.rotary_cache(head_dim, 300, 10000.0, rotary_dim=rotary_dim)
    for dtype in [torch.float32, torch.float16] + ([torch.float64] if backend != "triton" else []):
        tokens = 37
        packed = torch.randn(tokens, heads, 3, head_dim, dtype=torch.float64).to(dtype)
        x = packed[:, :, 1]  # a strided view, as q/k/v of a packed projection
        positions = torch.randint(0, 300, (tokens,))
        for conj in (False, True):
            if backend == "triton":
                from tpkernels.kernels.triton import rotary as tk

                out = torch.full(x.shape, NAN, dtype=dtype)
                tk.rotary(x, cos, sin, positions, interleaved, conj, out)
            elif backend == "cpp":
                out = torch.full(x.shape, NAN, dtype=dtype)
                extension().rotary_cpu(x, cos, sin, positions, interleaved, conj, out)
            else:
                out = reference.rotary_fwd(x, cos, sin, positions, interleaved, conj)
            s = -sin if conj else sin
            ref64 = _naive(x.double(), cos.double(), s.double(), positions, interleaved)
            ref_lp = _naive(x, cos, s, positions, interleaved)
            assert_fa_close(out, ref64, ref_lp, name=f"{backend} {dtype} conj={conj}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_the_inverse_rotation(backend):
    cos, sin = tpkernels.rotary_cache(32, 64, rotary_dim=24)
    dtype = torch.float64 if backend != "triton" else torch.float32
    q = torch.randn(2, 9, 4, 32, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 9, 2, 32, dtype=dtype, requires_grad=True)
    if backend != "triton":
        small = [torch.randn(1, 5, n, 32, dtype=dtype, requires_grad=True) for n in (2, 1)]
        assert torch.autograd.gradcheck(lambda a, b: tpkernels.apply_rotary(a, b, cos, sin, backend=backend), small)
    qr, kr = tpkernels.apply_rotary(q, k, cos, sin, backend=backend)
    dq, dk = torch.randn_like(qr), torch.randn_like(kr)
    torch.autograd.backward([qr, kr], [dq, dk])
    pos = torch.arange(9).repeat(2)
    want_q = _naive(dq.reshape(-1, 4, 32).double(), cos.double(), -sin.double(), pos, False).reshape(q.shape)
    torch.testing.assert_close(q.grad.double(), want_q, rtol=1e-5, atol=1e-5)
    # a rotation: the norm of every rotated pair is kept, so |q|² is unchanged
    torch.testing.assert_close(qr.detach().square().sum(), q.detach().square().sum(), rtol=1e-5, atol=1e-4)


# ---- equal to Hugging Face transformers ----

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_transformers_llama(scaling, backend):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, kv, max_pos, theta = 32, 4, 2, 256, 500000.0
    cfg = transformers.LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=max_pos, rope_theta=theta, rope_scaling=scaling)
    hf = LlamaRotaryEmbedding(cfg)
    ours_scaling, seqlen = scaling, 150
    if scaling and scaling["rope_type"] == "dynamic":
        # NTK stretches the frequencies to the sequence length once it passes the original context
        # (HF: the config's max_position_embeddings), here 300 > 256
        ours_scaling, seqlen = {**scaling, "original_max_position_embeddings": max_pos}, 300
    q = torch.randn(2, heads, seqlen, head_dim)  # HF layout (batch, heads, seq, dim)
    k = torch.randn(2, kv, seqlen, head_dim)
    pos = torch.arange(seqlen)[None].expand(2, seqlen)
    hf_cos, hf_sin = hf(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    cos, sin = tpkernels.rotary_cache(head_dim, seqlen, theta, ours_scaling)
    torch.testing.assert_close(cos[:seqlen], hf_cos[0, :, :head_dim // 2], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:seqlen], hf_sin[0, :, :head_dim // 2], rtol=0, atol=1e-6)
    qr, kr = tpkernels.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend=backend)
    torch.testing.assert_close(qr.transpose(1, 2), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kr.transpose(1, 2), want_k, rtol=1e-5, atol=1e-5)


def test_llama3_frequencies_equal_transformers_exactly():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                   rope_theta=500000.0, rope_scaling=scaling)  # Llama 3.1 8B
    assert torch.equal(inverse_frequencies(128, 500000.0, scaling), LlamaRotaryEmbedding(cfg).inv_freq)


# ---- packed sequences, positions, in place ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_equal_each_sequence_alone(backend):
    cos, sin = tpkernels.rotary_cache(64, 128)
    lens = [17, 1, 40, 9]
    cu = torch.tensor([0, 17, 18, 58, 67], dtype=torch.int32)
    q, k = torch.randn(67, 4, 64), torch.randn(67, 2, 64)
    qr, kr = tpkernels.apply_rotary(q, k, cos, sin, cu_seqlens=cu, backend=backend)
    for a, n in zip(cu.tolist(), lens):
        qa, ka = tpkernels.apply_rotary(q[None, a:a + n], k[None, a:a + n], cos, sin, backend=backend)
        torch.testing.assert_close(qr[a:a + n], qa[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(kr[a:a + n], ka[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_and_in_place(backend):
    cos, sin = tpkernels.rotary_cache(32, 100)
    q, k = torch.randn(3, 11, 2, 32), torch.randn(3, 11, 1, 32)
    pos = torch.randint(0, 100, (3, 11))
    qr, kr = tpkernels.apply_rotary(q, k, cos, sin, position_ids=pos, backend=backend)
    want = _naive(q.reshape(-1, 2, 32), cos, sin, pos.reshape(-1), False).reshape(q.shape)
    torch.testing.assert_close(qr, want, rtol=1e-6, atol=1e-6)
    shared = tpkernels.apply_rotary(q, k, cos, sin, position_ids=pos[0], backend=backend)[0]  # (seqlen,) for every row
    torch.testing.assert_close(shared[0], qr[0], rtol=0, atol=0)
    # in place, inside autograd: the projection's output is rotated in its own storage
    w = torch.randn(32, 32, requires_grad=True)
    qp, kp = (q @ w), (k @ w)
    ptr = qp.data_ptr()
    qi, ki = tpkernels.apply_rotary(qp, kp, cos, sin, position_ids=pos, inplace=True, backend=backend)
    assert qi.data_ptr() == ptr
    (qi.square().sum() + ki.sum()).backward()
    w2 = w.detach().clone().requires_grad_()
    qo, ko = tpkernels.apply_rotary(q @ w2, k @ w2, cos, sin, position_ids=pos, backend=backend)
    (qo.square().sum() + ko.sum()).backward()
    torch.testing.assert_close(qi, qo)
    torch.testing.assert_close(w.grad, w2.grad)


ROTARY_ERRORS = [
    (lambda: tpkernels.rotary_cache(64, 128, scaling={"rope_type": "yarn", "factor": 2.0}), ValueError,
     r"rope_type \('yarn'\) is not supported: choose one of default, linear, dynamic, llama3"),
    (lambda: tpkernels.rotary_cache(64, 128, scaling={"rope_type": "linear"}), ValueError, r"needs 'factor'"),
    (lambda: tpkernels.rotary_cache(64, 128, rotary_dim=66), ValueError, r"rotary_dim \(66\) must be even and <="),
    (lambda: tpkernels.rotary_cache(64, 0), ValueError, r"max_positions \(0\) must be a positive integer"),
    (lambda: tpkernels.apply_rotary(torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8), *tpkernels.rotary_cache(8, 4)),
     ValueError, r"seqlen \(9\) must be <= the positions of the cos/sin cache \(4\)"),
    (lambda: tpkernels.apply_rotary(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), *tpkernels.rotary_cache(8, 4),
                                    position_ids=torch.tensor([0, 1, 7])),
     ValueError, r"position_ids must be in \[0, 4\) \(the cos/sin cache\), got 0..7"),
    (lambda: tpkernels.apply_rotary(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 4), *tpkernels.rotary_cache(8, 4)),
     ValueError, r"head_dim of k \(4\) must equal head_dim of q \(8\)"),
    (lambda: tpkernels.apply_rotary(torch.randn(5, 2, 8), torch.randn(5, 2, 8), *tpkernels.rotary_cache(8, 8),
                                    cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)),
     ValueError, r"must start at 0, never decrease and end at the number of tokens \(5\)"),
]


@pytest.mark.parametrize("call,exc,message", ROTARY_ERRORS)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_opcheck_and_torch_compile():
    cos, sin = tpkernels.rotary_cache(16, 32)
    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    pos = torch.arange(5).repeat(2)
    for interleaved, conjugate in ((False, False), (True, True)):
        torch.library.opcheck(torch.ops.tpkernels.rotary.default, (q, k, cos, sin, pos, interleaved, conjugate, ""))
    torch._dynamo.reset()

    def block(q, k):
        qr, kr = tpkernels.apply_rotary(q, k, cos, sin)
        return (qr * kr.mean(2, keepdim=True)).sum()

    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    block(qa, ka).backward()
    qc, kc = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.compile(block, fullgraph=True, backend="aot_eager")(qc, kc).backward()
    torch.testing.assert_close(qc.grad, qa.grad)
    torch.testing.assert_close(kc.grad, ka.grad)
