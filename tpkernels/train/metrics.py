"""What the run reports per step: model FLOP utilisation, communication/compute, the pipeline bubble,
a JSON line for machines, and a Perfetto trace of one step.

MFU = model FLOPs of the step (the planner's count: forward + backward of every GEMM and of the
attention core, no recompute) / (step time × ranks × peak FLOP/s of one rank). The peak is the
GPU's dense bf16 peak from the planner's hardware table (matched by device name); on a CPU it is
the fp32 GEMM rate this rank measures at start-up (a 1024³ matmul), so CPU MFU is labelled
"vs measured GEMM": it says how much of the machine's matmul speed the step achieves.

Communication/compute: the TP and CP transfers of the step (``CommTrace`` spans of every GEMM-comm
op, of the TP/SP mappings' collectives and of context-parallel attention's K/V exchanges) that no
GEMM or attention block hid, over the rest of the step; the worst rank's is reported (one all-reduce of one
number), and above 30% after the warm-up step the run warns with advice that fits it (:func:`comm_advice`). The
bubble is this rank's idle share of its pipeline actions' span (the timeline of the runtime).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s of one rank, what it is)."""
    if device.type == "cuda":
        from tpkernels.planner.measure import preset_for_device  # noqa: PLC0415

        name = torch.cuda.get_device_name(device)
        spec = preset_for_device(name)
        if spec is not None:
            return spec.peak_tflops_bf16 * 1e12, f"{spec.name} bf16 peak"
        return float("nan"), f"{name}: no peak in the planner's table"
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    rate = 3 * 2 * 1024 ** 3 / (time.perf_counter() - t0)
    return rate, "measured CPU fp32 GEMM"


class MetricsFile:
    """One JSON object per line, appended as steps finish (rank 0), mirrored to TensorBoard
    (``tensorboard_dir``) and wandb (``wandb_project``) by :mod:`tpkernels.train.experiment_log`:
    every record written here goes there too, numbers as scalars and strings as text.

    The file is the record of one run, each step once, as the run finally took it: a new run starts
    a fresh file (``start(None)``), and a run resumed from the checkpoint of step S drops the records
    the earlier run wrote from its first record of step S on (``start(S)``): those steps are trained
    again and logged anew, so a reader never sees a step twice nor the abandoned values. The
    TensorBoard mirror does the same with ``SummaryWriter(purge_step=S)`` (0 for a new run). A line
    left half-written by a killed run is dropped too."""

    def __init__(self, path: str | Path | None, *, tensorboard_dir: str | Path | None = None,
                 wandb_project: str | None = None, config: dict | None = None):
        self.path = Path(path) if path else None
        self.tensorboard_dir = str(tensorboard_dir) if tensorboard_dir else None
        self.wandb_project = wandb_project
        self.config = config
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def of(cls, cfg, logging_rank: bool = True) -> "MetricsFile":
        """The sink of a TrainConfig's ``logging`` keys (nothing on a rank that does not log)."""
        lg = cfg.logging
        if not logging_rank:
            return cls(None)
        return cls(lg.metrics_file, tensorboard_dir=lg.tensorboard_dir, wandb_project=lg.wandb_project,
                   config=cfg.to_dict())

    def _mirrors(self, resumed_step: int | None, starting: bool) -> list:
        from tpkernels.train import experiment_log as xl  # noqa: PLC0415

        out = []
        for kind, where, make in (
                ("tensorboard", self.tensorboard_dir, lambda p: xl.TensorBoardLog(self.tensorboard_dir, p)),
                ("wandb", self.wandb_project, lambda p: xl.WandbLog(self.wandb_project, self.config,
                                                                   self.tensorboard_dir))):
            if where:
                out.append(xl.open_log(kind, where, resumed_step, make) if starting else
                           xl.current_log(kind, where, make))
        return out

    def start(self, resumed_step: int | None) -> None:
        """At a run's start: a fresh file for a new run (``resumed_step`` None), else the earlier run's
        records before the first one of step >= ``resumed_step`` (records without a step, such as
        the FP8 choice or an autotune summary, stay where they were written); the mirrors likewise,
        and the config as text."""
        from tpkernels.train.experiment_log import TensorBoardLog, config_text  # noqa: PLC0415

        for log in self._mirrors(resumed_step, starting=True):
            if isinstance(log, TensorBoardLog) and self.config is not None:
                log.step = resumed_step or 0
                log.text("config", config_text(self.config))
        if self.path is None:
            return
        kept: list[str] = []
        if resumed_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the half-written last line of a killed run
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and step >= resumed_step:
                    break
                kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)  # a reader sees the old file or the new one, never half of it

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        for log in self._mirrors(None, starting=False):
            log.write(record)


COMM_WARN = 0.30
MORE_WORK = "a larger parallel.micro_batch_size or data.seq_length gives each GEMM more to hide the transfers behind"


