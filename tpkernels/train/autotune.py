"""``layout: auto`` with ``autotune.candidates: K``: measure the planner's best K layouts in the run
that trains, then go on with the fastest.

    tpkernels train --layout auto --autotune 3 --nproc 4 ...

The trial phase trains: candidate 1 runs steps 0 … N (its first step is a warm-up, the next N
``autotune.steps`` are timed), candidate 2 resumes from there and runs the next N + 1, and so on;
the winner resumes from the last trial and trains to the end. Each switch goes through a
checkpoint in a trial folder (reshardable, exact: weights, AdamW moments, step, loss scale), and
the data of step k is the same at every layout, so no step is lost or repeated and the losses are
those of a run at one fixed layout, to fp32 reduction order (tests/test_autotune.py).

A candidate that every rank refuses before it starts (a layout rule, or on GPUs a predicted memory
above what the device has free) is reported and skipped. A failure inside a step (one rank out of
memory while the others wait in a collective) ends the run as any failure does: the rank that fails
cannot tell the others to skip without a collective they are not in.

Why not DeepSpeed's autotuner: it launches a short job per configuration and restarts, so nothing
it measures trains the model and its search starts again on every launch.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tpkernels.parallel import ParallelConfig, control
from tpkernels.parallel.config import ParallelConfigError
from tpkernels.train import checkpoint
from tpkernels.train.auto_layout import KEPT
from tpkernels.train.config import TrainConfig
from tpkernels.parallel.groups import group_rank_size
from tpkernels.train.metrics import MetricsFile, median



@dataclasses.dataclass(frozen=True)
class Prediction:
    """The planner's figures for one candidate: step time, its bubble and comm/compute shares, memory per
    GPU and (for the fit) the step's compute and communication parts, and the machine they are for."""

    step_s: float
    bubble: float = 0.0
    comm_ratio: float = 0.0
    memory_gib: float = 0.0
    compute_s: float | None = None
    comm_s: float | None = None
    machine: str | None = None
    ops: float | None = None  # kernels on the critical path (the fit's per-op term)

    @classmethod
    def of(cls, est, p) -> "Prediction":
        """From the planner's Estimate ``est`` of the Plan ``p``."""
        from tpkernels.planner.fit import components  # noqa: PLC0415

        compute, comm, ops = components(est.time, p.efficiency)
        return cls(est.step_time, est.bubble_fraction, est.time.comm_ratio, est.memory.total / 2**30, compute, comm,
                   p.machine_key, ops)

    def report(self, layout: str) -> dict:
        """What the run's prediction report reads (``TrainConfig.predicted``)."""
        return {"step_s": self.step_s, "bubble": self.bubble, "comm_ratio": self.comm_ratio, "layout": layout}


@dataclasses.dataclass(frozen=True)
class Candidate:
    parallel: ParallelConfig
    predicted: Prediction
    why: str = "planner's rank"  # how it came to be tried: the planner's ranking, or the config's own layout


def family(pc: ParallelConfig) -> str:
    """The structural kind of a layout, by what it spends its communication on."""
    return "TP" if pc.tp > 1 else "CP" if pc.cp > 1 else "PP" if pc.pp > 1 else "DP"


def diverse_order(items: list, config_of=lambda x: x.config) -> list:
    """``items`` (ranked fastest first) with the fastest of each family (TP, CP, PP, pure DP) first, then
    the rest in rank order. Trials of one family alone leave the fit's other terms unmeasured (the
    planner errs by family: on a 2-core box, +60–100% on TP layouts, −25–45% on PP ones), so the
    first trials span the families."""
    firsts, seen = [], set()
    for x in items:
        f = family(config_of(x))
        if f not in seen:
            seen.add(f)
            firsts.append(x)
    return firsts + [x for x in items if not any(x is y for y in firsts)]


def batch_change(pc: ParallelConfig, gb: int) -> str:
    """Why layout ``pc`` would not train the run's global batch ``gb`` ("" when it does): a layout that
    trained another batch would change the optimisation (the loss curve), not only the speed."""
    got = pc.micro_batch_size * pc.num_microbatches * (pc.dp or 1)
    if got == gb:
        return ""
    return (f"{label(pc)} is dropped: it trains {got} sequences per step (micro_batch_size {pc.micro_batch_size} × "
            f"num_microbatches {pc.num_microbatches} × dp {pc.dp}), not the run's global batch of {gb}")


