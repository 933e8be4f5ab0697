"""Mixture-of-experts models (issue 42): the ModelConfig fields and their rules, the one Hugging Face reader and
writer for mixtral / qwen2_moe / qwen3_moe, the presets' parameter counts against transformers' own models."""

from __future__ import annotations

import pytest
import torch

from tpkernels.description import MODEL_PRESETS, ModelConfig
from tpkernels.description.hf_config import config_to_hf
from tpkernels.parallel import ParallelConfig

transformers = pytest.importorskip("transformers")

MOE_PRESETS = [name for name, mc in MODEL_PRESETS.items() if mc.num_experts]
# published (total, active) parameters, billions
PUBLISHED = {"Mixtral-8x7B": (46.7, 12.9), "Mixtral-8x22B": (141, 39), "Qwen2-57B-A14B": (57.4, 14.2),
             "Qwen3-30B-A3B": (30.5, 3.3), "Qwen3-235B-A22B": (235, 22)}


def _meta_count(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_presets_count_what_transformers_builds(name):
    """Each MoE preset's total count is what transformers' model of the same config holds (built on the meta
    device), the active count is the published one, and the config survives the trip through transformers."""
    mc = MODEL_PRESETS[name]
    cfg = config_to_hf(mc)
    assert _meta_count(cfg) == mc.num_params()
    total, active = PUBLISHED[name]
    assert mc.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert mc.num_active_params() / 1e9 == pytest.approx(active, rel=0.02)
    assert ModelConfig.read_hf(cfg).replace(name="") == mc.replace(name="")


def tiny(kind: str, **kw):
    common = dict(vocab_size=61, hidden_size=24, intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if kind == "mixtral":
        return transformers.MixtralConfig(**{**common, "num_local_experts": 5, **kw})
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**{**common, "num_experts": 3, "moe_intermediate_size": 14,
                                              "shared_expert_intermediate_size": 18, **kw})
    return transformers.Qwen3MoeConfig(**{**common, "num_experts": 3, "moe_intermediate_size": 14, **kw})


def test_mixtral_fields():
    mc = ModelConfig.read_hf(tiny("mixtral", router_aux_loss_coef=0.02, sliding_window=7))
    assert (mc.num_experts, mc.experts_per_token, mc.expert_ffn, mc.shared_expert_ffn_hidden_size) == (5, 2, 20, 0)
    assert mc.router_normalize and mc.moe_layers is None and mc.router_aux_loss_coef == 0.02
    assert not mc.qkv_bias and mc.window(3) == (6, 0) and all(mc.is_moe_layer(i) for i in range(4))
    assert config_to_hf(mc).num_local_experts == 5


def test_qwen2_moe_fields_sparse_step_and_dense_layers():
    mc = ModelConfig.read_hf(tiny("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert mc.moe_layers == (1,) and [mc.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (mc.expert_ffn, mc.ffn_hidden_size, mc.shared_expert_ffn_hidden_size) == (14, 20, 18)
    assert mc.shared_expert_gate and mc.qkv_bias and mc.router_normalize
    assert _meta_count(config_to_hf(mc)) == mc.num_params()
    back = ModelConfig.read_hf(config_to_hf(mc))  # written as mlp_only_layers, read back alike
    assert back.replace(name="") == mc.replace(name="")
    # a dense layer's MLP is the dense width; the active count leaves out (E - k) experts of the MoE layer only
    assert mc.num_params() - mc.num_active_params() == (3 - 2) * 3 * 24 * 14


def test_qwen3_moe_fields_sparse_step_and_dense_layers():
    """Qwen3-MoE is built (its per-head q/k norms: tests/test_qk_norm.py): decoder_sparse_step, mlp_only_layers and
    norm_topk_prob are read as transformers' model uses them, and written back alike."""
    cfg = tiny("qwen3_moe", head_dim=8, decoder_sparse_step=2, mlp_only_layers=[1], norm_topk_prob=True)
    mc = ModelConfig.from_hf(cfg)
    assert mc.qk_norm and mc.num_experts == 3 and mc.dhead == 8 and mc.build_errors() == []
    assert mc.moe_layers == (3,) and mc.router_normalize and not mc.qkv_bias and not mc.shared_expert_ffn_hidden_size
    assert _meta_count(config_to_hf(mc)) == mc.num_params()
    assert ModelConfig.read_hf(config_to_hf(mc)).replace(name="") == mc.replace(name="")
    assert not ModelConfig.read_hf(tiny("qwen3_moe", norm_topk_prob=False)).router_normalize


def test_router_jitter_is_refused_like_dropout():
    mc = ModelConfig.read_hf(tiny("mixtral", router_jitter_noise=0.1))
    assert mc.router_jitter == 0.1
    with pytest.raises(ValueError, match=r"router_jitter_noise \(0.1\) > 0"):
        ModelConfig.from_hf(tiny("mixtral", router_jitter_noise=0.1))


@pytest.mark.parametrize("changes, message", [
    (dict(experts_per_token=6), r"experts_per_token \(6\) must be between 1 and num_experts \(5\)"),
    (dict(experts_per_token=0), r"experts_per_token \(0\) must be between 1"),
    (dict(num_experts=-1), r"num_experts \(-1\) must be a non-negative integer"),
    (dict(moe_ffn_hidden_size=0), r"moe_ffn_hidden_size \(0\) must be a positive integer"),
    (dict(moe_layers=(2, 1)), r"moe_layers \(\(2, 1\)\) must be a sorted tuple"),
    (dict(moe_layers=(4,)), r"moe_layers \(\(4,\)\) must be a sorted tuple of distinct layer ids in \[0, num_layers"),
    (dict(shared_expert_gate=True), r"shared_expert_gate \(True\) needs a shared expert"),
    (dict(capacity_factor=0.0), r"capacity_factor \(0.0\) must be a finite number > 0"),
    (dict(router_aux_loss_coef=-1.0), r"router_aux_loss_coef \(-1.0\) must be a finite number >= 0"),
    (dict(router_score="relu"), r"router_score \('relu'\) must be one of softmax, sigmoid"),
    (dict(num_experts=0), r"experts_per_token \(2\) set on a dense model"),
    (dict(activation="gelu"), r"activation \('gelu'\) must be 'swiglu' with num_experts \(5\)"),
])
def test_bad_moe_fields_are_named(changes, message):
    mc = ModelConfig.read_hf(tiny("mixtral"))
    with pytest.raises(ValueError, match=message):
        mc.replace(**changes)


def test_other_families_with_experts_are_refused():
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2)
    cfg.num_experts = 8
    with pytest.raises(ValueError, match=r"num_experts \(8\): experts in a 'qwen2' config are not supported"):
        ModelConfig.from_hf(cfg)


def test_flops_count_active_experts_and_router():
    """Mixtral-8x7B: a token's GEMM weights are attention + router + 2 of 8 experts; model FLOPs per token are
    6 × (active non-embedding weights) + attention core + logits, as Megatron-Core counts MoE."""
    mc = MODEL_PRESETS["Mixtral-8x7B"]
    h, f, e = 4096, 14336, 8
    attn = h * 4096 + 2 * h * 1024 + 4096 * h
    assert mc.linear_weights_per_layer() == attn + e * h + 2 * 3 * h * f
    lin, _ = mc.forward_flops_per_layer(1, 1)
    assert lin == 2 * (mc.num_active_params() - mc.embedding_params() - mc.head_params() - 32 * 2 * h) / 32
    dense = mc.replace(num_experts=0, experts_per_token=0)
    assert mc.model_flops_per_step(1, 4096) > dense.model_flops_per_step(1, 4096)
    F, B, W = mc.weight_split_flops(4096, 1, 2)
    assert W == lin * 4096 / 2
    r = 8
    assert mc.lora_params_per_layer(r) == r * (2 * (h + 4096) + 2 * (h + 1024)) + e * 3 * r * (h + f)


# ---- the model against transformers in float64: one process and EP / TP layouts on gloo ----

VOCAB = 61
# (family, experts, extra config): Mixtral every layer MoE; Qwen2-MoE a dense layer (mlp_only_layers), a shared
# expert with its sigmoid gate, un-normalised top-k weights and q/k/v biases
FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "mixtral-ties": dict(num_local_experts=5),  # router rows (r, r, -r, -r, 0): tied scores, expert 4 always empty
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=14, shared_expert_intermediate_size=18,
                      mlp_only_layers=[1], norm_topk_prob=False),
}


