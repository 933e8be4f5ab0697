"""Pipeline bubble of a schedule, from the engine's own simulator (tpkernels.pipeline.simulator):
the planner and the runtime share one definition of every schedule, so GPipe, 1F1B, interleaved
1F1B and ZB-H1 are timed by the same code that checks them, not by a second formula.

The simulator runs one step of ``m`` micro-batches with per-chunk costs f (forward), b (input
gradient) and w (weight gradient) and transfer delay comm. Its work grows with p · m · v, and a
search scores thousands of layouts, so two exact properties of these schedules keep it small:
  * once m ≥ 2p the pipeline is in its steady state, where the idle time grows linearly with m
    (slope 0 for GPipe, 1F1B and interleaved; for ZB-H1, whose order is built for F = B = W, a
    cheaper W leaves a gap of f − w per micro-batch): larger m are extrapolated from simulations at
    2p and 3p (multiples of p, which the interleaved schedule needs);
  * the idle time grows linearly with p − 1 (the warm-up and cool-down ramps have p − 1 steps in
    all four schedules): deeper pipelines are simulated at ``SIM_STAGES`` stages and scaled.
tests/test_planner_pipeline_bubble.py checks both against full simulations. Results are cached
on the cost ratios (rounded to a 4% grid).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

STEADY_FACTOR = 2  # micro-batches per stage beyond which the idle time is constant
RATIO_STEP = 0.04  # log-spaced grid of the cost ratios the cache keys on
SIM_STAGES = 16  # deepest pipeline simulated; deeper ones scale the idle time by (p − 1) / (SIM_STAGES − 1)


def steady_microbatches(p: int) -> int:
    return STEADY_FACTOR * p


@lru_cache(maxsize=4096)
def _idle_units(schedule: str, p: int, m: int, v: int, b: float, w: float, comm: float) -> float:
    from tpkernels.pipeline.schedules import make_schedule  # noqa: PLC0415  (torch-free modules)
    from tpkernels.pipeline.simulator import Costs, simulate  # noqa: PLC0415

    with warnings.catch_warnings():  # an unfilled pipeline is the planner's to report, not a warning
        warnings.simplefilter("ignore")
        sched = make_schedule(schedule, p, m, v)
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
    p_sim = min(p, SIM_STAGES)
    ratios = (_sig2(b / f), _sig2(w / f), _sig2(comm / f))
    scale = (p - 1) / (p_sim - 1)
    m_a = steady_microbatches(p_sim)
    if m <= m_a:
        m_sim = m
        if p_sim < p and m % p_sim and schedule == "interleaved":
            m_sim = p_sim * max(1, round(m / p_sim))  # keep the interleaved schedule's m % p == 0
        return f * _idle_units(schedule, p_sim, m_sim, v, *ratios) * scale
    m_b = m_a + p_sim
    idle_a = _idle_units(schedule, p_sim, m_a, v, *ratios)
    slope = max(0.0, (_idle_units(schedule, p_sim, m_b, v, *ratios) - idle_a) / (m_b - m_a))
    return f * ((idle_a - slope * m_a) * scale + slope * m)


def _sig2(x: float) -> float:
    """x on a grid of 4% steps (log scale): plenty for a plan, and a small cache."""
    if x <= 0:
        return 0.0
    return round(math.exp(round(math.log(x) / RATIO_STEP) * RATIO_STEP), 4)
