"""Bad input on one rank, or ranks that disagree, end every rank with the same named error within
seconds: not a hang until the process-group timeout, not a gloo abort, not a silent result. The
model checks its TP ranks' input shapes by default (TPKERNELS_CHECK_RANKS off here), the trainer
the whole config; an empty batch or a stage that refuses its inputs stops the other stages."""

from __future__ import annotations

import time

import pytest
import torch

from test_train import small
from tpkernels.functional.norms import rms_norm
from tpkernels.functional.swiglu import swiglu
from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy
from tpkernels.parallel import consistency

FAST_S = 30  # every rank must end well before the 120 s pool timeout and the pipeline's 300 s


def _model(layout: dict):
    from tpkernels.description import ModelConfig
    from tpkernels.models import ParallelTransformer
    from tpkernels.parallel.config import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    from model_checks import hf_config

    state = ParallelState.create(ParallelConfig(**layout))
    return ParallelTransformer(ModelConfig.from_hf(hf_config("llama")), state, seed=1)


def _step_worker(rank, world, layout, case):
    """Every rank calls the model's step; its inputs depend on the case (and on the rank)."""
    with consistency.check_ranks(False):  # what the model checks by itself
        model = _model(layout)
        st = model.state
        if case == "empty rows":
            ids = torch.zeros(0, 16, dtype=torch.long)
        elif case == "empty sequence":
            ids = torch.zeros(2, 0, dtype=torch.long)
        elif case == "other sequence length on one TP rank":
            ids = torch.zeros(2, 12 if st.tp_rank == 1 else 16, dtype=torch.long)
        elif case == "other batch on one TP rank":
            ids = torch.zeros(3 if st.tp_rank == 1 else 2, 16, dtype=torch.long)
        elif case == "int32 ids on one TP rank":
            ids = torch.zeros(2, 16, dtype=torch.int32 if st.tp_rank == 1 else torch.long)
        elif case == "token out of range on the first stage":
            ids = torch.zeros(2, 16, dtype=torch.long)
            ids[0, 3] = 500
        else:
            raise AssertionError(case)
        target = torch.zeros(ids.shape, dtype=torch.long)
        t0 = time.monotonic()
        try:
            model.step(ids if st.is_first_stage else None, target if st.is_last_stage else None,
                       num_microbatches=1 if ids.shape[0] != 2 else 2)
            return None, time.monotonic() - t0
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            return f"{type(e).__name__}: {e}", time.monotonic() - t0


CASES = [
    (dict(pp=2), "empty rows", r"(input_ids|target) shape \(0, 16\): .*the batch and the sequence length"),
    (dict(tp=2), "empty sequence", r"input_ids shape \(2, 0\): the batch and the sequence length must be >= 1"),
    (dict(tp=2, pp=2), "empty rows", r"(input_ids|target) shape \(0, 16\)"),
    (dict(tp=2, sequence_parallel=True), "other sequence length on one TP rank",
     r"ParallelTransformer inputs: ranks disagree on input_ids.shape: rank 1 has \(2, 12\), rank 0 has \(2, 16\)"),
    (dict(tp=4), "other batch on one TP rank", r"ranks disagree on input_ids.shape: rank 1 has \(3, 16\)"),
    (dict(tp=2, pp=2), "int32 ids on one TP rank",
     r"ranks disagree on input_ids.dtype: rank 1 has torch.int32, rank 0 has torch.int64"),
    (dict(pp=4), "token out of range on the first stage", r"input_ids \(500\) must be in \[0, vocab_size \(97\)\)"),
]


@pytest.mark.parametrize("layout, case, message", CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES])
def test_bad_model_inputs_stop_every_rank_with_the_message(rank_pool, layout, case, message):
    import re

    world = layout.get("tp", 1) * layout.get("pp", 1)
    out = rank_pool(world).run(_step_worker, layout, case, timeout=120)
    for rank, (msg, took) in enumerate(out):
        assert msg is not None, f"rank {rank} went on"
        assert re.search(message, msg), (rank, msg)
        assert took < FAST_S, (rank, took, msg)


def _config_worker(rank, world, key, mine):
    from tpkernels.train.trainer import Trainer

    t0 = time.monotonic()
    try:
        Trainer(small(**{key: mine[rank]}))
        return None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


@pytest.mark.parametrize("key, values, message", [
    ("lr", [3e-3, 1e-3], r"ranks disagree on the training config: optimizer.lr \(0.003 on rank 0, 0.001 on rank 1\)"),
    ("seed", [0, 0, 5], r"training.seed \(0 on rank 0, 5 on rank 2\)"),
    ("num_microbatches", [1, 2], r"ranks disagree on the (layout|training config): .*num_microbatches "
                                 r"\(1 on rank 0, 2 on rank 1\)"),
])
def test_ranks_given_other_configs_are_told_which_key(rank_pool, key, values, message):
    import re

    out = rank_pool(len(values)).run(_config_worker, key, values, timeout=120)
    for rank, (msg, took) in enumerate(out):
        assert msg is not None and re.search(message, msg), (rank, msg)
        assert took < FAST_S, (rank, took)


def _layout_worker(rank, world):
    from tpkernels.parallel.config import ParallelConfig, ParallelConfigError
    from tpkernels.parallel.state import ParallelState

    try:
        ParallelState.create(ParallelConfig(pp=2, num_microbatches=4 if rank == 1 else 2))
    except ParallelConfigError as e:
        return str(e)


def test_ranks_that_disagree_on_the_layout_see_the_field_not_two_equal_layouts(rank_pool):
    out = rank_pool(2).run(_layout_worker, timeout=60)
    assert out[0] == out[1] and "num_microbatches (2 on rank 0, 4 on rank 1)" in out[0], out


# ---- single-process ops on degenerate inputs ----

def test_norm_and_swiglu_backward_on_zero_rows_give_empty_gradients():
    x = torch.randn(0, 17, requires_grad=True)
    w = torch.randn(17, requires_grad=True)
    rms_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 17) and torch.equal(w.grad, torch.zeros(17))
    g = torch.randn(0, 2 * 9, requires_grad=True)
    swiglu(g).sum().backward()
    assert g.grad.shape == (0, 18)


@pytest.mark.parametrize("logits, message", [
    (torch.randint(0, 5, (4, 10)), r"logits_shard dtype \(torch.int64\) must be floating point"),
    (torch.randn(4, 0), r"logits_shard shape \(4, 0\): its last dimension .* must be >= 1"),
])
def test_vocab_parallel_loss_refuses_logits_it_cannot_use(logits, message):
    with pytest.raises(ValueError, match=message):
        vocab_parallel_cross_entropy(logits, torch.randint(0, 10, (4,)), None)
