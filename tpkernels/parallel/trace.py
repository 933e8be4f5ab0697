"""Opt-in trace of the chunked comm/GEMM pipeline, exportable as a Chrome trace (Perfetto).

    with CommTrace() as tr:                     # off unless a trace is active: zero cost otherwise
        y = all_gather_matmul(x, [w], group, algo="ring")
    tr.save_chrome_trace("tp.json", group)      # gathers every rank's spans into one file
    tr.hidden_comm_fraction()                   # share of communication time overlapped by GEMMs

On CPU tensors spans are wall-clock intervals on the host: a GEMM from its call to its return, a
transfer from the moment it is posted to the moment its ``wait()`` returns. On CUDA tensors both
are intervals on the device, between CUDA events recorded on the current stream (a GEMM: before
and after its launch; a transfer: when it is posted, which is when NCCL's stream may start it, and
right after its ``wait()``, which orders the current stream after it), all measured from one
origin event, so that GEMMs and transfers share one time base and ``hidden_comm_fraction()``
means the same on NCCL as on gloo. Host launch times would collapse every span to microseconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

_ACTIVE = threading.local()


@dataclass
class Span:
    name: str
    cat: str  # "comm" or "gemm"
    start: float | object  # seconds (perf_counter), or a CUDA event resolved at export
    end: float | object
    args: dict = field(default_factory=dict)


def _cuda_event():
    import torch  # noqa: PLC0415

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class CommTrace:
    """Collects spans on this rank while active (a context manager; nests per thread)."""

    def __init__(self):
        self.spans: list[Span] = []
        self._prev = None
        self._t0_wall = time.time()
        self._t0 = time.perf_counter()
        self._origin = None  # (host seconds, CUDA event) that anchors device spans

    def device_mark(self):
        """A CUDA event recorded now on the current stream (the first one anchors the device time base)."""
        if self._origin is None:
            self._origin = (time.perf_counter(), _cuda_event())
        return _cuda_event()

    def __enter__(self) -> "CommTrace":
        self._prev = getattr(_ACTIVE, "trace", None)
        _ACTIVE.trace = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.trace = self._prev

    # -- recording --
    def add(self, name: str, cat: str, start: float, end: float, **args) -> None:
        self.spans.append(Span(name, cat, start, end, args))

    # -- analysis --
    def intervals(self, cat: str) -> list[tuple[float, float]]:
        return [iv for s, iv in zip(self.spans, self._resolved()) if s.cat == cat]

    def hidden_comm_fraction(self) -> float:
        """Share of communication wall time during which some GEMM was also running (0 when no comm)."""
        comm, gemm = _merge(self.intervals("comm")), _merge(self.intervals("gemm"))
        total = sum(e - s for s, e in comm)
        if total <= 0:
            return 0.0
        hidden = 0.0
        for cs, ce in comm:
            for gs, ge in gemm:
                hidden += max(0.0, min(ce, ge) - max(cs, gs))
        return hidden / total

    def chrome_events(self, rank: int = 0) -> list[dict]:
        events = []
        for s, (start, end) in zip(self.spans, self._resolved()):
            events.append({
                "name": s.name, "cat": s.cat, "ph": "X", "pid": rank, "tid": 0 if s.cat == "gemm" else 1,
                "ts": (self._t0_wall + (start - self._t0)) * 1e6, "dur": max(0.0, end - start) * 1e6,
                "args": s.args,
            })
        return events

    def _resolved(self):
        for s in self.spans:
            if isinstance(s.end, float):
                yield s.start, s.end
            else:
                s.end.synchronize()
                host, origin = self._origin
                yield host + origin.elapsed_time(s.start) / 1e3, host + origin.elapsed_time(s.end) / 1e3

    def save_chrome_trace(self, path: str, group=None) -> list[dict] | None:
        """Write one Chrome-trace JSON with every rank of ``group`` (a pid per rank, GEMMs and transfers on
        two rows). Collective over ``group``; rank 0 writes the file and returns the events."""
        import torch.distributed as dist  # noqa: PLC0415

        from tpkernels.parallel import control  # noqa: PLC0415

        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        gathered = control.all_gather_objects(self.chrome_events(rank), group)
        if rank != 0:
            return None
        events = [e for per_rank in gathered for e in per_rank]
        for r in range(len(gathered)):
            events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "GEMM"}})
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "communication"}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return events


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def active() -> CommTrace | None:
    return getattr(_ACTIVE, "trace", None)


@contextlib.contextmanager
def gemm_span(name: str, device_type: str, **args):
    """Time a GEMM launched inside the block (no-op without an active trace)."""
    tr = active()
    if tr is None:
        yield
        return
    if device_type == "cuda":
        start = tr.device_mark()
        yield
        tr.spans.append(Span(name, "gemm", start, tr.device_mark(), args))
    else:
        t = time.perf_counter()
        yield
        tr.add(name, "gemm", t, time.perf_counter(), **args)


class CommSpan:
    """Marks a transfer from posting to completion: ``s = CommSpan(name, device_type)`` when posted,
    ``s.done()`` after its wait."""

    __slots__ = ("tr", "name", "args", "t", "cuda")

    def __init__(self, name: str, device_type: str = "cpu", **args):
        self.tr = active()
        if self.tr is not None:
            self.name, self.args, self.cuda = name, args, device_type == "cuda"
            self.t = self.tr.device_mark() if self.cuda else time.perf_counter()

    def done(self) -> None:
        if self.tr is not None:
            end = self.tr.device_mark() if self.cuda else time.perf_counter()
            self.tr.spans.append(Span(self.name, "comm", self.t, end, self.args))
