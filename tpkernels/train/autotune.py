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
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpkernels.parallel import ParallelConfig
from tpkernels.parallel.config import ParallelConfigError
from tpkernels.train import checkpoint
from tpkernels.train.auto_layout import KEPT
from tpkernels.train.config import TrainConfig
from tpkernels.parallel.groups import group_rank_size
from tpkernels.train.metrics import MetricsFile, median



@dataclasses.dataclass(frozen=True)
class Candidate:
    parallel: ParallelConfig
    predicted: dict  # the planner's step_s, bubble, comm_ratio, memory_gib, layout
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


def candidates_from_plan(cfg: TrainConfig, p, k: int) -> list[Candidate]:
    """The plan's ``k`` fastest layouts (one setting each) in :func:`diverse_order`, with the config's
    communication knobs."""
    out = []
    for est in diverse_order(p.ranked[:k]):
        parallel = est.config.replace(**{f: getattr(cfg.parallel, f) for f in KEPT})  # the user's comm knobs
        out.append(Candidate(parallel, _predicted(est, parallel, p)))
    return out


def _predicted(est, parallel: ParallelConfig, p) -> dict:
    """What a candidate carries of the planner's Estimate ``est`` (of the Plan ``p``)."""
    from tpkernels.planner.fit import components  # noqa: PLC0415

    compute, comm = components(est.time, p.efficiency)
    return {"step_s": est.step_time, "bubble": est.bubble_fraction, "comm_ratio": est.time.comm_ratio,
            "memory_gib": est.memory.total / 2**30, "layout": label(parallel), "compute_s": compute, "comm_s": comm,
            "machine": p.machine_key}


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
        est = estimate(p.model, p.train, p.cluster, pc, p.efficiency)
    except (ParallelConfigError, ValueError) as e:
        return None, f"your layout ({user.short()}) is not tried: " + " ".join(str(e).split())
    return Candidate(pc, _predicted(est, pc, p), why="your layout"), ""


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


