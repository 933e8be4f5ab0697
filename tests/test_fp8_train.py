"""FP8 training in the job: a Llama at TP2×PP2+SP trained 30 steps on packed text (LICENSE, byte
tokens) in fp8 with each recipe tracks the bf16 run (10-step means) within a band derived from the
same run's bf16 distance to fp32, with no NaN; the guardrail moves a linear whose inputs saturate back to bf16 and
says so; the per-linear choice is kept in the metrics file; bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_train import small
from tpkernels.train import Trainer

# a text that never changes (README.md did, with every docs edit, and with it the guardrail's moves)
CORPUS = str(Path(__file__).resolve().parents[1] / "LICENSE")
# 16-multiples per rank at TP2 (FP8 GEMMs): hidden 32, heads 4 / 2 KV (q/k/v 32 rows a rank), MLP 64
TEXT = {"model.hidden": 32, "model.ffn": 64, "model.vocab": 258, "data.source": CORPUS, "data.seq_length": 32,
        "optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3, "optimizer.clip_grad": 1.0}
LAYOUT = {"tp": 2, "pp": 2, "sequence_parallel": True, "num_microbatches": 1, "micro_batch_size": 2,
          "data.seq_length": 16, "fp8.learn": False}


def _losses(rank, world, kw):
    # 30 steps, three 10-step windows (was 50: the same gaps, 0.6-0.8% at 30 and 0.7-1.0% at 50, against the
    # 2% allowed; fp32's windows 4.64 -> 3.06 -> 3.47 learn; the five runs cost ~25 s less)
    t = Trainer(small(**{**TEXT, **LAYOUT, "steps": 30, **kw}))
    return [h["loss"] for h in t.train()]


def _windows(losses: torch.Tensor) -> torch.Tensor:
    """Means of 10-step windows: one step's loss follows its batch (a rounding difference can move a single
    step by 10% once the runs' trajectories part), a window's mean follows the training."""
    return losses.view(-1, 10).mean(1)


def test_fp8_recipes_track_bf16_within_the_bf16_to_fp32_band(rank_pool):
    runs = {name: torch.tensor(rank_pool(4).run(_losses, kw, timeout=600)[0]) for name, kw in {
        "fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"},
        "current": {"precision": "fp8", "fp8.layers": "all"},
        "delayed": {"precision": "fp8", "fp8.layers": "all", "fp8.recipe": "delayed"},
        "rowwise": {"precision": "fp8", "fp8.layers": "all", "fp8.recipe": "rowwise"}}.items()}
    fp32, bf16 = _windows(runs["fp32"]), _windows(runs["bf16"])
    assert fp32[-1] < fp32[0] - 0.5  # it learns the text
    # the band: bf16's largest window distance to fp32 (measured 0.07-0.7%); FP8 may be twice as far from bf16,
    # and at least 2% (3 mantissa bits against bf16's 8: measured 0.3-1.3% over four runs of this test)
    band = float(((bf16 - fp32).abs() / fp32).max())
    assert 0 < band < 0.05
    allowed = max(2 * band, 0.02)
    for recipe in ("current", "delayed", "rowwise"):
        got = runs[recipe]
        assert torch.isfinite(got).all(), recipe
        assert not torch.equal(got, runs["bf16"]), recipe  # FP8 ran
        gap = float(((_windows(got) - bf16).abs() / bf16).max())
        assert gap <= allowed, (recipe, gap, band)


def test_guardrail_moves_a_saturating_linear_back_to_bf16_and_says_so(tmp_path, capsys):
    """layers.1.down's input grows 8× every call (and its output is divided back, so nothing else sees it): under
    delayed scaling its casts saturate every step, and after fp8.guard_steps (2) steps it runs bf16; the other
    linears stay FP8; the metrics file names the move."""
    metrics = tmp_path / "m.jsonl"
    t = Trainer(small(**{**TEXT, "steps": 6, "precision": "fp8", "fp8.layers": "all", "fp8.recipe": "delayed",
                         "fp8.guard_steps": 2, "micro_batch_size": 2, "num_microbatches": 1,
                         "logging.metrics_file": str(metrics), "optimizer.lr": 1e-4, "optimizer.min_lr": 1e-5}))
    down = t.model.chunks[0].layers[1].mlp.down
    calls = [0]

    def grow(module, args):
        calls[0] += 1
        return (args[0] * 8.0 ** calls[0],)

    down.register_forward_pre_hook(grow)
    down.register_forward_hook(lambda module, args, out: out / 8.0 ** calls[0])
    history = t.train()
    assert [m["layer"] for m in t.fp8.moved] == ["layers.1.down"] and t.fp8.moved[0]["step"] == 2
    assert not down.fp8_active and down.fp8 is not None
    others = [m for n, (k, m) in t.fp8.mine.items() if n != "layers.1.down"]
    assert others and all(m.fp8_active for m in others)
    assert history[0]["fp8/saturated"] == 0 and history[1]["fp8/saturated"] > 1e-3  # the first cast: its own amax
    assert [h["fp8/linears"] for h in history] == [16, 16, 15, 15, 15, 15]
    out = capsys.readouterr().out
    assert "fp8 guardrail: layers.1.down moves back to bf16 after step 2" in out and "saturated" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    choice = [r for r in records if "fp8_choice" in r]
    assert choice and choice[0]["fp8_choice"]["fp8"] == ["qkv", "out", "gate_up", "down"]
    assert [r["fp8_guard"][0]["layer"] for r in records if "fp8_guard" in r] == ["layers.1.down"]


def test_fp8_bad_inputs_are_named():
    with pytest.raises(ValueError, match="training.precision fp8 with model.finetune qlora"):
        small(precision="fp8", **{"model.finetune": "qlora"})
    with pytest.raises(ValueError, match=r"training.initial_loss_scale \(1024.0\) is fp16's loss scaling"):
        small(precision="fp8", initial_loss_scale=1024.0)
    with pytest.raises(ValueError, match=r"fp8.layers \('qkv,mlp'\) names \['mlp'\]"):
        small(precision="fp8", **{"fp8.layers": "qkv,mlp"})
    with pytest.raises(ValueError, match=r"fp8.recipe"):
        small(precision="fp8", **{"fp8.recipe": "blockwise"})
    # an MLP 40 wide: the down projection's in_features is no FP8 GEMM shape
    with pytest.raises(ValueError, match=r"fp8.layers \('all'\): layers.0.down: .*in_features per rank \(40\) "
                                         r"must be a multiple of 16"):
        Trainer(small(precision="fp8", **{"fp8.layers": "all", "model.hidden": 32, "model.ffn": 40}))


def test_lora_adapters_train_in_bf16_on_an_fp8_base():
    """LoRA on an FP8 base: the base linears run FP8 (forward and input gradient only: frozen), the adapters
    train in bf16, the base weights never change."""
    t = Trainer(small(**{**TEXT, "steps": 3, "precision": "fp8", "fp8.layers": "all", "model.finetune": "lora",
                         "model.lora_rank": 4, "micro_batch_size": 2, "num_microbatches": 1}))
    down = t.model.chunks[0].layers[0].mlp.down
    before = down.weight.detach().clone()
    losses = [h["loss"] for h in t.train()]
    assert down.fp8_active and all(torch.isfinite(torch.tensor(losses)))
    assert torch.equal(down.weight.detach(), before) and down.weight.grad is None
    assert float(down.lora.B.detach().abs().sum()) > 0 and down.lora.B.dtype == torch.bfloat16


def _pair(rank, world, kw):
    base = {**TEXT, "steps": 6, "fp8.layers": "all", "fp8.learn": False, **kw}
    return [[h["loss"] for h in Trainer(small(**{**base, "precision": p})).train()] for p in ("bf16", "fp8")]


@pytest.mark.parametrize("world,kw", [
    (2, dict(dp=2, zero1=True, num_microbatches=2, micro_batch_size=1)),
    (2, dict(cp=2, num_microbatches=2, micro_batch_size=1, recompute="full")),
    (2, dict(pp=2, schedule="zb-h1", num_microbatches=4, micro_batch_size=1)),
    (2, dict(pp=2, virtual_stages=2, schedule="interleaved", num_microbatches=2, micro_batch_size=1)),
], ids=["dp2-zero1", "cp2-recompute", "pp2-zb-h1", "pp2-interleaved"])
def test_fp8_trains_at_every_layout(rank_pool, world, kw):
    """Each layout's fp8 run (current recipe, every linear) stays within 5% of its bf16 run, step by step."""
    bf16, fp8 = rank_pool(world).run(_pair, kw, timeout=600)[0]
    assert all(torch.isfinite(torch.tensor(fp8))) and fp8 != bf16
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=0.05, atol=0)