def _hf_moe(kind: str, seed: int, **extra):
    torch.manual_seed(seed)
    cfg = tiny(kind.split("-")[0], **{**FAMILIES[kind], **extra, "num_hidden_layers": 3, "vocab_size": VOCAB,
                        "router_aux_loss_coef": 0.37, "output_router_logits": True, "bos_token_id": None,
                        "eos_token_id": None, "pad_token_id": None})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                          experts_implementation="eager").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
                p[0] *= 3.0  # skewed routing: expert 0 takes most tokens
                if kind == "mixtral-ties":  # the top-2 is {0, 1} or {2, 3} (exact ties); logit 0 never makes it
                    p[1], p[2], p[3], p[4] = p[0], -p[0], -p[0], 0.0
            else:
                p.normal_(0.0, 0.15)
    return model


def _reference(model, ids):
    """(logits, CE + coef · aux, aux, {checkpoint name: grad}) of transformers' model."""
    from tpkernels.models.hf_checkpoint import unfuse_experts

    out = model(ids, labels=ids)
    model.zero_grad()
    out.loss.backward()
    grads = unfuse_experts({n: p.grad.clone() for n, p in model.named_parameters()}, model.config.model_type)
    aux = out.aux_loss.detach() if out.aux_loss is not None else None
    return out.logits.detach(), out.loss.detach(), aux, grads


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    cache = {}

    def get(kind, seed):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            model = _hf_moe(kind, seed % 10_000)
            model.save_pretrained(str(folder))
            ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
            ref = _reference(model, ids)
            model.config.output_router_logits = False  # the token loss alone (a pipeline's loss, below)
            cache[kind + "-ce"] = _reference(model, ids)
            cache[kind] = (str(folder), ids, ref)
        return cache[kind]

    return get


