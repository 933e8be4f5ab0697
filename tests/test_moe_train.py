"""`tpkernels train` with a mixture-of-experts model (issue 42): the router losses in the objective, the
MoE metrics, expert parallelism in the gradient reductions, norm, ZeRO-1, schedules, recompute and
checkpoints.

The oracle of the objective is transformers' Mixtral (loss = cross-entropy + router_aux_loss_coef ·
load_balancing_loss_func, the tokens of every layer pooled: ``training.moe_aux_loss_style
transformers``): one process, float64, its loss and every gradient. The layouts (EP2, DP2, EP2×TP2+SP,
EP2×PP2, with the per-layer style and a z-loss) are then held to the one-process float64 trainer at
the same number of micro-batches (the balancing loss is a per-micro-batch statistic), on packed
documents of uneven length: step-0 loss, aux and z losses, the per-expert load, the gradient norm and
every gradient.
"""

from __future__ import annotations

import json

import pytest
import torch

from tpkernels.models.hf_checkpoint import unfuse_experts
from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.data import data_of

E, K = 5, 2  # odd expert count; top-2
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32, intermediate_size=24,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
               max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=E,
               num_experts_per_tok=K, router_aux_loss_coef=0.05, tie_word_embeddings=False, torch_dtype="float64",
               output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
LAYOUT = ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.ep", "parallel.sequence_parallel",
          "parallel.schedule", "parallel.recompute", "parallel.zero1", "parallel.virtual_stages")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(a folder with a tiny Mixtral config.json: 2 layers, 4 experts (EP2 and EP4 split them),
    top-2; transformers)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("mixtral")
    (folder / "config.json").write_text(json.dumps({**MIXTRAL, "num_local_experts": 4}))
    return folder, transformers


def cfg_of(folder, **kw) -> TrainConfig:
    base = {"model.name": str(folder / "config.json"), "training.precision": "fp64", "training.steps": 2,
            "data.seq_length": 16, "data.source": "random-documents", "logging.progress": False,
            "optimizer.lr": 3e-3, "optimizer.warmup_steps": 0, "training.moe_z_loss_coeff": 0.01}
    return TrainConfig.from_values({**base, **kw})


def step0(cfg: TrainConfig) -> dict:
    """Step 0's forward, backward and gradient reductions (no optimizer step): the loss, the moe metrics, the
    global gradient norm and every gradient under its Hugging Face name (every stage's, gathered)."""
    from model_checks import all_stages
    from tpkernels.train.optim import global_grad_norm

    t = Trainer(cfg)
    loss, _, _ = t.forward_backward(t.prepare_batch(0))
    metrics = t.router.step_metrics()
    t.reduce_gradients()
    st = t.state
    norm = float(global_grad_norm(t.model, st.tp_group, st.pp_group, st.ep_group if t.pc.ep > 1 else None))
    grads = all_stages(t.model.to_hf_state_dict("grad"))
    t.router.remove()
    return dict(loss=loss, norm=norm, grads=grads, **metrics)