def _schedules(rank, world):
    base = {**TEXT, "steps": 6, "fp8.layers": "all", "precision": "fp8", "pp": 2, "num_microbatches": 4,
            "micro_batch_size": 1}
    return [[h["loss"] for h in Trainer(small(**{**base, "schedule": s})).train()] for s in ("1f1b", "zb-h1")]


def test_fp8_zero_bubble_trains_what_1f1b_trains(rank_pool):
    """The FP8 linears' weight gradients go through the one weight-gradient mechanism (deferred to W in zb-h1,
    the FP8 operands kept with them): zb-h1 trains exactly what 1F1B trains on the same micro-batches."""
    one, zb = rank_pool(2).run(_schedules, timeout=300)[0]
    assert one == zb and one[-1] < one[0]


def test_a_run_learns_each_linears_gain_and_the_next_auto_choice_uses_it(tmp_path, monkeypatch):
    """fp8.learn: the first step's timing of each kind of linear (bf16 vs FP8, this run's shapes) is kept per
    machine; the next run's auto choice reads it instead of the prediction (here: a fabricated 2× for gate_up
    picks it; the others follow the gains measured on this machine)."""
    from tpkernels.planner.fp8_choice import load_gains, save_gains

    monkeypatch.setenv("TPKERNELS_CACHE_DIR", str(tmp_path))
    kw = {**TEXT, "steps": 2, "precision": "fp8", "micro_batch_size": 2, "num_microbatches": 1}
    first = Trainer(small(**{**kw, "fp8.layers": "all"}))
    first.train()
    machine = first.fp8.machine()
    gains = load_gains(machine)
    assert sorted(gains) == sorted(first.fp8.learned) and len(gains) == 4
    assert all(0 < g < float("inf") for g in gains.values())
    assert sorted(k.split()[0] for k in gains) == ["down", "gate_up", "out", "qkv"]  # keyed by kind: none overwritten
    gate_up = next(k for k in gains if k.startswith("gate_up 64x32x128 tp1"))
    save_gains(machine, {gate_up: 2.0})
    second = Trainer(small(**{**kw, "fp8.layers": "auto", "fp8.learn": False}))
    assert "gate_up" in second.fp8.kinds
    assert [c.chosen for c in second.fp8.choices] == [gains[k] >= 1.05 or k == gate_up for k in
                                                      [next(g for g in gains if g.startswith(f"{c.name} "))
                                                       for c in second.fp8.choices]]
    reasons = {c.name: c.reason for c in second.fp8.choices}
    assert reasons["gate_up"].startswith("measured 2.00×") and reasons["qkv"].startswith("measured ")
