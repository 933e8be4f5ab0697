"""The training job: ten steps at TP2×PP2 with SP (1f1b and zb-h1), DP2×TP2 and TP4 with replicated
KV heads equal ten steps of the single-process model taking the whole batch at once (losses,
gradient norms and final weights), on packed documents of uneven length, with gradient clipping
active every step (the global norm must count every parameter once); the config file and flags;
the data; the CLI under --nproc.

The layout cases run in float64, so they agree to reduction order (~1e-12) and any slip in the
composition shows. One case runs fp32 on uniform random tokens, as users' fp32 runs do: there
weights after ten AdamW steps agree to 1e-5 absolute (lr 3e-3: Adam's update is scale-free, so a
rounding difference in a near-zero gradient moves a weight by up to ~lr·1e-3; a wrong gradient
moves many by ~lr)."""

from __future__ import annotations

import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from tpkernels.train import TrainConfig, Trainer
from tpkernels.parallel import ParallelConfig
from tpkernels.train.config import ALIASES
from tpkernels.train.data import EOD, PackedText, RandomTokens, restart_per_document

SMALL = {"model.name": "Llama-2-7B", "model.layers": 4, "model.hidden": 32, "model.heads": 4, "model.kv_heads": 2,
         "model.ffn": 48, "model.vocab": 97, "data.seq_length": 16, "training.steps": 10, "optimizer.lr": 3e-3,
         "optimizer.min_lr": 3e-4, "optimizer.warmup_steps": 2, "optimizer.clip_grad": 0.05, "logging.progress": False,
         "data.source": "random-documents"}  # packed documents of uneven length: what normalisation bugs need


def small(**kw) -> TrainConfig:
    """SMALL with ``kw`` on top: short aliases (tp=2, steps=8, model="GPT-1.7B") or dotted keys (given as a
    dict)."""
    names = {**ALIASES, "model": "model.name", "data": "data.source"}
    return TrainConfig.from_values({**SMALL, **{names.get(k, k): v for k, v in kw.items()}})


def _run(cfg: TrainConfig):
    trainer = Trainer(cfg)
    history = trainer.train()
    from model_checks import all_stages

    return [h["loss"] for h in history], [h["grad_norm"] for h in history], \
        all_stages(trainer.model.to_hf_state_dict())


def _worker(rank, world, kw):
    return _run(small(**kw))


LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "cp_algo", "sequence_parallel", "schedule", "virtual_stages", "zero1",
               "overlap_dp", "bucket_mb", "micro_batch_size", "num_microbatches")


_REFERENCES: dict = {}


def _reference(kw):
    """The same run in one process, the whole global batch as one micro-batch. Computed once per session for
    each (settings, global batch): six of the layouts share one (the config fixes every seed)."""
    pc = small(**kw).parallel
    batch = pc.micro_batch_size * pc.num_microbatches * (pc.dp or 1)
    settings = {k: v for k, v in kw.items() if k not in LAYOUT_KEYS}
    key = (tuple(sorted(settings.items())), batch)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(small(**settings, micro_batch_size=batch, num_microbatches=1))
    return _REFERENCES[key]


CASES = {
    "tp2pp2-sp-1f1b": dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, micro_batch_size=2),
    "tp2pp2-sp-zb": dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4, schedule="zb-h1"),
    "dp2tp2-sp": dict(tp=2, dp=2, sequence_parallel=True, num_microbatches=2),
    "tp4-replicated-kv": dict(tp=4, num_microbatches=1, micro_batch_size=2),
    "dp2tp2-zero1": dict(tp=2, dp=2, sequence_parallel=True, num_microbatches=2, zero1=True),
    "pp2-interleaved-v2": dict(pp=2, virtual_stages=2, num_microbatches=2, schedule="interleaved"),
    "dp2pp2-zb-serial-dp": dict(pp=2, dp=2, num_microbatches=2, schedule="zb-h1", overlap_dp=False),
    "dp2pp2-zb-small-buckets": dict(pp=2, dp=2, num_microbatches=2, schedule="zb-h1", bucket_mb=0.001),
    "tp2pp2-sp-1f1b-fp32-random": dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, micro_batch_size=2,
                                       precision="fp32", **{"data.source": "random"}),
}
FP64 = dict(loss=dict(rtol=1e-9, atol=0), norm=dict(rtol=1e-9, atol=0), weight=dict(rtol=1e-8, atol=1e-10))
FP32 = dict(loss=dict(rtol=1e-5, atol=1e-6), norm=dict(rtol=1e-4, atol=1e-6), weight=dict(rtol=1e-4, atol=1e-5))


def _check_against_reference(rank_pool, kw, world):
    kw = {"precision": "fp64", **kw}
    tol = FP64 if kw["precision"] == "fp64" else FP32
    want_loss, want_norm, want_w = _reference(kw)
    assert min(want_norm) > SMALL["optimizer.clip_grad"]  # clipping acts on every step
    for loss, norm, weights in rank_pool(world).run(_worker, kw, timeout=300):
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), **tol["loss"])
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), **tol["norm"])
        assert set(weights) == set(want_w)
        for k in want_w:
            torch.testing.assert_close(weights[k], want_w[k], **tol["weight"], msg=lambda m, k=k: f"{k}: {m}")
    assert want_loss[-1] != want_loss[0]


