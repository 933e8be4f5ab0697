"""Pipeline schedules as data: pure functions (stages, micro-batches, virtual stages) → per-rank
lists of actions.

An action is F (forward), B (backward; with zero-bubble schedules only the input gradient) or W
(weight gradient, zero-bubble only) of micro-batch ``mb`` on model chunk ``chunk`` of this rank.
Rank r's chunk c is virtual stage ``c·p + r`` (Megatron's round-robin assignment), so activations
flow rank 0 → 1 → … → p−1 → 0 (next chunk) → …. The sends and receives an action implies
(``communication``) follow from that.

    gpipe(p, m)                 all forwards, then all backwards          bubble (p−1)/(m+p−1)
    one_f_one_b(p, m)           PipeDream-flush: p−r−1 warm-up forwards   bubble (p−1)/(m+p−1), memory p
    interleaved_1f1b(p, m, v)   Megatron's virtual pipeline               bubble (p−1)/(v·m) of compute
    zb_h1(p, m)                 Qi et al. 2023 zero bubble, 1F1B memory   about a third of 1F1B's bubble
    forward_only(p, m, v)       evaluation: forwards only
"""

from __future__ import annotations

import warnings
from tpkernels.parallel.config import SCHEDULES, fill_warning, pipeline_errors, positive_int_errors
from tpkernels.pipeline.actions import Action, Schedule, ScheduleError, communication, stage_owner, virtual_stage
from tpkernels.pipeline.simulator import Costs, simulate



class PipelineFillWarning(UserWarning):
    """Fewer micro-batches than stages: most of the step is bubble."""


def _check(p: int, m: int, v: int = 1) -> None:
    """ParallelConfig's rules, with its messages (p is the pp)."""
    errs = positive_int_errors(pp=p, num_microbatches=m, virtual_stages=v)
    errs = errs or pipeline_errors(p, v, m)
    if errs:
        raise ScheduleError(errs[0])


