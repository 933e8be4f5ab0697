"""Check a schedule and predict its timing: every dependency met, transfers matched in order, no
deadlock; makespan, bubble fraction and peak in-flight activations per rank.

Costs are per action on one virtual stage (a model chunk): ``f``, ``b`` (the input-gradient part
of backward when the schedule has W actions, the whole backward otherwise: b + w) and ``w``,
plus ``comm`` per transfer between stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpkernels.pipeline.actions import Action, Schedule, ScheduleError, communication, stage_owner, virtual_stage


@dataclass(frozen=True)
class Costs:
    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0

    def __post_init__(self):
        for name in ("f", "b", "w", "comm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"costs.{name} ({value!r}) must be a finite number >= 0")
        if self.f + self.b + self.w <= 0:
            raise ValueError(f"costs (f={self.f}, b={self.b}, w={self.w}): at least one of f, b, w must be > 0 "
                             "(with no work at all there is no step to time)")


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per rank
    peak_inflight: list[int]  # micro-batch chunks holding activations, per rank
    timeline: list[list[tuple[Action, float, float]]] = field(default_factory=list)  # per rank

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, over all ranks: 1 − Σ busy / (p · makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def bubble_vs_compute(self) -> float:
        """Idle time over ideal compute time (the interleaved formula's (p−1)/(v·m) convention)."""
        ideal = max(self.busy)
        return (self.makespan - ideal) / ideal


def validate(sched: Schedule, m: int, v: int = 1) -> bool:
    """Every (micro-batch, chunk) has exactly one F and one B on each rank (and one W on all ranks or
    none), each B after its F and each W after its B, and transfers pair up in the same order on both
    ends. Returns whether the schedule splits backward (has W actions)."""
    p = len(sched)
    has_w = any(a.kind == "W" for acts in sched for a in acts)
    want = {(k, mb, c) for k in (("F", "B", "W") if has_w else ("F", "B")) for mb in range(m) for c in range(v)}
    for r, acts in enumerate(sched):
        got = [(a.kind, a.mb, a.chunk) for a in acts]
        if len(got) != len(set(got)) or set(got) != want:
            missing, extra = sorted(want - set(got)), sorted(set(got) - want)
            dup = sorted({x for x in got if got.count(x) > 1})
            raise ScheduleError(f"rank {r}: missing {missing[:5]}, unexpected {extra[:5]}, repeated {dup[:5]}")
        pos = {x: i for i, x in enumerate(got)}
        for mb in range(m):
            for c in range(v):
                if pos[("B", mb, c)] < pos[("F", mb, c)]:
                    raise ScheduleError(f"rank {r}: B{mb} of chunk {c} comes before its F")
                if has_w and pos[("W", mb, c)] < pos[("B", mb, c)]:
                    raise ScheduleError(f"rank {r}: W{mb} of chunk {c} comes before its B")
    comm = communication(sched, v)
    for src in range(p):
        for dst in range(p):
            for kind in ("act", "grad"):
                sent = [(a.mb, a.chunk) for op, a, peer in comm[src] if op == f"send_{kind}" and peer == dst]
                # the receiver names the action that consumes the message; map it back to the producer's
                recv = []
                for op, a, peer in comm[dst]:
                    if op == f"recv_{kind}" and peer == src:
                        vs = virtual_stage(dst, a.chunk, p) + (-1 if kind == "act" else 1)
                        recv.append((a.mb, stage_owner(vs, p)[1]))
                if sent != recv:
                    raise ScheduleError(f"{kind} transfers {src}→{dst} are sent in order {sent[:6]} but received in "
                                        f"order {recv[:6]}: a blocking runtime would deadlock")
    return has_w


def simulate(sched: Schedule, m: int, v: int = 1, costs: Costs = Costs(), check: bool = True) -> SimResult:
    """Run the schedule in time: each rank executes its actions in order, each as soon as the rank is
    free and its inputs have arrived. Raises ScheduleError on a deadlock. ``check=False`` skips
    ``validate`` (O(p²) transfer matching) for schedules built by ``make_schedule``, which its
    tests check; a deadlock is still detected."""
    has_w = validate(sched, m, v) if check else any(a.kind == "W" for acts in sched for a in acts)
    p, last = len(sched), len(sched) * v - 1
    dur = {"F": costs.f, "B": costs.b if has_w else costs.b + costs.w, "W": costs.w}
    finish: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    idx, free = [0] * p, [0.0] * p
    busy = [0.0] * p
    live, peak = [0] * p, [0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in sched)
    while remaining:
        progressed = False
        for r in range(p):
            while idx[r] < len(sched[r]):
                a = sched[r][idx[r]]
                vs = virtual_stage(r, a.chunk, p)
                if a.kind == "F":
                    deps = [("F", a.mb, vs - 1, vs > 0)]
                elif a.kind == "B":
                    deps = [("B", a.mb, vs + 1, vs < last), ("F", a.mb, vs, True)]
                else:
                    deps = [("B", a.mb, vs, True)]
                ready = free[r]
                blocked = False
                for kind, mb, s, needed in deps:
                    if not needed:
                        continue
                    key = (kind, mb, s)
                    if key not in finish:
                        blocked = True
                        break
                    cross = stage_owner(s, p)[0] != r
                    ready = max(ready, finish[key] + (costs.comm if cross else 0.0))
                if blocked:
                    break
                end = ready + dur[a.kind]
                finish[(a.kind, a.mb, vs)] = end
                timeline[r].append((a, ready, end))
                busy[r] += dur[a.kind]
                free[r] = end
                if a.kind == "F":
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif a.kind == ("W" if has_w else "B"):
                    live[r] -= 1
                idx[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(sched[r][idx[r]]) for r in range(p) if idx[r] < len(sched[r])}
            raise ScheduleError(f"deadlock: every rank waits (next actions by rank: {stuck})")
    return SimResult(max(free), busy, peak, timeline)
