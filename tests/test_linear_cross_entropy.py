"""linear_cross_entropy: on gloo at TP 1–4 the loss, d hidden and d weight equal the unfused path
(the full logits in float64; and vocab_parallel_cross_entropy of hidden @ weight.T) with ignored
tokens inside and outside the batch, label smoothing, z-loss and every reduction; the full logits
are never materialised (every tensor the call creates is recorded); Triton kernels under the
interpreter; errors; opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tpkernels
from tpkernels import backends
from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy
from tpkernels.testing.tolerance import assert_fa_close

CPU = torch.device("cpu")
BACKENDS = [b for b in ("reference", "triton") if backends.why_not(b, "linear_cross_entropy", CPU) is None]


def _dense_reference(hidden, weight, target, smoothing, z_loss, reduction, ignore_index=-100):
    """The unfused loss on the full logits, differentiable, in the inputs' dtype."""
    z = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    t = target.reshape(-1)
    per = F.cross_entropy(z, t, reduction="none", label_smoothing=smoothing, ignore_index=ignore_index)
    per = per + z_loss * torch.logsumexp(z, -1).square() * (t != ignore_index)
    if reduction == "none":
        return per.view(target.shape)
    return per.sum() if reduction == "sum" else per.sum() / (t != ignore_index).sum()


def _worker(rank, world, seed, cases, backend):
    results = []
    for tokens, chunk, smoothing, z_loss, reduction, ignored, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(seed + tokens)
        h_dim, vocab = 12, 7 * world
        hidden64 = torch.randn(2, tokens, h_dim, generator=g, dtype=torch.float64)
        weight64 = torch.randn(vocab, h_dim, generator=g, dtype=torch.float64) / 2
        target = torch.randint(0, vocab, (2, tokens), generator=g)
        if ignored:
            target[0, ::3] = -100
        upstream = torch.randn(2, tokens, generator=g, dtype=torch.float64) if reduction == "none" else \
            torch.tensor(1.7, dtype=torch.float64)
        rows = slice(rank * 7, (rank + 1) * 7)

        def dense(dt):
            h = hidden64.to(dt).clone().requires_grad_()
            w = weight64.to(dt).clone().requires_grad_()
            loss = _dense_reference(h, w, target, smoothing, z_loss, reduction)
            (loss * upstream.to(loss.dtype)).sum().backward()
            return loss.detach(), h.grad, w.grad[rows]

        ref64, ref_lp = dense(torch.float64), dense(dtype)
        h = hidden64.to(dtype).clone().requires_grad_()
        w = weight64[rows].to(dtype).clone().requires_grad_()
        loss = tpkernels.linear_cross_entropy(h, w, target, tp_group=None, chunk_size=chunk, label_smoothing=smoothing,
                                              z_loss=z_loss, reduction=reduction, backend=backend)
        (loss * upstream.to(loss.dtype)).sum().backward()
        tag = f"TP{world} {reduction} ε={smoothing} z={z_loss} chunk={chunk} {dtype_name}"
        # the fp32 loss of 16-bit inputs: the 16-bit reference loss is itself rounded to 16 bits,
        # so one ulp of the input dtype is the floor there (8·tokens ulps for fp32 and fp64 inputs)
        assert_fa_close(loss, ref64[0], ref_lp[0], ulps=8 * tokens if dtype.itemsize >= 4 else 1,
                        floor_dtype=dtype, name=f"loss {tag}")
        assert_fa_close(h.grad, ref64[1], ref_lp[1], grad=True, ulps=8, name=f"d hidden {tag}")
        assert_fa_close(w.grad, ref64[2], ref_lp[2], grad=True, ulps=8 * tokens, name=f"d weight {tag}")
        if z_loss == 0 and dtype == torch.float32:  # the statement: equal to the unfused vocab-parallel loss
            unfused = vocab_parallel_cross_entropy(h.detach() @ w.detach().t(), target, None,
                                                   label_smoothing=smoothing, reduction=reduction)
            torch.testing.assert_close(loss.detach(), unfused, rtol=1e-5, atol=1e-5)
        results.append(tag)
    return len(results)


