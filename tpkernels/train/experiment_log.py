"""The metrics file's records mirrored to TensorBoard (``logging.tensorboard_dir``) and, when the user has
it, Weights & Biases in offline mode (``logging.wandb_project``).

    log = TensorBoardLog("runs/demo", purge_step=0)      # a new run: the folder's earlier curves are dropped
    log.write({"step": 3, "loss": 2.1, "phases": {"compute": 0.2}, "layout": "tp2 pp2 dp1"})
    log.close()

One rule turns any record the metrics file gets into TensorBoard summaries, so a new kind of record
needs no code here (:func:`split_record`): ``step`` is the x axis; a number (a bool as 0/1) is a
scalar whose tag is the record's key (``loss``, ``eval/loss``, ``rewards/accuracies``); a nested
mapping's keys join with ``/`` (``phases/compute``); a string is text, and a list of mappings is
text too, as a markdown table (the autotune trials with their layouts, the FP8 guardrail's
records). A record without a step (the FP8 choice, the autotune summary) is placed at the last
step written. The run's context strings (``layout``, ``mfu_vs``) are written when they change, not
at every step.

A resumed run continues the same curves: the writer opens with ``purge_step`` = the step the run
resumes at, which makes TensorBoard's readers drop the earlier run's events from that step on
(those steps are trained again), as :class:`~tpkernels.train.metrics.MetricsFile` drops their
lines. A new run opens with ``purge_step`` 0: the folder's earlier curves are dropped, as a new
metrics file starts empty (the earlier event files stay on disk; the readers skip their events).

The writer is ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package writes the
event files): nothing here writes the event format itself.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from pathlib import Path

CONTEXT_KEYS = ("layout", "mfu_vs")  # the same on every step record: written when they change


def split_record(record: dict, prefix: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """(scalars, texts) of a metrics record, tags as in the module docstring (``step`` left out)."""
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if not prefix and key == "step" or value is None:
            continue
        if isinstance(value, bool):
            scalars[tag] = float(value)
        elif isinstance(value, (int, float)):
            scalars[tag] = float(value)
        elif isinstance(value, str):
            texts[tag] = value
        elif isinstance(value, dict):
            s, t = split_record(value, f"{tag}/")
            scalars.update(s)
            texts.update(t)
        elif isinstance(value, (list, tuple)) and value:  # an empty list says nothing
            texts[tag] = markdown_table(value) if value and all(isinstance(v, dict) for v in value) \
                else ", ".join(_cell(v) for v in value)
    return scalars, texts


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict]) -> str:
    """Rows of mappings as a markdown table (TensorBoard's text tab renders it), columns in first-seen order."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else _cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def config_text(config: dict) -> str:
    """The run's config as a YAML block for TensorBoard's text tab (markdown: indented = verbatim)."""
    import yaml  # noqa: PLC0415

    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    return "\n".join("    " + line for line in body.splitlines())


class TensorBoardLog:
    """Event files in ``folder`` (see the module docstring); ``purge_step``: the step from which the readers
    drop the folder's earlier events (a resumed run's first step; 0 for a new run), None: none dropped."""

    def __init__(self, folder: str | Path, purge_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ValueError(f"logging.tensorboard_dir ({str(folder)!r}) needs the tensorboard package "
                             f"(pip install tensorboard): {e}") from e
        self.folder = Path(folder)
        _after_newest_event_file(self.folder)
        self.step = purge_step or 0
        self.last_step: int | None = None  # the newest step a record of this writer carried
        self._said: dict[str, str] = {}
        self.writer = SummaryWriter(str(self.folder), purge_step=purge_step, flush_secs=10)

    def write(self, record: dict) -> None:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = step
            self.last_step = step if self.last_step is None else max(self.last_step, step)
        scalars, texts = split_record(record)
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, self.step)
        for tag, text in texts.items():
            if tag in CONTEXT_KEYS:
                if self._said.get(tag) == text:
                    continue
                self._said[tag] = text
            self.writer.add_text(tag, text, self.step)
        self.writer.flush()  # a reader (or a killed run) sees every finished step

    def text(self, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, self.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _after_newest_event_file(folder: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and the name starts with the second the file
    was opened: a file opened in the same second as the newest one could sort before it (its events
    then read as older). Wait for the next second in that case (a resume in the same process, tests)."""
    if not folder.is_dir():
        return
    stamps = []
    for p in folder.glob("events.out.tfevents.*"):
        try:
            stamps.append(int(p.name.split(".")[3]))
        except (IndexError, ValueError):
            continue
    if stamps:
        wait = max(stamps) + 1 - time.time()
        if wait > 0:
            time.sleep(wait)


class WandbLog:
    """The same scalars through ``wandb`` in offline mode (no network: ``wandb sync`` uploads later).
    A resumed run starts a new offline run that begins at its resume step (wandb cannot drop steps
    of an earlier run)."""

    def __init__(self, project: str, config: dict, folder: str | Path | None):
        wandb = import_wandb(project)
        kw = {"dir": str(folder)} if folder else {}
        self.run = wandb.init(project=project, mode="offline", config=config, **kw)
        self.last_step: int | None = None

    def write(self, record: dict) -> None:
        step = record.get("step")
        scalars, _ = split_record(record)
        scalars = {k: v for k, v in scalars.items() if math.isfinite(v)}
        if isinstance(step, int) and not isinstance(step, bool):
            self.last_step = step
        if scalars:  # wandb's steps only go up: a record without one is logged at the last step
            self.run.log(scalars, step=self.last_step)

    def close(self) -> None:
        self.run.finish()


def import_wandb(project: str):
    try:
        import wandb  # noqa: PLC0415
    except ImportError as e:
        raise ValueError(f"logging.wandb_project ({project!r}) needs the wandb package, which is not installed "
                         "(pip install wandb), or leave logging.wandb_project unset") from e
    os.environ.setdefault("WANDB_MODE", "offline")
    return wandb


# One writer per folder (project) in a process: the trainers one run builds in turn (autotune's trials,
# then its winner) continue one event file; a run that goes back (a resume in the same process) opens
# a new one that drops the steps trained again.
_OPEN: dict[tuple[str, str], "TensorBoardLog | WandbLog"] = {}


def _register(key, log):
    if not _OPEN:
        atexit.register(close_logs)  # the last events reach the disk however the process ends normally
    _OPEN[key] = log
    return log


def open_log(kind: str, where: str, resumed_step: int | None, make) -> "TensorBoardLog | WandbLog":
    """The process's log of ``kind`` at ``where`` for a run starting at ``resumed_step`` (None: a new run):
    the open one when the run goes on after its last step, else a new one from ``make(purge_step)``."""
    key = (kind, where)
    log = _OPEN.get(key)
    if log is not None and resumed_step is not None and (log.last_step is None or resumed_step > log.last_step):
        return log
    if log is not None:
        del _OPEN[key]
        log.close()
    return _register(key, make(0 if resumed_step is None else resumed_step))


def current_log(kind: str, where: str, make) -> "TensorBoardLog | WandbLog":
    """The open log (a record written outside a trainer: autotune's summary), or a new one dropping nothing."""
    key = (kind, where)
    return _OPEN[key] if key in _OPEN else _register(key, make(None))


def close_logs() -> None:
    """Close every open writer (the end of a run)."""
    while _OPEN:
        _OPEN.popitem()[1].close()


def wandb_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("wandb") is not None


def tensorboard_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("tensorboard") is not None


__all__ = ["CONTEXT_KEYS", "TensorBoardLog", "WandbLog", "close_logs", "config_text", "current_log", "markdown_table",
           "open_log", "split_record", "tensorboard_available", "wandb_available"]
