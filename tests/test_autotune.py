"""The autotune trial phase: candidates train the run's own steps, one after another, then the fastest
goes on; the losses and final weights equal a run at one fixed layout (no step lost or repeated),
on packed documents of uneven length with candidates of different micro-batch sizes (the loss is
the global token mean, so switching micro-batching does not change the objective); a candidate
every rank refuses is reported and skipped; a stop inside the trials stops there; several nodes
without a shared save_dir are refused; adapt switches through a checkpoint of the exact step,
with or without periodic saves; bad autotune settings are named."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_train import SMALL, small
from tpkernels.parallel import ParallelConfig

# one global batch of 4 sequences at every layout, as the planner's candidates share it, cut into
# micro-batches of 2, 1 and 1 rows
CANDIDATES = [ParallelConfig(tp=2, pp=2, dp=1, micro_batch_size=2, num_microbatches=2, sequence_parallel=True),
              ParallelConfig(tp=1, pp=1, dp=4, num_microbatches=1),
              ParallelConfig(tp=1, pp=2, dp=2, num_microbatches=2, schedule="zb-h1")]


def _cands(pcs):
    from tpkernels.train.autotune import Candidate, Prediction

    return [Candidate(pc, Prediction(step_s=0.1 * (i + 1), memory_gib=1.0)) for i, pc in enumerate(pcs)]


def _autotune_worker(rank, world, kw, pcs, save_dir):
    from model_checks import all_stages
    from tpkernels.train.autotune import train_autotuned
    from tpkernels.train.trainer import Trainer

    cfg = small(**kw, **{"layout": "auto", "autotune.candidates": len(pcs), "autotune.steps": 1},
                **({"checkpoint.save_dir": save_dir} if save_dir else {}))
    history = train_autotuned(cfg, _cands(pcs))
    weights = None
    if save_dir:  # the run's own checkpoint holds the final state: read it back at one layout
        probe = Trainer(small(**kw, tp=1, pp=1, num_microbatches=1, **{"checkpoint.save_dir": save_dir}))
        weights = all_stages(probe.model.to_hf_state_dict())
    return [h["step"] for h in history], [h["loss"] for h in history], weights


@functools.lru_cache(maxsize=None)
def _reference(steps):
    """The single-process run of ``steps`` steps (the config fixes every seed: one run per length per session)."""
    from model_checks import all_stages
    from tpkernels.train.trainer import Trainer

    t = Trainer(small(steps=steps, num_microbatches=4))
    h = t.train()
    return [x["loss"] for x in h], all_stages(t.model.to_hf_state_dict())


def test_trial_phase_trains_the_run_and_equals_a_fixed_layout(rank_pool, tmp_path):
    """Three layouts take steps 0-1, 2-3 and 4-5, the fastest takes 6-9: every step once, the losses
    and final weights of the single-process run (each layout equals it to fp32 reduction order)."""
    want_loss, want_w = _reference(10)
    out = rank_pool(4).run(_autotune_worker, dict(steps=10), CANDIDATES, str(tmp_path / "ck"), timeout=400)
    for steps, losses, weights in out:
        assert steps == list(range(10)), steps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=1e-5, atol=1e-6)
    weights = out[0][2]
    for k in want_w:
        torch.testing.assert_close(weights[k], want_w[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert not (tmp_path / "ck" / "autotune").exists()  # the trial folder is removed
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000010"]


def test_a_layout_every_rank_refuses_is_skipped(rank_pool, tmp_path):
    bad = ParallelConfig(tp=3, pp=1, dp=1, num_microbatches=4)  # 4 heads do not split over 3 (world 4 either)
    out = rank_pool(4).run(_autotune_worker, dict(steps=6, metrics_file=str(tmp_path / "m.jsonl")),
                           [bad, CANDIDATES[1]], None, timeout=300)
    want_loss, _ = _reference(6)
    for steps, losses, _ in out:
        assert steps == list(range(6))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=1e-5, atol=1e-6)
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    summary = next(r for r in records if "autotune" in r)
    status = {r["layout"]: r["status"] for r in summary["autotune"]}
    assert status[bad.short()].startswith("skipped: ") and "tp" in status[bad.short()], status
    assert summary["winner"] == CANDIDATES[1].short() and 0 < summary["trial_share"] <= 1


@pytest.mark.parametrize("values, message", [
    ({"autotune.candidates": 3}, r"autotune.candidates \(3\) needs layout: auto"),
    ({"layout": "auto", "autotune.candidates": 2, "autotune.steps": 0}, r"autotune.steps \(0\) must be a positive"),
    ({"layout": "auto", "autotune.candidates": -1}, r"autotune.candidates \(-1\) must be an integer >= 0"),
    ({"layout": "auto", "autotune.max_share": 1.5}, r"autotune.max_share \(1.5\) must be in \(0, 1\]"),
])
def test_bad_autotune_settings_are_named(values, message):
    from tpkernels.train import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig.from_values({**SMALL, **values})


def test_budget_leaves_the_winner_steps():
    from tpkernels.train.autotune import trial_budget

    cfg = small(steps=12, **{"layout": "auto", "autotune.candidates": 5, "autotune.steps": 2})
    assert trial_budget(cfg, 5) == 2  # half of 12 steps, 3 per candidate
    assert trial_budget(small(steps=2, **{"layout": "auto", "autotune.candidates": 3}), 3) == 1


def _corpus(path: Path, seed: int) -> Path:
    """Paragraphs of 1 to 40 words (documents of very uneven length), byte-level tokenized by the run."""
    g = torch.Generator().manual_seed(seed)
    words = ["tensor", "pipeline", "of", "a", "the", "gradient", "sequence", "rank", "kernel", "to", "is", "ring"]
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(torch.randint(1, 41, ())),),
                                                           generator=g)) for _ in range(400)]
    path.write_text("\n\n".join(docs))
    return path


def _train_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpkernels.train", *args], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])


def _losses(metrics: Path) -> list[float]:
    return [x["loss"] for x in map(json.loads, metrics.read_text().splitlines()) if "step" in x]


def _fixed_layout_run(rank, world, flags):
    """The CLI's config from ``flags`` (its own parser), trained at that fixed layout on a pool rank."""
    import argparse

    from tpkernels.train.cli import add_arguments
    from tpkernels.train.config import TrainConfig, flag_values
    from tpkernels.train.trainer import Trainer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = TrainConfig.load(None, flag_values(parser.parse_args(flags)), text_overrides=True)
    return [h["loss"] for h in Trainer(cfg).train()]


