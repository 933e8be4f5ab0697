"""The planner's pipeline bubble comes from the engine's simulator; its shortcuts (steady state in m,
linear in p − 1) must agree with full simulations, and it must reproduce the closed forms."""

from __future__ import annotations

import random

import pytest

from tpkernels.pipeline.schedules import make_schedule
from tpkernels.pipeline.simulator import Costs, simulate
from tpkernels.planner.pipeline_bubble import SIM_STAGES, bubble_time

# fewer micro-batches than stages is drawn on purpose here; the warning itself is tested in test_pipeline_schedules
pytestmark = pytest.mark.filterwarnings("ignore::tpkernels.pipeline.schedules.PipelineFillWarning")


def full_idle(schedule, p, m, v, f, b, w, comm=0.0):
    # ZB-H1's order is built for the costs, as the runtime builds it
    sched = make_schedule(schedule, p, m, v, (f, b, w) if schedule == "zb-h1" else None)
    sim = simulate(sched, m, v, Costs(f, b, w, comm))
    return sim.makespan - max(sim.busy)


@pytest.mark.parametrize("p,m", [(2, 1), (3, 7), (4, 17), (5, 5), (8, 64)])
def test_1f1b_and_gpipe_have_the_closed_form_bubble(p, m):
    f, b = random.uniform(0.5, 2), random.uniform(0.5, 3)
    for schedule in ("1f1b", "gpipe"):
        assert bubble_time(schedule, p, m, 1, f, b, 0.0) == pytest.approx((p - 1) * (f + b), rel=0.02)


def test_interleaving_divides_the_bubble_by_v():
    p, m, f, b = 4, 16, 1.0, 2.0
    for v in (2, 3):
        assert bubble_time("interleaved", p, m, v, f / v, b / v, 0.0) == pytest.approx((p - 1) * (f + b) / v, rel=0.02)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)])
@pytest.mark.parametrize("p,m", [(12, 60), (16, 40), (24, 48), (30, 7)])
def test_shortcuts_match_the_full_simulation(schedule, v, p, m, fresh_seed):
    if schedule == "interleaved" and m % p:
        m = p * max(1, m // p)
    rng = random.Random(fresh_seed)  # replayable with TPK_SEED
    f, b, w = rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5), rng.uniform(0.3, 1.2)
    comm = rng.choice([0.0, 0.05])
    split = schedule == "zb-h1"
    got = bubble_time(schedule, p, m, v, f, b if split else b + w, w if split else 0.0, comm)
    want = full_idle(schedule, p, m, v, f, b if split else b + w, w if split else 0.0, comm)
    assert p > SIM_STAGES or m > 16  # these cases exercise a shortcut
    # ZB-H1's order is built greedily for the costs: its idle time fluctuates from one m (or cost
    # ratio) to the next, so no shortcut from other m follows it closely: the worst of 2,100 random
    # cost sets at these depths was 34% of the bubble (pipeline_bubble.py's stated bound is 40%)
    rel = 0.40 if schedule == "zb-h1" else 0.10
    assert got == pytest.approx(want, rel=rel, abs=0.02 * (f + b + w)), (f, b, w, comm)


def test_zero_bubble_beats_1f1b_when_w_costs_what_f_does():
    # the engine's ZB-H1 order is built for F = B = W (tpkernels.pipeline.schedules.zb_h1)
    p, m, f, b, w = 4, 16, 1.0, 1.0, 1.0
    one = bubble_time("1f1b", p, m, 1, f, b + w, 0.0)
    zb = bubble_time("zb-h1", p, m, 1, f, b, w)
    assert zb < one
    assert zb == pytest.approx(full_idle("zb-h1", p, m, 1, f, b, w))


def test_zero_bubble_with_a_cheap_w_beats_1f1b_at_every_m():
    # an order built for F = B = W stalls f − w per micro-batch when W is cheaper; the order built
    # for the real costs does not, and its idle time stops growing with m
    p, f, b, w = 4, 1.0, 1.0, 0.6
    idle = [bubble_time("zb-h1", p, m, 1, f, b, w) for m in (16, 64, 200)]
    for m, i in zip((16, 64, 200), idle):
        assert i == pytest.approx(full_idle("zb-h1", p, m, 1, f, b, w), rel=0.03)
        assert i < bubble_time("1f1b", p, m, 1, f, b + w, 0.0)
    assert idle[-1] == pytest.approx(idle[0], rel=0.05)
    unit = simulate(make_schedule("zb-h1", p, 64), 64, 1, Costs(f, b, w))
    assert unit.makespan - max(unit.busy) > 2 * idle[1]  # what the unit-cost order would cost


def test_one_stage_has_no_bubble_and_bad_costs_are_refused():
    assert bubble_time("1f1b", 1, 8, 1, 1.0, 2.0, 0.0) == 0.0
    with pytest.raises(ValueError, match=r"f \(0"):
        bubble_time("1f1b", 4, 8, 1, 0.0, 2.0, 0.0)
