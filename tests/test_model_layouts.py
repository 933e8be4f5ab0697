"""Process groups from a ParallelConfig, and the model at a layout beyond the parity grid: layout
validation on every rank without a hang, sliced loading, HF round trip, layout-independent
initialisation, packed documents. gloo, world sizes 1–4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model_checks import VOCAB, all_stages, save_tiny_model
from tpkernels.models import ModelConfig, ParallelTransformer
from tpkernels.parallel import ParallelConfig, ParallelConfigError
from tpkernels.parallel.state import ParallelState, layout_ranks


# ---- ParallelState ----

def _state_worker(rank, world, layout):
    state = ParallelState.create(ParallelConfig(**layout))
    got = {name: dist.get_process_group_ranks(getattr(state, f"{name}_group")) for name in ("tp", "dp", "pp")}
    mesh = state.device_mesh
    return dict(coords=(state.tp_rank, state.dp_rank, state.pp_rank), groups=got,
                emb=dist.get_process_group_ranks(state.embedding_group) if state.embedding_group else None,
                mesh_tp=dist.get_process_group_ranks(mesh.get_group("tp")), mesh_names=mesh.mesh_dim_names)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=3), dict(tp=2, pp=2), dict(dp=2, tp=2), dict(dp=3),
                                    dict(pp=2, dp=2)])
def test_groups_follow_the_documented_rank_order(rank_pool, layout):
    pc = ParallelConfig(**layout)
    out = rank_pool(pc.world_size).run(_state_worker, layout, timeout=60)
    ranks = layout_ranks(pc)
    for rank, o in enumerate(out):
        t, d, p = o["coords"]
        assert rank == (p * pc.dp + d) * pc.tp + t
        for name in ("tp", "dp", "pp"):
            assert o["groups"][name] in ranks[name] and rank in o["groups"][name]
        assert o["mesh_tp"] == o["groups"]["tp"] and o["mesh_names"] == ("pp", "dp", "tp")
        if pc.pp > 1 and p in (0, pc.pp - 1):
            assert o["emb"] == [o["groups"]["pp"][0], o["groups"]["pp"][-1]]


def test_world_of_one_without_torch_distributed():
    state = ParallelState.create(ParallelConfig())
    assert (state.tp_group, state.pp_group, state.tp_rank, state.pp_rank) == (None, None, 0, 0)


def _invalid_worker(rank, world, layout, model_kw, differ):
    if differ and rank == 1:
        layout = {**layout, "num_microbatches": 3}
    try:
        state = ParallelState.create(ParallelConfig(**layout))
        if model_kw:
            ParallelTransformer(ModelConfig("llama", **model_kw), state)
    except ParallelConfigError as e:
        dist.barrier()  # every rank raised, and none is stuck in a group creation
        return str(e)
    return "no error"


@pytest.mark.parametrize("layout, model_kw, differ, message", [
    (dict(tp=3), None, False, r"world_size \(2\) must equal tp \(3\)"),
    (dict(tp=2, sequence_parallel=False, virtual_stages=2), None, False, r"virtual_stages \(2\) > 1 requires"),
    (dict(tp=2), dict(num_layers=2, hidden_size=24, num_attention_heads=3, ffn_hidden_size=16, vocab_size=50),
     False, r"num_attention_heads \(3\) must be divisible by tp \(2\)"),
    (dict(pp=2), dict(num_layers=3, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16, vocab_size=50),
     False, r"num_layers \(3\) must be divisible by pp \(2\)"),
    (dict(tp=2), None, True, r"ranks disagree on the layout"),
])
def test_invalid_layouts_raise_on_every_rank(rank_pool, layout, model_kw, differ, message):
    out = rank_pool(2).run(_invalid_worker, layout, model_kw, differ, timeout=60)
    import re

    assert all(re.search(message, o) for o in out), out
    assert len(set(out)) == 1, out  # the same message everywhere


# ---- loading, export, initialisation ----

def _roundtrip_worker(rank, world, folder, out_folder, layout, seed):
    import os

    import transformers

    state = ParallelState.create(ParallelConfig(**layout))
    model = ParallelTransformer.from_hf(folder, state)
    from tpkernels.models.hf_checkpoint import SafetensorsSource

    src = SafetensorsSource(folder)
    model.load_hf_(src)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    model.save_hf(out_folder)
    if rank != 0:
        return src.bytes_read, total, None
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    a = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    b = transformers.AutoModelForCausalLM.from_pretrained(out_folder, attn_implementation="eager")
    with torch.no_grad():
        diff = (a(ids).logits - b(ids).logits).abs().max().item()
    return src.bytes_read, total, diff


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_slices_and_round_trip(rank_pool, tmp_path, fresh_seed, family):
    """Each rank of TP2×PP2 reads well under the whole checkpoint; the exported folder loads in
    transformers and gives the original logits."""
    folder = save_tiny_model(family, tmp_path / "in", fresh_seed % 1000, layers=4)
    out = rank_pool(4).run(_roundtrip_worker, folder, str(tmp_path / "out"), dict(tp=2, pp=2), fresh_seed, timeout=120)
    for read, total, _ in out:
        assert 0 < read < 0.5 * total, (read, total)
    assert out[0][2] == 0.0


def _tiny_llama():
    return ModelConfig.from_preset("Llama-2-7B").replace(num_layers=4, hidden_size=32, num_attention_heads=4,
                                                         num_kv_heads=2, ffn_hidden_size=48, vocab_size=VOCAB,
                                                         max_position_embeddings=32)


def _init_worker(rank, world, layout, seed):
    state = ParallelState.create(ParallelConfig(**layout))
    return all_stages(ParallelTransformer(_tiny_llama(), state, seed=seed).to_hf_state_dict())


def test_random_init_is_the_same_at_every_layout(rank_pool, fresh_seed):
    whole = ParallelTransformer(_tiny_llama(), None, seed=fresh_seed).to_hf_state_dict()
    for sharded in rank_pool(4).run(_init_worker, dict(tp=2, pp=2), fresh_seed, timeout=120):
        assert set(sharded) == set(whole)
        for k in whole:
            assert torch.equal(sharded[k], whole[k]), k
    other = ParallelTransformer(_tiny_llama(), None, seed=fresh_seed + 1).to_hf_state_dict()
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], whole["model.layers.0.mlp.up_proj.weight"])


def _packed_worker(rank, world, folder, layout, seed):
    from tpkernels.models import next_token_targets, positions_from_cu_seqlens

    state = ParallelState.create(ParallelConfig(**layout))
    model = ParallelTransformer.from_hf(folder, state)
    g = torch.Generator().manual_seed(seed)
    lens = [6, 6, 2, 10]  # two rows of 12 tokens (even lengths: each document also runs alone under SP)
    docs = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lens]
    ids = torch.cat([torch.cat(docs[:2], 1), torch.cat(docs[2:], 1)])
    cu = torch.tensor([0, 6, 12, 14, 24], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu)
        alone = [model(d) for d in docs]
    torch.testing.assert_close(packed[0, :6], alone[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[0, 6:], alone[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[1, 2:], alone[3][0], rtol=1e-5, atol=1e-5)
    pos = positions_from_cu_seqlens(cu, 2, 12)
    target = next_token_targets(ids, pos)
    assert target[0, 5] == -100 and target[1, 1] == -100  # no prediction across a document boundary
    loss = model(ids, cu_seqlens=cu, target=target)
    want = sum(model(d, target=next_token_targets(d)) * (d.shape[1] - 1) for d in docs) / sum(
        d.shape[1] - 1 for d in docs)
    assert abs(loss.item() - want.item()) < 1e-5
    return lens


@pytest.mark.parametrize("layout", [dict(), dict(tp=2, sequence_parallel=True)])
def test_packed_documents_never_attend_to_each_other(rank_pool, tmp_path, fresh_seed, layout):
    folder = save_tiny_model("llama", tmp_path, fresh_seed % 1000, layers=2)
    world = layout.get("tp", 1)
    rank_pool(world).run(_packed_worker, folder, layout, fresh_seed, timeout=120)


def _packed_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 12), generator=g)
    cu = torch.tensor([0, 4, 12, 14, 24, 36, 38, 44, 48], dtype=torch.int32)  # 8 documents over 4 rows
    return ids, cu


def _packed_step(model, seed):
    from tpkernels.models import next_token_targets, positions_from_cu_seqlens

    ids, cu = _packed_batch(seed)
    target = next_token_targets(ids, positions_from_cu_seqlens(cu, *ids.shape))
    loss = model.step(ids, target, cu_seqlens=cu, schedule="1f1b", num_microbatches=2)
    model.finish_grad_sync()
    return loss, model.evaluate(ids, target, cu_seqlens=cu, num_microbatches=2)


def _packed_pipeline_worker(rank, world, folder, layout, seed):
    state = ParallelState.create(ParallelConfig(**layout))
    model = ParallelTransformer.from_hf(folder, state)
    loss, eval_loss = _packed_step(model, seed)
    return loss, eval_loss, all_stages(model.to_hf_state_dict("grad"))


def test_packed_documents_through_the_pipeline(rank_pool, tmp_path, fresh_seed):
    """Document boundaries travel with the activations: TP2 × PP2 with SP on packed rows gives the
    loss and gradients of the single-process model (whose packing is checked against documents
    run alone above)."""
    folder = save_tiny_model("llama", tmp_path, fresh_seed % 1000, layers=4)
    ref = ParallelTransformer.from_hf(folder)
    want_loss, want_eval = _packed_step(ref, fresh_seed)
    want = ref.to_hf_state_dict("grad")
    assert abs(want_loss - want_eval) < 1e-6
    layout = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2)
    for loss, eval_loss, grads in rank_pool(4).run(_packed_pipeline_worker, folder, layout, fresh_seed, timeout=120):
        assert abs(loss - want_loss) < 1e-5 and abs(eval_loss - want_eval) < 1e-5
        for k in want:
            torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")