@pytest.mark.parametrize("case", list(CASES))
def test_ten_steps_equal_the_single_process_run(rank_pool, case):
    kw = CASES[case]
    _check_against_reference(rank_pool, kw, kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1))


def test_gpt2_tied_embeddings_across_stages(rank_pool):
    _check_against_reference(rank_pool, dict(model="GPT-1.7B", tp=2, pp=2, sequence_parallel=True, num_microbatches=2,
                                             layers=4, hidden=32, heads=4, kv_heads=None, ffn=48, vocab=97), 4)


# ---- config ----

def _view(cfg: TrainConfig) -> tuple:
    return cfg.parallel.tp, cfg.training.steps, cfg.optimizer.lr, cfg.parallel.sequence_parallel, cfg.parallel.pp


def test_config_sections_from_yaml_and_toml_with_flags_on_top(tmp_path):
    (tmp_path / "a.yaml").write_text("parallel:\n  tp: 2\n  sequence-parallel: true\ntraining.steps: 7\n"
                                     "optimizer: {lr: 0.001}\n")
    (tmp_path / "a.toml").write_text('[parallel]\ntp = 2\nsequence_parallel = true\n[training]\nsteps = 7\n'
                                     '[optimizer]\nlr = 0.001\n')
    for f in ("a.yaml", "a.toml"):
        cfg = TrainConfig.load(tmp_path / f, {"training.steps": 9, "parallel.pp": None})
        assert _view(cfg) == (2, 9, 0.001, True, 1)
        assert isinstance(cfg.parallel, ParallelConfig) and cfg.parallel.dp is None  # the layout itself, nested
    flags = TrainConfig.load(tmp_path / "a.yaml", {"parallel.pp": "2", "steps": "3", "parallel.sequence_parallel":
                                                   "false"}, text_overrides=True)
    assert _view(flags) == (2, 3, 0.001, False, 2)


def test_old_flat_config_files_keep_working_with_a_note_naming_the_key(tmp_path):
    (tmp_path / "old.yaml").write_text("model: Llama-3-8B\nlayers: 2\ntp: 2\nsteps: 7\nlr: 0.001\n"
                                       "sequence_parallel: true\ndata: random\nsave_dir: ck\n")
    with pytest.warns(FutureWarning, match=r"config key 'tp' is the old flat spelling of 'parallel.tp'"):
        cfg = TrainConfig.load(tmp_path / "old.yaml")
    assert _view(cfg) == (2, 7, 0.001, True, 1)
    assert (cfg.model.name, cfg.model.layers, cfg.data.source, cfg.checkpoint.save_dir) == ("Llama-3-8B", 2, "random",
                                                                                              "ck")


@pytest.mark.parametrize("values, message", [
    ({"stepz": 3}, r"unknown config key 'stepz' \(did you mean 'training.steps'\?\)"),
    ({"training.steps": 0}, r"training.steps \(0\) must be a positive integer"),
    ({"parallel.schedule": "zb-v"}, r"parallel.schedule \('zb-v'\) must be one of"),
    ({"optimizer.min_lr": 1.0, "optimizer.lr": 0.1}, r"optimizer.min_lr \(1.0\) must be <= optimizer.lr \(0.1\)"),
    ({"parallel.sequence_parallel": "no"}, r"parallel.sequence_parallel \(the string 'no'\) must be true or false"),
    ({"training.steps": 2.5}, r"training.steps \(2.5\) must be an integer"),
    ({"parallel.tp": True}, r"parallel.tp \(True\) must be an integer"),
    ({"parallel.bucket_mb": 0}, r"parallel.bucket_mb \(0.0\) must be a finite number > 0"),
    ({"model.layers": "4"}, r"model.layers \(the string '4'\) must be an integer or none"),
    ({"tp": 2, "parallel.tp": 3}, r"config key 'parallel.tp' is given twice"),
    ({"data.seq_length": 1}, r"data.seq_length \(1\) must be at least 2: a token and the next one"),
    ({"optimizer.adam_eps": 0.0}, r"optimizer.adam_eps \(0.0\) must be a finite number > 0"),
    ({"training.stop_at_step": -1}, r"training.stop_at_step \(-1\) must be >= 0"),
    ({"parallel.bucket_mb": -5}, r"parallel.bucket_mb \(-5.0\) must be a finite number > 0"),
])
def test_bad_config_names_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.load(None, values)


def test_a_yaml_key_given_twice_is_refused(tmp_path):
    (tmp_path / "twice.yaml").write_text("training:\n  steps: 2\n  steps: 7\n")
    with pytest.raises(ValueError, match=r"key 'steps' is given twice \(lines 2 and 3\)"):
        TrainConfig.load(tmp_path / "twice.yaml")