def _moe_parity_worker(rank, world, folder, layout, ids, reference):
    import torch.distributed as dist

    from model_checks import all_stages
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    # routing scores are fp32 on both sides (transformers' choice): a logit rounded differently at another layout
    # moves a combine weight by ~1e-7 relative, ~1e-6 in the logits after three layers; a wrong share, reduction
    # or expert slice moves them by 1e-2 or more
    ref_logits, ref_loss, ref_aux, ref_grads = reference
    state = ParallelState.create(ParallelConfig(**layout))
    pc = state.config
    model = ParallelTransformer.from_hf(folder, state, dtype=torch.float64)
    d = pc.dp * pc.cp
    rows = slice(state.dp_rank * ids.shape[0] // pc.dp, (state.dp_rank + 1) * ids.shape[0] // pc.dp)
    logits = model(ids[rows])
    torch.testing.assert_close(logits, ref_logits[rows], rtol=1e-5, atol=2e-5)
    ce = model(ids[rows], target=next_token_targets(ids[rows]))  # this replica's token mean (equal counts)
    aux = model.moe_losses.aux_loss("transformers")  # this rank's share: summed over TP × DP, transformers' aux
    # the DP reduction averages over dp · cp, so a rank's share enters × dp · cp, as its token mean does
    (ce + model.config.router_aux_loss_coef * d * aux).backward()
    model.finish_grad_sync()
    values = torch.stack([ce.detach() / (pc.tp * d), aux.detach().double()])
    if world > 1:
        dist.all_reduce(values)
    torch.testing.assert_close(values[1], ref_aux.double(), rtol=1e-5, atol=1e-9)  # transformers: fp32
    torch.testing.assert_close(values[0] + model.config.router_aux_loss_coef * values[1], ref_loss.double(), rtol=1e-5,
                               atol=1e-9)
    grads = all_stages(model.to_hf_state_dict("grad"))
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    counts = torch.stack([c for c in model.moe_losses.expert_load().values()])
    return counts.tolist()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_one_process_matches_transformers(moe_checkpoints, fresh_seed, kind):
    folder, ids, ref = moe_checkpoints(kind, fresh_seed)
    counts = _moe_parity_worker(0, 1, folder, {}, ids, ref)
    assert all(sum(layer) == ids.numel() * 2 for layer in counts)  # T · k assignments per MoE layer
    if kind == "mixtral-ties":  # tied experts go together, the empty expert stays empty (and gets no gradient)
        assert all(layer[4] == 0 and layer[0] == layer[1] and layer[2] == layer[3] for layer in counts), counts


PARITY_LAYOUTS = {
    "ep2": dict(dp=2, ep=2),
    "ep2-tp2-sp": dict(tp=2, dp=2, ep=2, sequence_parallel=True),
    "ep2-tp2": dict(tp=2, dp=2, ep=2),
    "ep4": dict(dp=4, ep=4),
}


@pytest.mark.parametrize("kind, case", [("mixtral", "ep2"), ("mixtral", "ep2-tp2-sp"), ("mixtral", "ep4"),
                                        ("qwen2_moe", "ep2-tp2")])
def test_expert_parallel_layouts_match_transformers(rank_pool, moe_checkpoints, fresh_seed, kind, case):
    folder, ids, ref = moe_checkpoints(kind, fresh_seed)
    layout = PARITY_LAYOUTS[case]
    world = ParallelConfig(**layout).world_size
    rank_pool(world).run(_moe_parity_worker, folder, layout, ids, ref, timeout=120)


def _round_trip_worker(rank, world, folder, out_folder, layout, ids):
    import os

    from tpkernels.models import ParallelTransformer
    from tpkernels.models.hf_checkpoint import SafetensorsSource
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(**layout))
    model = ParallelTransformer(ModelConfig.from_hf(folder), state, dtype=torch.float64, init=None)
    src = SafetensorsSource(folder)
    model.load_hf_(src)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    model.save_hf(out_folder)
    if rank != 0:
        return src.bytes_read, total, None
    a = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    b, info = transformers.AutoModelForCausalLM.from_pretrained(out_folder, dtype=torch.float64,
                                                                experts_implementation="eager",
                                                                output_loading_info=True)
    with torch.no_grad():
        diff = (a(ids).logits - b(ids).logits).abs().max().item()
    return src.bytes_read, total, (diff, {k: sorted(v) for k, v in info.items() if v})