def candidates_from_plan(cfg: TrainConfig, p, k: int) -> list[Candidate]:
    """The plan's ``k`` fastest layouts (one setting each) in :func:`diverse_order`, with the config's
    communication knobs; each trains the plan's global batch (one that does not is dropped, with a
    warning saying why: the planner's search only proposes layouts that do)."""
    out = []
    for est in diverse_order(p.ranked[:k]):
        parallel = est.config.replace(**{f: getattr(cfg.parallel, f) for f in KEPT})  # the user's comm knobs
        why = batch_change(parallel, p.train.global_batch)
        if why:
            warnings.warn(f"autotune: {why}", stacklevel=2)
            continue
        out.append(Candidate(parallel, Prediction.of(est, p)))
    return out


# the parallel keys that make a layout (micro-batching only sets the batch under layout: auto)
LAYOUT_KEYS = ("tp", "pp", "cp", "cp_algo", "virtual_stages", "schedule", "sequence_parallel", "recompute", "zero1")


def manual_candidate(cfg: TrainConfig, p, world: int) -> tuple[Candidate | None, str]:
    """The config's own ``parallel`` section as one more candidate, when it sets a layout (a key of
    LAYOUT_KEYS away from its default) next to ``layout: auto``: its TP, PP, CP, schedule and
    micro-batch size, with the micro-batch count that gives the plan's global batch (every candidate
    trains the same batches). ``(candidate, "")``; ``(None, why)`` when it cannot run here;
    ``(None, "")`` when the config sets no layout."""
    from tpkernels.planner import estimate  # noqa: PLC0415

    user, default = cfg.parallel, TrainConfig().parallel
    if all(getattr(user, k) == getattr(default, k) for k in LAYOUT_KEYS):
        return None, ""
    pc = user.for_world(world)
    gb, per = p.train.global_batch, pc.micro_batch_size * pc.dp
    if gb % per == 0:
        pc = pc.replace(num_microbatches=gb // per)
    try:
        pc.validate(world_size=world, key_prefix="parallel.", **p.model.layout_rules(p.train.seq_length))
        if gb % per:
            raise ParallelConfigError([f"the run's global batch ({gb}) is not a multiple of micro_batch_size × dp "
                                       f"({pc.micro_batch_size} × {pc.dp})"])
        if batch_change(pc, gb):
            raise ParallelConfigError([batch_change(pc, gb)])
        est = estimate(p.model, p.train, p.cluster, pc, p.efficiency)
    except (ParallelConfigError, ValueError) as e:
        return None, f"your layout ({user.short()}) is not tried: " + " ".join(str(e).split())
    return Candidate(pc, Prediction.of(est, p), why="your layout"), ""


def with_manual(cands: list[Candidate], tries: int, mine: Candidate | None) -> list[Candidate]:
    """``cands`` with the config's own layout among the first ``tries`` (it replaces the last planner's
    pick there when the trial budget has no room; nothing changes when the planner already tries it)."""
    if mine is None or label(mine.parallel) in {label(c.parallel) for c in cands[:tries]}:
        return cands
    rest = [c for c in cands if label(c.parallel) != label(mine.parallel)]
    return rest[:tries - 1] + [mine] + rest[tries - 1:]


def label(pc: ParallelConfig) -> str:
    """The layout and, with a pipeline, its schedule: two candidates may differ in the schedule only."""
    return pc.short() + (f" {pc.pipeline_schedule}" if pc.pp > 1 else "")


def trial_budget(cfg: TrainConfig, n: int) -> int:
    """How many of ``n`` candidates fit in ``autotune.max_share`` of the run's steps, leaving the winner
    at least one step (at least one candidate)."""
    per = 1 + cfg.autotune.steps
    room = min(cfg.autotune.max_share * cfg.training.steps, cfg.training.steps - 1)
    return max(1, min(n, int(room) // per))


def _trial_folder(cfg: TrainConfig) -> Path:
    """The folder trial checkpoints go to, emptied: under save_dir when there is one; else a temporary
    folder made by rank 0, whose path every rank takes, which only works when every rank shares its
    /tmp: a job on several nodes must give a save_dir they all see. The run removes it at the end."""
    if cfg.checkpoint.save_dir:
        name = str(Path(cfg.checkpoint.save_dir) / "autotune")
        if group_rank_size(None)[0] == 0:  # a crashed run's trials would be resumed as if they were this one's
            shutil.rmtree(name, ignore_errors=True)
        return Path(control.broadcast_object(name))
    nodes = len(set(control.all_gather_objects(socket.gethostname())))
    if nodes > 1:
        raise ValueError(f"autotune.candidates ({cfg.autotune.candidates}) on {nodes} nodes needs checkpoint.save_dir "
                         "on storage every node sees: the trials hand the model from one layout to the next through "
                         "a checkpoint there (without it rank 0's private temporary folder would be used)")
    mine = tempfile.mkdtemp(prefix="tpk_autotune_") if group_rank_size(None)[0] == 0 else None
    return Path(control.broadcast_object(mine))


def _fits_here(c: Candidate) -> bool:
    """On a GPU: the planner's memory for the candidate is within what the device has free (every rank)."""
    if not torch.cuda.is_available():
        return True
    free, _ = torch.cuda.mem_get_info()
    return control.agree_all(c.predicted.memory_gib * 2**30 <= free)


@dataclasses.dataclass
class TrialResult:
    """One candidate's trial: measured (``steps`` trained, medians of its timed steps) or skipped (why)."""

    candidate: int
    layout: str
    why: str
    predicted: Prediction
    skipped: str | None = None
    steps: tuple[int, int] | None = None  # first and last step trained
    step_s: float = math.nan
    bubble: float = math.nan
    comm_ratio: float = math.nan
    tokens_per_s: float = math.nan

    @property
    def measured(self) -> bool:
        return self.skipped is None

    def row(self) -> dict:
        """The metrics file's record of the trial."""
        out = {"candidate": self.candidate, "layout": self.layout, "why": self.why,
               "predicted_step_s": self.predicted.step_s, "predicted_bubble": self.predicted.bubble,
               "predicted_comm_ratio": self.predicted.comm_ratio,
               "status": "ok" if self.measured else f"skipped: {self.skipped}"}
        if self.measured:
            out.update(steps=f"{self.steps[0]}-{self.steps[1]}", measured_step_s=self.step_s, bubble=self.bubble,
                       comm_ratio=self.comm_ratio, tokens_per_s=self.tokens_per_s)
        return out


class TrialRunner:
    """Trains candidates one after another, each 1 + ``autotune.steps`` steps from where the last one
    stopped (through checkpoints in ``folder``), up to the run's last step (``training.stop_at_step``
    when set). ``results`` are rank 0's measurements on every rank (one winner for all)."""

    def __init__(self, cfg: TrainConfig, folder: Path, source: Path | None):
        self.cfg, self.folder, self.source = cfg, folder, source
        self.per = 1 + cfg.autotune.steps
        stop = cfg.training.stop_at_step
        self.last = cfg.training.steps if stop is None else min(cfg.training.steps, stop)
        self.first: int | None = None  # the first step the trials trained
        self.step: int | None = None  # the next step to train
        self.results: list[TrialResult] = []
        self.history: list[dict] = []

    @property
    def done(self) -> bool:
        return self.step is not None and self.step >= self.last

    def room_for_one_more(self) -> bool:
        return (self.step or 0) + self.per < self.last

    def _trial_config(self, c: Candidate) -> TrainConfig:
        cfg, ck = self.cfg, self.cfg.checkpoint
        return dataclasses.replace(
            cfg, layout="manual", parallel=c.parallel, predicted=None,
            autotune=dataclasses.replace(cfg.autotune, candidates=0, adapt=False, monitor_every=0),
            checkpoint=dataclasses.replace(ck, save_dir=str(self.folder), save_every=0, resume=False,
                                           async_save=False),
            logging=dataclasses.replace(cfg.logging, progress=False, trace=None))

    def run(self, i: int, c: Candidate, why: str) -> None:
        """Train candidate ``i`` for its trial's steps (or record why it cannot run here)."""
        from tpkernels.train.trainer import Trainer  # noqa: PLC0415

        result = TrialResult(i, label(c.parallel), why, c.predicted)
        if not _fits_here(c):
            result.skipped = f"the planner's {c.predicted.memory_gib:.1f} GiB per GPU exceeds the free device memory"
        else:
            trial_cfg = self._trial_config(c)
            try:
                trainer = Trainer(trial_cfg, resume_dir=self.source)
            except (ParallelConfigError, ValueError) as e:  # every rank refuses the same layout alike
                result.skipped = " ".join(str(e).split())[:200]
            else:
                trainer.narrate = False  # its checkpoints are the hand-over, its comm/compute is in the table
                self._measure(trainer, trial_cfg, result)
                del trainer
                gc.collect()
        self.results = control.broadcast_object(self.results + [result])

    def _measure(self, trainer, trial_cfg: TrainConfig, result: TrialResult) -> None:
        start = trainer.step_index
        self.first = start if self.first is None else self.first
        trainer.cfg = dataclasses.replace(trial_cfg, training=dataclasses.replace(
            trial_cfg.training, stop_at_step=min(start + self.per, self.last)))
        h = trainer.train()  # saves its last step into the trial folder: the next layout starts there
        self.step, self.source = trainer.step_index, self.folder
        self.history += h
        timed = h[1:] or h
        result.steps = (h[0]["step"], h[-1]["step"]) if h else (start, start)
        result.step_s = median([r["step_s"] for r in timed]) if timed else math.nan
        result.bubble = median([r["bubble"] for r in timed]) if timed else math.nan
        result.comm_ratio = median([r["comm_ratio"] for r in timed]) if timed else math.nan
        result.tokens_per_s = trainer.pc.global_batch_size * self.cfg.data.seq_length / result.step_s


def train_autotuned(cfg: TrainConfig, cands: list[Candidate], tries: int | None = None) -> list[dict]:
    """Every rank: the trial phase over the first ``tries`` of ``cands`` (the planner's ranking; all of
    them by default), then, when the corrections fitted to those trials make the planner prefer an
    untried candidate, that one too (steps permitting); then the fastest measured to the last step.
    Returns the history of every step, trial steps included."""
    t_start = time.perf_counter()
    cands = control.broadcast_object(list(cands))  # under torchrun each rank planned for itself: rank 0's list
    folder = _trial_folder(cfg)
    ck = cfg.checkpoint
    # a resumed run goes on from its own latest checkpoint, the trial phase included
    source = Path(ck.save_dir) if ck.save_dir and ck.resume and checkpoint.latest(ck.save_dir) else None
    trials = TrialRunner(cfg, folder, source)
    for i, c in enumerate(cands[:len(cands) if tries is None else tries]):
        if trials.done:
            break
        trials.run(i, c, c.why)
    favourite = _untried_favourite(cands, trials.results)
    if favourite is not None and trials.room_for_one_more():
        trials.run(favourite, cands[favourite], "refit planner's pick")
    best = _fastest(trials.results)
    t_trials = time.perf_counter() - t_start
    if group_rank_size(None)[0] == 0:
        print(report(trials, best), flush=True)
        said = learn(cfg, cands, trials.results)
        if said:
            print(said, flush=True)
    history, switches = trials.history, []
    if not trials.done:
        more, switches = _run_winner(cfg, cands, trials, best.candidate)
        history = history + more
    elif ck.save_dir:  # the trials ran to the last step: their last checkpoint is the run's
        _hand_over(trials.folder, Path(ck.save_dir))
    _summarise(cfg, trials, best, switches, t_trials, time.perf_counter() - t_start)
    control.barrier()  # every rank has loaded the last trial before its folder goes
    if group_rank_size(None)[0] == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return history


def _fastest(results: list[TrialResult]) -> TrialResult:
    measured = [r for r in results if r.measured]
    if not measured:
        raise RuntimeError("autotune: every candidate was skipped: " + "; ".join(f"{r.layout}: {r.skipped}"
                                                                                  for r in results))
    return min(measured, key=lambda r: r.step_s)


def _untried_favourite(cands: list[Candidate], results: list[TrialResult]) -> int | None:
    """The candidate the planner, refitted to the trials, predicts fastest, when it was not tried and
    is predicted faster than the best measured by more than 5% (less is within the trials' noise)."""
    refit = _refit(cands, results)
    if refit is None:
        return None
    _, pick, predicted = refit
    best = min(r.step_s for r in results if r.measured)
    if pick in {r.candidate for r in results} or predicted[pick] >= 0.95 * best:
        return None
    return pick


def _run_winner(cfg: TrainConfig, cands: list[Candidate], trials: TrialRunner, current: int
                ) -> tuple[list[dict], list[dict]]:
    """The fastest measured layout from the last trial's checkpoint to the run's last step, watched by the
    slowdown monitor; with ``autotune.adapt``, one switch to a re-ranked candidate through a
    checkpoint after a sustained slowdown. Returns (history, switches)."""
    from tpkernels.train.trainer import Trainer  # noqa: PLC0415

    ck = cfg.checkpoint
    watched = dataclasses.replace(cfg.autotune, candidates=0, adapt=False)
    # adapting needs a checkpoint to switch through: the trial folder when the run keeps none
    final_ck = ck if ck.save_dir or not cfg.autotune.adapt else dataclasses.replace(
        ck, save_dir=str(trials.folder), save_every=0)
    history, switches, source = [], [], trials.source
    while True:
        c = cands[current]
        run_cfg = dataclasses.replace(cfg, layout="manual", parallel=c.parallel, autotune=watched, checkpoint=final_ck,
                                      predicted={**c.predicted.report(label(c.parallel)), "chosen_by": "autotune"})
        trainer = Trainer(run_cfg, resume_dir=source)
        history += trainer.train(stop_on_slowdown=cfg.autotune.adapt and not switches)
        source, slow = final_ck.save_dir, (trainer.slowdowns[-1] if trainer.slowdowns else None)
        if slow is None or not cfg.autotune.adapt or switches or trainer.step_index >= trials.last:
            return history, switches
        move = _adapt(cands, trials.results, current, slow, cfg.autotune.slowdown)
        switches.append({"step": trainer.step_index, "from": label(c.parallel), **move})
        if group_rank_size(None)[0] == 0:
            MetricsFile.of(cfg).write({"adapt": switches[-1]})
            print(move["text"], flush=True)
        current = move["to_candidate"] if move["to_candidate"] is not None else current
        del trainer
        gc.collect()


def _hand_over(folder: Path, save_dir: Path) -> None:
    """The trial folder's last checkpoint copied into the run's save_dir (rank 0; every rank waits)."""
    if group_rank_size(None)[0] == 0:
        done = checkpoint.latest(folder)
        shutil.copytree(done, save_dir / done.name, dirs_exist_ok=True)
    control.barrier()


def _summarise(cfg: TrainConfig, trials: TrialRunner, best: TrialResult, switches: list[dict], t_trials: float,
               total: float) -> None:
    """The run's autotune record in the metrics file and one line on rank 0."""
    if group_rank_size(None)[0] != 0:
        return
    n = (trials.step or 0) - (trials.first or 0)
    MetricsFile.of(cfg).write({
        "autotune": [r.row() for r in trials.results], "winner": best.layout, "trial_steps": n, "trial_s": t_trials,
        "run_s": total, "trial_share": t_trials / total, "switches": switches})
    print(f"autotune: the trial phase ({n} steps) took {t_trials:.1f} s of the run's {total:.1f} s "
          f"({100 * t_trials / total:.0f}%); each of its steps trained the model", flush=True)


def _refit(cands: list[Candidate], results: list[TrialResult]):
    """(the fitted corrections, the candidate they predict fastest, every candidate's prediction), or
    None when the trials measured nothing or the candidates carry no planner components."""
    from tpkernels.planner import fit as fitting  # noqa: PLC0415

    ok = [(cands[r.candidate].predicted, r.step_s) for r in results if r.measured]
    if not ok or any(c.predicted.compute_s is None or c.predicted.comm_s is None for c in cands):
        return None
    f = fitting.fit([(p.compute_s, p.comm_s, p.ops or 0.0, t) for p, t in ok])  # no kernel count: no per-op term
    predicted = [f.predict(c.predicted.compute_s, c.predicted.comm_s, c.predicted.ops or 0.0) for c in cands]
    return f, min(range(len(cands)), key=predicted.__getitem__), predicted


def _adapt(cands: list[Candidate], results: list[TrialResult], current: int, slow, threshold: float) -> dict:
    """After a sustained slowdown: the trials' corrections scaled by how much the slowest rank's own work
    (compute, host) and waiting (TP/CP, P2P, DP) grew, every candidate predicted again, and the
    fastest taken when it beats the degraded step by more than ``threshold``. Every rank computes the
    same (the monitor's figures were exchanged)."""
    refit = _refit(cands, results)
    here = label(cands[current].parallel)
    if refit is None:
        return {"to": here, "to_candidate": None,
                "text": f"adapt: {slow.text}; the candidates carry no planner figures to re-rank: staying on {here}"}
    f = refit[0]
    b, n = slow.base_phases, slow.now_phases
    own = lambda x: x["compute"] + x["other"]  # noqa: E731
    wait = lambda x: x["tp_comm"] + x["p2p_wait"] + x["dp_reduce"]  # noqa: E731
    a = f.compute_scale * (own(n) / own(b) if own(b) > 0 else 1.0)
    c = f.comm_scale * (wait(n) / wait(b) if wait(b) > 1e-6 else 1.0)
    predicted = [a * x.predicted.compute_s + c * x.predicted.comm_s + f.op_overhead_s * (x.predicted.ops or 0.0)
                 for x in cands]
    j = min(range(len(cands)), key=predicted.__getitem__)
    head = (f"adapt: the step slowed from {slow.baseline_s:.3g} s to {slow.now_s:.3g} s ({slow.kind}: "
            f"{slow.wait_phase}); refitted: compute ×{a:.3g}, communication ×{c:.3g}")
    if j != current and predicted[j] < (1 - threshold) * slow.now_s:
        to = label(cands[j].parallel)
        return {"to": to, "to_candidate": j, "predicted_s": predicted[j], "now_s": slow.now_s,
                "text": f"{head}; switching from {here} to {to}, predicted {predicted[j]:.3g} s per step, through "
                        "a checkpoint (no step lost)"}
    return {"to": here, "to_candidate": None, "predicted_s": predicted[j], "now_s": slow.now_s,
            "text": f"{head}; no candidate is predicted faster by more than {100 * threshold:.0f}%: staying on {here}"}


def learn(cfg: TrainConfig, cands: list[Candidate], results: list[TrialResult]) -> str | None:
    """Fit the planner's corrections to the measured trials and keep them for this machine (rank 0);
    returns what it says, or None (cache off, no machine, no measurement)."""
    from tpkernels.planner import fit as fitting  # noqa: PLC0415

    key = cands[0].predicted.machine if cands else None
    refit = _refit(cands, results)
    if not (cfg.autotune.cache and key and refit):
        return None
    f = refit[0]
    path = fitting.save(key, f, layouts=[r.layout for r in results if r.measured], model=cfg.model.name,
                        seq_length=cfg.data.seq_length)
    return f"planner refit for {key}: {f.describe()}; kept in {path} for the next plan on this machine"


def report(trials: TrialRunner, best: TrialResult) -> str:
    """The trial phase's table: predicted and measured step, bubble, comm/compute, tokens/s, the winner."""
    cfg, results = trials.cfg, trials.results
    head = ("layout", "tried as", "steps", "predicted s", "measured s", "bubble", "comm/comp", "tokens/s", "")
    body = []
    for r in results:
        if not r.measured:
            body.append((r.layout, r.why, "-", f"{r.predicted.step_s:.3g}", "-", "-", "-", "-", f"skipped: {r.skipped}"))
            continue
        body.append((r.layout, r.why, f"{r.steps[0]}-{r.steps[1]}", f"{r.predicted.step_s:.3g}", f"{r.step_s:.3g}",
                     f"{100 * r.bubble:.0f}%", f"{100 * r.comm_ratio:.0f}%", f"{r.tokens_per_s:.0f}",
                     "← fastest measured" if r is best else ""))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [f"autotune: {len(results)} candidate(s), 1 warm-up + {cfg.autotune.steps} timed step(s) each; steps "
             f"{trials.first}-{(trials.step or 0) - 1} of {cfg.training.steps} trained on the way"]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head, *body]]
    predicted_best = min(results, key=lambda r: r.predicted.step_s).layout
    why = ("the planner's first choice, confirmed" if best.layout == predicted_best else
           f"measured faster than the planner's first choice {predicted_best}")
    lines.append(f"continuing with {best.layout}: {why}")
    return "\n".join(lines)


__all__ = ["Candidate", "Prediction", "TrialResult", "TrialRunner", "batch_change", "candidates_from_plan", "diverse_order", "family", "label", "learn", "report", "train_autotuned", "trial_budget"]