def test_flags_of_both_clis_come_from_the_same_sections(capsys):
    """``--parallel.tp`` and its alias ``--tp``; the model section's flags are plan's too."""
    from tpkernels.cli import main

    for argv in (["--parallel.tp", "3"], ["--tp", "3"], ["--parallel.micro-batch-size", "1", "--tp", "3"]):
        assert main(["train", *argv, "--dry-run"]) == 2
        assert "num_attention_heads (32) must be divisible by parallel.tp (3)" in capsys.readouterr().err
    for cmd in (["train", "--dry-run"], ["plan", "--gpu", "H100-SXM"]):
        assert main([cmd[0], "--model", "Llama-3-8B", "--model.heads", "0", *cmd[1:]]) == 2
        assert "model.heads (0) must be a positive integer" in capsys.readouterr().err
    for cmd in ("train", "plan"):  # every key's help renders
        with pytest.raises(SystemExit) as done:
            main([cmd, "--help"])
        assert done.value.code == 0 and "--model.name" in capsys.readouterr().out


# ---- data ----

def test_random_batches_depend_only_on_seed_and_step():
    a, b = RandomTokens(97, 16, 3), RandomTokens(97, 16, 3)
    assert torch.equal(a.batch(5, 4).ids, b.batch(5, 4).ids)
    assert not torch.equal(a.batch(5, 4).ids, a.batch(6, 4).ids)


def test_packed_text_restarts_positions_per_document(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world\n\nab\n\n" + b"x" * 40)
    data = PackedText(tmp_path / "t.txt", 8, 0, 300)
    ids = data.batch(0, data.rows).ids
    flat_ids = data.ids.reshape(-1)
    assert flat_ids[:12].tolist() == list(b"hello world") + [EOD]
    p = restart_per_document(data.ids)
    assert p[0].tolist() == list(range(8)) and p[1, :4].tolist() == [0, 1, 2, 3]  # row 1: "rld" + EOD, a restart
    assert p[1, 4] == 0  # "ab" starts after the end-of-document token
    assert torch.equal(torch.sort(ids.reshape(-1)).values, torch.sort(flat_ids).values)  # one epoch = every row
    with pytest.raises(ValueError, match=r"vocab \(97\) must be at least 257"):
        PackedText(tmp_path / "t.txt", 8, 0, 97)


# ---- CLI ----

def test_cli_trains_on_spawned_ranks_and_dry_run_explains_a_bad_layout(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n\n" * 30)
    args = ["--nproc", "2", "--tp", "2", "--sequence-parallel", "true", "--layers", "2", "--hidden", "32",
            "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab", "300", "--seq-length", "32", "--steps", "4",
            "--data", str(tmp_path / "corpus.txt"), "--save-dir", str(tmp_path / "ck"),
            "--verify-step0", "--metrics-file", str(tmp_path / "m.jsonl"), "--trace", str(tmp_path / "t.json")]
    r = subprocess.run([sys.executable, "-m", "tpkernels.train", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # the progress bar's lock is a semaphore: ranks ended by os._exit leaked it (a warning at every exit);
    # stdout is a pipe: progress is plain lines, no bar
    assert "leaked semaphore" not in r.stderr and "step 4/4  loss" in r.stdout and "\r" not in r.stdout + r.stderr
    assert "TP2 PP1 DP1 mbs1 SP: 4 steps: loss" in r.stdout
    assert "from the single-process fp64 model on the whole batch at once: equal" in r.stdout
    assert (tmp_path / "ck" / "step_00000004" / "meta.json").is_file()
    import json

    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3] and all(0 < x["mfu"] < 1 for x in lines)
    assert lines[0]["mfu_vs"] == "measured CPU fp32 GEMM" and lines[0]["layout"] == "TP2 PP1 DP1 mbs1 SP"
    assert all(0 <= x["comm_ratio"] and 0 <= x["bubble"] < 1 for x in lines)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "X"}
    assert spans == {(r, t) for r in (0, 1) for t in (0, 1, 2)}  # GEMMs, TP transfers, pipeline, per rank
    from tpkernels.cli import main  # the same command in this process: the refusal is the CLI's, not a launch's

    capsys.readouterr()
    assert main(["train", "--tp", "3", "--nproc", "3", "--dry-run"]) == 2
    assert "num_attention_heads (32) must be divisible by parallel.tp (3)" in capsys.readouterr().err


# ---- checkpoints ----

def _ckpt_worker(rank, world, kw):
    trainer = Trainer(small(**kw))
    history = trainer.train()
    return [h["loss"] for h in history], trainer.step_index, str(trainer.resumed_from)


def test_exact_resume_and_reshard(rank_pool, tmp_path):
    """Stopped at step 4 of 8 and resumed: the same losses, bitwise at the same layout and to fp32
    rounding at TP1×PP4, TP4×PP1 and DP2×TP2 (saved at TP2×PP2 with SP)."""
    layout = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2)
    full = rank_pool(4).run(_ckpt_worker, {**layout, "steps": 8}, timeout=300)[0][0]
    first = rank_pool(4).run(_ckpt_worker, {**layout, "steps": 8, "save_dir": str(tmp_path / "a"),
                                            "save_every": 4}, timeout=300)
    assert first[0][1] == 8 and first[0][0] == full
    # keep only step 4, as if the run had stopped there
    import shutil

    shutil.rmtree(tmp_path / "a" / "step_00000008")
    (tmp_path / "a" / "step_00000009.tmp").mkdir()  # a half-written checkpoint: ignored, with a warning
    (tmp_path / "a" / "step_00000010").mkdir()  # renamed but without its metadata (corrupted): ignored too
    from tpkernels.train.checkpoint import latest

    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint"):
        assert latest(tmp_path / "a").name == "step_00000004"
    again = rank_pool(4).run(_ckpt_worker, {**layout, "steps": 8, "save_dir": str(tmp_path / "a")}, timeout=300)
    assert again[0][2].endswith("step_00000004") and again[0][0] == full[4:]  # bitwise
    for other in (dict(pp=4, num_microbatches=2), dict(tp=4, num_microbatches=2),  # the same global batch
                  dict(tp=2, dp=2, sequence_parallel=True, num_microbatches=1)):
        d = tmp_path / f"r{len(other)}{other.get('tp', 1)}{other.get('pp', 1)}"
        shutil.copytree(tmp_path / "a" / "step_00000004", d / "step_00000004")
        out = rank_pool(4).run(_ckpt_worker, {**other, "steps": 8, "save_dir": str(d)}, timeout=300)
        torch.testing.assert_close(torch.tensor(out[0][0]), torch.tensor(full[4:]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, o=other: f"resumed at {o}: {m}")


def test_export_hf_of_a_checkpoint_loads_in_transformers(rank_pool, tmp_path, capsys):
    """Saved at TP2×PP2; `tpkernels export-hf` (the CLI's main, in this process) writes a folder transformers
    loads, equal to the run's weights."""
    import transformers

    from tpkernels.cli import main

    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, steps=3, save_dir=str(tmp_path / "ck"))
    weights = rank_pool(4).run(_worker, kw, timeout=300)[0][2]
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) in (0, None), capsys.readouterr().err
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    sd = hf.state_dict()
    for k, v in weights.items():
        assert torch.equal(sd[k], v), k


