"""Schedules as data, checked by the simulator: dependencies, transfer order, deadlocks, bubble
formulas, memory; property tests over many (stages, micro-batches, virtual stages)."""

from __future__ import annotations

import random

import pytest

from tpkernels.pipeline.schedules import (
    Action,
    PipelineFillWarning,
    ScheduleError,
    communication,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from tpkernels.parallel import ParallelConfig, ParallelConfigError
from tpkernels.pipeline.simulator import Costs, simulate, validate

# fewer micro-batches than stages is drawn on purpose here; the warning itself is tested in test_pipeline_schedules
pytestmark = pytest.mark.filterwarnings("ignore::tpkernels.pipeline.schedules.PipelineFillWarning")

CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 9, 16)]


@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_bubble_is_textbook(p, m):
    for sched in (gpipe(p, m), one_f_one_b(p, m)):
        r = simulate(sched, m, costs=Costs(f=1.0, b=1.0, w=1.0))  # B = 2 units (no W actions)
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(gpipe(p, m), m).peak_inflight == [m] * p
    assert simulate(one_f_one_b(p, m), m).peak_inflight == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_interleaved_bubble_is_textbook(p, v, k):
    m = k * p
    r = simulate(interleaved_1f1b(p, m, v), m, v, Costs(f=1.0 / v, b=1.0 / v, w=1.0 / v))
    assert r.bubble_vs_compute == pytest.approx((p - 1) / (v * m))
    # Korthikanti/Megatron: the first stage holds 1 + (p−1)/(p·v) of 1F1B's activations (in chunks of 1/v)
    assert r.peak_inflight[0] == min(m * v, 2 * (p - 1) + (v - 1) * p + 1)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if p > 1])
def test_zb_h1_beats_1f1b_with_its_memory(p, m):
    zb = simulate(zb_h1(p, m), m, costs=Costs())
    f1 = simulate(one_f_one_b(p, m), m, costs=Costs())
    assert zb.makespan < f1.makespan
    assert zb.bubble_fraction < f1.bubble_fraction
    assert max(zb.peak_inflight) <= max(f1.peak_inflight)  # 1F1B's peak (its first stage)
    if m >= p:  # the steady state is reached: well under 1F1B's 3(p−1) units of bubble
        assert zb.makespan - 3 * m <= (p - 1) + 2 * (p // 2)


def test_random_costs_and_comm_never_deadlock(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(60):
        p, v = rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 1, 2, 3])
        name = rng.choice(["gpipe", "1f1b", "zb-h1"]) if v == 1 or p == 1 else "interleaved"
        m = p * rng.randint(1, 4) if name == "interleaved" else rng.randint(1, 12)
        costs = Costs(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1), rng.uniform(0, 0.5))
        sched = make_schedule(name, p, m, v if name == "interleaved" else 1)
        r = simulate(sched, m, v if name == "interleaved" else 1, costs)
        assert 0 <= r.bubble_fraction < 1
        assert r.makespan >= max(r.busy) - 1e-9
        ops = communication(sched, v if name == "interleaved" else 1)
        sends = sum(1 for per in ops for op, *_ in per if op.startswith("send"))
        recvs = sum(1 for per in ops for op, *_ in per if op.startswith("recv"))
        assert sends == recvs == 2 * m * (p * (v if name == "interleaved" else 1) - 1)


def _config_errors(**kw) -> list[str]:
    with pytest.raises(ParallelConfigError) as e:
        ParallelConfig(**kw).validate()
    return e.value.errors