def _agree(flag: bool) -> bool:
    """True on every rank when it is true on every rank."""
    if group_rank_size(None)[1] == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _trial_folder(cfg: TrainConfig) -> Path:
    """The folder trial checkpoints go to, emptied: under save_dir when there is one (every rank of a
    multi-node job sees it); else a temporary folder made by rank 0, whose path every rank takes (one
    node: they share /tmp). The run removes it at the end."""
    rank, world = group_rank_size(None)
    if cfg.checkpoint.save_dir:
        name = [str(Path(cfg.checkpoint.save_dir) / "autotune")]
        if rank == 0:  # a crashed run's trials would be resumed as if they were this one's
            shutil.rmtree(name[0], ignore_errors=True)
    else:
        name = [tempfile.mkdtemp(prefix="tpk_autotune_") if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _fits_here(c: Candidate) -> bool:
    """On a GPU: the planner's memory for the candidate is within what the device has free (every rank)."""
    if not torch.cuda.is_available():
        return True
    free, _ = torch.cuda.mem_get_info()
    return _agree(c.predicted["memory_gib"] * 2**30 <= free)


def _shared(obj):
    """Rank 0's ``obj`` on every rank (the ranks time their own steps: they must pick one winner)."""
    box = [obj]
    if group_rank_size(None)[1] > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def train_autotuned(cfg: TrainConfig, cands: list[Candidate], tries: int | None = None) -> list[dict]:
    """Every rank: the trial phase over the first ``tries`` of ``cands`` (the planner's ranking; all of
    them by default), then, when the corrections fitted to those trials make the planner prefer an
    untried candidate, that one too (steps permitting); then the fastest measured to the last step.
    Returns the history of every step, trial steps included."""
    from tpkernels.train.trainer import Trainer  # noqa: PLC0415

    t_start = time.perf_counter()
    rank, world = group_rank_size(None)
    cands = _shared(list(cands))  # under torchrun each rank planned for itself: rank 0's list for all
    folder = _trial_folder(cfg)
    ck, steps, per = cfg.checkpoint, cfg.training.steps, 1 + cfg.autotune.steps
    tries = len(cands) if tries is None else tries
    # each trial and the winner run one fixed layout; only the winner's phase is monitored
    off = dataclasses.replace(cfg.autotune, candidates=0, adapt=False, monitor_every=0)
    watched = dataclasses.replace(cfg.autotune, candidates=0, adapt=False)
    # a resumed run goes on from its own latest checkpoint, the trial phase included
    source = Path(ck.save_dir) if ck.save_dir and ck.resume and checkpoint.latest(ck.save_dir) else None
    history: list[dict] = []
    rows: list[dict] = []
    state = {"first": None, "step": None, "source": source}

    def trial(i: int, c: Candidate, why: str) -> None:
        """Train candidate ``i`` for 1 + autotune.steps steps from where the last one stopped."""
        row = {"candidate": i, "layout": label(c.parallel), "predicted_step_s": c.predicted["step_s"],
               "predicted_bubble": c.predicted["bubble"], "predicted_comm_ratio": c.predicted["comm_ratio"],
               "why": why}
        if not _fits_here(c):
            rows.append({**row, "status": f"skipped: the planner's {c.predicted['memory_gib']:.1f} GiB per GPU "
                                           "exceeds the free device memory"})
            return
        trial_cfg = dataclasses.replace(
            cfg, layout="manual", parallel=c.parallel, predicted=None, autotune=off,
            checkpoint=dataclasses.replace(ck, save_dir=str(folder), save_every=0, resume=False, async_save=False),
            logging=dataclasses.replace(cfg.logging, progress=False, trace=None))
        try:
            trainer = Trainer(trial_cfg, resume_dir=state["source"])
        except (ParallelConfigError, ValueError) as e:  # every rank refuses the same layout alike
            rows.append({**row, "status": "skipped: " + " ".join(str(e).split())[:200]})
            return
        step = trainer.step_index
        state["first"] = step if state["first"] is None else state["first"]
        trainer.cfg = dataclasses.replace(trial_cfg, training=dataclasses.replace(
            trial_cfg.training, stop_at_step=min(step + per, steps)))
        h = trainer.train()  # saves its last step into the trial folder: the next layout starts there
        state["step"], state["source"] = trainer.step_index, folder
        timed = h[1:] or h
        gb = trainer.pc.global_batch_size * cfg.data.seq_length
        measured = median([r["step_s"] for r in timed])
        rows.append({**row, "status": "ok", "steps": f"{h[0]['step']}-{h[-1]['step']}" if h else "-",
                     "measured_step_s": measured, "bubble": median([r["bubble"] for r in timed]),
                     "comm_ratio": median([r["comm_ratio"] for r in timed]), "tokens_per_s": gb / measured})
        history.extend(h)
        del trainer
        gc.collect()

    for i, c in enumerate(cands[:tries]):
        if state["step"] is not None and state["step"] >= steps:
            break
        trial(i, c, c.why)
    rows = _shared(rows)
    refit = _refit(cands, rows)
    if refit is not None and (state["step"] or 0) + per < steps:
        # the planner again, with what the trials taught it: its new favourite, if untried, is tried too
        f, pick, predicted = refit
        done = {r["candidate"] for r in rows}
        best_measured = min(r["measured_step_s"] for r in rows if r["status"] == "ok")
        if pick not in done and predicted[pick] < 0.95 * best_measured:
            trial(pick, cands[pick], "refit planner's pick")
            rows = _shared(rows)
    first, step, source = state["first"], state["step"], state["source"]
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        raise RuntimeError("autotune: every candidate was skipped: " + "; ".join(f"{r['layout']}: {r['status']}"
                                                                                  for r in rows))
    best = min(measured, key=lambda r: r["measured_step_s"])
    winner = cands[best["candidate"]]
    t_trials = time.perf_counter() - t_start
    if rank == 0:
        print(report(rows, best, first, step, cfg), flush=True)
        refit = learn(cfg, cands, rows)
        if refit:
            print(refit, flush=True)
    switches: list[dict] = []
    current = best["candidate"]
    # adapting needs a checkpoint to switch through: the trial folder when the run keeps none
    final_ck = ck if ck.save_dir or not cfg.autotune.adapt else dataclasses.replace(ck, save_dir=str(folder),
                                                                                      save_every=0)
    while True:
        c = cands[current]
        final_cfg = dataclasses.replace(cfg, layout="manual", parallel=c.parallel, autotune=watched,
                                        checkpoint=final_ck, predicted={**c.predicted, "layout": label(c.parallel)})
        trainer = Trainer(final_cfg, resume_dir=source)
        history += trainer.train(stop_on_slowdown=cfg.autotune.adapt and not switches)
        source = final_ck.save_dir
        slow = trainer.slowdowns[-1] if trainer.slowdowns else None
        if slow is None or not cfg.autotune.adapt or switches or trainer.step_index >= steps:
            break
        move = _adapt(cands, rows, current, slow, cfg.autotune.slowdown)
        switches.append({"step": trainer.step_index, "from": label(c.parallel), **move})
        if rank == 0:
            MetricsFile(cfg.logging.metrics_file).write({"adapt": switches[-1]})
            print(move["text"], flush=True)
        current = move["to_candidate"] if move["to_candidate"] is not None else current
        del trainer
        gc.collect()
    if ck.save_dir and not trainer.history:  # the trials ran to the end: their last checkpoint is the run's
        if rank == 0:
            done = checkpoint.latest(folder)
            shutil.copytree(done, Path(ck.save_dir) / done.name, dirs_exist_ok=True)
        if world > 1:
            dist.barrier()
    del trainer
    total = time.perf_counter() - t_start
    summary = {"autotune": rows, "winner": best["layout"], "trial_steps": step - first, "trial_s": t_trials,
               "run_s": total, "trial_share": t_trials / total, "switches": switches}
    if rank == 0:
        MetricsFile(cfg.logging.metrics_file).write(summary)
        print(f"autotune: the trial phase ({step - first} steps) took {t_trials:.1f} s of the run's {total:.1f} s "
              f"({100 * t_trials / total:.0f}%); each of its steps trained the model", flush=True)
    if world > 1:
        dist.barrier()  # every rank has loaded the last trial before its folder goes
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return history


def _refit(cands: list[Candidate], rows: list[dict]):
    """(the fitted corrections, the candidate they predict fastest, every candidate's prediction), or
    None when the trials measured nothing or the candidates carry no planner components."""
    from tpkernels.planner import fit as fitting  # noqa: PLC0415

    ok = [(cands[r["candidate"]].predicted, r["measured_step_s"]) for r in rows if r["status"] == "ok"]
    if not ok or not all("compute_s" in c.predicted for c in cands):
        return None
    f = fitting.fit([(p["compute_s"], p["comm_s"], t) for p, t in ok])
    predicted = [f.compute_scale * c.predicted["compute_s"] + f.comm_scale * c.predicted["comm_s"] + f.step_overhead_s
                 for c in cands]
    return f, min(range(len(cands)), key=predicted.__getitem__), predicted


def _adapt(cands: list[Candidate], rows: list[dict], current: int, slow, threshold: float) -> dict:
    """After a sustained slowdown: the trials' corrections scaled by how much the slowest rank's own work
    (compute, host) and waiting (TP/CP, P2P, DP) grew, every candidate predicted again, and the
    fastest taken when it beats the degraded step by more than ``threshold``. Every rank computes the
    same (the monitor's figures were exchanged)."""
    refit = _refit(cands, rows)
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
    predicted = [a * x.predicted["compute_s"] + c * x.predicted["comm_s"] + f.step_overhead_s for x in cands]
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


def learn(cfg: TrainConfig, cands: list[Candidate], rows: list[dict]) -> str | None:
    """Fit the planner's corrections to the measured trials and keep them for this machine (rank 0);
    returns what it says, or None (cache off, no machine, no measurement)."""
    from tpkernels.planner import fit as fitting  # noqa: PLC0415

    key = cands[0].predicted.get("machine") if cands else None
    refit = _refit(cands, rows)
    if not (cfg.autotune.cache and key and refit):
        return None
    f = refit[0]
    path = fitting.save(key, f, layouts=[r["layout"] for r in rows if r["status"] == "ok"], model=cfg.model.name,
                        seq_length=cfg.data.seq_length)
    return f"planner refit for {key}: {f.describe()}; kept in {path} for the next plan on this machine"


def report(rows: list[dict], best: dict, first: int, step: int, cfg: TrainConfig) -> str:
    """The trial phase's table: predicted and measured step, bubble, comm/compute, tokens/s, the winner."""
    head = ("layout", "tried as", "steps", "predicted s", "measured s", "bubble", "comm/comp", "tokens/s", "")
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append((r["layout"], r["why"], "-", f"{r['predicted_step_s']:.3g}", "-", "-", "-", "-", r["status"]))
            continue
        body.append((r["layout"], r["why"], r["steps"], f"{r['predicted_step_s']:.3g}", f"{r['measured_step_s']:.3g}",
                     f"{100 * r['bubble']:.0f}%", f"{100 * r['comm_ratio']:.0f}%", f"{r['tokens_per_s']:.0f}",
                     "← fastest measured" if r is best else ""))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [f"autotune: {len(rows)} candidate(s), 1 warm-up + {cfg.autotune.steps} timed step(s) each; steps "
             f"{first}-{step - 1} of {cfg.training.steps} trained on the way"]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head, *body]]
    predicted_best = min(rows, key=lambda r: r["predicted_step_s"])["layout"]
    why = ("the planner's first choice, confirmed" if best["layout"] == predicted_best else
           f"measured faster than the planner's first choice {predicted_best}")
    lines.append(f"continuing with {best['layout']}: {why}")
    return "\n".join(lines)


__all__ = ["Candidate", "candidates_from_plan", "diverse_order", "family", "label", "learn", "report", "train_autotuned", "trial_budget"]
