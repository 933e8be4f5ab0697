"""Qwen3's per-head q/k RMSNorms (``qk_norm``, issue 42): Qwen3ForCausalLM and Qwen3MoeForCausalLM built from
transformers' configs equal transformers in float64 (logits, loss, every gradient, the two norm weights' included)
at one process, TP2 + SP (dense, one KV head shared by both ranks; the q/k norm gradients summed over TP) and
EP2 × TP2 (MoE) on gloo; from_hf -> save_hf gives files transformers loads with no missing or unexpected key;
greedy generation through the KV cache (keys normalised before they are cached) equals transformers'; LoRA
leaves the norms frozen."""

from __future__ import annotations

import pytest
import torch

from tpkernels.parallel import ParallelConfig

transformers = pytest.importorskip("transformers")

VOCAB = 59
# odd sizes: hidden 30, 6 query heads over 2 KV heads, head_dim 10 (not hidden / heads), FFN 22; expert FFN 14
# and 6 experts (EP2 × TP2 splits them)
COMMON = dict(vocab_size=VOCAB, hidden_size=30, intermediate_size=22, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, head_dim=10, max_position_embeddings=64, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    # biases on q/k/v/o too; one KV head: at TP2 both ranks hold it (replicated KV rows and a k_norm gradient
    # from each rank's query heads, summed over TP)
    "qwen3": lambda: transformers.Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, attention_bias=True),
    # layer 1 dense (mlp_only_layers), un-normalised top-k weights
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                     moe_intermediate_size=14, mlp_only_layers=[1],
                                                     norm_topk_prob=False, router_aux_loss_coef=0.0),
}


def _hf_model(kind: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager",
                                                          experts_implementation="eager").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones would hide a q/k norm swap or a missing weight
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def qwen3_checkpoints(tmp_path_factory):
    """(folder, ids, (logits, loss, {checkpoint name: grad})) per kind, from transformers' fp64 model."""
    from tpkernels.models.hf_checkpoint import unfuse_experts

    cache = {}

    def get(kind, seed):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            model = _hf_model(kind, seed % 10_000)
            model.save_pretrained(str(folder))
            ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
            out = model(ids, labels=ids)
            out.loss.backward()
            grads = unfuse_experts({n: p.grad.clone() for n, p in model.named_parameters()}, kind) \
                if kind == "qwen3_moe" else {n: p.grad.clone() for n, p in model.named_parameters()}
            cache[kind] = (str(folder), ids, (out.logits.detach(), out.loss.detach(), grads))
        return cache[kind]

    return get


