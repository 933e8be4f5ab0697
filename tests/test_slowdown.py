"""The slowdown monitor: a straggler injected into one rank's TP collectives is named, with the phase in
which the others wait for it; a steady run reports nothing; the diagnosis tells a slow link from a
slow rank."""

from __future__ import annotations

import time

import pytest

from test_train import small
from tpkernels.train.slowdown import diagnose

DELAY_S = 0.01


def _slowed(fn, trainer_ref, after: int):
    def wrapper(*args, **kwargs):
        if trainer_ref[0].step_index >= after:
            time.sleep(DELAY_S)  # rank 1 is late to every TP collective
        return fn(*args, **kwargs)

    return wrapper


def _worker(rank, world, slow_rank, after, steps):
    import tpkernels.functional.tp_linear as tp_linear
    from tpkernels.train.trainer import Trainer

    cfg = small(tp=2, sequence_parallel=True, num_microbatches=2, steps=steps,
                **{"autotune.monitor_every": 3, "autotune.sustain": 2, "autotune.slowdown": 0.5})  # +200% injected
    ref = [None]
    if rank == slow_rank:
        for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            setattr(tp_linear, name, _slowed(getattr(tp_linear, name), ref, after))
    ref[0] = trainer = Trainer(cfg)
    trainer.train()
    return [s.as_dict() for s in trainer.slowdowns]


def test_a_straggler_in_tp_collectives_is_named_with_the_phase(rank_pool):
    out = rank_pool(2).run(_worker, 1, 6, 12, timeout=300)
    for reports in out:  # every rank reaches the same verdict
        assert len(reports) == 1, reports
        r = reports[0]
        assert r["rank"] == 1 and r["wait_phase"] == "tp_comm", r["text"]
        assert r["now_s"] > 1.5 * r["baseline_s"] and r["step"] in (8, 11)  # 8: a noisy window 3-5
        assert "rank 1 is the straggler" in r["text"] and "TP/CP communication" in r["text"]


def test_a_steady_run_reports_nothing(rank_pool):
    out = rank_pool(2).run(_worker, None, 0, 9, timeout=300)
    assert out == [[], []]


def _phases(**kw):
    base = {"compute": 0.1, "tp_comm": 0.02, "p2p_wait": 0.0, "dp_reduce": 0.01, "other": 0.01}
    return {**base, **kw, "step": 0.14 + sum(kw.values()) - sum(base[k] for k in kw)}


def test_a_slow_link_is_not_blamed_on_a_rank():
    base = [_phases(), _phases()]
    now = [_phases(tp_comm=0.07), _phases(tp_comm=0.07)]
    s = diagnose(base, now, 20, 5, 2)
    assert s.rank is None and s.wait_phase == "tp_comm" and "no rank's own work grew" in s.text
    late = diagnose(base, [_phases(dp_reduce=0.06), _phases(compute=0.15)], 20, 5, 2)
    assert late.rank == 1 and late.rank_phase == "compute" and late.wait_phase == "dp_reduce"
    assert late.rank_delta_s == pytest.approx(0.05)