def test_errors_are_parallel_configs_rules():
    # one rule, one message: the schedules raise exactly what ParallelConfig says for the same layout
    cases = [
        (lambda: interleaved_1f1b(4, 6, 2), dict(pp=4, virtual_stages=2, num_microbatches=6),
         "num_microbatches (6) must be a multiple of pp (4) with the interleaved schedule "
         "(virtual_stages=2), as in Megatron-LM"),
        (lambda: interleaved_1f1b(1, 4, 2), dict(pp=1, virtual_stages=2, num_microbatches=4),
         "virtual_stages (2) > 1 requires pp > 1 (interleaving splits each pipeline rank's "
         "layers into chunks)"),
        (lambda: one_f_one_b(2, 0), dict(pp=2, num_microbatches=0), "num_microbatches (0) must be a positive integer"),
        (lambda: zb_h1(-1, 3), dict(pp=-1, num_microbatches=3), "pp (-1) must be a positive integer"),
    ]
    for call, layout, message in cases:
        with pytest.raises(ScheduleError) as e:
            call()
        assert str(e.value) == message
        assert message in _config_errors(**layout)
    with pytest.raises(ScheduleError, match=r"schedule \('pipedream'\) must be one of"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="needs the interleaved schedule"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.warns(PipelineFillWarning) as w:
        make_schedule("1f1b", 8, 3)
    assert [str(x.message) for x in w] == ParallelConfig(pp=8, num_microbatches=3).warnings() == [
        "pipeline cannot fill: num_microbatches (3) < pp (8); bubble is 70% of the step"]


def test_simulator_costs_must_be_non_negative_and_not_all_zero():
    sched = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match=r"costs.f \(-1.0\) must be a finite number >= 0"):
        simulate(sched, 2, costs=Costs(f=-1.0))
    with pytest.raises(ValueError, match=r"costs.comm \(nan\) must be a finite number >= 0"):
        simulate(sched, 2, costs=Costs(comm=float("nan")))
    with pytest.raises(ValueError, match=r"costs \(f=0.0, b=0.0, w=0.0\): at least one of f, b, w must be > 0"):
        simulate(sched, 2, costs=Costs(0.0, 0.0, 0.0))
    r = simulate(zb_h1(2, 3), 3, costs=Costs(f=1.0, b=0.0, w=0.0))  # zero B and W are fine
    assert 0 <= r.bubble_fraction < 1


def test_simulator_rejects_broken_schedules():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    with pytest.raises(ScheduleError, match="B0 of chunk 0 comes before its F"):
        validate([[B(0), F(0)], [F(0), B(0)]], 1)
    with pytest.raises(ScheduleError, match="missing"):
        validate([[F(0)], [F(0), B(0)]], 1)
    with pytest.raises(ScheduleError, match=r"act transfers 0→1 are sent in order \[\(0, 0\), \(1, 0\)\]"):
        validate([[F(0), F(1), B(0), B(1)], [F(1), F(0), B(0), B(1)]], 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], 2)  # rank 0 waits for a grad, rank 1 for F1


@pytest.mark.parametrize("costs", [(1.0, 1.0, 0.6), (1.0, 1.2, 0.8), (0.7, 1.3, 0.5), (1.0, 1.0, 1.4)])
@pytest.mark.parametrize("p,m", [(2, 3), (4, 17), (5, 40)])
def test_zb_h1_built_for_the_costs_is_valid_and_never_worse_than_1f1b(costs, p, m):
    f, b, w = costs
    sched = zb_h1(p, m, costs)
    r = simulate(sched, m, costs=Costs(f, b, w))  # validates: every action once, in dependency order
    one = simulate(one_f_one_b(p, m), m, costs=Costs(f, b + w, 0.0))
    assert r.makespan <= one.makespan + 1e-9
    assert max(r.peak_inflight) <= max(one.peak_inflight)  # 1F1B's activation memory, as ZB-H1 promises
    unit = simulate(zb_h1(p, m), m, costs=Costs(f, b, w))
    assert r.makespan <= unit.makespan + 1e-9


def test_zb_h1_costs_equal_unit_order_and_bad_costs_raise():
    assert zb_h1(4, 9, (1.0, 1.0, 1.0)) == zb_h1(4, 9)
    with pytest.raises(ScheduleError, match=r"costs \(\(0"):
        zb_h1(4, 9, (0.0, 1.0, 1.0))
