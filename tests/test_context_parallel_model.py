"""Whole models at a context-parallel layout train like the single-process model: ten steps of
losses, every step's gradient norm and the final weights (float64, packed documents of uneven
length: the single process takes the whole batch at once), at CP2 (each algorithm), CP4, TP2×CP2
with SP, CP2×PP2 (1F1B and zero-bubble) and DP2×CP2; byte-level text whose documents cross the
zigzag chunks; a run saved at CP2 resumes at CP1 and TP2 with the same losses."""

from __future__ import annotations

import pytest
import torch

from test_train import _check_against_reference, _reference, _run, small

CASES = {
    "cp2-ring": dict(cp=2, num_microbatches=2),
    "cp2-allgather": dict(cp=2, cp_algo="allgather", num_microbatches=2),
    "cp2-a2a": dict(cp=2, cp_algo="a2a", num_microbatches=2),
    "cp4-ring": dict(cp=4, num_microbatches=1, micro_batch_size=2),
    "tp2cp2-sp": dict(tp=2, cp=2, sequence_parallel=True, num_microbatches=2),
    "cp2pp2-1f1b": dict(cp=2, pp=2, num_microbatches=2),
    "cp2pp2-zb": dict(cp=2, pp=2, num_microbatches=4, schedule="zb-h1"),
    "dp2cp2": dict(dp=2, cp=2, num_microbatches=2),
    "dp2cp2-zero1": dict(dp=2, cp=2, num_microbatches=2, zero1=True),
}


def _worker(rank, world, kw):
    return _run(small(**kw))


@pytest.mark.parametrize("case", list(CASES))
def test_ten_steps_at_a_cp_layout_equal_the_single_process_run(rank_pool, case):
    kw = CASES[case]
    _check_against_reference(rank_pool, kw, kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1) * kw["cp"])


@pytest.mark.parametrize("algo", ["ring", "a2a"])
def test_packed_documents_across_the_zigzag_chunks(rank_pool, tmp_path, algo):
    """Byte-level text, documents of many lengths: boundaries fall inside and across each rank's chunks."""
    text = "".join(f"doc {i} " + "xy" * (i % 7) + "\n\n" for i in range(60))
    (tmp_path / "corpus.txt").write_text(text)
    kw = dict(cp=2, cp_algo=algo, num_microbatches=2, vocab=300, data=str(tmp_path / "corpus.txt"), steps=4)
    want_loss, want_norm, _ = _reference(kw)
    for loss, norm, _ in rank_pool(2).run(_worker, kw, timeout=300):
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), rtol=1e-4, atol=1e-6)


def _ckpt_worker(rank, world, kw):
    from tpkernels.train.trainer import Trainer

    trainer = Trainer(small(**kw))
    return [h["loss"] for h in trainer.train()], trainer.step_index


def test_a_run_saved_at_cp2_resumes_at_cp1_and_tp2(rank_pool, tmp_path):
    import shutil

    full = rank_pool(2).run(_ckpt_worker, dict(cp=2, num_microbatches=2, steps=6), timeout=300)[0][0]
    rank_pool(2).run(_ckpt_worker, dict(cp=2, num_microbatches=2, steps=6, stop_at_step=3,
                                        save_dir=str(tmp_path / "a")), timeout=300)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    at_cp1 = _ckpt_worker(0, 1, dict(num_microbatches=2, steps=6, save_dir=str(tmp_path / "a")))[0]
    at_tp2 = rank_pool(2).run(_ckpt_worker, dict(tp=2, num_microbatches=2, steps=6, save_dir=str(tmp_path / "b")),
                              timeout=300)[0][0]
    for got in (at_cp1, at_tp2):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(full[3:]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--cp", "3", "--nproc", "3"], r"sequence length \(16\) must be divisible by 2 × parallel.cp \(6\)"),
    (["--cp", "2", "--cp-algo", "a2a", "--kv-heads", "1", "--nproc", "2"],
     r"parallel.cp_algo 'a2a' needs the heads per TP rank \(4\) and KV heads per TP rank \(1\) divisible by "
     r"parallel.cp \(2\)"),
    (["--cp", "4", "--nproc", "6"], r"world_size \(6\) must be divisible by parallel.tp \(1\) × parallel.cp \(4\)"),
    (["--cp", "2", "--cp-algo", "tree"], r"parallel.cp_algo \('tree'\) must be one of ring, allgather, a2a"),
])
def test_bad_cp_layouts_are_named_before_any_rank_starts(capsys, flags, message):
    import re

    from tpkernels.cli import main

    argv = ["train", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab",
            "97", "--seq-length", "16", *flags]
    assert main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err


def test_dry_run_prints_the_chunk_layout(capsys):
    from tpkernels.cli import main

    assert main(["train", "--seq-length", "24", "--cp", "3", "--nproc", "3", "--layers", "2", "--hidden", "32",
                 "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab", "97", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "context parallel: 3 ranks, ring attention, zigzag chunks of 4 tokens: CP rank 0: [0, 4) + [20, 24)" in out


def _comm_worker(rank, world, kw):
    from tpkernels.train.trainer import Trainer

    return [h["comm_ratio"] for h in Trainer(small(**kw)).train()]


def test_the_cp_exchange_counts_in_the_comm_compute_ratio(rank_pool):
    """The ring's K/V hops are traced like TP's transfers: a CP2 run reports communication; CP1 none."""
    assert all(r == 0 for r in _comm_worker(0, 1, dict(steps=2)))
    for ratios in rank_pool(2).run(_comm_worker, dict(cp=2, steps=2), timeout=300):
        assert all(r > 0 for r in ratios), ratios
