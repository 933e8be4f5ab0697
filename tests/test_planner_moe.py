"""The planner on mixture-of-experts models: memory per EP rank against hand counts, the MoE block's
activations and dispatch buffers, the all-to-all and its chunked overlap, EP in the search, presets,
and the layouts it must refuse by name."""

from __future__ import annotations

import io
import math
import random
from contextlib import redirect_stdout

import pytest

from tpkernels.description import ModelConfig, model_preset
from tpkernels.parallel import ParallelConfig
from tpkernels.planner import ClusterSpec, TrainingSetup, calibrated_for, explain, gpu_preset, plan
from tpkernels.planner.activations import layer_activations, moe_block_activations, moe_peak_imbalance
from tpkernels.planner.collectives import all_to_all_time
from tpkernels.planner.estimate import layout_errors
from tpkernels.planner.expert_parallel import busiest_share, chunked_exposed
from tpkernels.planner.memory import GIB, stage_memory, stage_param_split, stage_params_per_rank
from tpkernels.planner.step_time import step_time

H100 = gpu_preset("H100-SXM")
EFF = calibrated_for(H100)


def small_moe(rng: random.Random, **over) -> ModelConfig:
    """A random small Qwen2-MoE-shaped model (odd sizes; a shared expert with its gate half the time)."""
    heads = rng.choice([2, 4, 6])
    kv = rng.choice([d for d in (1, 2, heads) if heads % d == 0])
    hidden = heads * rng.choice([8, 12, 16])
    experts = rng.choice([4, 6, 8, 12])
    shared = rng.choice([0, 24, 40])
    fields = dict(num_layers=rng.choice([2, 4, 6]), hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv,
                  ffn_hidden_size=rng.choice([40, 56]), vocab_size=rng.randint(300, 900), qkv_bias=rng.random() < 0.5,
                  num_experts=experts, experts_per_token=rng.randint(1, min(4, experts)),
                  moe_ffn_hidden_size=rng.choice([8, 24, 32]), shared_expert_ffn_hidden_size=shared,
                  shared_expert_gate=shared > 0 and rng.random() < 0.5)
    fields.update(over)
    return ModelConfig("qwen2_moe", **fields)


def hand_split(m: ModelConfig, tp: int, ep: int) -> tuple[float, float]:
    """(other, expert) parameters of one decoder layer on one GPU, counted from the shapes by hand."""
    h, q, kv, e, f, s = (m.hidden_size, m.q_dim, m.kv_dim, m.num_experts, m.expert_ffn,
                         m.shared_expert_ffn_hidden_size)
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.qkv_bias else 0)
    shared, gate = 3 * h * s, (h if m.shared_expert_gate else 0)
    norms, router = 2 * h, e * h  # two RMSNorms, the router and the shared gate: whole on every TP rank
    return (attn + shared) / tp + norms + router + gate, e * 3 * h * f / (ep * tp)


