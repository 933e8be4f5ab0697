"""Per-token log-probs without the logits and their per-document sums (tpkernels.functional.preference):
−linear_cross_entropy(reduction="none") equals log_softmax(h @ Wᵀ) in float64 (vocab 97, 17 rows,
padded vocabulary shards) with gradients, on one device and vocabulary-parallel on gloo at TP 1–4;
the LM head's token_logps at TP2 with sequence parallelism; sequence_logps per document of packed
rows (one-token documents, documents without a supervised token, padding); the CP reduction at CP2
and TP2×CP2 on gloo: loss and gradients equal to the unsharded computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import tpkernels
from tpkernels.functional.preference import (
    all_reduce_sequence_sums,
    preference_loss,
    sequence_logps,
    sequence_token_counts,
    sft_loss,
)

VOCAB, ROWS, HID = 97, 17, 13


def _dense_token_logps(h, w, target, ignore_index=-100):
    lp = torch.log_softmax(h @ w.t(), dim=-1)
    t = target.clamp(min=0)
    out = lp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    return torch.where(target == ignore_index, torch.zeros_like(out), out)


def _vocab_parallel_worker(rank, world, seed):
    g = torch.Generator().manual_seed(seed)
    h64 = torch.randn(ROWS, HID, generator=g, dtype=torch.float64)
    v_local = math.ceil(VOCAB / world)
    w64 = torch.randn(v_local * world, HID, generator=g, dtype=torch.float64) / 2  # rows past VOCAB: padding
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    target[::5] = -100
    upstream = torch.randn(ROWS, generator=g, dtype=torch.float64)
    rows = slice(rank * v_local, (rank + 1) * v_local)

    h_ref, w_ref = h64.clone().requires_grad_(), w64[:VOCAB].clone().requires_grad_()
    ref = _dense_token_logps(h_ref, w_ref, target)
    (ref * upstream).sum().backward()
    w_ref_grad = torch.cat([w_ref.grad, torch.zeros(v_local * world - VOCAB, HID, dtype=torch.float64)])[rows]

    for chunk in (None, 4):
        h, w = h64.clone().requires_grad_(), w64[rows].clone().requires_grad_()
        lp = -tpkernels.linear_cross_entropy(h, w, target, tp_group=None, vocab_size=VOCAB, reduction="none",
                                             chunk_size=chunk)
        assert lp.dtype == torch.float64 and lp.shape == (ROWS,)
        (lp * upstream).sum().backward()
        torch.testing.assert_close(lp.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(w.grad, w_ref_grad, rtol=1e-11, atol=1e-12)
    return world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_token_logps_equal_log_softmax_vocab_parallel(rank_pool, fresh_seed, world):
    assert rank_pool(world).run(_vocab_parallel_worker, fresh_seed, timeout=120) == [world] * world


def test_token_logps_single_device_float32(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    h64, w64 = torch.randn(3, ROWS, HID, generator=g, dtype=torch.float64), torch.randn(VOCAB, HID, generator=g,
                                                                                        dtype=torch.float64) / 2
    target = torch.randint(0, VOCAB, (3, ROWS), generator=g)
    target[1, :4] = -100
    h, w = h64.float().requires_grad_(), w64.float().requires_grad_()
    lp = -tpkernels.linear_cross_entropy(h, w, target, reduction="none")
    assert lp.shape == target.shape and lp.dtype == torch.float32
    lp.sum().backward()
    h_ref, w_ref = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref = _dense_token_logps(h_ref, w_ref, target)
    ref.sum().backward()
    torch.testing.assert_close(lp.detach().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-5)
    assert (lp[1, :4] == 0).all()


def _head_worker(rank, world, seed):
    from model_checks import hf_config

    from tpkernels.models import ModelConfig, ParallelTransformer
    from tpkernels.parallel.config import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(tp=world, sequence_parallel=True))
    model = ParallelTransformer(ModelConfig.from_hf(hf_config("llama", layers=1)), state, seed=seed % 1000,
                                dtype=torch.float64)
    head = model.head
    g = torch.Generator().manual_seed(seed)
    seq = 8
    y_full = torch.randn(2, seq, 32, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, seq), generator=g)
    target[0, :3] = -100
    upstream = torch.randn(2, seq, generator=g, dtype=torch.float64)
    share = y_full[:, rank * seq // world:(rank + 1) * seq // world]

    y = share.clone().requires_grad_()
    lp = head.token_logps(y, target)
    (lp * upstream).sum().backward()
    dy, dw = y.grad, head.weight.grad.clone()
    head.weight.grad = None

    y2 = share.clone().requires_grad_()
    ref = _dense_token_logps_from_logits(head.logits(y2), target)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dy, y2.grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(dw, head.weight.grad, rtol=1e-11, atol=1e-12)
    return world


def _dense_token_logps_from_logits(z, target):
    lp = torch.log_softmax(z, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target == -100, torch.zeros_like(lp), lp)


def test_lm_head_token_logps_tp2_sequence_parallel(rank_pool, fresh_seed):
    assert rank_pool(2).run(_head_worker, fresh_seed, timeout=120) == [2, 2]


# ---- per-document sums over packed rows ----

SEQ = 16  # divisible by 2·CP for the zigzag shares
# (row, [(doc id, length), ...]); the rest of the row is padding (-1). Document 8 appears nowhere.
LAYOUT = [[(0, 5), (1, 1), (2, 7)], [(3, 1), (4, 9), (5, 6)], [(6, 4), (7, 10)]]
NUM_DOCS = 9


def _packed(g):
    doc = torch.full((len(LAYOUT), SEQ), -1, dtype=torch.int64)
    for r, docs in enumerate(LAYOUT):
        at = 0
        for d, n in docs:
            doc[r, at:at + n] = d
            at += n
    mask = (torch.rand(doc.shape, generator=g) < 0.6) & (doc >= 0)
    mask[0, 5] = True    # document 1: one token, supervised
    mask[1, 0] = False   # document 3: one token, not supervised
    mask[2, :4] = False  # document 6: no supervised token
    mask[2, 4] = True    # document 7 has at least one
    mask[0, 13:] = True  # a mask set on padding adds nothing
    return mask, doc


def _loop_sums(token_lp, mask, doc):
    out = [0.0] * NUM_DOCS
    counts = [0] * NUM_DOCS
    for r in range(doc.shape[0]):
        for s in range(doc.shape[1]):
            if mask[r, s] and doc[r, s] >= 0:
                out[int(doc[r, s])] += float(token_lp[r, s])
                counts[int(doc[r, s])] += 1
    return torch.tensor(out, dtype=torch.float64), torch.tensor(counts)


def test_sequence_logps_per_document_of_packed_rows(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    mask, doc = _packed(g)
    token_lp = (-torch.rand(doc.shape, generator=g, dtype=torch.float64) * 5).requires_grad_()
    sums = sequence_logps(token_lp, mask, doc, NUM_DOCS)
    ref, counts = _loop_sums(token_lp.detach(), mask, doc)
    torch.testing.assert_close(sums.detach(), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(sequence_token_counts(mask, doc, NUM_DOCS), counts)
    assert sums[3] == 0 and sums[6] == 0 and sums[8] == 0 and counts[1] == 1
    upstream = torch.randn(NUM_DOCS, generator=g, dtype=torch.float64)
    (sums * upstream).sum().backward()
    expected = torch.where(mask & (doc >= 0), upstream[doc.clamp(min=0)], torch.zeros(()))
    assert torch.equal(token_lp.grad, expected)
    # an integer mask and int32 ids give the same; nan where nothing is selected stays out
    poisoned = token_lp.detach().clone()
    poisoned[~(mask & (doc >= 0))] = float("nan")
    torch.testing.assert_close(sequence_logps(poisoned, mask.int(), doc.int(), NUM_DOCS), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda t, m, d: sequence_logps(t, m, d, 3), r"doc_index \(\d\) must be in \[0, num_docs \(3\)\) or -1"),
    (lambda t, m, d: sequence_logps(t, m, d.clamp(max=-2), 9), r"doc_index \(-2\) must be in"),
    (lambda t, m, d: sequence_logps(t[:, :4], m, d, 9), r"token_logps shape \(3, 4\) must equal loss_mask shape"),
    (lambda t, m, d: sequence_logps(t, m.double(), d, 9), r"loss_mask dtype \(torch.float64\) must be bool"),
    (lambda t, m, d: sequence_logps(t, m, d.float(), 9), r"doc_index dtype \(torch.float32\) must be int64"),
    (lambda t, m, d: sequence_token_counts(m, d, -1), r"num_docs \(-1\) must be an integer >= 0"),
])
def test_sequence_logps_bad_input(call, message):
    mask, doc = _packed(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(doc.shape, dtype=torch.float64), mask, doc)


# ---- the CP reduction: loss and gradients equal to the unsharded ones ----

HC = 8  # hidden size of the CP test


def _cp_problem(seed):
    g = torch.Generator().manual_seed(seed)
    mask, doc = _packed(g)
    h = torch.randn(len(LAYOUT), SEQ, HC, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, HC, generator=g, dtype=torch.float64) / 2
    target = torch.randint(0, VOCAB, doc.shape, generator=g)
    target[~mask] = -100
    ref = torch.randn(NUM_DOCS, generator=g, dtype=torch.float64) * 3
    return mask, doc, h, w, target, ref


def _dpo_objective(doc_lp, counts, ref):
    # pairs: documents (0, 1), (2, 3), (4, 5), (6, 7); document 8 is left out
    c, r = torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])
    losses, _ = preference_loss(doc_lp[c], doc_lp[r], ref[c], ref[r], beta=0.3, loss_type="ipo",
                                chosen_lengths=counts[c], rejected_lengths=counts[r])
    return losses.mean() + 0.7 * sft_loss(doc_lp[c], counts[c].sum())


def _unsharded(mask, doc, h, w, target, ref):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp = _dense_token_logps(h, w, target)
    loss = _dpo_objective(sequence_logps(lp, mask, doc, NUM_DOCS), sequence_token_counts(mask, doc, NUM_DOCS), ref)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _cp_worker(rank, world, seed, tp):
    from tpkernels.functional.context_parallel_blocks import zigzag_indices

    cp = world // tp
    cp_rank, tp_rank = divmod(rank, tp)
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    tp_group, cp_group = tp_groups[cp_rank], cp_groups[tp_rank]

    mask, doc, h_full, w_full, target, ref = _cp_problem(seed)
    loss_ref, dh_ref, dw_ref = _unsharded(mask, doc, h_full, w_full, target, ref)

    idx = zigzag_indices(SEQ, cp, cp_rank)
    v_local = math.ceil(VOCAB / tp)
    w_pad = torch.cat([w_full, torch.zeros(v_local * tp - VOCAB, HC, dtype=torch.float64)])
    rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
    h = h_full[:, idx].clone().requires_grad_()
    w = w_pad[rows].clone().requires_grad_()
    lp = -tpkernels.linear_cross_entropy(h, w, target[:, idx], tp_group=tp_group, vocab_size=VOCAB,
                                         reduction="none", chunk_size=5)
    m, d = mask[:, idx], doc[:, idx]
    partial = torch.cat([sequence_logps(lp, m, d, NUM_DOCS), sequence_token_counts(m, d, NUM_DOCS).double()])
    total = all_reduce_sequence_sums(partial, cp_group)  # one collective for sums and counts
    loss = _dpo_objective(total[:NUM_DOCS], total[NUM_DOCS:], ref)
    loss.backward()

    torch.testing.assert_close(loss.detach(), loss_ref, rtol=1e-12, atol=1e-12)
    # each CP rank's hidden-state gradient is the unsharded one at its positions (whole, over TP)
    torch.testing.assert_close(h.grad, dh_ref[:, idx], rtol=1e-10, atol=1e-12)
    # the head's gradient: each CP rank holds its tokens' part; their sum is the unsharded one
    dw = w.grad.clone()
    dist.all_reduce(dw, group=cp_group)
    dw_ref_pad = torch.cat([dw_ref, torch.zeros(v_local * tp - VOCAB, HC, dtype=torch.float64)])[rows]
    torch.testing.assert_close(dw, dw_ref_pad, rtol=1e-10, atol=1e-12)
    return cp


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["cp2", "tp2xcp2"])
def test_cp_reduction_equals_unsharded(rank_pool, fresh_seed, world, tp):
    assert rank_pool(world).run(_cp_worker, fresh_seed, tp, timeout=120) == [world // tp] * world


def test_cp_reduction_is_identity_on_one_rank():
    x = torch.randn(4, requires_grad=True)
    y = all_reduce_sequence_sums(x, None)
    y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones(4))
