"""The data of a pipeline schedule: actions (F, B, W of a micro-batch on a model chunk), a schedule
(a list of actions per rank), where each virtual stage lives, and the transfers a schedule implies.

Rank r's chunk c is virtual stage ``c·p + r`` (Megatron's round-robin assignment), so activations
flow rank 0 → 1 → … → p−1 → 0 (next chunk) → …. Shared by the schedule generators
(:mod:`~tpkernels.pipeline.schedules`), the simulator and the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot run (bad sizes, missing or misordered actions, deadlock)."""


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F", "B" or "W"
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]  # per rank


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def stage_owner(vs: int, p: int) -> tuple[int, int]:
    """(rank, chunk) of virtual stage ``vs``."""
    return vs % p, vs // p


def communication(sched: Schedule, v: int = 1) -> list[list[tuple[str, Action, int]]]:
    """Per rank, the transfers in the order its actions produce or need them:
    ("recv_act"/"send_act"/"recv_grad"/"send_grad", action, peer rank)."""
    p = len(sched)
    last = p * v - 1
    out = []
    for r, acts in enumerate(sched):
        ops = []
        for a in acts:
            vs = virtual_stage(r, a.chunk, p)
            if a.kind == "F":
                if vs > 0:
                    ops.append(("recv_act", a, stage_owner(vs - 1, p)[0]))
                if vs < last:
                    ops.append(("send_act", a, stage_owner(vs + 1, p)[0]))
            elif a.kind == "B":
                if vs < last:
                    ops.append(("recv_grad", a, stage_owner(vs + 1, p)[0]))
                if vs > 0:
                    ops.append(("send_grad", a, stage_owner(vs - 1, p)[0]))
        out.append(ops)
    return out


__all__ = ["Action", "Schedule", "ScheduleError", "communication", "stage_owner", "virtual_stage"]