CASES = [
    # tokens, chunk, smoothing, z_loss, reduction, ignored tokens, dtype
    (17, 4, 0.0, 0.0, "mean", True, "float32"),
    (17, None, 0.1, 1e-3, "sum", False, "float32"),
    (9, 2, 0.05, 1e-2, "none", True, "float32"),
    (5, 5, 0.0, 1e-4, "mean", False, "float64"),
    (13, 3, 0.1, 0.0, "none", False, "float64"),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equals_the_unfused_loss_at_every_tp_size(rank_pool, fresh_seed, world):
    assert rank_pool(world).run(_worker, fresh_seed, CASES, "reference", timeout=120) == [len(CASES)] * world


def _padded_worker(rank, world, seed, backend):
    """A head padded past the real vocabulary (the last rank may hold padding only) equals the
    unpadded loss; the padding rows get a zero gradient."""
    g = torch.Generator().manual_seed(seed)
    per, h_dim = 7, 12
    real = per * world - (9 if world > 1 else 3)
    hidden = torch.randn(17, h_dim, generator=g)
    weight = torch.randn(per * world, h_dim, generator=g) / 2
    target = torch.randint(0, real, (17,), generator=g)
    target[::4] = -100
    h_ref = hidden.double().requires_grad_()
    w_ref = weight[:real].double().requires_grad_()
    _dense_reference(h_ref, w_ref, target, 0.1, 1e-3, "mean").backward()
    h = hidden.clone().requires_grad_()
    w = weight[rank * per:(rank + 1) * per].clone().requires_grad_()
    loss = tpkernels.linear_cross_entropy(h, w, target, chunk_size=5, label_smoothing=0.1, z_loss=1e-3,
                                          vocab_size=real, backend=backend)
    loss.backward()
    want = _dense_reference(h_ref.detach(), w_ref.detach(), target, 0.1, 1e-3, "mean")
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    n_real = max(0, min(per, real - rank * per))
    torch.testing.assert_close(w.grad[:n_real].double(), w_ref.grad[rank * per:rank * per + n_real], rtol=1e-4,
                               atol=1e-6)
    assert bool((w.grad[n_real:] == 0).all())
    return n_real


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padded_vocabulary_is_left_out(rank_pool, fresh_seed, world):
    counts = rank_pool(world).run(_padded_worker, fresh_seed, BACKENDS[-1], timeout=120)
    assert sum(counts) == 7 * world - (9 if world > 1 else 3)
    assert world == 1 or counts[-1] == 0  # a shard of padding only


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton cannot run here")
@pytest.mark.parametrize("world", [1, 2])
def test_triton_kernels_under_the_interpreter(rank_pool, fresh_seed, world):
    cases = [c for c in CASES if c[-1] == "float32"] + [(11, 4, 0.1, 1e-3, "mean", True, "float16")]
    assert rank_pool(world).run(_worker, fresh_seed, cases, "triton", timeout=120) == [len(cases)] * world


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (in elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_full_logits_never_exist():
    # Every tensor the chunk loop makes is recorded (the loop itself: a dispatch mode does not see
    # inside the custom op that wraps it, whose outputs are only the loss and the two gradients).
    from tpkernels.functional.linear_cross_entropy import _chunk_pass

    tokens, h_dim, vocab = 256, 32, 4000  # logits: 1,024,000 elements; hidden 8,192; weight 128,000
    hidden, weight = torch.randn(tokens, h_dim), torch.randn(vocab, h_dim)
    target = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as fused:
        losses, dh, dw = _chunk_pass(hidden, weight, target, None, 16, -100, 0.1, 1e-3, None, True, "reference")
    with _LargestTensor() as unfused:
        F.cross_entropy(hidden @ weight.t(), target)
    assert unfused.largest == tokens * vocab
    # the weight (and its gradient) is the largest thing the fused loop makes; one chunk of logits
    # (16 × 4000) the largest activation
    assert fused.largest == vocab * h_dim, fused.largest
    assert fused.largest < tokens * vocab / 4
    loss = tpkernels.linear_cross_entropy(hidden, weight, target, chunk_size=16, label_smoothing=0.1, z_loss=1e-3,
                                          reduction="sum")
    torch.testing.assert_close(loss, losses.sum())


LCE_ERRORS = [
    (lambda: tpkernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long)),
     ValueError, r"weight must be \(vocab / tensor_parallel_size, 4\), got shape \(5, 6\)"),
    (lambda: tpkernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 5, 1])),
     ValueError, r"target \(5\) must be in \[0, vocab_size \(5\)\) or equal ignore_index \(-100\)"),
    (lambda: tpkernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long),
                                            reduction="avg"),
     ValueError, r"reduction \('avg'\) must be 'none', 'sum' or 'mean'"),
    (lambda: tpkernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long),
                                            chunk_size=0),
     ValueError, r"chunk_size \(0\) must be a positive integer"),
    (lambda: tpkernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long),
                                            z_loss=-1.0),
     ValueError, r"z_loss \(-1.0\) must be a finite number >= 0"),
]


@pytest.mark.parametrize("call,exc,message", LCE_ERRORS)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_opcheck_and_torch_compile_over_a_head():
    h, w, t = torch.randn(10, 8), torch.randn(23, 8), torch.randint(0, 19, (10,))
    torch.library.opcheck(torch.ops.tpkernels.linear_cross_entropy_forward.default,
                          (h, w, t, "", 3, -100, 0.1, 1e-3, "mean", True, "reference", 19, True, True))
    torch._dynamo.reset()
    norm_w = torch.randn(8)

    def head(x, weight):
        y = tpkernels.rms_norm(x, norm_w)
        return tpkernels.linear_cross_entropy(y, weight, t, chunk_size=4)

    xa, wa = h.clone().requires_grad_(), w.clone().requires_grad_()
    la = head(xa, wa)
    la.backward()
    xc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    lc = torch.compile(head, fullgraph=True, backend="aot_eager")(xc, wc)
    lc.backward()
    torch.testing.assert_close(lc, la)
    torch.testing.assert_close(xc.grad, xa.grad)
    torch.testing.assert_close(wc.grad, wa.grad)
