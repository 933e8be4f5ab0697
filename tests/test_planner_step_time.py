"""Step-time model: bubble, TP overlap, DP reduction, flags; every layout the search returns is valid."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig
from tpkernels.planner import A100_CALIBRATED, ClusterSpec, TrainingSetup, gpu_preset, model_preset, plan
from tpkernels.planner.estimate import estimate, layout_errors
from tpkernels.planner.step_time import step_time

MODEL = model_preset("Llama-3-8B")
CLUSTER = ClusterSpec(gpu_preset("H100-SXM"), 8, 4)


def test_bubble_is_textbook_fraction(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(20):
        p = rng.choice([2, 4, 8])
        v = rng.choice([1, 2, 4]) if 32 % (p * 4) == 0 else 1
        m = p * rng.randint(1, 8)
        dp = 32 // (p * 2)
        cfg = ParallelConfig(tp=2, pp=p, dp=dp, virtual_stages=v, num_microbatches=m, sequence_parallel=True)
        t = step_time(MODEL, TrainingSetup(m * dp, 2048), cfg, CLUSTER, A100_CALIBRATED)
        per_mb = (t.total - t.bubble - t.dp_exposed - t.optimizer) / m
        # the engine's simulator on cost ratios rounded to a 4% grid reproduces the closed form
        assert t.bubble / (m * per_mb) == pytest.approx((p - 1) / (v * m), rel=0.03)


def test_sequence_parallel_overlap_exposes_first_chunks_only():
    """With SP and overlap on, a ring exposes one chunk of each collective and what outlasts its GEMM
    (tp_overlap.py). On a link fast enough that every GEMM outlasts its collective the exposed part
    is the closed form: per layer 6 rings × c/t forward and backward, the bulk overlaps hidden; on
    NVLink at TP8 the short QKV GEMMs no longer hide their gathers, and more is exposed."""
    from tpkernels.planner.collectives import group_collective_time  # noqa: PLC0415

    cfg = ParallelConfig(tp=8, pp=1, dp=4, num_microbatches=4)
    train = TrainingSetup(16, 4096)
    fast = ClusterSpec(gpu_preset("H100-SXM"), 8, 4, intra_node_gbs=50_000.0)
    nvlink = step_time(MODEL, train, cfg.replace(sequence_parallel=True), CLUSTER, A100_CALIBRATED)
    plain = step_time(MODEL, train, cfg, fast, A100_CALIBRATED)
    sp = step_time(MODEL, train, cfg.replace(sequence_parallel=True), fast, A100_CALIBRATED)
    off = step_time(MODEL, train, cfg.replace(sequence_parallel=True, overlap_comm=False), fast, A100_CALIBRATED)
    assert plain.tp_exposed == plain.tp_comm > 0
    assert off.tp_exposed == off.tp_comm == sp.tp_comm
    one = group_collective_time("all_gather", train.activation_bytes * 4096 * MODEL.hidden_size, 8, 1, fast,
                                A100_CALIBRATED)
    rings = 4 + 2  # forward: QKV, proj, up, down; backward: proj and down dgrad
    expected = 4 * (MODEL.num_layers * rings * one / 8 + 2 * one)  # 4 micro-batches; the head's two exposed
    assert sp.tp_exposed == pytest.approx(expected, rel=1e-9)
    assert nvlink.tp_comm * expected / sp.tp_comm < nvlink.tp_exposed < nvlink.tp_comm
    none = step_time(MODEL, train, cfg.replace(sequence_parallel=True), CLUSTER,
                     A100_CALIBRATED.replace(tp_overlap=0.0))
    assert none.tp_exposed == pytest.approx(none.tp_comm)


def test_overlap_cannot_hide_more_than_the_gemms():
    cfg = ParallelConfig(tp=8, pp=1, dp=1, num_microbatches=8, sequence_parallel=True)
    pcie = ClusterSpec(gpu_preset("H100-SXM"), 8, 1, intra_link="pcie", intra_node_gbs=4.0)
    t = step_time(MODEL, TrainingSetup(8, 4096), cfg, pcie, A100_CALIBRATED)
    assert t.tp_comm > t.gemm  # this link is far too slow for TP8
    assert t.tp_exposed >= t.tp_comm - t.gemm


def test_more_overlap_never_predicts_a_slower_step(fresh_seed):
    """Monotone in the overlap: raising Efficiency.tp_overlap, or turning the software's overlap on,
    never makes a layout slower (random models, TP sizes, links, recompute, LoRA)."""
    rng = random.Random(fresh_seed)
    for _ in range(12):
        model = model_preset(rng.choice(["Llama-3-8B", "GPT-7.5B", "Qwen2.5-14B"]))
        tp = rng.choice([2, 4, 8])
        link = rng.choice([None, rng.uniform(2.0, 400.0)])
        cluster = ClusterSpec(gpu_preset(rng.choice(["H100-SXM", "A100-80GB"])), 8, 1,
                              **({} if link is None else {"intra_link": "pcie", "intra_node_gbs": link}))
        cfg = ParallelConfig(tp=tp, pp=1, dp=8 // tp, num_microbatches=rng.randint(1, 4), sequence_parallel=True,
                             recompute=rng.choice(["none", "selective", "full"]), micro_batch_size=rng.randint(1, 3))
        train = TrainingSetup(cfg.num_microbatches * cfg.micro_batch_size * cfg.dp, rng.choice([512, 2048, 4096]),
                              finetune=rng.choice(["full", "lora"]))
        last = step_time(model, train, cfg.replace(overlap_comm=False), cluster, A100_CALIBRATED).total
        for share in sorted(rng.uniform(0, 1) for _ in range(4)) + [1.0]:
            now = step_time(model, train, cfg, cluster, A100_CALIBRATED.replace(tp_overlap=share)).total
            assert now <= last * (1 + 1e-12), (share, now, last)
            last = now


def test_one_microbatch_over_two_stages_idles_half_the_step():
    """The bubble is the engine simulator's for every micro-batch count: 1 micro-batch over 2 stages
    keeps each stage idle while the other works (50% of the pipeline's time), on GPUs and on ranks
    that share cores alike."""
    cfg = ParallelConfig(tp=1, pp=2, dp=1, num_microbatches=1)
    train = TrainingSetup(1, 2048)
    for eff in (A100_CALIBRATED, A100_CALIBRATED.replace(core_share=0.5)):
        t = step_time(MODEL, train, cfg, CLUSTER, eff)
        work = t.total - t.bubble - t.dp_exposed - t.optimizer - t.overhead
        assert t.bubble / (t.bubble + work) == pytest.approx(0.5, abs=0.03)


def test_zero1_shrinks_memory_not_comm_volume_much():
    cfg = ParallelConfig(tp=1, pp=1, dp=32, num_microbatches=2)
    train = TrainingSetup(64, 2048)
    a = estimate(MODEL, train, CLUSTER, cfg, A100_CALIBRATED)
    b = estimate(MODEL, train, CLUSTER, cfg.replace(zero1=True), A100_CALIBRATED)
    assert b.memory.optimizer == pytest.approx(a.memory.optimizer / 32)
    assert 0.5 < b.time.dp_comm / a.time.dp_comm < 1.0  # RS(fp32) + AG(bf16) vs 2 × fp32


def test_slow_links_raise_comm_ratio_and_get_flagged():
    cfg = ParallelConfig(tp=8, pp=1, dp=1, num_microbatches=8)
    train = TrainingSetup(8, 4096)
    pcie = ClusterSpec(gpu_preset("H100-SXM"), 8, 1, intra_link="pcie")
    fast = estimate(MODEL, train, ClusterSpec(gpu_preset("H100-SXM"), 8, 1), cfg, A100_CALIBRATED)
    slow = estimate(MODEL, train, pcie, cfg, A100_CALIBRATED)
    assert slow.time.comm_ratio > 3 * fast.time.comm_ratio
    assert any(n.startswith("communication/compute ratio") for n in slow.notes)


def test_every_ranked_layout_is_valid_and_fits(fresh_seed):
    rng = random.Random(fresh_seed)
    name = rng.choice(["Llama-3-8B", "Qwen2.5-14B", "GPT-7.5B"])
    gpu = rng.choice(["A100-80GB", "H100-SXM", "L20"])
    nodes, batch = rng.choice([1, 2, 3]), rng.choice([16, 48, 96])
    model, train = model_preset(name), TrainingSetup(batch, 2048)
    cluster = ClusterSpec(gpu_preset(gpu), 8, nodes)
    p = plan(model, train, cluster)
    for e in p.ranked:
        assert layout_errors(model, train, cluster, e.config) == []
        assert e.fits and e.config.world_size == 8 * nodes and e.config.global_batch_size == batch
    times = [e.step_time for e in p.ranked]
    assert times == sorted(times)


def test_fixed_choices_are_honoured_and_unknown_ones_named():
    p = plan(MODEL, TrainingSetup(64, 2048), CLUSTER, fixed={"tp": 4, "recompute": "full"})
    assert p.ranked and all(e.config.tp == 4 and e.config.recompute == "full" for e in p.ranked)
    with pytest.raises(ValueError, match="not layout fields"):
        plan(MODEL, TrainingSetup(64, 2048), CLUSTER, fixed={"pipeline": 2})


def test_fp8_needs_fp8_tensor_cores():
    errs = layout_errors(MODEL, TrainingSetup(8, 2048, precision="fp8"), ClusterSpec(gpu_preset("A100-80GB"), 8, 1),
                         ParallelConfig(tp=8, num_microbatches=8))
    assert errs == ["precision ('fp8') is not supported by A100-80GB: it has no FP8 tensor cores"]
    h100 = estimate(MODEL, TrainingSetup(8, 2048, precision="fp8"), CLUSTER, ParallelConfig(tp=8, dp=4, num_microbatches=2),
                    A100_CALIBRATED)
    bf16 = estimate(MODEL, TrainingSetup(8, 2048), CLUSTER, ParallelConfig(tp=8, dp=4, num_microbatches=2), A100_CALIBRATED)
    assert h100.time.gemm < bf16.time.gemm


def test_tp_must_stay_in_a_node():
    errs = layout_errors(MODEL, TrainingSetup(8, 2048), ClusterSpec(gpu_preset("H100-SXM"), 4, 4),
                         ParallelConfig(tp=8, dp=2, num_microbatches=4))
    assert "tp (8) must divide gpus_per_node (4)" in errs[0]


@pytest.mark.parametrize("preset", ["Llama-3-8B", "GPT-3.6B"])
def test_per_op_selective_recompute_reruns_every_other_matmul(preset, fresh_seed):
    """torchtitan's per-op selective checkpointing (TrainingSetup.selective_policy "every_other_matmul")
    recomputes the even-numbered matmuls of a layer (k, o, up; a two-matrix MLP's down) and every
    memory-bound op: its GEMM time lies between Korthikanti's selective recompute and full
    recompute, the extra time is those projections' forward FLOPs at about the GEMM ceiling, and the
    policy changes nothing unless recompute is selective."""
    rng = random.Random(fresh_seed)
    model = model_preset(preset)
    tp, m = rng.choice([1, 2]), rng.randint(1, 3)
    cfg = ParallelConfig(tp=tp, pp=1, dp=1, num_microbatches=m, sequence_parallel=tp > 1)
    base = dict(global_batch=m, seq_length=4096, precision="bf16")
    cluster = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)

    def run(recompute, policy):
        train = TrainingSetup(**base, selective_policy=policy)
        return step_time(model, train, cfg.replace(recompute=recompute), cluster, A100_CALIBRATED)

    none, sel, op, full = (run("none", "attention"), run("selective", "attention"),
                           run("selective", "every_other_matmul"), run("full", "attention"))
    assert sel.gemm == pytest.approx(none.gemm)  # FlashAttention recomputes its scores anyway
    assert none.gemm < op.gemm < full.gemm
    assert sel.elementwise < op.elementwise == pytest.approx(full.elementwise)
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    gated = model.mlp_matrices == 3
    # torchtitan's order q, k, v, o, gate, up, down (two matrices: up, down): the 2nd, 4th, 6th run again
    rerun = h * kv + q * h + (h * f if gated else f * h)
    flops = 2.0 * 4096 * rerun / tp * model.num_layers * m
    ceiling = cluster.gpu.peak_tflops("bf16") * 1e12 * A100_CALIBRATED.gemm
    # never faster than the ceiling; the GEMM model's shape losses (waves, short k, launches) cost < 30% here
    assert flops / ceiling <= op.gemm - none.gemm <= 1.3 * flops / ceiling
    for recompute in ("none", "full"):
        assert run(recompute, "every_other_matmul").total == pytest.approx(run(recompute, "attention").total)
    with pytest.raises(ValueError, match=r"selective_policy \('layer'\) must be one of attention, every_other_matmul"):
        TrainingSetup(**base, selective_policy="layer")


def test_async_tp_exposes_the_column_parallel_input_gradient_reduce_scatter(fresh_seed):
    """PyTorch's async TP (TrainingSetup.tp_overlap_style "async_tp") pipelines the same rings as
    TransformerEngine but leaves the column-parallel linears' input-gradient reduce-scatter exposed (it
    sums q/k/v and gate/up products: no single matmul to fuse with): its exposed TP time lies between
    userbuffers' and no overlap's, and exceeds userbuffers' by exactly what the two bulk overlaps hid."""
    from tpkernels.planner.collectives import group_collective_time
    from tpkernels.planner.gemm_model import linear_time
    from tpkernels.planner.tp_overlap import bulk_exposed

    rng = random.Random(fresh_seed)
    model = model_preset(rng.choice(["Llama-3-8B", "Llama-2-13B"]))
    t, m, s = rng.choice([2, 4, 8]), rng.randint(1, 3), rng.choice([2048, 4096])
    cfg = ParallelConfig(tp=t, pp=1, dp=1, num_microbatches=m, sequence_parallel=True, overlap_comm=True)
    cluster = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)

    def exposed(style, overlap=True):
        train = TrainingSetup(m, s, tp_overlap_style=style)
        return step_time(model, train, cfg.replace(overlap_comm=overlap), cluster, A100_CALIBRATED).tp_exposed

    ub, async_tp, off = exposed("userbuffers"), exposed("async_tp"), exposed("userbuffers", overlap=False)
    assert ub < async_tp < off  # more overlap never predicts more exposed time
    assert exposed("async_tp", overlap=False) == pytest.approx(off)  # the style matters only when overlapping
    one = group_collective_time("all_gather", 2 * s * model.hidden_size, t, 1, cluster, A100_CALIBRATED)
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    wgrads = [linear_time(s, h, n / t, cluster.gpu, A100_CALIBRATED, "bf16")[2] for n in (q + 2 * kv, 2 * f)]
    hidden_by_bulk = sum(one - bulk_exposed(one, w) for w in wgrads)
    assert async_tp - ub == pytest.approx(model.num_layers * m * hidden_by_bulk, rel=1e-6)
    with pytest.raises(ValueError, match=r"tp_overlap_style \('nccl'\) must be one of userbuffers, async_tp"):
        TrainingSetup(m, s, tp_overlap_style="nccl")