def memory_capacity_gib(device) -> float | None:
    """What one rank may hold: the GPU's memory, or on a CPU the host's memory shared by the local ranks."""
    import os  # noqa: PLC0415

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return host / 2**30 / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def fits_at_tp(cfg, mc, pc, tp: int, capacity_gib: float | None) -> bool | None:
    """Whether the planner's memory model puts this run at ``tp`` (the rest of the layout as it is) within
    ``capacity_gib`` per rank; None when it cannot tell."""
    if capacity_gib is None:
        return None
    try:
        from tpkernels.planner.memory import fits, peak_memory  # noqa: PLC0415
        from tpkernels.planner.workload import TrainingSetup  # noqa: PLC0415

        precision = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}.get(cfg.training.precision, "fp32")
        task = cfg.training.task if cfg.training.task != "auto" else "pretrain"
        train = TrainingSetup(pc.global_batch_size, cfg.data.seq_length, precision=precision,
                              finetune=cfg.model.finetune, quant=cfg.model.base_quant, lora_rank=cfg.model.lora_rank,
                              overlap_grad_reduce=pc.overlap_dp, task=task)
        smaller = pc.replace(tp=tp, sequence_parallel=pc.sequence_parallel and tp > 1)
        return fits(peak_memory(mc, train, smaller), capacity_gib)
    except Exception:  # noqa: BLE001 (advice only: a layout the planner cannot model gets the general advice)
        return None


def comm_advice(pc, cfg, mc, device=None) -> str:
    """What to change when the exposed TP/CP transfers exceed COMM_WARN of the step, fitting the run: no
    "lower TP" for a layout autotune measured fastest or the planner picked, nor where a smaller TP does
    not fit in memory (the planner's memory model)."""
    chosen = (cfg.predicted or {}).get("chosen_by") or ("the planner" if cfg.predicted else None)
    if chosen == "autotune":
        return (f"autotune measured {pc.short()} the fastest of the layouts it tried for this model on these "
                f"ranks, so this share is the model's price here; {MORE_WORK}")
    if chosen:
        return (f"the planner picked {pc.short()} (`--autotune K` measures its best K layouts in the run); "
                f"{MORE_WORK}")
    if pc.tp > 1:
        smaller = max(1, pc.tp // 2)
        ok = fits_at_tp(cfg, mc, pc, smaller, memory_capacity_gib(device or torch.device("cpu")))
        if ok is False:
            return (f"parallel.tp ({pc.tp}) is the smallest that fits this model in memory here (the planner's "
                    f"estimate at tp {smaller} exceeds it): {MORE_WORK}")
        fit_note = "" if ok else " if the model fits at that size (`tpkernels plan` predicts each layout's memory)"
        return f"lower parallel.tp ({pc.tp} -> {smaller}, with more dp or pp){fit_note}; or {MORE_WORK}"
    if pc.cp > 1:
        return f"lower parallel.cp ({pc.cp}) or give each rank longer sequences"
    return f"give each rank more work: {MORE_WORK}"


def exposed_comm_s(trace) -> float:
    """Seconds of TP and CP communication that no GEMM hid, from a CommTrace of the step."""
    from tpkernels.parallel.trace import _merge  # noqa: PLC0415

    total = sum(e - s for s, e in _merge(trace.intervals("comm")))
    return total * (1.0 - trace.hidden_comm_fraction())


def median(xs: list[float]) -> float:
    """The middle value (the upper one of an even count), nan for none: robust to one slow step."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


PHASES = ("compute", "tp_comm", "p2p_wait", "dp_reduce", "other")


def step_phases(step_s: float, fwd_bwd_s: float, tp_comm_s: float, dp_s: float, timeline=None) -> dict:
    """This rank's step in seconds by phase: ``tp_comm`` the exposed TP/CP transfers, ``p2p_wait`` the
    pipeline's idle time between its actions (waiting for a neighbour stage), ``dp_reduce`` the
    wait for the data-parallel gradient reduction after the backward, ``compute`` the rest of the
    forward and backward, ``other`` the optimizer step and host work."""
    wait = 0.0
    if timeline:
        span = max(e for _, _, e in timeline) - min(s for _, s, _ in timeline)
        wait = max(0.0, span - sum(e - s for _, s, e in timeline))
    compute = max(0.0, fwd_bwd_s - tp_comm_s - wait)
    return {"compute": compute, "tp_comm": tp_comm_s, "p2p_wait": wait, "dp_reduce": dp_s,
            "other": max(0.0, step_s - fwd_bwd_s - dp_s)}


def idle_share(timeline) -> float:
    """1 − busy / span of this rank's pipeline actions (its share of the bubble)."""
    if not timeline:
        return 0.0
    span = max(e for _, _, e in timeline) - min(s for _, s, _ in timeline)
    busy = sum(e - s for _, s, e in timeline)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def step_trace_events(rank: int, trace, timeline) -> list[dict]:
    """Chrome-trace events of one step on this rank: GEMMs (tid 0), TP transfers (tid 1) and the
    pipeline actions (tid 2), on one host time base."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": n}}
               for t, n in ((0, "GEMM"), (1, "TP communication"), (2, "pipeline"))]
    events += trace.chrome_events(rank)
    for a, s, e in timeline:
        events.append({"name": str(a), "cat": a.kind, "ph": "X", "pid": rank, "tid": 2,
                       "ts": (trace._t0_wall + (s - trace._t0)) * 1e6, "dur": (e - s) * 1e6,
                       "args": {"microbatch": a.mb, "chunk": a.chunk}})
    return events


def write_trace(path: str | Path, events_by_rank: list[list[dict]]) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": [e for evs in events_by_rank for e in evs], "displayTimeUnit": "ms"}, f)
