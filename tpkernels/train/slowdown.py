"""A running job that slows down says where: which rank, and which phase of its step.

    autotune: {monitor_every: 10, slowdown: 0.2, sustain: 2}

Every ``monitor_every`` steps the ranks exchange the median seconds of each phase of their steps
over the window (tpkernels.train.metrics.step_phases: compute, TP/CP communication, pipeline P2P
wait, DP gradient reduction, optimizer and host work: one small all-gather). The first window is
the baseline. When the step is slower than the baseline by more than ``slowdown`` for ``sustain``
windows in a row, the monitor reports once: the rank whose own work (compute, optimizer and host
time) grew the most is the straggler, and the phase in which the other ranks' waiting grew is
where the job loses the time (they wait for the straggler in their next collective). When no
rank's own work grew, every rank lost it in communication: a slow link, not a slow rank.
"""

from __future__ import annotations

from dataclasses import dataclass


from tpkernels.parallel import control

from tpkernels.train.metrics import PHASES, median

OWN = ("compute", "other")  # time a rank spends on its own work
WAIT = ("tp_comm", "p2p_wait", "dp_reduce")  # time it spends waiting for the others
WHAT = {"compute": "compute (forward and backward outside communication)", "tp_comm": "TP/CP communication",
        "p2p_wait": "pipeline P2P wait", "dp_reduce": "the DP gradient reduction",
        "other": "optimizer and host work"}


@dataclass
class Slowdown:
    step: int  # the last step of the window that triggered the report
    baseline_s: float
    now_s: float
    rank: int | None  # the straggler, None when the time went to communication on every rank
    rank_phase: str | None
    rank_delta_s: float
    wait_phase: str
    wait_delta_s: float
    text: str
    base_phases: dict | None = None  # per phase, the slowest rank's median: the baseline window
    now_phases: dict | None = None  # and the window that triggered the report

    @property
    def kind(self) -> str:
        """"rank" (one rank's own work grew) or "link" (every rank lost it in communication)."""
        return "link" if self.rank is None else "rank"

    def as_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items()}, "kind": self.kind}


def diagnose(base: list[dict], now: list[dict], step: int, window: int, sustain: int) -> Slowdown:
    """``base``/``now``: per rank {"step": s, phase: s, ...} medians of a window."""
    deltas = [{p: n[p] - b[p] for p in PHASES} for b, n in zip(base, now)]
    phases = ({p: max(x[p] for x in base) for p in PHASES}, {p: max(x[p] for x in now) for p in PHASES})
    own = [max((d[p], p) for p in OWN) for d in deltas]
    rank = max(range(len(own)), key=lambda r: own[r][0])
    others = [r for r in range(len(deltas)) if r != rank] or [rank]
    wait_delta, wait_phase = max((max(deltas[r][p] for r in others), p) for p in WAIT)
    b_s, n_s = max(x["step"] for x in base), max(x["step"] for x in now)
    head = (f"slowdown: the step went from {b_s:.3g} s to {n_s:.3g} s (+{100 * (n_s / b_s - 1):.0f}%) for {sustain} "
            f"window(s) of {window} steps, up to step {step}")
    if own[rank][0] > 0.25 * (n_s - b_s):
        text = (f"{head}; rank {rank} is the straggler: its {WHAT[own[rank][1]]} grew by "
                f"{1e3 * own[rank][0]:.1f} ms per step, and the other ranks waited {1e3 * wait_delta:.1f} ms more in "
                f"{WHAT[wait_phase]}")
        return Slowdown(step, b_s, n_s, rank, own[rank][1], own[rank][0], wait_phase, wait_delta, text, *phases)
    every = max((min(d[p] for d in deltas), p) for p in WAIT)
    text = (f"{head}; no rank's own work grew: every rank lost {1e3 * every[0]:.1f} ms more per step in "
            f"{WHAT[every[1]]} (a slow or contended link)")
    return Slowdown(step, b_s, n_s, None, None, 0.0, every[1], every[0], text, *phases)


class SlowdownMonitor:
    """Feed it every step's record (``rec["phases"]``, ``rec["step_s"]``) on every rank alike: collective
    every ``every`` steps. Returns a :class:`Slowdown` once, when the slowdown is sustained."""

    def __init__(self, every: int, threshold: float, sustain: int, group=None):
        self.every, self.threshold, self.sustain, self.group = every, threshold, sustain, group
        self._window: list[dict] = []
        self.baseline: list[dict] | None = None
        self._strikes = 0
        self.reported: Slowdown | None = None

    def observe(self, rec: dict) -> Slowdown | None:
        self._window.append(rec)
        if len(self._window) < self.every:
            return None
        mine = {p: median([r["phases"][p] for r in self._window]) for p in PHASES}
        mine["step"] = median([r["step_s"] for r in self._window])
        self._window = []
        every_rank = control.all_gather_objects(mine, self.group)
        if self.baseline is None:
            self.baseline = every_rank
            return None
        slow = max(x["step"] for x in every_rank) > (1 + self.threshold) * max(x["step"] for x in self.baseline)
        self._strikes = self._strikes + 1 if slow else 0
        if self._strikes < self.sustain or self.reported is not None:
            return None
        self.reported = diagnose(self.baseline, every_rank, rec["step"], self.every, self.sustain)
        return self.reported


__all__ = ["Slowdown", "SlowdownMonitor", "diagnose"]