def test_cli_autotunes_on_spawned_ranks(tmp_path, fresh_seed, rank_pool):
    """`tpkernels train --layout auto --autotune 3 --nproc 4 --verify-step0` on packed text, with a layout
    of its own (TP2 PP2 GPipe, which the planner never ranks first: 1F1B has its bubble with less
    memory): the table, the planner's three and "your layout", the winner, the metrics record; step
    0 equals the whole-batch fp64 reference, and every step equals the run at that fixed layout."""
    corpus = _corpus(tmp_path / "corpus.txt", fresh_seed)
    metrics = tmp_path / "m.jsonl"
    common = ["--nproc", "4", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48",
              "--vocab", "300", "--seq-length", "16", "--steps", "24", "--progress", "false",
              "--data", str(corpus), "--verify-step0", "--tp", "2", "--pp", "2", "--schedule", "gpipe"]
    # layout auto's global batch is the config's own: micro_batch_size × num_microbatches × dp (TP2 PP2 on 4
    # ranks: dp 1) = 16 rows, the fixed run's
    r = _train_cli(["--layout", "auto", "--autotune", "3", "--num-microbatches", "16", "--metrics-file", str(metrics),
                    *common])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "autotune: " in r.stdout and "← fastest measured" in r.stdout and "continuing with " in r.stdout, r.stdout
    assert "from the single-process fp64 model on the whole batch at once: equal" in r.stdout, r.stdout[-2000:]
    # the fixed layout's run from the same flags on the session's 4-rank pool (a second CLI launch of 4 ranks
    # costs ~15 s of start-up on 2 cores); its step 0 equals the fp64 reference through the autotuned run's,
    # which the CLI checked above and which it equals here
    fixed = rank_pool(4).run(_fixed_layout_run, ["--num-microbatches", "16", *common], timeout=300)[0]
    torch.testing.assert_close(torch.tensor(_losses(metrics)), torch.tensor(fixed), rtol=1e-5, atol=0)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in records if "step" in x] == list(range(24))
    summary = next(x for x in records if "autotune" in x)
    tried = summary["autotune"]  # 3 by the planner's rank, the config's own, maybe one the refit planner prefers
    assert [r["why"] for r in tried[:4]] == ["planner's rank"] * 3 + ["your layout"] and len(tried) in (4, 5)
    assert tried[3]["layout"] == "TP2 PP2 DP1 mbs1 gpipe" and tried[3]["status"] == "ok", tried[3]
    assert summary["trial_steps"] == 3 * len(tried)  # (1 + 2) steps each, of the 24
    assert summary["winner"] in {x["layout"] for x in summary["autotune"]}


