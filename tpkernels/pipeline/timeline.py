"""Per-action timeline of a pipeline step on every rank: Chrome trace (Perfetto), PNG Gantt chart,
measured bubble fraction.

Times are ``time.perf_counter()`` of each rank; on one machine (CLOCK_MONOTONIC) they share an
origin, across machines they would need a clock offset.
"""

from __future__ import annotations

import json
from typing import Sequence


from tpkernels.parallel import control

from tpkernels.pipeline.actions import Action

Timeline = list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def gather_timeline(local: Sequence[tuple[Action, float, float]], group=None) -> Timeline:
    """Every rank's timeline on every rank (collective)."""
    out = control.all_gather_objects([(str(a.kind), a.mb, a.chunk, s, e) for a, s, e in local], group)
    return [[(Action(k, mb, c), s, e) for k, mb, c, s, e in per_rank] for per_rank in out]


def bubble_fraction(tl: Timeline) -> float:
    """1 − busy / (ranks × span), span from the first start to the last end over all ranks."""
    start = min(s for r in tl for _, s, _ in r)
    end = max(e for r in tl for _, _, e in r)
    busy = sum(e - s for r in tl for _, s, e in r)
    return 1.0 - busy / (len(tl) * (end - start))


def to_chrome_trace(tl: Timeline, path: str, name: str = "pipeline") -> None:
    t0 = min(s for r in tl for _, s, _ in r)
    events = []
    for rank, acts in enumerate(tl):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for a, s, e in acts:
            events.append({"name": str(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6,
                           "args": {"microbatch": a.mb, "chunk": a.chunk}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": name}}, f)


def plot_gantt(tl: Timeline, path: str, title: str = "", predicted_bubble: float | None = None) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    t0 = min(s for r in tl for _, s, _ in r)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(tl)))
    for rank, acts in enumerate(tl):
        for a, s, e in acts:
            ax.barh(rank, (e - s) * 1e3, left=(s - t0) * 1e3, color=COLORS[a.kind],
                    alpha=1.0 if a.chunk % 2 == 0 else 0.6, edgecolor="white", linewidth=0.5)
            if (e - s) * 1e3 > 0:
                ax.text((s - t0 + (e - s) / 2) * 1e3, rank, str(a.mb), ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_yticks(range(len(tl)), [f"rank {r}" for r in range(len(tl))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    sub = f"measured bubble {100 * bubble_fraction(tl):.1f}%"
    if predicted_bubble is not None:
        sub += f", simulator {100 * predicted_bubble:.1f}%"
    ax.set_title(f"{title}  ({sub})" if title else sub, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, ["forward", "backward (input grad)", "weight grad"], fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def transfer_latency(tl: Timeline, v: int = 1) -> float:
    """Median delay between a stage finishing an action and its neighbour starting the action that
    consumes the result, over the cases where the neighbour was idle waiting (so the delay is the
    transfer, not queueing): the per-transfer cost to give the simulator."""
    p = len(tl)
    end = {}
    for r, acts in enumerate(tl):
        for a, s, e in acts:
            end[(a.kind, a.mb, a.chunk * p + r)] = e
    samples = []
    for r, acts in enumerate(tl):
        prev_end = None
        for a, s, e in acts:
            vs = a.chunk * p + r
            src = ("F", a.mb, vs - 1) if a.kind == "F" else ("B", a.mb, vs + 1) if a.kind == "B" else None
            if src in end and (prev_end is None or prev_end < end[src]):
                samples.append(s - end[src])
            prev_end = e
    samples.sort()
    return samples[len(samples) // 2] if samples else 0.0