def test_one_process_objective_is_transformers_mixtral_with_its_aux_loss(mixtral, fresh_seed):
    """Loss and every gradient of step 0 at one process = MixtralForCausalLM(labels, output_router_logits)'s,
    float64 (its loss adds router_aux_loss_coef × the pooled switch loss)."""
    folder, transformers = mixtral
    torch.manual_seed(fresh_seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**{**MIXTRAL, "num_hidden_layers": 2}),
                                                       attn_implementation="eager", experts_implementation="eager")
    hf = hf.double()
    hf.save_pretrained(folder / "hf2")
    cfg = cfg_of(folder, **{"model.name": str(folder / "hf2"), "model.init_from": str(folder / "hf2"),
                            "data.source": "random", "parallel.micro_batch_size": 3,
                            "training.moe_aux_loss_style": "transformers", "training.moe_z_loss_coeff": None,
                            "training.seed": fresh_seed % 2**31})
    got = step0(cfg)
    batch = data_of(cfg, 97, 3).batch(0, 3).ids  # the trainer's: the data depends on (seed, step) only
    out = hf(input_ids=batch, output_router_logits=True)
    # transformers' own loss pieces, kept in float64 (its loss function would upcast only to float32)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), batch[:, 1:].reshape(-1))
    mixtral_module = __import__("transformers.models.mixtral.modeling_mixtral", fromlist=["x"])
    aux = mixtral_module.load_balancing_loss_func(tuple(r.double() for r in out.router_logits), E, K)
    (ce + hf.config.router_aux_loss_coef * aux).backward()
    assert got["loss"] == pytest.approx(float(ce), rel=1e-7)
    assert got["moe/aux_loss"] == pytest.approx(float(aux), rel=1e-6)
    assert got["moe/z_loss"] > 0  # measured, though Mixtral's coefficient is 0
    ours = got["grads"]
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    # transformers fuses the experts in memory: compare under the checkpoint names
    theirs = unfuse_experts(theirs, "mixtral")
    assert set(ours) == set(theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


LORA = {"model.finetune": "lora", "model.lora_rank": 3}
# world: layouts run one after the other on the same ranks; each against the one-process run (the same
# global micro-batches: dp 2 × mbs 1, 2 micro-batches)
LAYOUTS = {
    2: [{"parallel.dp": 2, "parallel.ep": 2}, {"parallel.dp": 2},
        {"parallel.dp": 1, "parallel.cp": 2, "parallel.ep": 2, "parallel.micro_batch_size": 2}],  # EP inside CP
    4: [{"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
        {"parallel.dp": 2, "parallel.ep": 2, "parallel.pp": 2, "parallel.recompute": "selective"},  # 1f1b
        # zero bubble (the TP linears' W deferred; the grouped experts' dW comes in B) and the whole layer
        # recomputed in backward: the MoE layer routes again, its shares are not added twice
        {"parallel.dp": 2, "parallel.ep": 2, "parallel.pp": 2, "parallel.schedule": "zb-h1",
         "parallel.recompute": "full"},
        # LoRA on attention and on every expert (B_gu split over TP, B_d's gradient a partial sum over TP)
        {"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": True, **LORA}],
}
PACKED = {"parallel.num_microbatches": 2, "parallel.micro_batch_size": 1}


def _layouts_worker(rank, world, folder, seed):
    return [step0(cfg_of(folder, **{**PACKED, **kw, "training.seed": seed})) for kw in LAYOUTS[world]]


@pytest.fixture(scope="module")
def one_process(mixtral):
    """The one-process float64 step 0 of the layouts' global batch: 2 micro-batches of 2 rows."""
    def get(seed, **kw):
        return step0(cfg_of(mixtral[0], **{**PACKED, "parallel.micro_batch_size": 2, "training.seed": seed, **kw}))
    return get


@pytest.mark.parametrize("world", [2, 4])
def test_step0_at_every_layout_equals_one_process_fp64(rank_pool, mixtral, one_process, world, fresh_seed):
    """EP2, DP2 and CP2×EP2 (world 2), EP2×TP2+SP and EP2×PP2 under 1f1b + selective recompute and zb-h1 + full
    recompute, EP2×TP2+SP with LoRA on attention and experts (world 4): loss, aux / z losses, the
    per-expert load, the gradient norm (LoRA: the adapters' only) and every gradient equal the one-process
    run."""
    seed = fresh_seed % 2**31
    refs = {False: one_process(seed)}
    if any("model.finetune" in kw for kw in LAYOUTS[world]):
        refs[True] = one_process(seed, **LORA)
    assert refs[False]["moe/aux_loss"] > 0 and refs[False]["moe/z_loss"] > 0
    for per_rank in rank_pool(world).run(_layouts_worker, mixtral[0], seed, timeout=300):
        for kw, got in zip(LAYOUTS[world], per_rank):
            ref, where = refs["model.finetune" in kw], f"{kw}: "
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-10), where
            for k in ("moe/aux_loss", "moe/z_loss"):
                assert got[k] == pytest.approx(ref[k], rel=1e-6), where + k
            assert got["moe/load"] == ref["moe/load"] and got["moe/dropped_tokens"] == 0, where
            assert got["norm"] == pytest.approx(ref["norm"], rel=1e-6), where
            assert set(got["grads"]) == set(ref["grads"]), where
            for k, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][k], g, rtol=1e-5, atol=1e-9,
                                           msg=lambda m, k=k: f"{where}{k}: {m}")


# ---- checkpoints that reshard across EP ----