def test_eager_kernels_move_the_counted_extra_traffic(fresh_seed):
    """TrainingSetup.kernels "eager" (no torch.compile: one PyTorch op per kernel) scales the
    memory-bound kernels' traffic by the ratio kernel_fusion counts: torchtitan's fp32 RMSNorm (36
    bytes per element against 4 fused), complex-fp32 rotary (20 against 4), SwiGLU's silu and product
    (10 against 6) and the attention output's transpose copy; nothing else in the step changes."""
    from tpkernels.planner.kernel_fusion import eager_traffic_ratio

    rng = random.Random(fresh_seed)
    llama = model_preset("Llama-3-8B")
    h, q, kv, f = 4096, 4096, 1024, 14336
    fused = 2 * 4 * h + 4 * (q + kv) + 6 * f + 12 * h
    eager = 2 * 36 * h + 20 * (q + kv) + 10 * f + 4 * q + 12 * h
    assert eager_traffic_ratio(llama) == pytest.approx(eager / fused)  # 3.22
    # a LayerNorm model with learned positions: F.layer_norm is one kernel either way, no rotary
    gpt = model_preset("GPT-3.6B")
    assert 1.0 < eager_traffic_ratio(gpt) < 1.2
    model = rng.choice([llama, gpt])
    tp, m = rng.choice([1, 2]), rng.randint(1, 3)
    cfg = ParallelConfig(tp=tp, pp=1, dp=1, num_microbatches=m, sequence_parallel=tp > 1,
                         recompute=rng.choice(["none", "selective", "full"]))
    cluster = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)
    # the output layer's cross-entropy traffic is one fused kernel either way: left out of the comparison
    runs = {k: step_time(model, TrainingSetup(m, 2048, kernels=k), cfg, cluster,
                         A100_CALIBRATED.replace(logit_traffic=0.0)) for k in ("fused", "eager")}
    assert runs["eager"].elementwise == pytest.approx(runs["fused"].elementwise * eager_traffic_ratio(model))
    assert runs["eager"].gemm == pytest.approx(runs["fused"].gemm)
    assert runs["eager"].tp_comm == pytest.approx(runs["fused"].tp_comm)
    with pytest.raises(ValueError, match=r"kernels \('compiled'\) must be one of fused, eager"):
        TrainingSetup(m, 2048, kernels="compiled")
