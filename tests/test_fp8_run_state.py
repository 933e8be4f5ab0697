"""The FP8 run state has one owner: a delayed-scaling run at TP2 + SP that stops and resumes equals the
uninterrupted run bit for bit (losses, histories, the guardrail's streaks and moves), and another layout
reads the same state; a recomputed forward casts with the forward's scales (recompute on = off, bit for
bit); validation and the fp8.learn timing leave the training untouched; the auto choice is rank 0's;
learned gains are keyed by kind and written through a file name of their own."""

from __future__ import annotations

import json
import threading

import torch

from test_fp8_train import TEXT
from test_train import small
from tpkernels.train import Trainer

# TP2 + SP, two micro-batches, delayed scaling over a short window; any saturating cast is a bad step for
# the guardrail, so some linears move back to bf16 during the run (in both of its halves)
BASE = {**TEXT, "tp": 2, "sequence_parallel": True, "num_microbatches": 2, "micro_batch_size": 1,
        "data.seq_length": 16, "steps": 8, "precision": "fp8", "fp8.layers": "all", "fp8.recipe": "delayed",
        "fp8.history": 3, "fp8.learn": False, "fp8.guard_steps": 2, "fp8.max_saturation": 0.02, "optimizer.lr": 3e-2}


def _state(t: Trainer) -> dict:
    return {k: v.detach().cpu().clone() for k, v in t.fp8.state.state_tensors().items()}


def _run(**kw):
    t = Trainer(small(**{**BASE, **kw}))
    return t, [h["loss"] for h in t.train()]


def _resume_worker(rank, world, folder):
    whole, losses = _run()
    _run(**{"checkpoint.save_dir": folder, "training.stop_at_step": 4})
    resumed, rest = _run(**{"checkpoint.save_dir": folder})
    # another layout (PP2, no TP) reads the same state from the last checkpoint, by linear name
    other = Trainer(small(**{**BASE, "tp": 1, "pp": 2, "sequence_parallel": False, "checkpoint.save_dir": folder}))
    return (losses, rest, whole.fp8.moved, resumed.fp8.moved, _state(whole), _state(resumed), _state(other),
            len(whole.history))


def test_a_resumed_delayed_run_equals_the_uninterrupted_one_at_any_layout(rank_pool, tmp_path):
    losses, rest, moved, moved_resumed, whole, resumed, other, _ = rank_pool(2).run(
        _resume_worker, str(tmp_path / "ckpt"), timeout=600)[0]
    assert rest == losses[4:]  # bit for bit
    assert moved == moved_resumed and {m["step"] for m in moved} & {0, 1, 2, 3} and \
        {m["step"] for m in moved} & {4, 5, 6, 7}, moved  # moves made before the stop are kept, later ones made alike
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert other and set(other) <= set(whole) and all(torch.equal(other[k], whole[k]) for k in other)
    assert any(bool(v.any()) for k, v in other.items() if k.endswith("amax_history"))


def _recompute_worker(rank, world):
    plain, a = _run(steps=4)
    again, b = _run(steps=4, recompute="full")
    return a, b, _state(plain), _state(again)


def test_a_recomputed_forward_casts_with_the_forwards_scales(rank_pool):
    """Recompute runs each layer's forward again in backward: it must read the history the forward read and
    record nothing (else the weight gradient reads another x8 and each step pushes its amaxes twice)."""
    a, b, sa, sb = rank_pool(2).run(_recompute_worker, timeout=600)[0]
    assert a == b
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _side_pass_worker(rank, world, readme):
    _, plain = _run(steps=4)
    busy, side = _run(steps=4, **{"eval.every": 1, "eval.source": readme, "eval.batches": 2, "fp8.learn": True})
    return plain, side, "eval/loss" in busy.history[0], busy.fp8.learned is not None


def test_validation_and_the_learn_timing_leave_training_untouched(rank_pool):
    from test_fp8_train import CORPUS

    plain, side, evaluated, learned = rank_pool(2).run(_side_pass_worker, CORPUS, timeout=600)[0]
    assert evaluated and learned
    assert plain == side


def _rank_choice_worker(rank, world, folder):
    import os

    from tpkernels.planner.fit import machine_key
    from tpkernels.planner.fp8_choice import fp8_layer_choices, gain_key, save_gains

    os.environ["TPKERNELS_CACHE_DIR"] = f"{folder}/rank{rank}"  # each rank its own node-local gains file
    cfg = small(**{**BASE, "fp8.layers": "auto"})
    if rank == 1:  # this node once measured FP8 2× faster everywhere; rank 0's node never measured anything
        tokens = cfg.parallel.micro_batch_size * cfg.data.seq_length
        shapes = fp8_layer_choices(cfg.model_config(), tp=2, sequence_parallel=True, tokens=tokens)
        save_gains(machine_key("cpu", world), {gain_key(c.name, c.m, c.k, c.n, 2, False, True): 2.0 for c in shapes})
    t = Trainer(cfg)
    return t.fp8.kinds, [c.chosen for c in t.fp8.choices]


def test_the_auto_choice_is_rank_0s_on_every_rank(rank_pool, tmp_path):
    got = rank_pool(2).run(_rank_choice_worker, str(tmp_path), timeout=300)
    assert got[0] == got[1] == ([], [False] * 4)  # no rate on a CPU without a measurement: nothing, on both


def test_learned_gains_keep_kinds_apart_and_concurrent_writers_succeed(tmp_path, monkeypatch):
    from tpkernels.planner.fp8_choice import gain_key, load_gains, save_gains

    monkeypatch.setenv("TPKERNELS_CACHE_DIR", str(tmp_path))
    qkv, down = gain_key("qkv", 64, 32, 32, 2, False, True), gain_key("down", 64, 32, 32, 2, False, True)
    assert qkv != down  # one GEMM shape, two kinds: a column layer gathers, a row layer reduce-scatters
    errors = []

    def writer(i):
        try:
            for j in range(20):
                save_gains("cpu-2", {f"k{i}-{j}": float(i)})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert json.loads((tmp_path / "fp8_gains.json").read_text()) and load_gains("cpu-2")
    assert not list(tmp_path.glob("*.tmp"))
