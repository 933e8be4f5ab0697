"""Aux-loss-free balancing (issue 42, DeepSeek-V3; ``training.moe_expert_bias_rate``): the per-expert
selection bias each MoE layer routes with, its update once per step from the step's global load, and
the bias as run state: the same at EP2 as at one process, resumed at another layout bit for bit, frozen
in validation and recompute, refused on a dense model and by export-hf.

The oracle of the update is the hand rule on the step's ``moe/load`` counts:
b_e(step+1) = b_e(step) + rate · sign(mean(load) − load_e).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tpkernels.train import TrainConfig, Trainer

E, K = 4, 2
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32, intermediate_size=24,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
               max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=E,
               num_experts_per_tok=K, router_aux_loss_coef=0.0, tie_word_embeddings=False, torch_dtype="float64",
               output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
RATE = 0.01


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral_bias")
    (d / "config.json").write_text(json.dumps(MIXTRAL))
    return d


def cfg_of(folder, **kw) -> TrainConfig:
    base = {"model.name": str(folder / "config.json"), "training.precision": "fp64", "training.steps": 3,
            "data.seq_length": 16, "data.source": "random-documents", "logging.progress": False,
            "optimizer.lr": 3e-3, "optimizer.warmup_steps": 0, "training.moe_expert_bias_rate": RATE,
            "parallel.num_microbatches": 2, "parallel.micro_batch_size": 2}
    return TrainConfig.from_values({**base, **kw})


def biases(t: Trainer) -> dict[str, list[float]]:
    return {k: v.tolist() for k, v in t.expert_bias.state_tensors().items()}


def run(cfg: TrainConfig, between=None) -> dict:
    """Each step's loss, moe/load and the biases after it; ``between(trainer)`` runs before every step."""
    t = Trainer(cfg)
    out = {"loss": [], "load": [], "bias": []}
    while t.step_index < cfg.training.steps:
        if between is not None:
            between(t)
        h = t.train_step()
        out["loss"].append(h["loss"])
        out["load"].append(h["moe/load"])
        out["bias"].append(biases(t))
    t.router.remove()
    return out


def test_update_is_the_sign_rule_frozen_outside_steps_and_moves_load_off_busy_experts(folder, fresh_seed):
    """Every step: bias += rate · sign(mean load − load) of that step's moe/load (the global count, summed over
    both micro-batches), starting from 0, in float32. The bias is frozen outside training steps: a validation
    before every step leaves losses, loads and biases as they were, and a recomputed forward routes as its
    forward did (recompute full = none). With a rate of 1 (above any softmax score gap) the experts busier
    than the mean at step 0 get fewer assignments at step 1 than the same run without the bias."""
    seed = fresh_seed % 2**31
    got = run(cfg_of(folder, **{"training.seed": seed}))
    seen = []
    val = run(cfg_of(folder, **{"training.seed": seed, "eval.source": "random-documents", "eval.batches": 1,
                                "eval.every": 1}),
              between=lambda t: seen.append(t.validate()))
    assert len(seen) == 3 and all(math.isfinite(v["eval/loss"]) for v in seen), seen
    rc = run(cfg_of(folder, **{"training.seed": seed, "parallel.recompute": "full"}))
    for name, other in (("validation", val), ("recompute", rc)):
        assert other["bias"] == got["bias"], name
        assert other["load"] == got["load"], name
        torch.testing.assert_close(torch.tensor(other["loss"]), torch.tensor(got["loss"]), rtol=1e-12, atol=0)
    b = {i: torch.zeros(E, dtype=torch.float32) for i in range(2)}
    for load, after in zip(got["load"], got["bias"]):
        assert sum(load["0"]) == K * 2 * 2 * 16  # every assignment of the step's 64 tokens, dropless
        for i in range(2):
            c = torch.tensor(load[str(i)], dtype=torch.float64)
            b[i] = b[i] + (RATE * torch.sign(c.mean() - c)).float()
            assert after[f"moe:layers.{i}.expert_bias"] == b[i].tolist()

    kw = {"training.seed": seed, "training.steps": 2, "optimizer.lr": 1e-12, "optimizer.min_lr": 0.0}
    on = run(cfg_of(folder, **kw, **{"training.moe_expert_bias_rate": 1.0}))
    t = Trainer(cfg_of(folder, **kw, **{"training.moe_expert_bias_rate": 0.0}))
    assert t.expert_bias is None
    off = [t.train_step()["moe/load"] for _ in range(2)]
    t.router.remove()
    assert on["load"][0] == off[0]  # the bias starts at zero: step 0 routes as without it
    for i in ("0", "1"):
        c0 = torch.tensor(on["load"][0][i], dtype=torch.float64)
        busy = c0 > c0.mean()
        assert int(torch.tensor(on["load"][1][i])[busy].sum()) < int(torch.tensor(off[1][i])[busy].sum())