def test_memory_per_rank_matches_hand_counts(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(20):
        m = small_moe(rng)
        tp = rng.choice([t for t in (1, 2) if m.kv_heads % t == 0])
        ep = rng.choice([d for d in (1, 2, 4) if m.num_experts % d == 0])
        dp = ep * rng.choice([1, 2, 3])
        cfg = ParallelConfig(tp=tp, dp=dp, ep=ep, num_microbatches=2, zero1=rng.random() < 0.5)
        other, experts = hand_split(m, tp, ep)
        other = m.num_layers * other + m.padded_vocab(tp) * m.hidden_size / tp * 2 + m.hidden_size  # + embedding,
        experts = m.num_layers * experts  # head, final norm
        assert stage_param_split(m, cfg, 0) == pytest.approx((other, experts))
        mem = stage_memory(m, TrainingSetup(dp * 2, 64), cfg, 0)
        assert mem.weights == pytest.approx(2 * (other + experts))
        assert mem.gradients == pytest.approx(4 * (other + experts))
        zero, zero_e = (dp, dp // ep) if cfg.zero1 else (1, 1)
        assert mem.optimizer == pytest.approx(12 * (other / zero + experts / zero_e))


def test_ep_divides_expert_memory_by_ep(fresh_seed):
    rng = random.Random(fresh_seed)
    m = small_moe(rng, num_experts=8)
    train = TrainingSetup(16, 128)
    base = ParallelConfig(dp=8, num_microbatches=2)
    for ep in (2, 4, 8):
        cfg = base.replace(ep=ep)
        assert stage_param_split(m, cfg, 0)[1] * ep == pytest.approx(stage_param_split(m, base, 0)[1])
        assert stage_param_split(m, cfg, 0)[0] == pytest.approx(stage_param_split(m, base, 0)[0])
        # weights and gradients shrink by ep; ZeRO-1 shards expert states over dp/ep instead of dp: the same
        one, split = stage_memory(m, train, base.replace(zero1=True), 0), stage_memory(m, train, cfg.replace(zero1=True), 0)
        _, experts = stage_param_split(m, base, 0)
        assert one.weights - split.weights == pytest.approx(2 * experts * (1 - 1 / ep))
        assert one.optimizer == pytest.approx(split.optimizer)


def test_moe_layers_subset_counts_each_stage(fresh_seed):
    m = small_moe(random.Random(fresh_seed), num_layers=4, moe_layers=(1,))
    cfg = ParallelConfig(pp=2, dp=2, ep=2, num_microbatches=4)
    _, e_first = stage_param_split(m, cfg, 0)  # layers 0, 1: one MoE layer
    _, e_last = stage_param_split(m, cfg, 1)  # layers 2, 3: dense
    assert e_first == pytest.approx(hand_split(m, 1, 2)[1]) and e_last == 0
    dense = m.replace(num_experts=0, experts_per_token=0, moe_ffn_hidden_size=None, shared_expert_ffn_hidden_size=0,
                      shared_expert_gate=False, moe_layers=None)
    assert stage_params_per_rank(m, cfg, 1) == pytest.approx(stage_params_per_rank(dense, cfg.replace(ep=1), 1))


def test_moe_block_activations_hand_count(fresh_seed):
    rng = random.Random(fresh_seed)
    m = small_moe(rng)
    s, b, tp, ep = rng.choice([64, 96]), rng.randint(1, 3), 2, 2
    h, k, e, f = m.hidden_size, m.experts_per_token, m.num_experts, m.expert_ffn
    rho = 1.5
    act = moe_block_activations(m, seq=s, micro_batch=b, tp=tp, ep=ep, imbalance=rho)
    t = s * b
    shared = 2 * t * 3 * m.shared_expert_ffn_hidden_size / tp
    stored = 2 * rho * t * k * h + 2 * t * k * h + 8 * t * e + 20 * t * k + shared
    swiglu, sent = 2 * rho * t * k * 3 * f / tp, 2 * t * k * h * (1 + rho)
    assert act.stored == pytest.approx(stored)
    assert act.produced == pytest.approx(stored + swiglu + sent)
    assert act.recompute_peak == pytest.approx(max(swiglu, sent))
    one = moe_block_activations(m, seq=s, micro_batch=b, tp=tp, ep=1)
    assert one.recompute_peak == pytest.approx(2 * t * k * 3 * f / tp)  # no send buffers without EP
    full = moe_block_activations(m, seq=s, micro_batch=b, tp=tp, ep=ep, recompute="full", imbalance=rho)
    assert full.stored == 0 and full.recompute_peak > act.stored
    # a MoE layer = the attention part of a dense layer + the block
    kw = dict(seq=s, micro_batch=b, tp=tp, sequence_parallel=True, recompute="none", flash_attention=True)
    layer = layer_activations(m, moe=True, ep=ep, imbalance=rho, **kw)
    assert layer.stored == pytest.approx(layer_activations(m, mlp=False, **kw).stored + act.stored)


def test_dispatch_buffer_imbalance_bounds():
    m = model_preset("Mixtral-8x7B")  # 8 experts, top-2, dropless
    assert moe_peak_imbalance(m, 1, 3.0) == 1.0  # one rank holds every expert: its own rows only
    assert moe_peak_imbalance(m, 8, 2.0) == 2.0  # the stated worst case
    assert moe_peak_imbalance(m, 8, 10.0) == 4.0  # at most ep · min(k, E/ep) / k = 8 · 1 / 2
    assert moe_peak_imbalance(m.replace(capacity_factor=1.25), 8, 2.0) == 1.25  # the capacity bounds it
    assert busiest_share(m.replace(capacity_factor=1.25), 8, 1.0) == 1.0  # balanced routing fills less
    train, cfg = TrainingSetup(16, 4096), ParallelConfig(tp=1, dp=8, ep=8, num_microbatches=2)
    low, high = (stage_memory(m, train.replace(moe_peak_imbalance=x), cfg, 0).activations for x in (1.0, 3.0))
    assert high > low
    with pytest.raises(ValueError, match=r"moe_peak_imbalance \(0\.5\) must be a finite number >= 1"):
        TrainingSetup(16, 4096, moe_peak_imbalance=0.5)


def test_all_to_all_zero_at_ep1_and_slower_across_nodes():
    m = model_preset("Qwen3-30B-A3B")
    train = TrainingSetup(64, 4096)
    cluster = ClusterSpec(H100, 8, 2)
    one = step_time(m, train, ParallelConfig(dp=16, num_microbatches=4), cluster, EFF)
    assert one.ep_comm == 0 and one.ep_exposed == 0
    eight = step_time(m, train, ParallelConfig(dp=16, ep=8, num_microbatches=4), cluster, EFF)
    assert 0 < eight.ep_exposed <= eight.ep_comm
    sixteen = step_time(m, train, ParallelConfig(dp=16, ep=16, num_microbatches=4), cluster, EFF)
    assert sixteen.ep_comm > eight.ep_comm  # EP16 leaves the node: its share for the other node crosses the NIC
    nbytes = 1e8
    assert all_to_all_time(nbytes, 1, 1, cluster, EFF) == 0
    intra = all_to_all_time(nbytes, 8, 1, cluster, EFF)
    assert intra == pytest.approx(nbytes * 7 / 8 / (450e9 * EFF.link) + 7 * EFF.collective_latency_s)
    assert all_to_all_time(nbytes, 8, 2, cluster, EFF) > intra  # EP8 × TP2: half the group on the other node


def test_chunked_overlap_is_monotone(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(200):
        a, g, c = rng.uniform(0, 2), rng.uniform(0, 2), rng.randint(1, 16)
        e = chunked_exposed(a, g, c)
        assert 0 <= e <= a + 1e-12
        assert chunked_exposed(a, g, c + 1) <= e + 1e-12  # more chunks never expose more
        assert chunked_exposed(a, g + rng.uniform(0, 1), c) <= e + 1e-12  # nor more GEMM time
        assert chunked_exposed(a, g, 1) == pytest.approx(a)  # one chunk hides nothing
    assert chunked_exposed(1.0, 10.0, 4) == pytest.approx(0.25)  # only the first chunk's exchange
    # through the whole step: more chunks, or slower GEMMs (more time to hide behind), never a slower step
    m, cluster = model_preset("Mixtral-8x7B"), ClusterSpec(H100, 8, 2)
    cfg = ParallelConfig(tp=2, dp=8, ep=8, num_microbatches=4, sequence_parallel=True, zero1=True)
    steps = [step_time(m, TrainingSetup(32, 4096), cfg.replace(moe_chunks=c), cluster, EFF) for c in (1, 2, 4, 8)]
    assert all(b.total <= a.total + 1e-12 and b.ep_exposed <= a.ep_exposed + 1e-12 for a, b in zip(steps, steps[1:]))
    assert steps[-1].ep_exposed < steps[0].ep_exposed
    slow = step_time(m, TrainingSetup(32, 4096), cfg.replace(moe_chunks=4), cluster, EFF.replace(gemm=0.4))
    assert slow.ep_exposed <= steps[2].ep_exposed


def test_bad_layouts_are_named():
    m, train = model_preset("Mixtral-8x7B"), TrainingSetup(64, 4096)
    cluster = ClusterSpec(H100, 8, 2)
    errs = layout_errors(m, train, cluster, ParallelConfig(tp=2, dp=8, ep=3, num_microbatches=8))
    assert errs == ["ep (3) must divide dp (8): expert parallelism splits the experts over the data-parallel ranks"]
    errs = layout_errors(m, train, cluster, ParallelConfig(dp=16, ep=16, num_microbatches=4))
    assert any(e.startswith("num_experts (8) must be divisible by ep (16)") for e in errs)
    dense = model_preset("Llama-3-8B")
    errs = layout_errors(dense, train, cluster, ParallelConfig(dp=16, ep=2, num_microbatches=4))
    assert any(e.startswith("ep (2) > 1 needs a mixture-of-experts model") for e in errs)
    x = explain(m, train, ClusterSpec(H100, 8, 1), "TP=2,EP=3")
    assert x.errors and "ep (3) must divide dp (4)" in x.errors[0]


def test_presets_plan_with_ep_in_rows():
    from tpkernels.cli import main  # noqa: PLC0415

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["plan", "--model", "Qwen3-30B-A3B", "--nodes", "1", "--global-batch", "64", "--seq-len", "4096",
                     "--fix", "PP=1", "--top", "20"])
    text = out.getvalue()
    assert code == 0 and "128 experts of ffn 768 top-8" in text and "EP exposed" in text
    assert any(" EP8 " in line or " EP4 " in line or " EP2 " in line for line in text.splitlines()[8:])


def test_search_picks_ep_where_ep1_does_not_fit():
    # Mixtral-8x7B, full Adam training on 8 H100 80GB: 18 bytes/param of model state over 8 GPUs is
    # 46.7e9 · 18 / 8 B = 97.9 GiB per GPU whatever the layout: nothing fits, EP or not.
    m = model_preset("Mixtral-8x7B")
    p = plan(m, TrainingSetup(64, 4096), ClusterSpec(H100, 8, 1), fixed={"pp": 1})
    assert not p.ranked and p.too_big
    assert m.num_params() * 18 / 8 / GIB > 0.9 * 79.6
    assert p.too_big[0].memory.total / GIB > 97
    # Qwen3-30B-A3B on 16 H100 with TP1 PP1 (the layout of NVIDIA's published runs): EP1 keeps all
    # 30.5B parameters' weights and gradients on every GPU (>170 GiB); EP splits the experts
    q = model_preset("Qwen3-30B-A3B")
    p = plan(q, TrainingSetup(1024, 4096, precision="fp8"), ClusterSpec(H100, 8, 2), fixed={"tp": 1, "pp": 1})
    assert p.ranked and all(e.config.ep > 1 for e in p.ranked)
    assert [e.config.ep for e in p.too_big if e.config.ep == 1] == [1]  # EP1 was scored: it does not fit
    ep1 = stage_memory(q, TrainingSetup(1024, 4096), ParallelConfig(dp=16, zero1=True, num_microbatches=64), 0)
    assert (ep1.weights + ep1.gradients) / GIB > 170


def test_held_out_moe_rows_read_as_published():
    from pathlib import Path  # noqa: PLC0415

    from tpkernels.planner.calibration import held_out_rows, predict, sources  # noqa: PLC0415

    data = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
    rows = held_out_rows(data)
    assert [(r.label, r.layout()) for r in rows] == [
        ("QWEN3-30B-A3B@16 26.06", "TP1 PP1 DP16 EP16 mbs1"), ("QWEN3-30B-A3B@16 26.02.01", "TP1 PP2 v12 DP8 EP8 mbs1"),
        ("QWEN3-30B-A3B@16 25.11", "TP1 PP2 v24 DP8 EP8 mbs2"), ("GPT-OSS-120B@64 26.04.01", "TP1 PP4 DP16 EP8 mbs1")]
    assert not any(r.source in sources(data) for r in rows)  # in no fit
    qwen = model_preset("Qwen3-30B-A3B")  # the rows' shape is the preset's, without its q/k norms
    assert rows[0].spec.num_active_params() == pytest.approx(qwen.num_active_params(), rel=1e-4)
    assert rows[0].spec.num_params() == pytest.approx(qwen.num_params(), rel=1e-4)
    for r in rows[:3]:  # the shape's FLOPs per token are the source's (it halves the causal attention)
        s = r.training.seq_length
        lin, core = r.spec.forward_flops_per_layer(1, s)
        per_token = 3 * (r.spec.num_layers * (lin + core / 2) + r.spec.logits_forward_flops(1, s)) / s
        published = r.published_tflops_per_gpu * 1e12 / (r.training.tokens / r.published_step_s / r.gpus)
        assert per_token == pytest.approx(published, rel=0.01), r.label
    for r in rows:
        assert not layout_errors(r.spec, r.training, r.cluster, r.config)
        t = predict(r).time
        assert t.ep_comm > 0 and 0 < t.total < 10 * r.published_step_s
    # HybridEP sends a token once per node across the network: EP16 over two nodes moves less than k copies
    plain = rows[0].training.replace(moe_dispatch="alltoall")
    assert predict(rows[0]).time.ep_comm < step_time(rows[0].spec, plain, rows[0].config, rows[0].cluster,
                                                     calibrated_for(H100)).ep_comm


def test_shared_expert_gathers_and_reduces_on_its_own():
    from tpkernels.planner.collectives import group_collective_time  # noqa: PLC0415

    m = model_preset("Qwen2-57B-A14B")  # a shared expert of 20480 with its gate, on every layer
    bare = m.replace(shared_expert_ffn_hidden_size=0, shared_expert_gate=False)
    cluster, train = ClusterSpec(H100, 8, 1), TrainingSetup(8, 2048)
    cfg = ParallelConfig(tp=4, pp=1, dp=2, ep=2, num_microbatches=4, sequence_parallel=True, overlap_comm=False)
    one = group_collective_time("all_gather", 2 * 2048 * m.hidden_size, 4, 1, cluster, EFF)
    extra = step_time(m, train, cfg, cluster, EFF).tp_comm - step_time(bare, train, cfg, cluster, EFF).tp_comm
    assert extra == pytest.approx(m.num_layers * 4 * 5 * one)  # 2 forward, 3 backward, 4 micro-batches
    # its weights are split over TP like a dense MLP's, its gate stays whole on every rank
    assert stage_param_split(m, cfg, 0)[0] - stage_param_split(bare, cfg, 0)[0] == pytest.approx(
        m.num_layers * (3 * m.hidden_size * 20480 / 4 + m.hidden_size))


def test_dedup_dispatch_counts_distinct_ranks_and_nodes():
    from tpkernels.planner.expert_parallel import dispatch_time  # noqa: PLC0415

    m = model_preset("Qwen3-30B-A3B")  # 128 experts, top-8
    two_nodes = ClusterSpec(H100, 8, 2)
    row = 2 * m.hidden_size
    # EP16 over two nodes: a token reaches the other node once if any of its 8 experts is there
    p_other = 1 - math.comb(64, 8) / math.comb(128, 8)
    inter = 4096 * row * p_other
    assert dispatch_time(m, 4096, row, 16, 1, two_nodes, EFF, "dedup") == pytest.approx(
        inter / (50e9 * EFF.link) + 15 * EFF.collective_latency_s)
    plain = dispatch_time(m, 4096, row, 16, 1, two_nodes, EFF, "alltoall")
    assert plain == pytest.approx(all_to_all_time(4096 * 8 * row, 16, 1, two_nodes, EFF))
    assert dispatch_time(m, 4096, row, 16, 1, two_nodes, EFF, "dedup") < plain
    # a group that does not fill whole nodes still sends its off-node share over the NIC
    assert dispatch_time(m, 4096, row, 12, 1, two_nodes, EFF, "dedup") > dispatch_time(m, 4096, row, 8, 1, two_nodes,
                                                                                         EFF, "dedup")
    assert dispatch_time(m, 4096, row, 1, 1, two_nodes, EFF, "dedup") == 0


@pytest.mark.parametrize("name,nodes,layout", [
    ("Mixtral-8x22B", 8, dict(tp=8, pp=4, dp=2, ep=2)), ("Qwen2-57B-A14B", 2, dict(tp=4, pp=1, dp=4, ep=4)),
    ("Qwen3-235B-A22B", 32, dict(tp=1, pp=2, dp=128, ep=32))])
def test_every_moe_preset_is_estimated(name, nodes, layout):
    from tpkernels.planner import estimate  # noqa: PLC0415

    m, train, cluster = model_preset(name), TrainingSetup(256, 4096), ClusterSpec(H100, 8, nodes)
    cfg = ParallelConfig(**layout, num_microbatches=256 // layout["dp"], sequence_parallel=layout["tp"] > 1, zero1=True)
    assert not layout_errors(m, train, cluster, cfg)
    est = estimate(m, train, cluster, cfg, EFF)
    assert est.time.ep_comm > 0 and est.memory.total > 0 and est.mfu < 1
    other, experts = stage_param_split(m, cfg, 0)
    assert experts * layout["ep"] * layout["tp"] * cfg.pp == pytest.approx(
        m.expert_params_per_layer() * m.num_layers)  # every layer has experts: stages alike


@pytest.mark.parametrize("sp", [True, False])
def test_tp_ranks_dispatch_their_own_tokens(sp):
    """tpkernels.models.moe at TP t: each TP rank routes and sends T/t tokens (the all-to-all is 1/t of
    TP1's at the same tokens), the received rows are all-gathered and the results reduce-scattered over TP
    (without SP the combined tokens all-gathered too), in place of the dense MLP's TP collectives."""
    from tpkernels.planner.collectives import group_collective_time  # noqa: PLC0415
    from tpkernels.planner.expert_parallel import moe_layer_time  # noqa: PLC0415

    m, cluster, train = model_preset("Mixtral-8x7B"), ClusterSpec(H100, 8, 2), TrainingSetup(32, 4096)
    h, k, tokens, b = m.hidden_size, m.experts_per_token, 4096, train.activation_bytes
    cfg = ParallelConfig(tp=2, dp=8, ep=8, num_microbatches=4, sequence_parallel=sp, zero1=True)
    t2 = moe_layer_time(m, train, cfg, cluster, EFF, precision="bf16")
    # EP members are tp = 2 apart: 8 of them span the 2 nodes; each sends T·k/2 copies each way
    assert t2["a2a_f"] == pytest.approx(2 * all_to_all_time(tokens * k / 2 * h * b, 8, 2, cluster, EFF))
    t1 = moe_layer_time(m, train, cfg.replace(tp=1, sequence_parallel=False), cluster, EFF, precision="bf16")
    assert t1["a2a_f"] == pytest.approx(2 * all_to_all_time(tokens * k * h * b, 8, 1, cluster, EFF))
    assert t1["etp_f"] == t1["etp_b"] == 0
    ag = group_collective_time("all_gather", tokens * k * h * b, 2, 1, cluster, EFF)
    out = 0 if sp else group_collective_time("all_gather", tokens * h * b, 2, 1, cluster, EFF)
    assert t2["etp_f"] == pytest.approx(2 * ag + out) and t2["etp_b"] == pytest.approx(2 * ag + out)
    # in the step: the MoE layers' TP communication is the expert-TP exchange plus attention's collectives
    bare = step_time(m, train, cfg.replace(overlap_comm=False), cluster, EFF)
    one = group_collective_time("all_gather", tokens * h * b, 2, 1, cluster, EFF)
    ar = group_collective_time("all_reduce", tokens * h * b, 2, 1, cluster, EFF)
    attention = one * 5 if sp else ar * 2
    head = 2 * one if sp else ar  # the last stage's output layer
    assert bare.tp_comm == pytest.approx(4 * (m.num_layers * (attention + 2 * (2 * ag + out)) + head))


def test_moe_chunks_is_the_layouts():
    """tpkernels plan scores each layout's ParallelConfig.moe_chunks (what tpkernels train runs): fixed
    with --fix, shown in the layout's label; the old --training.moe_chunks flag is gone."""
    from tpkernels.cli import main  # noqa: PLC0415

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["plan", "--model", "Qwen3-30B-A3B", "--nodes", "2", "--global-batch", "64", "--seq-len", "4096",
                     "--fix", "PP=1,TP=1,EP=8,moe_chunks=4", "--top", "3"])
    text = out.getvalue()
    assert code == 0 and "all-to-all in 4 chunks" in text and " EP8 chunks4 " in text, text
    with pytest.raises(SystemExit), redirect_stdout(io.StringIO()):
        main(["plan", "--model", "Qwen3-30B-A3B", "--nodes", "1", "--training.moe_chunks", "4"])
    m, cluster, train = model_preset("Qwen3-30B-A3B"), ClusterSpec(H100, 8, 2), TrainingSetup(64, 4096)
    best = plan(m, train, cluster, EFF, fixed={"pp": 1}).best
    assert best.config.moe_chunks == 2


def test_parallel_transformer_reads_moe_chunks_from_its_layout():
    import torch  # noqa: PLC0415

    from tpkernels.models.transformer import ParallelTransformer  # noqa: PLC0415
    from tpkernels.parallel.state import ParallelState  # noqa: PLC0415

    m = ModelConfig("mixtral", 1, 16, 2, 32, 64, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=8)
    model = ParallelTransformer(m, ParallelState.create(ParallelConfig(moe_chunks=3)), dtype=torch.float64)
    assert model.ctx.moe_chunks == 3 and all(mod.chunks == 3 for mod in model.modules() if hasattr(mod, "num_local"))
