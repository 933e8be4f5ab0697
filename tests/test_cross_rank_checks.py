"""Ranks that disagree get a clear error, never a silent result, a crash or a wait: the cross-rank
check (TPKERNELS_CHECK_RANKS, on in this suite) for the GEMM-comm ops, the mappings and the TP
layers; the vocabulary-parallel loss and embedding on bad targets, ids and shard widths; a rank
outside the group it is given."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpkernels.functional.gemm_comm import all_gather_matmul, matmul_reduce_scatter
from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpkernels.parallel import consistency
from tpkernels.parallel.mappings import all_gather_dim, all_reduce
from tpkernels.testing.errors import error_messages


def test_the_suite_runs_with_the_check_on():
    assert consistency.enabled()
    with consistency.check_ranks(False):
        assert not consistency.enabled()
    assert consistency.enabled()


def _disagreeing_worker(rank, world, case, algo):
    """Rank 1 passes something else than the others; every rank must raise the same ValueError."""
    odd = rank == 1
    if case == "dtype":  # same byte size, other dtype: silently wrong without the check
        a, b = torch.randn(3, 8, dtype=torch.float16 if odd else torch.bfloat16), torch.randn(8, 5)
        b = b.to(a.dtype)
        calls = [lambda: all_gather_matmul(a, [b], None, algo=algo),
                 lambda: matmul_reduce_scatter(torch.cat([a] * world), b, None, algo=algo)]
    elif case == "shape-same-bytes":  # (3, 8) vs (6, 4): the same bytes on the wire
        a = torch.randn(6, 4) if odd else torch.randn(3, 8)
        calls = [lambda: all_gather_matmul(a, [torch.randn(a.shape[-1], 5)], None, algo=algo)]
    elif case == "size":  # gloo would abort the process (SIGABRT) without the check
        calls = [lambda: matmul_reduce_scatter(torch.randn(world * (3 if odd else 2), 8), torch.randn(8, 5), None,
                                               algo=algo),
                 lambda: all_reduce(torch.randn(5 if odd else 4), None),
                 lambda: all_gather_dim(torch.randn(2, 3 if odd else 2), 0, None)]
    elif case == "layer":  # a TP layer fed different shapes (a batch of 2 on one rank, 3 elsewhere)
        col = ColumnParallelLinear(8, 4 * world, tp_group=None, sequence_parallel=True, algo=algo)
        calls = [lambda: col(torch.randn(2, 3 if odd else 2, 8))]
    else:
        raise AssertionError(case)
    return error_messages(calls)


@pytest.mark.parametrize("algo", ["collective", "ring"])
@pytest.mark.parametrize("case", ["dtype", "shape-same-bytes", "size", "layer"])
def test_ranks_that_disagree_get_one_clear_error(rank_pool, case, algo):
    results = rank_pool(3).run(_disagreeing_worker, case, algo, timeout=60)
    assert all(r == results[0] for r in results), "every rank must raise the same error"
    for msg in results[0]:
        assert msg is not None, "a disagreement went through"
        assert "ranks disagree on" in msg and "rank 1 has" in msg and "rank 0 has" in msg, msg
    if case == "dtype":
        assert "a_shard.dtype: rank 1 has torch.float16, rank 0 has torch.bfloat16" in results[0][0]
    if case == "shape-same-bytes":
        assert "a_shard.shape: rank 1 has (6, 4), rank 0 has (3, 8)" in results[0][0]


def _loss_worker(rank, world):
    vocab = 4 * world
    logits = torch.randn(5, vocab // world)
    target = torch.randint(0, vocab, (5,))
    bad_hi, bad_neg = target.clone(), target.clone()
    bad_hi[2], bad_neg[0] = vocab, -3
    ignored = target.clone()
    ignored[1] = -100
    emb = VocabParallelEmbedding(vocab, 3, None)
    wide = torch.randn(5, vocab // world + (1 if rank == world - 1 else 0))
    msgs = error_messages([
        lambda: vocab_parallel_cross_entropy(logits, bad_hi, None),
        lambda: vocab_parallel_cross_entropy(logits, bad_neg, None),
        lambda: vocab_parallel_cross_entropy(logits, ignored, None),  # ignore_index is fine
        lambda: emb(torch.tensor([0, vocab])),
    ], (ValueError, IndexError))
    with consistency.check_ranks(False):  # the width rule holds without the debug check too
        msgs += error_messages([lambda: vocab_parallel_cross_entropy(wide, target, None)])
    return msgs


def test_vocab_parallel_loss_and_embedding_reject_what_torch_rejects(rank_pool):
    world = 2
    for msgs in rank_pool(world).run(_loss_worker, timeout=60):
        assert msgs[0] == "target (8) must be in [0, vocab_size (8)) or equal ignore_index (-100)"
        assert msgs[1] == "target (-3) must be in [0, vocab_size (8)) or equal ignore_index (-100)"
        assert msgs[2] is None
        assert msgs[3] == "ids (8) must be in [0, num_embeddings (8))"
        assert msgs[4].startswith("logits_shard.shape[-1] differs across the TP group (from 4 to 5 columns")


def _outsider_worker(rank, world):
    group = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
    if rank != 2:
        return None
    return error_messages([lambda: ColumnParallelLinear(8, 4, tp_group=group),
                           lambda: all_gather_matmul(torch.randn(2, 3), [torch.randn(3, 4)], group)])


def test_a_rank_outside_the_group_is_told_so(rank_pool):
    msgs = rank_pool(3).run(_outsider_worker, timeout=60)[2]
    assert msgs == ["rank 2 is not a member of the given process group (its global ranks: [0, 1]); every rank "
                    "must pass a group it belongs to"] * 2