# ---- mixed precision ----

def _prec_worker(rank, world, kw):
    trainer = Trainer(small(**kw))
    history = trainer.train()
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    main = {str(p.main_grad.dtype) for p in trainer.model.parameters()} if trainer.mp else set()
    return [h["loss"] for h in history], [h["skipped"] for h in history], dtypes, main, \
        [m.dtype for m in trainer.mp.masters][:1] if trainer.mp else []


def test_bf16_tracks_fp32_with_fp32_masters_and_accumulation(rank_pool):
    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, schedule="zb-h1")
    fp32 = rank_pool(4).run(_prec_worker, kw, timeout=300)[0][0]
    losses, skipped, dtypes, main, masters = rank_pool(4).run(_prec_worker, {**kw, "precision": "bf16"}, timeout=300)[0]
    assert dtypes == {"torch.bfloat16"} and main == {"torch.float32"} and masters == [torch.float32]
    assert not any(skipped)
    # bf16 rounds activations and weights to 8 bits of mantissa: the loss agrees to ~1e-2 relative
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=2e-2, atol=0)


def test_fp16_loss_scaling_skips_overflowing_steps():
    losses, skipped, dtypes, _, _ = _prec_worker(0, 1, dict(precision="fp16", initial_loss_scale=2.0 ** 28, steps=20,
                                                            num_microbatches=2))
    assert dtypes == {"torch.float16"}
    assert skipped[0] and not skipped[-1]  # overflow at 2^28; the halved scale soon fits
    assert all(torch.isfinite(torch.tensor(losses)))


def test_bf16_checkpoint_resumes_exactly(tmp_path):
    kw = dict(precision="bf16", num_microbatches=2, steps=6)
    full = _prec_worker(0, 1, kw)[0]
    _prec_worker(0, 1, {**kw, "steps": 3, "save_dir": str(tmp_path)})
    again = _prec_worker(0, 1, {**kw, "save_dir": str(tmp_path)})[0]
    assert again == full[3:]


def test_metrics_file_holds_each_step_of_the_run_once(tmp_path):
    """logging.metrics_file is the run's record: a new run replaces what the file held (here an older run's
    step 0); a run resumed from step 2, after a run that logged steps 2 and 3 and was killed writing a
    line, logs 2 and 3 once, its own (step_s tells the runs apart)."""
    import json
    import shutil

    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    metrics.write_text('{"step": 0, "loss": 99.0, "step_s": 1.0}\n')
    kw = dict(steps=4, num_microbatches=1, metrics_file=str(metrics))

    def logged():
        return [(r["step"], r["loss"], r["step_s"]) for r in map(json.loads, metrics.read_text().splitlines())]

    first = Trainer(small(**kw, save_dir=str(ck), save_every=2)).train()
    assert logged() == [(h["step"], h["loss"], h["step_s"]) for h in first]
    shutil.rmtree(ck / "step_00000004")  # the run is resumed from step 2
    with open(metrics, "a") as f:
        f.write('{"step": 4, "lo')
    again = Trainer(small(**kw, save_dir=str(ck))).train()
    assert [h["step"] for h in again] == [2, 3]
    assert logged() == [(h["step"], h["loss"], h["step_s"]) for h in first[:2] + again]


