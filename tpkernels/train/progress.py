"""What rank 0 shows while a run trains, and the summary it ends with.

On a terminal: tqdm's bar (its postfix updated every ``logging.log_every`` steps). When stdout is a
file or a pipe (a job log, ``tee``, CI), a bar's carriage returns make one endless line, so the run
writes one plain line per ``log_every`` steps instead::

    step 10/40  loss 4.5217  lr 2.85e-03  tokens/s 10,870  ETA 0:00:03

The summary's tokens/s and MFU are over the steps the run trained (total tokens / total step time),
not the last step's: a step's rate is noisy and the first one carries the warm-up.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path


def _eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds))) if seconds == seconds else "?"


class PlainProgress:
    """One line per logging step (``show``), for a stdout that is not a terminal; the ETA is the remaining
    steps at the mean step time of this run's steps after its first (the warm-up)."""

    def __init__(self, total: int, initial: int, stream=None):
        self.total, self.initial = total, initial
        self.stream = stream or sys.stdout
        self.times: list[float] = []

    def show(self, rec: dict, logging_step: bool) -> None:
        self.times.append(rec["step_s"])
        if not logging_step:
            return
        timed = self.times[1:] or self.times
        left = self.total - rec["step"] - 1
        eta = left * sum(timed) / len(timed)
        extra = f"  eval {rec['eval/loss']:.4f}" if "eval/loss" in rec else ""
        if "rewards/accuracies" in rec:
            extra += f"  acc {rec['rewards/accuracies']:.2f}"
        if "moe/aux_loss" in rec:  # a mixture-of-experts model: the balancing loss and the worst imbalance
            extra += f"  aux {rec['moe/aux_loss']:.4f}  load max/mean {rec['moe/load_max_over_mean']:.2f}"
        print(f"step {rec['step'] + 1}/{self.total}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
              f"tokens/s {rec['tokens_per_s']:,.0f}{extra}  ETA {_eta(eta)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class BarProgress:
    """tqdm's bar on a terminal."""

    def __init__(self, total: int, initial: int, desc: str):
        from tqdm import tqdm  # noqa: PLC0415

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step")

    def show(self, rec: dict, logging_step: bool) -> None:
        self.bar.update(1)
        if logging_step:
            self.bar.set_postfix(
                loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", gnorm=f"{rec['grad_norm']:.3f}",
                tok_s=f"{rec['tokens_per_s']:.0f}", step_s=f"{rec['step_s']:.3f}", mfu=f"{100 * rec['mfu']:.1f}%",
                comm=f"{100 * rec['comm_ratio']:.0f}%", bubble=f"{100 * rec['bubble']:.0f}%",
                **({"acc": f"{rec['rewards/accuracies']:.2f}", "margin": f"{rec['rewards/margins']:.3f}"}
                   if "rewards/accuracies" in rec else {}),
                **({"aux": f"{rec['moe/aux_loss']:.4f}", "load": f"{rec['moe/load_max_over_mean']:.2f}"}
                   if "moe/aux_loss" in rec else {}),
                **({"eval": f"{rec['eval/loss']:.4f}"} if "eval/loss" in rec else {}))

    def close(self) -> None:
        self.bar.close()


def make_progress(total: int, initial: int, desc: str, stream=None):
    """A bar when ``stream`` (stdout) is a terminal, plain lines otherwise."""
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return BarProgress(total, initial, desc)
    return PlainProgress(total, initial, stream)


def over_the_run(history: list[dict]) -> tuple[float, float]:
    """(tokens/s, MFU) over the steps of ``history``: total tokens / total step time, and the MFU of that
    time (each step's MFU weighted by its time: the FLOPs of the steps / their time × ranks × peak)."""
    total = sum(h["step_s"] for h in history)
    if total <= 0:
        return float("nan"), float("nan")
    return (sum(h["tokens_per_s"] * h["step_s"] for h in history) / total,
            sum(h["mfu"] * h["step_s"] for h in history) / total)


def run_summary(cfg, history: list[dict], *, layout: str, peak_label: str = "", wall_s: float | None = None) -> str:
    """The block a run ends with: its steps and loss, eval losses (final and best), speed over the run, and
    where its checkpoints, metrics, TensorBoard files and traces are (and how to export)."""
    from tpkernels.train import checkpoint  # noqa: PLC0415

    first, last = history[0], history[-1]
    n = len(history)
    lines = [f"{layout}: {n} step{'s' * (n != 1)}: loss {first['loss']:.4f} -> {last['loss']:.4f}",
             f"  steps        {last['step'] + 1} of {cfg.training.steps} done; this run trained {n} (the metrics "
             f"file's steps {first['step']}-{last['step']})"]
    evals = [(h["eval/loss"], h["step"]) for h in history if "eval/loss" in h]
    if evals:
        best = min(evals)
        lines.append(f"  eval loss    {evals[-1][0]:.4f} final, {best[0]:.4f} best (after step {best[1]})")
    tps, mfu = over_the_run(history)
    vs = f" vs {peak_label}" if peak_label else ""
    took = f", {wall_s:.1f} s in all" if wall_s is not None else ""
    lines.append(f"  speed        {tps:,.0f} tokens/s, MFU {100 * mfu:.3g}%{vs}, over the run's {n} "
                 f"step{'s' * (n != 1)} ({sum(h['step_s'] for h in history):.2f} s of steps{took})")
    ck, lg = cfg.checkpoint, cfg.logging
    latest = checkpoint.latest(ck.save_dir) if ck.save_dir and Path(ck.save_dir).is_dir() else None
    if latest is not None:
        lines.append(f"  checkpoint   {latest} (resume: run the same command; export: tpkernels export-hf "
                     f"{latest} OUT_FOLDER)")
    elif ck.save_dir:
        lines.append(f"  checkpoint   none complete in {ck.save_dir}")
    else:
        lines.append("  checkpoint   none: checkpoint.save_dir is not set, the trained model is not kept")
    for key, value, how in (("metrics", lg.metrics_file, ""),
                            ("tensorboard", lg.tensorboard_dir, f" (view: tensorboard --logdir {lg.tensorboard_dir})"),
                            ("trace", lg.trace, " (open in ui.perfetto.dev)")):
        if value:
            lines.append(f"  {key:<12} {value}{how}")
    return "\n".join(lines)


__all__ = ["BarProgress", "PlainProgress", "make_progress", "over_the_run", "run_summary"]
