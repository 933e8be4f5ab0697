"""Pipeline bubble of a schedule, from the engine's own simulator (tpkernels.pipeline.simulator):
the planner and the runtime share one definition of every schedule, so GPipe, 1F1B, interleaved
1F1B and ZB-H1 are timed by the same code that checks them, not by a second formula.

The simulator runs one step of ``m`` micro-batches with per-chunk costs f (forward), b (input
gradient) and w (weight gradient) and transfer delay comm. Its work grows with p · m · v, and a
search scores thousands of layouts, so two exact properties of these schedules keep it small:
  * once m ≥ 3p the pipeline is in its steady state, where the idle time grows linearly with m
    (slope 0 for GPipe, 1F1B and interleaved): larger m are extrapolated from simulations at 3p
    and 4p (multiples of p, which the interleaved schedule needs). ZB-H1's order is built for the
    costs; its idle time stops growing with m but fluctuates from one m to the next, so it takes
    the mean of the two samples: within 40% of a full simulation's bubble (the worst of 2,100
    random cost sets at 12–24 stages was 34%; up to ~9% of the step at small m / p), the other
    schedules within 10%;
  * at a fixed number of micro-batches per stage the idle time grows linearly with p (the warm-up
    and cool-down ramps have p − 1 steps in all four schedules): deeper pipelines than
    ``SIM_STAGES`` are extrapolated from SIM_STAGES / 2 and SIM_STAGES stages holding the same
    m / p.
tests/test_planner_pipeline_bubble.py checks both against full simulations. Results are cached
on the cost ratios (rounded to a 4% grid).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

STEADY_FACTOR = 3  # micro-batches per stage beyond which the idle time is linear in m
RATIO_STEP = 0.04  # log-spaced grid of the cost ratios the cache keys on
SIM_STAGES = 16  # deepest pipeline simulated; deeper ones are extrapolated linearly in p


def steady_microbatches(p: int) -> int:
    return STEADY_FACTOR * p


@lru_cache(maxsize=4096)
def _idle_units(schedule: str, p: int, m: int, v: int, b: float, w: float, comm: float) -> float:
    from tpkernels.pipeline.schedules import make_schedule  # noqa: PLC0415  (torch-free modules)
    from tpkernels.pipeline.simulator import Costs, simulate  # noqa: PLC0415

    with warnings.catch_warnings():  # an unfilled pipeline is the planner's to report, not a warning
        warnings.simplefilter("ignore")
        # ZB-H1's order is built for the costs, as the runtime builds it (ParallelTransformer.pipeline)
        sched = make_schedule(schedule, p, m, v, (1.0, b, w) if schedule == "zb-h1" else None)
    sim = simulate(sched, m, v, Costs(f=1.0, b=b, w=w, comm=comm), check=False)
    return sim.makespan - max(sim.busy)


def bubble_time(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float, comm: float = 0.0) -> float:
    """Idle seconds of the busiest rank in one step: makespan − m · v · (f + b + w).

    f, b, w: seconds of one micro-batch on one model chunk (a 1/(p·v) slice of the layers).
    Schedules without a W action (all but zb-h1) run b and w back to back. comm: seconds a
    transfer between stages delays its consumer (asynchronous P2P; 0 when P2P is charged to the
    stages' own time)."""
    if p <= 1:
        return 0.0
    if f <= 0:
        raise ValueError(f"f ({f!r}) must be > 0: a pipeline stage with no forward work cannot be timed")
    ratios = (_on_grid(b / f), _on_grid(w / f), _on_grid(comm / f))
    if p <= SIM_STAGES:
        return f * _idle_in_m(schedule, p, m, v, ratios)
    # deeper pipelines: at a fixed m / p the idle time is linear in p (ramps of p − 1 steps);
    # extrapolate from two simulated depths with the same micro-batches per stage
    lo, hi = SIM_STAGES // 2, SIM_STAGES
    i_lo = _idle_in_m(schedule, lo, max(1, round(m * lo / p)), v, ratios)
    i_hi = _idle_in_m(schedule, hi, max(1, round(m * hi / p)), v, ratios)
    idle = i_hi + (p - hi) * (i_hi - i_lo) / (hi - lo)
    return f * max(0.0, idle)


def _idle_in_m(schedule: str, p: int, m: int, v: int, ratios: tuple) -> float:
    """Idle time in units of f at depth p: simulated, or extrapolated linearly in m from the
    steady state (simulations at 3p and 4p)."""
    m_a = steady_microbatches(p)
    if m <= m_a:
        if m % p and schedule == "interleaved":
            m = p * max(1, round(m / p))  # keep the interleaved schedule's m % p == 0
        return _idle_units(schedule, p, m, v, *ratios)
    m_b = m_a + p
    idle_a = _idle_units(schedule, p, m_a, v, *ratios)
    idle_b = _idle_units(schedule, p, m_b, v, *ratios)
    if schedule == "zb-h1":
        # the order built for the costs stops the idle time growing with m, but its greedy choices
        # make it fluctuate from one m to the next: a slope fitted to two samples amplifies that;
        # their mean stays within 40% of the bubble (the module docstring's bound)
        return 0.5 * (idle_a + idle_b)
    slope = max(0.0, (idle_b - idle_a) / (m_b - m_a))
    return idle_a + slope * (m - m_a)


def _on_grid(x: float) -> float:
    """x on a grid of 4% steps (log scale): plenty for a plan, and a small cache."""
    if x <= 0:
        return 0.0
    return round(math.exp(round(math.log(x) / RATIO_STEP) * RATIO_STEP), 4)