def _fill_warning_worker(rank, world):
    import contextlib
    import io

    import tpkernels.train.trainer as trainer_mod

    trainer_mod._SAID.clear()  # what a fresh process has said: the pool's ranks live across tests
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):  # print and warnings.showwarning
        for _ in range(2):  # two trainers at one layout in one run, as autotune's trial and then its winner
            Trainer(small(pp=2, num_microbatches=1, steps=1, **{"optimizer.warmup_steps": 0})).train()
    return out.getvalue()


def test_a_pipeline_that_cannot_fill_is_said_once_in_one_line(rank_pool):
    """Every rank's schedule warns (PipelineFillWarning): the run says it once, by the logging rank, in one
    line of its own voice (not Python's "runtime.py:90: PipelineFillWarning: ..." and its source line)."""
    outs = rank_pool(2).run(_fill_warning_worker, timeout=300)
    said = [line for text in outs for line in text.splitlines() if "pipeline cannot fill" in line
            or "PipelineFillWarning" in line or "make_schedule(" in line]
    assert said == ["warning: pipeline cannot fill: num_microbatches (1) < pp (2); bubble is 50% of the step"], outs


def test_one_process_saves_loads_and_exports_say_nothing_of_dcp(tmp_path):
    """Without a process group DCP warns "torch.distributed is disabled ..." at every save and load: one
    process is what we mean there, so no such warning reaches a user of a one-process run or export-hf."""
    import warnings

    from tpkernels.train.checkpoint import export_hf

    ck = str(tmp_path / "ck")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(small(steps=2, num_microbatches=1, save_dir=ck)).train()  # saves step 2
        Trainer(small(steps=3, num_microbatches=1, save_dir=ck)).train()  # loads it, saves step 3
        export_hf(ck, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert not [str(w.message) for w in seen if "torch.distributed is disabled" in str(w.message)]


# ---- recompute ----

def test_recompute_gives_the_same_training_and_keeps_less(rank_pool):
    """Full and selective recompute at TP2×PP2 with SP under zb-h1 (the recomputation keeps the
    weights out of B's graph, as the forward did) give the run without recompute, bitwise."""
    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4, schedule="zb-h1", steps=4)
    base = rank_pool(4).run(_worker, kw, timeout=300)[0]
    for mode in ("selective", "full"):
        loss, norm, weights = rank_pool(4).run(_worker, {**kw, "recompute": mode}, timeout=300)[0]
        assert loss == base[0] and norm == base[1], mode
        assert all(torch.equal(weights[k], base[2][k]) for k in weights), mode


def _saved_bytes(recompute: str) -> int:
    from tpkernels.models import ModelConfig, ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    mc = ModelConfig.from_preset("Llama-2-7B").replace(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                       num_kv_heads=2, ffn_hidden_size=96, vocab_size=97,
                                                       max_position_embeddings=64)
    model = ParallelTransformer(mc, ParallelState.create(ParallelConfig(recompute=recompute)))
    ids = torch.randint(0, 97, (2, 33))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, target=next_token_targets(ids))
    loss.backward()
    return sum(saved)


def test_recompute_keeps_fewer_activations():
    none, selective, full = (_saved_bytes(m) for m in ("none", "selective", "full"))
    assert full < selective < none, (none, selective, full)


def test_zero1_checkpoint_resumes_exactly(rank_pool, tmp_path):
    """ZeRO-1 over DP2: each DP rank saves the AdamW states it owns; resumed, the run goes on as before."""
    kw = dict(dp=2, tp=2, num_microbatches=1, zero1=True, steps=6)
    full = rank_pool(4).run(_ckpt_worker, kw, timeout=300)[0][0]
    rank_pool(4).run(_ckpt_worker, {**kw, "steps": 3, "save_dir": str(tmp_path)}, timeout=300)
    again = rank_pool(4).run(_ckpt_worker, {**kw, "save_dir": str(tmp_path)}, timeout=300)[0][0]
    assert again == full[3:]


def _overlap_worker(rank, world, kw):
    trainer = Trainer(small(**kw))
    trainer.train()
    return trainer.dp_reduce.launched_in_backward


def test_dp_buckets_start_during_the_backward(rank_pool):
    """With small buckets, most DP all-reduces start before the backward ends (the overlap)."""
    launched = rank_pool(2).run(_overlap_worker, dict(dp=2, num_microbatches=2, bucket_mb=0.001, steps=1,
                                                      warmup_steps=0),
                                timeout=120)
    assert min(launched) > 5, launched