SAVED_AT = {"parallel.dp": 4, "parallel.ep": 2, "parallel.zero1": True}  # edp 2: experts reduced and sharded
RESUMED_AT = [{"parallel.dp": 4, "parallel.ep": 4}, {"parallel.dp": 4},  # EP4, EP1
              {"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.micro_batch_size": 2}]  # EP2×TP2


def _resume_worker(rank, world, folder, ckpt, seed):
    import shutil

    import torch.distributed as dist

    run = {**PACKED, "training.seed": seed, "training.steps": 3}
    t = Trainer(cfg_of(folder, **SAVED_AT, **run, **{"checkpoint.save_dir": str(ckpt / "a"),
                                                        "checkpoint.save_every": 2}))
    full = t.train()
    out = {"full": [(h["loss"], h["moe/aux_loss"]) for h in full]}
    for j, kw in enumerate(RESUMED_AT):
        d = ckpt / f"r{j}"
        if rank == 0:
            shutil.copytree(ckpt / "a" / "step_00000002", d / "step_00000002")
        dist.barrier()
        t = Trainer(cfg_of(folder, **{**run, **kw, "checkpoint.save_dir": str(d)}))
        assert t.step_index == 2
        out[str(kw)] = [(h["loss"], h["moe/aux_loss"]) for h in t.train()]
    return out


def test_checkpoint_saved_at_ep2_resumes_at_ep4_ep1_and_ep2tp2(rank_pool, mixtral, tmp_path, fresh_seed):
    """Saved at step 2 at DP4 with EP2 (ZeRO-1: expert moments sharded over their edp pair), resumed at EP4,
    EP1 and EP2×TP2: step 2 (loss and aux loss, after two AdamW steps of weights and moments read back) equals
    the uninterrupted run's. Expert e of layer l is
    stored under its Hugging Face name whatever EP rank held it, so every layout finds it; export-hf of the
    checkpoint is a Mixtral folder that transformers loads and runs as the checkpoint's model does."""
    got = rank_pool(4).run(_resume_worker, mixtral[0], tmp_path, fresh_seed % 2**31, timeout=300)[0]
    full = torch.tensor(got.pop("full"))
    assert len(got) == len(RESUMED_AT)
    for layout, losses in got.items():
        torch.testing.assert_close(torch.tensor(losses), full[2:], rtol=1e-6, atol=0,
                                   msg=lambda m, k=layout: f"resumed at {k}: {m}")
    # export-hf of the EP2 checkpoint: transformers' Mixtral loads it and computes what the checkpoint's model does
    from tpkernels.models import ParallelTransformer
    from tpkernels.train import checkpoint

    step2 = tmp_path / "a" / "step_00000002"
    checkpoint.export_hf(step2, tmp_path / "hf")
    hf = mixtral[1].AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager",
                                                         attn_implementation="eager", dtype=torch.float64)
    ours = ParallelTransformer(checkpoint.config_of(checkpoint.read_meta(step2)).model_config(), None, init=None,
                               dtype=torch.float64)
    checkpoint.load(step2, ours)
    ids = torch.randint(0, MIXTRAL["vocab_size"], (2, 11))
    torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-6)

    from tpkernels.train.checkpoint_files import read_dcp_metadata

    keys = set(read_dcp_metadata(tmp_path / "a" / "step_00000002").state_dict_metadata)
    for kind in ("model", "exp_avg", "exp_avg_sq"):  # one key per expert (and TP rectangle), none per EP rank
        assert {k for k in keys if k.startswith(f"{kind}::model.layers.1.block_sparse_moe.experts.")} == {
            f"{kind}::model.layers.1.block_sparse_moe.experts.{e}.{w}.weight::{'0-32::0-24' if w == 'w2' else '0-24::0-32'}"
            for e in range(4) for w in ("w1", "w2", "w3")}


# ---- fine-tuning: SFT with LoRA, DPO with a frozen reference and validation ----