def _adapt_worker(rank, world, steps, metrics, save_dir=None, save_every=0):
    import tpkernels.functional.gemm_comm as gemm_comm
    from tpkernels.train.autotune import Candidate, Prediction, train_autotuned

    # rank 1's link is slow from step 6 on: a sleep inside its TP transfers (both ranks wait in them)
    holder = {}
    if rank == 1:
        for name in ("all_gather_into", "reduce_scatter_into"):
            orig = getattr(gemm_comm, name)

            def slow(*a, _orig=orig, **k):
                if holder.get("step", 0) >= 6:
                    time.sleep(0.01)
                return _orig(*a, **k)

            setattr(gemm_comm, name, slow)
    import tpkernels.train.trainer as trainer_mod

    step = trainer_mod.Trainer.train_step

    def counting(self):
        holder["step"] = self.step_index
        return step(self)

    trainer_mod.Trainer.train_step = counting
    tp2 = ParallelConfig(tp=2, pp=1, dp=1, num_microbatches=4, sequence_parallel=True)
    dp2 = ParallelConfig(tp=1, pp=1, dp=2, num_microbatches=2)
    # the planner's figures: TP2 predicted fastest, DP2 (no TP traffic) slower unless TP's links degrade
    cands = [Candidate(tp2, Prediction(0.15, comm_ratio=0.5, memory_gib=1.0, compute_s=0.10, comm_s=0.05)),
             Candidate(dp2, Prediction(0.16, memory_gib=1.0, compute_s=0.16, comm_s=0.0))]
    saving = {"checkpoint.save_dir": save_dir, "checkpoint.save_every": save_every} if save_dir else {}
    cfg = small(steps=steps, metrics_file=metrics, **{
        "layout": "auto", "autotune.candidates": 2, "autotune.steps": 2, "autotune.monitor_every": 3,
        "autotune.sustain": 2, "autotune.slowdown": 0.3, "autotune.adapt": True}, **saving)
    history = train_autotuned(cfg, cands, tries=1)
    return [h["step"] for h in history], [h["loss"] for h in history]