def test_bf16_with_overlapped_dp_matches_one_replica(rank_pool):
    """The DP buckets take the fp32 main_grads that mixed precision accumulates (hook order)."""
    kw = dict(precision="bf16", num_microbatches=2, steps=5)
    want = _prec_worker(0, 1, {**kw, "num_microbatches": 4})[0]
    got = rank_pool(2).run(_prec_worker, {**kw, "dp": 2, "bucket_mb": 0.001}, timeout=120)[0][0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


# ---- LoRA ----

def _lora_worker(rank, world, kw, folder):
    from model_checks import all_stages

    base = {k: v for k, v in SMALL.items() if k.split(".")[-1] not in ("layers", "hidden", "heads", "kv_heads", "ffn",
                                                                          "vocab")}
    trainer = Trainer(TrainConfig.from_values({**base, "model.init_from": folder, "model.name": folder,
                                               "model.finetune": "lora", "model.lora_rank": 4,
                                               "optimizer.clip_grad": 0.0, **{ALIASES[k]: v for k, v in kw.items()}}))
    trainable = sorted({n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n, p in trainer.model.named_parameters()
                        if p.requires_grad})
    history = trainer.train()
    return [h["loss"] for h in history], trainable, all_stages(trainer.model.to_hf_state_dict())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_trains_only_the_adapters_at_any_layout(rank_pool, tmp_path, fresh_seed, family):
    from model_checks import save_tiny_model

    folder = save_tiny_model(family, tmp_path, fresh_seed % 1000, layers=4)
    want, trainable, base = _lora_worker(0, 1, dict(num_microbatches=2), folder)
    assert trainable == ["lora.A", "lora.B"]
    from safetensors.torch import load_file

    original = load_file(f"{folder}/model.safetensors")
    assert all(torch.equal(base[k], original[k]) for k in original)  # frozen
    assert want[-1] != want[0]  # the adapters train (random tokens: no trend to expect)
    layouts = [dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2)]
    if family == "llama":  # TP4 > 2 KV heads: B's replicated KV rows
        layouts.append(dict(tp=4, num_microbatches=2))
    for kw in layouts:
        got, _, weights = rank_pool(4).run(_lora_worker, kw, folder, timeout=300)[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, kw=kw: f"{kw}: {m}")
        assert all(torch.equal(weights[k], original[k]) for k in original)