@pytest.mark.parametrize("kind, layout", [("mixtral", dict(tp=2, dp=2, ep=2)), ("qwen2_moe", dict(dp=2, ep=2))])
def test_load_only_my_experts_and_save_what_transformers_loads(rank_pool, moe_checkpoints, tmp_path, fresh_seed,
                                                               kind, layout):
    """Each rank reads its experts' TP slices only (well under the checkpoint); save_hf gathers them over TP and
    EP into files that transformers loads with no missing or unexpected key, giving the original logits."""
    folder, ids, _ = moe_checkpoints(kind, fresh_seed)
    world = ParallelConfig(**layout).world_size
    out = rank_pool(world).run(_round_trip_worker, folder, str(tmp_path / "out"), layout, ids, timeout=120)
    mc = ModelConfig.from_hf(folder)
    expert_bytes = 8 * sum(mc.moe_params(i).get("experts", 0) for i in range(mc.num_layers))  # float64 files
    for read, total, _ in out:  # the other EP rank's experts are never read (and half the rest at TP2)
        assert 0 < read <= total - expert_bytes // 2, (read, total, expert_bytes)
        if world == 4:
            assert read < 0.45 * total
    diff, info = out[0][2]
    assert info == {} and diff == 0.0, (diff, info)


def _pipeline_worker(rank, world, folder, layout, ids, reference):
    import torch.distributed as dist

    from model_checks import all_stages
    from tpkernels.functional.context_parallel import zigzag_split
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel.state import ParallelState

    _, ref_loss, _, ref_grads = reference
    state = ParallelState.create(ParallelConfig(**layout))
    pc = state.config
    counts = [2, 1] if pc.pp == 2 else None  # 3 layers
    model = ParallelTransformer.from_hf(folder, state, dtype=torch.float64, layer_counts=counts)
    rows = slice(state.dp_rank * ids.shape[0] // pc.dp, (state.dp_rank + 1) * ids.shape[0] // pc.dp)
    targets = next_token_targets(ids[rows])
    share = (lambda t: zigzag_split(t, pc.cp, state.cp_rank, dim=1)) if pc.cp > 1 else (lambda t: t)  # noqa: E731
    loss = model.step(share(ids[rows]) if state.is_first_stage else None,
                      share(targets) if state.is_last_stage else None, schedule=pc.pipeline_schedule)
    model.finish_grad_sync()
    t = torch.tensor([loss if state.is_last_stage else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    torch.testing.assert_close(t[0] / (pc.dp * pc.cp * pc.tp), ref_loss.double(), rtol=1e-5, atol=1e-9)  # fp32
    grads = all_stages(model.to_hf_state_dict("grad"))
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", [dict(dp=2, pp=2, ep=2, num_microbatches=2, schedule="1f1b"),
                                    dict(dp=2, pp=2, ep=2, num_microbatches=2, schedule="zb-h1"),
                                    dict(cp=2, ep=2, num_microbatches=2)], ids=["ep2pp2", "ep2pp2-zb", "ep2-over-cp2"])
def test_expert_parallel_with_a_pipeline_matches_transformers(rank_pool, moe_checkpoints, fresh_seed, layout):
    """EP2 × PP2 with two micro-batches through the pipeline runtime (zb-h1: deferred weight gradients), and EP2
    over the two CP ranks of one sequence (zigzag shares): the token loss and every gradient of transformers'
    model (its router losses left out: through model.step they are the trainer's, tpkernels.train)."""
    folder, ids, _ = moe_checkpoints("mixtral", fresh_seed)
    rank_pool(ParallelConfig(**layout).world_size).run(_pipeline_worker, folder, layout, ids, moe_checkpoints("mixtral-ce", fresh_seed), timeout=120)


def test_router_loss_records_equal_the_router_functions(fresh_seed):
    """Each layer's record gives what tpkernels.functional.moe_router computes from the layer's own input:
    E · Σ f · P is load_balancing_loss, z is z_loss; the 'per_layer' style is their mean over the MoE layers
    (the dense layer 1 has no record), 'transformers' pools the layers' f and P."""
    from tpkernels.functional.moe_router import load_balancing_loss, route, z_loss
    from tpkernels.models import ParallelTransformer

    mc = ModelConfig.read_hf(tiny("qwen2_moe", mlp_only_layers=[1], router_z_loss_coef=0.0)).replace(
        router_z_loss_coef=0.01, capacity_factor=1.0)
    model = ParallelTransformer(mc, None, seed=fresh_seed % 1000, dtype=torch.float64)
    inputs = {}
    for block in model.chunks[0].layers:
        block.mlp.register_forward_hook(lambda m, a, out, i=block.layer: inputs.__setitem__(i, a[0]))
    ids = torch.randint(0, 61, (3, 11))
    model(ids)
    losses = model.moe_losses
    assert sorted(losses.records) == [0, 2, 3]
    aux, z = [], []
    for layer, rec in losses.records.items():
        mlp = model.chunks[0].layers[layer].mlp
        r = route(inputs[layer].reshape(-1, 24) @ mlp.router.T, 2, normalize=False, capacity_factor=1.0)
        kept = r.experts.masked_fill(r.dropped, -1)
        aux.append(load_balancing_loss(r.scores, kept, 3))
        z.append(z_loss(r.logits))
        torch.testing.assert_close(3 * torch.sum(rec.f * rec.p), aux[-1])
        torch.testing.assert_close(rec.z, z[-1])
        assert int(rec.counts.sum()) + rec.dropped == ids.numel() * 2 and rec.dropped == int(r.dropped.sum())
    torch.testing.assert_close(losses.aux_loss("per_layer"), sum(aux) / 3)
    f = torch.stack([r.f for r in losses.records.values()]).mean(0)
    p = torch.stack([r.p for r in losses.records.values()]).mean(0)
    torch.testing.assert_close(losses.aux_loss("transformers"), 3 * torch.sum(f * p))
    torch.testing.assert_close(losses.loss(), mc.router_aux_loss_coef * sum(aux) / 3 + 0.01 * sum(z) / 3)
    with pytest.raises(ValueError, match=r"style \('mean'\) must be one of per_layer, transformers"):
        losses.aux_loss("mean")
    losses.reset()
    assert losses.records == {} and float(losses.aux_loss()) == 0.0
    losses.record(2, rec)  # a pipeline stage holds some of the MoE layers: the pooled style cannot be formed
    with pytest.raises(ValueError, match=r"style 'transformers' pools the tokens of every MoE layer \(3\), but this "
                                         r"rank ran 1 of them.*use style 'per_layer'"):
        losses.aux_loss("transformers")
    torch.testing.assert_close(losses.aux_loss("per_layer"), 3 * torch.sum(rec.f * rec.p) / 3)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_from_an_in_memory_transformers_module(fresh_seed, kind):
    """A transformers module holds its experts fused (experts.gate_up_proj (E, 2F, H)); from_hf splits them as
    transformers' own save does, and to_hf_state_dict gives back exactly the checkpoint tensors."""
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.hf_checkpoint import unfuse_experts

    hf = _hf_moe(kind, fresh_seed % 1000)
    ours = ParallelTransformer.from_hf(hf, dtype=torch.float64)
    want = unfuse_experts(hf.state_dict(), kind)
    got = ours.to_hf_state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(".experts.3." in k for k in got) and not any("gate_up_proj" in k for k in got)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=2e-5)