# the trials take steps 0-2; the monitor's windows are 3-5 (its baseline), 6-8 and 9-11 (slow): the
# slowdown is reported after step 11, i.e. at step 12, a multiple of save_every 4 (the stop used to
# skip that step's save and resume step 8's); without save_dir the trial folder carries the switch
@pytest.mark.parametrize("save_every", [None, 4])
def test_adapt_switches_away_from_a_slow_link_without_losing_a_step(rank_pool, tmp_path, save_every):
    metrics = tmp_path / "m.jsonl"
    save_dir = str(tmp_path / "ck") if save_every else None
    out = rank_pool(2).run(_adapt_worker, 16, str(metrics), save_dir, save_every or 0, timeout=400)
    want_loss, _ = _reference(16)
    for steps, losses in out:
        assert steps == list(range(16)), steps  # a resume from an older checkpoint would repeat steps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=1e-5, atol=1e-6)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    move = next(r["adapt"] for r in records if "adapt" in r)
    slow = next(r["slowdown"] for r in records if "slowdown" in r)
    assert slow["kind"] == "link" and slow["wait_phase"] == "tp_comm", slow["text"]
    assert move["from"] == CANDIDATES[0].replace(dp=1, micro_batch_size=1, num_microbatches=4, sequence_parallel=True,
                                                 pp=1, schedule=None).short() and move["to"].startswith("TP1 PP1 DP2")
    layouts = [r["layout"] for r in records if "step" in r]
    assert layouts[-1].startswith("TP1 PP1 DP2") and layouts[3].startswith("TP2")
    if save_dir:
        kept = sorted(int(p.name.split("_")[1]) for p in Path(save_dir).iterdir() if p.name.startswith("step_"))
        assert move["step"] in kept and kept[-1] == 16, (move["step"], kept)


def _stop_worker(rank, world, save_dir):
    from tpkernels.train.autotune import train_autotuned

    cfg = small(steps=12, stop_at_step=4, **{"layout": "auto", "autotune.candidates": 3, "autotune.steps": 1,
                                               "checkpoint.save_dir": save_dir})
    return [h["step"] for h in train_autotuned(cfg, _cands(CANDIDATES))]


def test_a_stop_inside_the_trials_stops_there_and_saves_that_step(rank_pool, tmp_path):
    """stop_at_step 4 with trials of 2 steps: the second trial stops after step 3; the run resumes at 4."""
    out = rank_pool(4).run(_stop_worker, str(tmp_path / "ck"), timeout=300)
    for steps in out:
        assert steps == [0, 1, 2, 3], steps
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000004"]


def _two_nodes_worker(rank, world):
    import socket

    from tpkernels.train.autotune import train_autotuned

    real = socket.gethostname
    socket.gethostname = lambda: f"node{rank // 2}"  # ranks 0-1 on one host, 2-3 on another
    try:
        train_autotuned(small(steps=8, **{"layout": "auto", "autotune.candidates": 2}), _cands(CANDIDATES[:2]))
    except ValueError as e:
        return str(e)
    finally:
        socket.gethostname = real  # the pool's workers serve the next tests
    return "trained"


def test_several_nodes_without_a_shared_save_dir_are_refused(rank_pool):
    for said in rank_pool(4).run(_two_nodes_worker, timeout=120):
        assert "autotune.candidates (2) on 2 nodes needs checkpoint.save_dir" in said, said