def _finetune_cfgs(folder, data, seed):
    from data_checks import CHATS, MARKED, make_tokenizer, write_jsonl
    from test_dpo import _pairs

    if not (data / "tok").exists():
        make_tokenizer(data / "tok", MARKED)
        write_jsonl(data / "chat.jsonl", CHATS * 4)
        write_jsonl(data / "pairs.jsonl", _pairs(12))
    common = {"data.tokenizer": str(data / "tok"), "data.seq_length": 48, "training.seed": seed, **PACKED}
    return {"sft-lora": {**common, "data.source": str(data / "chat.jsonl"), "model.finetune": "lora",
                         "model.lora_rank": 4},
            "dpo": {**common, "data.source": str(data / "pairs.jsonl"), "dpo.reference": "model",
                    "eval.source": str(data / "pairs.jsonl"), "eval.every": 1, "eval.batches": 1}}


def _finetune(cfg: TrainConfig) -> dict:
    t = Trainer(cfg)
    experts = {n: p.detach().clone() for n, p in t.model.named_parameters() if "w_gate_up" in n or "w_down" in n}
    hist = t.train()
    moved = {n: not torch.equal(p.detach(), experts[n]) for n, p in t.model.named_parameters() if n in experts}
    adapters = [bool(p.detach().abs().sum() > 0) for n, p in t.model.named_parameters() if ".mlp.lora.B_" in n]
    rows = t.pc.global_batch_size * cfg.data.seq_length
    return {"loss": [h["loss"] for h in hist], "aux": [h["moe/aux_loss"] for h in hist],
            "assignments": [[sum(v) for v in h["moe/load"].values()] for h in hist], "tokens": rows,
            "experts_moved": moved, "eval": [h.get("eval/loss") for h in hist], "expert_adapters": adapters}


def _finetune_worker(rank, world, folder, data, seed):
    return {k: _finetune(cfg_of(folder, **kw, **{"parallel.dp": 2, "parallel.ep": 2}))
            for k, kw in _finetune_cfgs(folder, data, seed).items()}


def test_sft_lora_and_dpo_at_ep2_train_what_one_process_trains(rank_pool, mixtral, tmp_path, fresh_seed):
    """SFT with LoRA (adapters on attention and on every routed expert: the router and the experts' base
    weights stay frozen, the experts' adapters train) and DPO (its reference a frozen
    copy run every step, validation after every step) at EP2 = one process, in float64; the load counts
    only the training steps' tokens (reference and validation passes record no metric)."""
    folder, seed = mixtral[0], fresh_seed % 2**31
    got = rank_pool(2).run(_finetune_worker, folder, tmp_path, seed, timeout=300)[0]
    for task, kw in _finetune_cfgs(folder, tmp_path, seed).items():
        want = _finetune(cfg_of(folder, **{**kw, "parallel.micro_batch_size": 2}))
        mine = got[task]
        torch.testing.assert_close(torch.tensor(mine["loss"]), torch.tensor(want["loss"]), rtol=1e-9, atol=0)
        torch.testing.assert_close(torch.tensor(mine["aux"]), torch.tensor(want["aux"]), rtol=1e-6, atol=0)
        for r in (mine, want):
            assert r["assignments"] == [[K * r["tokens"]] * 2] * 2, task  # every token routed to K experts
        assert not any(mine["experts_moved"].values()) if task == "sft-lora" else all(mine["experts_moved"].values())
        assert mine["expert_adapters"] == ([True] * 4 if task == "sft-lora" else [])  # B_gu, B_d of 2 layers trained
    assert got["dpo"]["eval"][0] is not None


@pytest.mark.parametrize("values, message", [
    ({"training.moe_aux_loss_style": "transformers", "parallel.pp": 2, "parallel.dp": 1},
     r"training.moe_aux_loss_style \(transformers\) pools the tokens of every MoE layer, which needs them all on one "
     r"pipeline stage \(parallel.pp 1, now 2"),
])
def test_what_moe_cannot_train_with_is_named(mixtral, values, message):
    with pytest.raises(ValueError, match=message):
        Trainer(cfg_of(mixtral[0], **values))


def test_moe_keys_on_a_dense_model_and_bad_coefficients_are_named(mixtral):
    from test_train import small

    with pytest.raises(ValueError, match=r"training.moe_aux_loss_coeff \(0.1\) set for .*a dense model"):
        Trainer(small(**{"training.moe_aux_loss_coeff": 0.1}))
    with pytest.raises(ValueError, match=r"training.moe_z_loss_coeff \(-1.0\) must be a finite number >= 0"):
        cfg_of(mixtral[0], **{"training.moe_z_loss_coeff": -1.0})