def test_lora_export_merges_the_adapters(rank_pool, tmp_path, fresh_seed, capsys):
    """Trained at TP2×PP2, exported merged, and the adapters alone as a PEFT folder: transformers' logits
    for the merged model, and PEFT's for the base with the adapters, equal our adapted model's. The
    `tpkernels export-hf` / `export-peft` commands run in this process (the CLI's own main: a process each
    cost ~5 s of start-up)."""
    import transformers

    from model_checks import save_tiny_model
    from tpkernels.cli import main
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.lora import apply_lora
    from tpkernels.train.checkpoint import latest, load

    folder = save_tiny_model("llama", tmp_path / "base", fresh_seed % 1000, layers=4)
    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, steps=3, save_dir=str(tmp_path / "ck"))
    rank_pool(4).run(_lora_worker, kw, folder, timeout=300)
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) in (0, None), capsys.readouterr().err
    ours = ParallelTransformer.from_hf(folder)
    apply_lora(ours, 4)
    load(latest(tmp_path / "ck"), ours)
    assert any(float(m.lora.B.detach().abs().sum()) > 0 for m in ours.modules() if hasattr(m, "lora"))
    ids = torch.randint(0, 97, (2, 11))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    # the adapters alone, as PEFT loads them onto the Hugging Face base (q/k/v and gate/up split apart)
    import peft

    assert main(["export-peft", str(tmp_path / "ck"), str(tmp_path / "peft")]) in (0, None), capsys.readouterr().err
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert sorted(adapted.peft_config["default"].target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                                     "q_proj", "up_proj", "v_proj"]
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["export-peft", str(tmp_path / "nothing"), str(tmp_path / "peft2")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_layout_auto_plans_trains_and_reports_prediction_vs_measurement(tmp_path):
    (tmp_path / "corpus.txt").write_text("pack my box with five dozen liquor jugs\n\n" * 40)
    args = ["--layout", "auto", "--nproc", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
            "--ffn", "48", "--vocab", "300", "--seq-length", "32", "--global-batch", "4", "--steps", "3",
            "--data", str(tmp_path / "corpus.txt"), "--progress", "false"]
    r = subprocess.run([sys.executable, "-m", "tpkernels.train", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "layout auto: " in r.stdout and " wins: " in r.stdout
    assert "planner vs measured (" in r.stdout and "3 steps: loss" in r.stdout


def test_text_through_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "the cat sat on the mat\n\nthe dog ate the bone\n\n" * 20
    (tmp_path / "c.txt").write_text(text)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tok.json"))
    data = PackedText(tmp_path / "c.txt", 8, 0, 50, tokenizer=str(tmp_path / "tok.json"))
    eod = tok.token_to_id("</s>")
    assert data.ids[0, :7].tolist() == tok.encode("the cat sat on the mat").ids + [eod]
    assert data.pos[0, 7] == 0  # a new document after the end-of-document id
    with pytest.raises(ValueError, match=r"vocab \(5\) must be at least"):
        PackedText(tmp_path / "c.txt", 8, 0, 5, tokenizer=str(tmp_path / "tok.json"))


def _nan_worker(rank, world, kw):
    trainer = Trainer(small(**kw))
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    try:
        trainer.train()
    except FloatingPointError as e:
        return str(e)
    return "no error"


def test_nan_loss_stops_every_rank_naming_the_step(rank_pool):
    out = rank_pool(4).run(_nan_worker, dict(tp=2, pp=2, num_microbatches=2), timeout=120)
    assert all("loss is nan at step 0 (TP2 PP2 DP1 mbs1); last good checkpoint: none" in o for o in out), out


def _kill_worker(rank, world, kw, folder, victim, at_step):
    import os

    from tpkernels.train.failures import RankLostError

    trainer = Trainer(small(**kw, save_dir=folder, save_every=2))
    try:
        while trainer.step_index < trainer.cfg.training.steps:
            if rank == victim and trainer.step_index == at_step:
                with open(os.path.join(folder, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os._exit(3)  # the process dies mid-run
            trainer._guarded(trainer.train_step, f"step {trainer.step_index}")
            if trainer.step_index % 2 == 0:
                trainer.save()
    except RankLostError as e:
        return e.ranks, str(e), time.time()
    return "finished", "", time.time()


def test_a_killed_rank_is_named_everywhere_and_the_restart_resumes(rank_pool, tmp_path):
    from tpkernels.parallel.local_ranks import RankExited

    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, steps=6)
    full = rank_pool(4).run(_ckpt_worker, kw, timeout=300)[0][0]
    out = rank_pool(4).run(_kill_worker, kw, str(tmp_path), 1, 3, expect_exit={1}, timeout=120)
    assert isinstance(out[1], RankExited)
    killed_at = float((tmp_path / "killed_at").read_text())
    for r in (0, 2, 3):
        ranks, msg, ended = out[r]
        assert ranks == [1], msg
        assert "step_00000002" in msg and "restart the job" in msg
        # measured 3-6 s (the check-in waits 3 s): far below the process group's 1800 s
        assert ended - killed_at < 60, (r, ended - killed_at)
        print(f"rank {r} ended {ended - killed_at:.1f} s after the kill")
    again = rank_pool(4).run(_ckpt_worker, {**kw, "save_dir": str(tmp_path)}, timeout=300)[0]
    assert again[2].endswith("step_00000002") and again[0] == full[2:]


def test_out_of_memory_says_where_and_what_to_change(monkeypatch):
    trainer = Trainer(small(micro_batch_size=2))

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")

    monkeypatch.setattr(trainer, "train_step", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"rank 0 \(pipeline stage 0 of 1, TP1 PP1 DP1 mbs2\) ran out of "
                                                     r"memory at step 0: CUDA out of memory. Tried to allocate 2.00 GiB"
                                                     r".*recompute=selective.*micro_batch_size \(now 2"):
        trainer.train()


def test_async_save_completes_and_resumes_exactly(rank_pool, tmp_path):
    """Checkpoints written in the background (on a gloo group of their own) while training goes on."""
    kw = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, steps=6)
    full = rank_pool(4).run(_ckpt_worker, kw, timeout=300)[0][0]
    out = rank_pool(4).run(_ckpt_worker, {**kw, "save_dir": str(tmp_path), "save_every": 2, "async_save": True},
                           timeout=300)[0]
    assert out[0] == full  # training did not change while the saves ran
    import shutil

    shutil.rmtree(tmp_path / "step_00000006")
    shutil.rmtree(tmp_path / "step_00000004")
    again = rank_pool(4).run(_ckpt_worker, {**kw, "save_dir": str(tmp_path)}, timeout=300)[0]
    assert again[2].endswith("step_00000002") and again[0] == full[2:]


def test_under_torchrun(tmp_path):
    """`torchrun -m tpkernels.train`: the launch users run on GPU nodes (gloo here)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["--tp", "2", "--sequence-parallel", "true", "--layers", "2", "--hidden", "32", "--heads", "4",
            "--kv-heads", "2", "--ffn", "48", "--vocab", "97", "--seq-length", "16", "--steps", "3",
            "--progress", "false", "--save-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), "-m", "tpkernels.train", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TP2 PP1 DP1 mbs1 SP: 3 steps: loss" in r.stdout
    assert (tmp_path / "step_00000003" / "meta.json").is_file()


# ---- the skip of an overflowing fp16 step is agreed by every rank ----

def _inf_worker(rank, world, kw, victim):
    """fp16 at a TP/PP layout; on ``victim`` only, one gradient becomes inf after the backward."""
    trainer = Trainer(small(**kw, precision="fp16", steps=2, initial_loss_scale=2.0 ** 8))
    finish = trainer.model.finish_grad_sync

    def poisoned(*a, **k):
        finish(*a, **k)
        if rank == victim and trainer.step_index == 0:
            next(p for p in trainer.model.parameters() if p.requires_grad).main_grad.view(-1)[0] = float("inf")

    trainer.model.finish_grad_sync = poisoned
    history = trainer.train()
    return [h["skipped"] for h in history], [h["loss_scale"] for h in history]


@pytest.mark.parametrize("kw, victim", [(dict(tp=2), 1), (dict(tp=2, pp=2, num_microbatches=2), 3),
                                        (dict(pp=2, dp=2, num_microbatches=2), 2)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(rank_pool, kw, victim):
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1)
    out = rank_pool(world).run(_inf_worker, kw, victim, timeout=300)
    assert all(o == ([True, False], [2.0 ** 7, 2.0 ** 7]) for o in out), out  # skipped together, same scales


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()  # the others wait: the agent must stop them, not the timeout
    return "never"


def test_a_rank_that_fails_under_nproc_is_named_and_stops_the_others(monkeypatch):
    """--nproc goes through torch's elastic launcher: a failing rank ends the job at once, named.
    The ranks fork from a server started once per process (early, by the command line): they see
    the launcher's environment as it is at each launch, not as it was when the server started."""
    import time

    from tpkernels.train.launch import LaunchError, launch

    monkeypatch.setenv("TPK_TEST_LAUNCH_A", "first")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: rank 1 cannot go on"):
        launch(_fails_on_rank_one, 3, pg_timeout_s=120)
    assert time.monotonic() - t0 < 60  # the process group's timeout is 120 s: the agent stopped them
    assert launch(_ranks_and_size, 2) == [(0, 2, "first", None), (1, 2, "first", None)]
    monkeypatch.delenv("TPK_TEST_LAUNCH_A")  # the server is running now: a removal and a new variable
    monkeypatch.setenv("TPK_TEST_LAUNCH_B", "second")
    assert launch(_ranks_and_size, 2) == [(0, 2, None, "second"), (1, 2, None, "second")]


def _ranks_and_size():
    import os

    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.environ.get("TPK_TEST_LAUNCH_A"), \
        os.environ.get("TPK_TEST_LAUNCH_B")


@pytest.mark.parametrize("change, says", [
    (dict(layers=2), r"num_layers \(4 in the checkpoint, 2 here\)"),
    (dict(hidden=16, heads=2, kv_heads=1), r"hidden_size \(32 in the checkpoint, 16 here\).*num_attention_heads"),
    (dict(ffn=64), r"ffn_hidden_size \(48 in the checkpoint, 64 here\)"),
    (dict(vocab=80), r"vocab_size \(97 in the checkpoint, 80 here\)"),
    (dict(kv_heads=1), r"num_kv_heads \(2 in the checkpoint, 1 here\)"),
    (dict(model="Qwen2.5-7B"), r"model_type \('llama' in the checkpoint, 'qwen2' here\).*qkv_bias"),
])
def test_a_checkpoint_resumes_only_into_its_own_model(tmp_path, change, says):
    """Resharding changes the layout, never the model: another shape's overlapping rectangles would load
    without a word, so the saved model description is compared first, naming the field."""
    Trainer(small(steps=4, stop_at_step=2, save_dir=str(tmp_path))).train()
    with pytest.raises(ValueError, match=says):
        Trainer(small(steps=4, save_dir=str(tmp_path), **change))
    from tpkernels.models import ParallelTransformer
    from tpkernels.train.checkpoint import latest, load

    other = ParallelTransformer(small(**change).model_config(), None)  # load itself refuses, not only the trainer
    with pytest.raises(ValueError, match=says):
        load(latest(tmp_path), other)
    assert [h["step"] for h in Trainer(small(steps=4, save_dir=str(tmp_path))).train()] == [2, 3]


def test_positions_beyond_the_model_warn_for_rotary_and_are_refused_for_a_learned_table(tmp_path):
    rotary = small(seq_length=16, model="Llama-2-7B").with_values({"data.seq_length": 5000})
    with pytest.warns(UserWarning, match=r"data.seq_length \(5000\) > max_position_embeddings \(4096\)"):
        assert rotary.model_config().max_position_embeddings == 5000
    learned = small(model="GPT-1.7B").with_values({"data.seq_length": 4096, "model.kv_heads": None})
    with pytest.raises(ValueError, match=r"data.seq_length \(4096\) must be <= the model's learned position table "
                                         r"\(max_position_embeddings 2048\)"):
        learned.model_config()


def test_dry_run_checks_what_the_run_would(capsys):
    from tpkernels.cli import main

    assert main(["train", "--data", "no/such/corpus.txt", "--dry-run"]) == 2
    assert "data.source ('no/such/corpus.txt') must be 'random', 'random-documents', a text file or a folder" in capsys.readouterr().err
    readme = str(Path(__file__).resolve().parents[1] / "README.md")
    assert main(["train", "--data", readme, "--tokenizer", "no/such/tokenizer.json", "--dry-run"]) == 2
    assert "data.tokenizer ('no/such/tokenizer.json') does not exist" in capsys.readouterr().err
    # before a launch the data's paths are checked once, in the parent, without reading the corpus
    assert main(["train", "--nproc", "2", "--data", "no/such/corpus.txt"]) == 2
    assert "data.source ('no/such/corpus.txt') must be 'random', 'random-documents', a text file or a folder" in capsys.readouterr().err