def _ep2_worker(rank, world, folder, ckpt, seed):
    import shutil

    import torch.distributed as dist

    ep2 = {"training.seed": seed, "parallel.dp": 2, "parallel.ep": 2, "parallel.micro_batch_size": 1}
    full = run(cfg_of(folder, **ep2, **{"checkpoint.save_dir": str(ckpt / "a")}),
               between=lambda t: t.save() if t.step_index == 2 else None)
    d = ckpt / "b"
    if rank == 0:
        shutil.copytree(ckpt / "a" / "step_00000002", d / "step_00000002")
    dist.barrier()
    # resumed at TP2 (no EP, no DP): the biases are read whole from their layout-independent keys
    resumed = run(cfg_of(folder, **{"training.seed": seed, "parallel.tp": 2, "parallel.sequence_parallel": True,
                                    "checkpoint.save_dir": str(d)}))
    return {"full": full, "resumed": resumed}


def test_ep2_equals_one_process_and_a_resume_at_tp2_continues_bit_for_bit(rank_pool, folder, tmp_path, fresh_seed):
    """DP2 × EP2 over 3 steps = one process (losses, per-step load, biases: exactly); saved at step 2, resumed at
    TP2+SP, step 2's loss and the biases after it equal the uninterrupted run's. The checkpoint holds the biases
    under moe:layers.<i>.expert_bias, whole (E,)."""
    seed = fresh_seed % 2**31
    one = run(cfg_of(folder, **{"training.seed": seed}))
    got = rank_pool(2).run(_ep2_worker, folder, tmp_path, seed, timeout=300)
    for r in got:
        torch.testing.assert_close(torch.tensor(r["full"]["loss"]), torch.tensor(one["loss"]), rtol=1e-10, atol=0)
        assert r["full"]["load"] == one["load"]
        assert r["full"]["bias"] == one["bias"]
        assert r["resumed"]["bias"] == one["bias"][2:]
        assert r["resumed"]["load"] == one["load"][2:]
        torch.testing.assert_close(torch.tensor(r["resumed"]["loss"]), torch.tensor(one["loss"][2:]), rtol=1e-10,
                                   atol=0)
    from tpkernels.train import checkpoint
    from tpkernels.train.checkpoint_files import read_dcp_metadata

    step2 = tmp_path / "a" / "step_00000002"
    md = read_dcp_metadata(step2).state_dict_metadata
    assert {k: tuple(md[k].size) for k in md if "expert_bias" in k} == {
        "moe:layers.0.expert_bias": (E,), "moe:layers.1.expert_bias": (E,)}
    # generation from the checkpoint routes with the biases saved at step 2 (those after step 1), frozen
    from tpkernels.train.generate_load import load_for_generation
    from tpkernels.train.moe_bias import moe_layers

    layers = moe_layers(load_for_generation(step2, None, dtype="float64").model)
    assert {f"moe:layers.{i}.expert_bias": m.expert_bias.tolist() for i, m in layers.items()} == one["bias"][1]
    with pytest.raises(ValueError, match=r"export-hf: .*training.moe_expert_bias_rate \(0.01\).*no weight for"):
        checkpoint.export_hf(step2, tmp_path / "hf")
    # resuming with the option off would route without the trained biases: refused, naming the key
    with pytest.raises(ValueError, match=r"aux-loss-free balancing .*resume it with training.moe_expert_bias_rate"):
        Trainer(cfg_of(folder, **{"training.seed": seed, "training.moe_expert_bias_rate": 0.0,
                                  "checkpoint.save_dir": str(tmp_path / "a"), "checkpoint.resume": True}))


def test_bad_rates_and_a_dense_model_are_named(folder):
    from test_train import small

    with pytest.raises(ValueError, match=r"training.moe_expert_bias_rate \(0.1\) set for .*a dense model"):
        Trainer(small(**{"training.moe_expert_bias_rate": 0.1}))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"training.moe_expert_bias_rate \(.*\) must be a finite number"):
            cfg_of(folder, **{"training.moe_expert_bias_rate": bad})