def gpipe(p: int, m: int) -> Schedule:
    _check(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """Rank r runs min(p−r−1, m) warm-up forwards, then alternates F and B, then drains the Bs."""
    _check(p, m)
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved schedule. Micro-batches go through the chunks in groups of p:
    forward k touches chunk (k // p) % v of micro-batch (k // (p·v))·p + k % p; backwards visit the
    chunks in reverse. Rank r warms up with 2·(p−r−1) + (v−1)·p forwards."""
    _check(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    total = m * v

    def fwd(k):
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warm, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int, costs: tuple[float, float, float] | None = None) -> Schedule:
    """ZB-H1: 1F1B's order of F and B (B = input gradient only), with each W deferred so that it fills
    the gaps 1F1B leaves. Built by list scheduling: a rank runs a ready B first, else a ready F while
    fewer than p micro-batches hold activations (forwarded, W not yet run: 1F1B's peak, which its
    first stage reaches), else its oldest pending W. Later stages may thus hold more micro-batches
    than under 1F1B, never more than 1F1B's fullest stage.

    costs: (f, b, w) seconds of one micro-batch's F, B and W on a stage. Without them the order is
    built for F = B = W (the paper's assumption); when W is cheaper than F that order stalls
    about f − w per micro-batch in the steady state, so pass the real ratios when known
    (``tpkernels.planner`` estimates them from the model)."""
    if costs is not None:
        # the greedy order built for the costs, unless the F = B = W order happens to run faster
        # at these costs (possible when W is dearer than F): keep the faster of the two
        timed, unit = _zb_h1_timed(p, m, costs), zb_h1(p, m)
        c = Costs(*costs)
        return min((timed, unit), key=lambda s: simulate(s, m, 1, c, check=False).makespan)
    _check(p, m)
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, rank) -> finish time
    order: Schedule = [[] for _ in range(p)]
    next_f, next_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    live = [0] * p  # micro-batches forwarded whose W has not run
    t = 0
    while any(len(a) < 3 * m for a in order):
        for r in range(p):
            b, f = next_b[r], next_f[r]
            b_ready = b < m and b < f and (r == p - 1 or done.get(("B", b, r + 1), 1 << 30) <= t)
            f_ready = f < m and live[r] < p and (r == 0 or done.get(("F", f, r - 1), 1 << 30) <= t)
            if b_ready:
                act, next_b[r] = Action("B", b), b + 1
                pending_w[r].append(b)
            elif f_ready:
                act, next_f[r] = Action("F", f), f + 1
                live[r] += 1
            elif pending_w[r]:
                act = Action("W", pending_w[r].pop(0))
                live[r] -= 1
            else:
                continue
            order[r].append(act)
            done[(act.kind, act.mb, r)] = t + 1
        t += 1
    return order


def _zb_h1_timed(p: int, m: int, costs: tuple[float, float, float]) -> Schedule:
    """``zb_h1``'s list scheduling in continuous time with per-kind durations."""
    _check(p, m)
    if len(costs) != 3 or any(not isinstance(c, (int, float)) or not c >= 0 for c in costs) or costs[0] <= 0:
        raise ScheduleError(f"costs ({costs!r}) must be (f, b, w) with f > 0 and b, w >= 0")
    dur = dict(zip("FBW", (float(c) for c in costs)))
    fin: dict[tuple[str, int, int], float] = {}  # (kind, mb, rank) -> finish time
    order: Schedule = [[] for _ in range(p)]
    next_f, next_b, pending_w, live = [0] * p, [0] * p, [[] for _ in range(p)], [0] * p
    free = [0.0] * p
    eps = 1e-9 * sum(dur.values())
    while True:
        busy = [r for r in range(p) if len(order[r]) < 3 * m]
        if not busy:
            return order
        r = min(busy, key=lambda q: (free[q], q))
        t = free[r]
        b, f = next_b[r], next_f[r]
        b_dep = (fin.get(("B", b, r + 1)) if r < p - 1 else 0.0) if b < m and b < f else None
        f_dep = (fin.get(("F", f, r - 1)) if r > 0 else 0.0) if f < m and live[r] < p else None
        if b_dep is not None and b_dep <= t:
            act, next_b[r] = Action("B", b), b + 1
            pending_w[r].append(b)
        elif f_dep is not None and f_dep <= t:
            act, next_f[r] = Action("F", f), f + 1
            live[r] += 1
        elif pending_w[r]:
            act = Action("W", pending_w[r].pop(0))
            live[r] -= 1
        else:  # idle until an input arrives, or until another rank moves on
            known = [d for d in (b_dep, f_dep) if d is not None and d > t]
            later = [free[q] for q in busy if q != r and free[q] > t]
            free[r] = min(known + later) if known or later else t + eps
            continue
        order[r].append(act)
        fin[(act.kind, act.mb, r)] = free[r] = t + dur[act.kind]


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: every rank runs its forwards only, chunk by chunk, micro-batches in order (no
    backward, so no activations are kept for one; nothing to interleave)."""
    errs = positive_int_errors(pp=p, num_microbatches=m, virtual_stages=v)
    if errs:
        raise ScheduleError(errs[0])
    return [[Action("F", mb, c) for c in range(v) for mb in range(m)] for _ in range(p)]


def make_schedule(name: str, p: int, m: int, v: int = 1,
                  costs: tuple[float, float, float] | None = None) -> Schedule:
    """The named schedule; ``costs`` (f, b, w) shape ZB-H1's order (see ``zb_h1``), others ignore it."""
    if name == "gpipe":
        sched = gpipe(p, m)
    elif name == "1f1b":
        sched = one_f_one_b(p, m)
    elif name == "interleaved":
        sched = interleaved_1f1b(p, m, v)
    elif name == "zb-h1":
        sched = zb_h1(p, m, costs)
    else:
        raise ScheduleError(f"schedule ({name!r}) must be one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ScheduleError(f"virtual_stages ({v}) > 1 needs the interleaved schedule, not {name!r}")
    msg = fill_warning(p, m)
    if msg:
        warnings.warn(msg, PipelineFillWarning, stacklevel=2)
    return sched


__all__ = ["SCHEDULES", "Action", "PipelineFillWarning", "Schedule", "ScheduleError", "communication",
           "forward_only", "gpipe", "interleaved_1f1b", "make_schedule", "one_f_one_b", "stage_owner", "virtual_stage",
           "zb_h1"]