def test_expert_adapters_merge_into_the_experts(mixtral, fresh_seed):
    """The experts' adapters (one (A, B) per expert) run unfused in the layer and merge into the stacked
    weights (W += alpha/r · A·B): logits before and after the merge agree in float64; B = 0 at the start
    leaves the model as it was."""
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.lora import EXPERTS, TARGETS, apply_lora, merge_lora_

    mc = cfg_of(mixtral[0]).model_config()
    model = ParallelTransformer(mc, None, seed=fresh_seed % 2**31, dtype=torch.float64)
    ids = torch.randint(0, mc.vocab_size, (2, 9))
    base = model(ids)
    done = apply_lora(model, 3, 5.0, TARGETS + (EXPERTS,), seed=1)
    assert sum(d.endswith(".mlp.experts") for d in done) == 2
    torch.testing.assert_close(model(ids), base, rtol=1e-12, atol=1e-12)  # the unfused MLP: rounding only
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.normal_(0, 0.3)
    adapted = model(ids)
    assert (adapted - base).abs().max() > 1e-3
    assert merge_lora_(model) == 2 + 2 * 2  # two MoE layers, each layer's qkv and out
    torch.testing.assert_close(model(ids), adapted, rtol=1e-10, atol=1e-10)


def test_moe_metrics_reach_the_metrics_file_the_progress_line_and_tensorboard(mixtral, tmp_path, capsys):
    """One process, 2 steps: the metrics file's step records hold the moe/* values, the plain progress line
    shows aux and load max/mean, and TensorBoard's own reader finds the same aux curve and the per-layer
    load as text."""
    from test_experiment_log import read_events
    from tpkernels.train.experiment_log import close_logs

    cfg = cfg_of(mixtral[0], **{"logging.metrics_file": str(tmp_path / "m.jsonl"), "logging.log_every": 1,
                                "logging.progress": True, "logging.tensorboard_dir": str(tmp_path / "tb"),
                                "parallel.micro_batch_size": 2})
    Trainer(cfg).train()
    close_logs()
    recs = [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["moe/aux_loss"] > 0 and r["moe/load_max_over_mean"] >= 1 and r["moe/dropped_tokens"] == 0
        assert set(r["moe/load"]) == {"0", "1"} and all(sum(v) == K * 2 * 16 for v in r["moe/load"].values())
    out = capsys.readouterr().out
    assert f"aux {recs[1]['moe/aux_loss']:.4f}  load max/mean {recs[1]['moe/load_max_over_mean']:.2f}" in out
    scalars, texts = read_events(tmp_path / "tb")
    assert [v for _, v in scalars["moe/aux_loss"]] == pytest.approx([r["moe/aux_loss"] for r in recs], rel=1e-6)
    assert texts["moe/load/1"][-1] == (1, ", ".join(map(str, recs[1]["moe/load"]["1"])))


def test_zero_bubble_defers_the_expert_weight_gradients_to_w(mixtral, fresh_seed):
    """A forward inside split_weight_grads (a zb-h1 F): B leaves the experts' stacked weights without a
    gradient and queues dW (grouped_gemm_split); W (the store's flush) lands the same gradients as an
    ordinary backward, every parameter's, in float64."""
    from tpkernels.functional.weight_grad import WeightGradStore, defer_weight_grads, split_weight_grads
    from tpkernels.models import ParallelTransformer

    mc = cfg_of(mixtral[0]).model_config()
    ids = torch.randint(0, mc.vocab_size, (2, 9))

    def run(split: bool):
        model = ParallelTransformer(mc, None, seed=fresh_seed % 2**31, dtype=torch.float64)
        store = WeightGradStore()
        with split_weight_grads(split):
            loss = model(ids, target=ids)
        with defer_weight_grads(store):
            loss.backward()
        in_b = {n: p.grad is not None for n, p in model.named_parameters() if "w_gate_up" in n or "w_down" in n}
        store.flush()
        return in_b, {n: p.grad for n, p in model.named_parameters()}

    in_b, want = run(False)
    assert all(in_b.values())
    in_b, got = run(True)
    assert not any(in_b.values()) and len(in_b) == 4
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=1e-12, atol=1e-14, msg=lambda m, k=k: f"{k}: {m}")