def test_the_configs_own_layout_is_a_candidate_at_the_runs_batch():
    from tpkernels.planner import ClusterSpec, TrainingSetup, calibrated_for, gpu_preset, plan
    from tpkernels.train import TrainConfig
    from tpkernels.train.autotune import candidates_from_plan, label, manual_candidate, with_manual

    def cfg(**parallel):
        return TrainConfig.from_values({"layout": "auto", "model": {"name": "Llama-2-7B", "layers": 4, "hidden": 64,
                                                                     "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 97},
                                        "parallel": {"micro_batch_size": 2, **parallel}, "data": {"seq_length": 16},
                                        "autotune": {"candidates": 3}})

    c = cfg()
    gpu = gpu_preset("H100-SXM")
    p = plan(c.model_config(), TrainingSetup(24, 16), ClusterSpec(gpu, 4, 1), calibrated_for(gpu))
    assert manual_candidate(c, p, 4) == (None, "")  # no layout set: the planner's only
    mine, why = manual_candidate(cfg(tp=2, pp=2, sequence_parallel=True, schedule="gpipe"), p, 4)
    assert why == "" and mine.why == "your layout" and mine.parallel.num_microbatches == 12  # 24 / (2 × DP1)
    assert label(mine.parallel) == "TP2 PP2 DP1 mbs2 SP gpipe" and mine.predicted.step_s > 0
    none, why = manual_candidate(cfg(tp=3), p, 4)
    assert none is None and "your layout (TP3" in why and "num_attention_heads (4)" in why, why
    none, why = manual_candidate(cfg(tp=2, micro_batch_size=5), p, 4)
    assert none is None and "global batch (24) is not a multiple of micro_batch_size × dp (5 × 2)" in why, why
    cands = candidates_from_plan(c, p, 20)
    put = with_manual(cands, 3, mine)
    assert put[2] is mine and put[:2] == cands[:2] and len(put) == len(cands) + 1
    assert with_manual(cands, 3, cands[1]) == cands  # the planner tries it already


def test_layout_auto_keeps_the_configs_global_batch(fresh_seed):
    """issue 44: ``layout: auto`` plans, and autotune tries every candidate (the config's own layout too), at
    the config's global batch (mbs × microbatches × dp at its own layout), never at mbs × microbatches × world;
    a candidate that would train another batch is dropped with a warning naming both batches."""
    import dataclasses
    import random

    import pytest

    from tpkernels.planner import ClusterSpec, TrainingSetup, calibrated_for, gpu_preset, plan
    from tpkernels.train import TrainConfig
    from tpkernels.train.auto_layout import run_global_batch
    from tpkernels.train.autotune import candidates_from_plan, manual_candidate

    rng = random.Random(fresh_seed)
    mbs, nm = rng.choice([1, 2, 3]), rng.choice([1, 2, 5])

    def cfg(**extra):
        parallel = {"micro_batch_size": mbs, "num_microbatches": nm, **extra.pop("parallel", {})}
        return TrainConfig.from_values({"layout": "auto", "model": {"name": "Llama-2-7B", "layers": 4, "hidden": 64,
                                                                     "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 97},
                                        "parallel": parallel, "data": {"seq_length": 16},
                                        "autotune": {"candidates": 3}, **extra})

    assert run_global_batch(cfg(), 4)[0] == mbs * nm * 4  # pure DP: dp = world
    mine = cfg(parallel={"tp": 2, "pp": 2, "schedule": "gpipe"})
    gb, why = run_global_batch(mine, 4)
    assert gb == mbs * nm and "dp 1 = world 4 / (tp·cp·pp 4)" in why, why  # was mbs × nm × 4
    assert run_global_batch(cfg(parallel={"tp": 2, "dp": 3}), 6)[0] == mbs * nm * 3
    assert run_global_batch(cfg(parallel={"tp": 3}), 4) == (mbs * nm * 4, run_global_batch(cfg(parallel={"tp": 3}), 4)[1])
    assert "does not divide the world (4)" in run_global_batch(cfg(parallel={"tp": 3}), 4)[1]
    assert run_global_batch(cfg(training={"global_batch": 7}), 4) == (7, "training.global_batch")

    gpu = gpu_preset("H100-SXM")
    p = plan(mine.model_config(), TrainingSetup(gb, 16), ClusterSpec(gpu, 4, 1), calibrated_for(gpu))
    cands = candidates_from_plan(mine, p, 20)
    assert cands and all(c.parallel.global_batch_size == gb for c in cands)
    own, note = manual_candidate(mine, p, 4)
    assert note == "" and (own.parallel.tp, own.parallel.pp, own.parallel.global_batch_size) == (2, 2, gb)
    assert own.parallel.num_microbatches == nm  # the config's own micro-batching, unchanged

    other = dataclasses.replace(p, train=dataclasses.replace(p.train, global_batch=gb * 2))
    with pytest.warns(UserWarning, match=f"not the run's global batch of {gb * 2}"):
        assert candidates_from_plan(mine, other, 20) == []