def _parity_worker(rank, world, folder, layout, ids, reference):
    import torch.distributed as dist

    from model_checks import all_stages
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel.state import ParallelState

    ref_logits, ref_loss, ref_grads = reference
    state = ParallelState.create(ParallelConfig(**layout))
    pc = state.config
    model = ParallelTransformer.from_hf(folder, state, dtype=torch.float64)
    assert model.config.qk_norm
    rows = slice(state.dp_rank * ids.shape[0] // pc.dp, (state.dp_rank + 1) * ids.shape[0] // pc.dp)
    # transformers' RMSNorms run in fp32 (also on fp64 inputs), its routing too: ~1e-7 relative apart
    torch.testing.assert_close(model(ids[rows]), ref_logits[rows], rtol=1e-5, atol=2e-5)
    ce = model(ids[rows], target=next_token_targets(ids[rows]))  # this replica's token mean (equal counts)
    ce.backward()
    model.finish_grad_sync()
    loss = ce.detach().reshape(1) / (pc.tp * pc.dp)
    if world > 1:
        dist.all_reduce(loss)
    torch.testing.assert_close(loss[0], ref_loss.double(), rtol=1e-5, atol=1e-9)  # transformers: an fp32 CE
    grads = all_stages(model.to_hf_state_dict("grad"))
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    assert any(n.endswith("self_attn.k_norm.weight") for n in grads)
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_one_process_matches_transformers(qwen3_checkpoints, fresh_seed, kind):
    folder, ids, ref = qwen3_checkpoints(kind, fresh_seed)
    _parity_worker(0, 1, folder, {}, ids, ref)


@pytest.mark.parametrize("kind, layout", [("qwen3", dict(tp=2, sequence_parallel=True)),
                                          ("qwen3_moe", dict(tp=2, dp=2, ep=2))], ids=["tp2-sp", "ep2-tp2"])
def test_parallel_layouts_match_transformers(rank_pool, qwen3_checkpoints, fresh_seed, kind, layout):
    """At TP2 each rank normalises its own heads with the whole (head_dim,) weights: their gradients are partial
    over TP until finish_grad_sync sums them (checked against transformers' full gradient)."""
    folder, ids, ref = qwen3_checkpoints(kind, fresh_seed)
    rank_pool(ParallelConfig(**layout).world_size).run(_parity_worker, folder, layout, ids, ref, timeout=120)


def test_lora_adapts_the_projections_and_freezes_the_norms(fresh_seed):
    """LoRA on a Qwen3 model: the q/k norm weights are frozen with the base (whole, untagged as partial at one
    process), the adapters sit on the q/k/v GEMM before the norms, and merging them gives the adapted logits."""
    from tpkernels.description import ModelConfig
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.lora import apply_lora, merge_lora_
    from tpkernels.parallel.param_tags import tag_of

    model = ParallelTransformer(ModelConfig.from_hf(CONFIGS["qwen3"]()), seed=fresh_seed % 1000, dtype=torch.float64)
    attn = model.chunks[0].layers[0].attention
    assert attn.q_norm.shape == attn.k_norm.shape == (10,)
    assert tag_of(attn.q_norm).split_dim is None and not tag_of(attn.k_norm).partial_grad
    assert "chunks.0.layers.0.attention.qkv" in apply_lora(model, rank=3)
    assert not attn.q_norm.requires_grad and not attn.k_norm.requires_grad
    g = torch.Generator().manual_seed(fresh_seed)
    with torch.no_grad():
        attn.q_norm.uniform_(0.5, 1.5, generator=g)
        for m in model.modules():
            if getattr(m, "lora", None) is not None:
                m.lora.B.copy_(torch.randn(m.lora.B.shape, generator=g, dtype=torch.float64) * 0.1)
        ids = torch.randint(0, VOCAB, (2, 7), generator=g)
        adapted = model(ids)
        assert merge_lora_(model) > 0
        torch.testing.assert_close(model(ids), adapted, rtol=1e-10, atol=1e-10)


def _round_trip_worker(rank, world, folder, out_folder, layout, ids):
    from tpkernels.models import ParallelTransformer
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(**layout))
    model = ParallelTransformer.from_hf(folder, state, dtype=torch.float64)
    model.save_hf(out_folder)
    if rank != 0:
        return None
    a = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    b, info = transformers.AutoModelForCausalLM.from_pretrained(out_folder, dtype=torch.float64,
                                                                experts_implementation="eager",
                                                                output_loading_info=True)
    assert type(b).__name__ == type(a).__name__
    with torch.no_grad():
        diff = (a(ids).logits - b(ids).logits).abs().max().item()
    return diff, {k: sorted(v) for k, v in info.items() if v}


def test_save_hf_round_trip_loads_in_transformers(rank_pool, qwen3_checkpoints, tmp_path, fresh_seed):
    """from_hf at TP2 -> save_hf: a Qwen3ForCausalLM with no missing or unexpected key, the same logits."""
    folder, ids, _ = qwen3_checkpoints("qwen3", fresh_seed)
    out = rank_pool(2).run(_round_trip_worker, folder, str(tmp_path / "out"), dict(tp=2), ids, timeout=120)
    diff, info = out[0]
    assert info == {} and diff == 0.0, (diff, info)


def test_moe_round_trip_one_process(qwen3_checkpoints, tmp_path, fresh_seed):
    folder, ids, _ = qwen3_checkpoints("qwen3_moe", fresh_seed)
    diff, info = _round_trip_worker(0, 1, folder, str(tmp_path / "out"), {}, ids)
    assert info == {} and diff == 0.0, (diff, info)


def test_generation_with_the_kv_cache_equals_transformers(qwen3_checkpoints, fresh_seed):
    """Greedy tokens through our KV cache (packed prefill of prompts of different lengths, then one token per
    step through the varlen path) equal transformers' generate, whose cache holds the normalised, rotated keys:
    a raw key cached would move every decoded token's logits."""
    from generate_checks import hf_greedy, random_prompts
    from tpkernels.generate import Generator
    from tpkernels.models import ParallelTransformer

    folder, _, _ = qwen3_checkpoints("qwen3", fresh_seed)
    prompts = random_prompts(fresh_seed, (5, 9), vocab=VOCAB)
    outs = Generator(ParallelTransformer.from_hf(folder, dtype=torch.float64)).generate(prompts, max_new_tokens=6)
    assert [o.ids for o in outs] == hf_greedy(folder, prompts, 6)
