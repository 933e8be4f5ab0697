"""Step time of one layout: compute, TP / PP / DP communication, pipeline bubble, optimizer.

Per micro-batch on the slowest pipeline stage (the last one also runs the output layer):
  GEMMs      every linear layer's forward, input-gradient and weight-gradient GEMM timed at its own
             shape after TP splitting (gemm_model.py: ceiling, wave quantization, short-k loss,
             memory roof, launch cost); LoRA's frozen linears skip the weight gradient; full
             recompute runs the forward twice, torchtitan's per-op selective recompute the k,
             output and up projections' (TrainingSetup.selective_policy). QLoRA's forward and
             input-gradient GEMMs read the quantised weight (≈ 0.516 bytes/param for NF4) and dequantise it in registers:
             max(compute / QLORA_GEMM_EFFICIENCY, traffic), so a GEMM bound by its bf16 weight
             bytes gets faster, a compute-bound one slower. FP8 runs the linear GEMMs at the FP8
             peak (QLoRA's in bf16: the kernels dequantise to the activations' dtype) and the
             attention core in bf16.
  attention  FlashAttention: forward + backward (2.5× forward, it recomputes the scores) FLOPs
             over bf16 peak × Efficiency.attention. Without FlashAttention (Megatron 2021): the
             batched QKᵀ and PV GEMMs through the GEMM model; selective recompute redoes them.
  elementwise  the bytes of activations the layer writes × Efficiency.elementwise_traffic over
             HBM bandwidth × Efficiency.hbm (norms, softmax, GeLU, dropout are memory-bound); eager
             PyTorch's unfused ops × the traffic ratio kernel_fusion.py counts.
  TP comm    message = s·b·h 16-bit activations. Without SP, Megatron's form: 2 all-reduces per
             layer forward and 2 backward (+2 with full recompute), not hidden. With SP:
             all-gathers and reduce-scatters (4 forward, 6 backward counting the re-gather of the
             input for the weight gradient), each paired with the GEMM the software overlaps it
             with when ``cfg.overlap_comm`` (tp_overlap.py: TransformerEngine userbuffers / async
             TP / our ring ops): a ring exposes its first chunk (1/t of it) and whatever the
             collective outlasts its GEMM; a bulk overlap only the excess. Efficiency.tp_overlap
             (1 on GPUs, 0 where the collectives progress on the cores the GEMMs use: gloo) says
             how much of that structural hiding the machine gets.
  P2P        one activation forward and one gradient backward per model chunk, 1/t of it per
             TP rank (Narayanan et al.'s scatter/gather), not hidden.
  CP         context parallelism splits every sequence over cp ranks: each rank runs the linear
             layers and memory-bound kernels on s/cp tokens and 1/cp of the (load-balanced)
             attention core, and exchanges K/V with its CP group every layer (context_parallel.py:
             the ring's hops hide behind the attention blocks they feed; all-gather and a2a do not).
  MoE        a mixture-of-experts layer runs its block in place of the dense MLP (expert_parallel.py:
             router, grouped expert GEMMs at their per-expert shape over the E/ep local experts,
             shared expert, the EP all-to-all over NVLink or the network by placement, exposed as
             the chunked dispatch leaves it); the MLP's SP collectives pair with the expert GEMMs.
             Models with dense layers too mix the two in proportion.
Step = the engine's simulated makespan of the schedule (pipeline_bubble.py: GPipe, 1F1B,
       interleaved, ZB-H1 with its split weight gradient) over those per-micro-batch costs, for
       every micro-batch count (1 micro-batch over 2 stages idles each stage half the step)
     + exposed DP communication over DP × CP (collectives.py: hierarchical across nodes; the gradient
       reduction bucketed behind the last micro-batch's backward, the ZeRO-1 weight all-gather
       behind the first forward, when the software overlaps them); routed-expert gradients are
       reduced over their expert-data-parallel group (DP × CP / EP ranks, tp · ep apart) instead
     + optimizer step (memory-bound)
     + this machine's corrections where its autotune trials fitted them (fit.py), all rates that
       scale with the work: compute × Efficiency.compute_scale, exposed communication × comm_scale,
       and Efficiency.op_overhead_s per kernel on the critical path (StepTime.ops: host dispatch
       and per-op bookkeeping, which grow with layers and micro-batches, not with the step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.activations import layer_activations
from tpkernels.planner.collectives import exposed_after_overlap, group_collective_time
from tpkernels.planner.context_parallel import cp_attention_comm
from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.expert_parallel import moe_layer_share, moe_layer_time
from tpkernels.planner.gemm_model import gemm_time, linear_time
from tpkernels.planner.hardware import ClusterSpec
from tpkernels.planner.kernel_fusion import eager_traffic_ratio
from tpkernels.planner.memory import BASE_BYTES_PER_PARAM, lora_param_split, optimizer_shards, stage_param_split
from tpkernels.description import ModelConfig
from tpkernels.planner.pipeline_bubble import bubble_time
from tpkernels.planner.tp_overlap import column_backward_exposed, ring_exposed, sp_exposed
from tpkernels.planner.workload import TrainingSetup

# Non-GEMM kernels of one decoder layer, forward + backward, in our implementation: forward runs two
# fused norms (each also adds a residual), rotary on q and k, the attention core, the MLP
# activation and ~6 reshapes/copies around the GEMMs; backward runs each again with about twice the
# kernels. Only Efficiency.kernel_launch_s (CPUs) makes this count matter.
ELEMENTWISE_KERNELS_PER_LAYER = 36
# Trained tensors of one decoder layer (q, k, v, o, gate, up, down weights and two norms; LoRA: an A
# and a B per adapted linear) and the kernels the optimizer step launches for each (Adam's two
# moment updates, the bias-corrected step and the weight write; torch's foreach path batches the
# launches but keeps per-tensor host work). Only Efficiency.op_overhead_s makes these counts matter.
PARAM_TENSORS_PER_LAYER = 9
LORA_TENSORS_PER_LAYER = 14
OPTIMIZER_KERNELS_PER_TENSOR = 4
# Compute rate of a QLoRA linear's GEMM (NF4/int8 weight dequantised tile by tile in registers, the
# Triton kernel tpkernels/kernels/triton/nf4_linear.py) relative to a bf16 cuBLAS GEMM of the same
# shape. 0.8 is the project's target for M ≥ 2048 (issue 34), not a measurement: no GPU has run the
# kernel yet. Assumed until benchmarks/gpu_check.sh measures it.
QLORA_GEMM_EFFICIENCY = 0.8



@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest GPU, and what they are made of."""

    gemm: float  # GEMMs (and the attention core) of all micro-batches
    elementwise: float  # memory-bound kernels of all micro-batches
    tp_comm: float  # TP collectives, total (hidden + exposed)
    tp_exposed: float
    p2p: float  # pipeline send/recv (exposed)
    bubble: float
    dp_comm: float  # DP gradient reduction (+ ZeRO-1 weight all-gather), total
    dp_exposed: float
    optimizer: float
    schedule: str = "none"
    cp_comm: float = 0.0  # context-parallel K/V exchange, total (hidden + exposed)
    cp_exposed: float = 0.0
    overhead: float = 0.0  # per-op cost measured on this machine: Efficiency.op_overhead_s × ops
    ops: float = 0.0  # kernels (GEMMs, memory-bound kernels, collectives) on the critical path of one step
    reference: float = 0.0  # DPO's online reference: a forward-only pipeline pass over the step's tokens
    # DPO's cached reference: the same forward-only pass, once before training per step of data (not in total)
    reference_prepass: float = 0.0
    ep_comm: float = 0.0  # expert-parallel all-to-all (dispatch + combine), total (hidden + exposed)
    ep_exposed: float = 0.0

    @property
    def compute(self) -> float:
        return self.gemm + self.elementwise

    @property
    def total(self) -> float:
        return (self.compute + self.tp_exposed + self.cp_exposed + self.ep_exposed + self.p2p + self.bubble
                + self.dp_exposed + self.optimizer + self.overhead + self.reference)

    @property
    def comm_ratio(self) -> float:
        """All communication time (hidden or not) over compute time."""
        return (self.tp_comm + self.cp_comm + self.ep_comm + self.p2p + self.dp_comm) / self.compute

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(compute=self.compute, total=self.total, comm_ratio=self.comm_ratio)
        return d


def _linear_shapes(model: ModelConfig, t: int) -> list[tuple[float, float]]:
    """(k, n) per TP rank of one layer's linear GEMMs: QKV, output projection, MLP up(+gate), down."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    return [(h, (q + 2 * kv) / t), (q / t, h), (h, f * (model.mlp_matrices - 1) / t), (f / t, h)]


def _every_other_matmul_shares(model: ModelConfig) -> list[float]:
    """Share of each of :func:`_linear_shapes`' forward GEMMs that torchtitan's per-op selective
    checkpointing recomputes: it counts a layer's matmuls (q, k, v, o, then gate, up, down; a
    two-matrix MLP: up, down) and recomputes the even-numbered ones: k of QKV, o, up of gate|up (the
    second MLP matrix of a two-matrix MLP). The fused QKV's share is k's FLOPs over q + 2·kv."""
    q, kv = model.q_dim, model.kv_dim
    gated = model.mlp_matrices == 3
    return [kv / (q + 2 * kv), 1.0, 0.5 if gated else 0.0, 0.0 if gated else 1.0]


def _attention_time(model: ModelConfig, train: TrainingSetup, b: int, s: int, t: int, cluster: ClusterSpec,
                    eff: Efficiency, cp: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core on one TP rank (and 1/cp of the
    sequence's queries against all of its keys: the zigzag split balances the causal work)."""
    precision = "bf16" if train.precision == "fp8" else train.precision
    if train.flash_attention or cp > 1:  # context parallelism always runs the FlashAttention-style blocks
        core = 4.0 * b * s * s * model.q_dim  # ModelConfig.forward_flops_per_layer's attention core (QKᵀ, PV)
        fwd = core / t / cp / (cluster.gpu.peak_tflops(precision) * 1e12 * eff.attention)
        return fwd, 2.5 * fwd
    heads, d = model.num_attention_heads / t, model.dhead
    fwd = (gemm_time(s, s, d, cluster.gpu, eff, precision, batch=b * heads)  # QKᵀ
           + gemm_time(s, d, s, cluster.gpu, eff, precision, batch=b * heads))  # PV
    return fwd, 2.0 * fwd


def _microbatch_time(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec,
                     eff: Efficiency, last_stage: bool) -> dict[str, float]:
    """Seconds of one micro-batch on one GPU of a stage: forward, input-gradient, weight-gradient."""
    t, b, s, cp = cfg.tp, cfg.micro_batch_size, train.seq_length, cfg.cp
    tokens = b * (s // cp)  # this rank's share of the sequence (s divides by 2·cp: a layout rule)
    layers = model.num_layers / cfg.pp
    gpu, frozen = cluster.gpu, train.adapters
    lin_precision, quant = train.precision, {}
    if train.quant is not None:
        quant = {"weight_bytes": BASE_BYTES_PER_PARAM[train.quant], "compute_scale": QLORA_GEMM_EFFICIENCY}
        # the kernels dequantise to the activations' dtype (bf16 under FP8 training): no FP8 GEMM here
        lin_precision = "bf16" if train.precision == "fp8" else train.precision
    # (forward, input-gradient, weight-gradient) of QKV, output projection, MLP up, down
    per_linear = [linear_time(tokens, k, n, gpu, eff, lin_precision, weight_grad=not frozen, **quant)
                  for k, n in _linear_shapes(model, t)]
    lin_f, lin_b, lin_w = (sum(lin[i] for lin in per_linear) for i in range(3))
    share = moe_layer_share(model)
    dense_linear = list(per_linear)  # a dense layer's, for its SP collectives' overlap
    moe = None
    if share:  # a MoE layer's block replaces the dense MLP (expert_parallel.py); the layers mix in proportion
        moe = moe_layer_time(model, train, cfg, cluster, eff, precision=lin_precision, quant=quant)
        mlp = [per_linear[2][i] + per_linear[3][i] for i in range(3)]
        lin_f, lin_b, lin_w = (x + share * (moe[k] - mlp[i]) for i, (x, k) in enumerate(zip((lin_f, lin_b, lin_w),
                                                                                           "fbw")))
        per_linear[2] = tuple((1 - share) * per_linear[2][i] + share * moe["up"][i] for i in range(3))
        per_linear[3] = tuple((1 - share) * per_linear[3][i] + share * moe["down"][i] for i in range(3))
    att_f, att_b = _attention_time(model, train, b, s, t, cluster, eff, cp)
    cpc = cp_attention_comm(model, cfg, s, train.activation_bytes, att_f, att_b, cluster, eff)
    passes_f = 2 if cfg.recompute == "full" else 1  # full recompute exchanges K/V again
    cp_comm = layers * (passes_f * cpc["fwd"] + cpc["bwd"])
    cp_exposed = layers * (passes_f * cpc["fwd_exposed"] + cpc["bwd_exposed"])
    fwd_rc = {"full": lin_f + att_f, "selective": 0.0 if train.flash_attention else att_f, "none": 0.0}[cfg.recompute]
    matmul_rc = cfg.recompute == "selective" and train.selective_policy == "every_other_matmul"
    if matmul_rc:
        fwd_rc += sum(r * lin[0] for r, lin in zip(_every_other_matmul_shares(model), per_linear))
    f = layers * (lin_f + att_f)
    bwd_in = layers * (lin_b + att_b + fwd_rc)  # recompute runs just before the backward that needs it
    bwd_w = layers * lin_w
    if last_stage:
        vocab = model.padded_vocab(t) / t
        # The output layer stays in 16 bits under FP8 (TransformerEngine recipes keep it out of FP8).
        head_precision = "bf16" if train.precision == "fp8" else train.precision
        hf, hb, hw = linear_time(tokens, model.hidden_size, vocab, gpu, eff, head_precision,
                                 weight_grad=not (frozen and not model.tied_embeddings))
        f, bwd_in, bwd_w = f + hf, bwd_in + hb, bwd_w + hw
    gemm = f + bwd_in + bwd_w

    act_kw = dict(seq=s, micro_batch=b, tp=t, sequence_parallel=cfg.sequence_parallel, recompute="none",
                  flash_attention=train.flash_attention or cp > 1, cp=cp, cp_algo=cfg.cp_algo)
    produced = layer_activations(model, **act_kw).produced
    if moe is not None:  # the permutation's passes, the experts' SwiGLU, the router's softmax and top-k
        imbalance = moe["rows"] / (tokens * model.experts_per_token)
        produced = (1 - share) * produced + share * layer_activations(model, moe=True, ep=cfg.ep, imbalance=imbalance,
                                                                      **act_kw).produced
    # forward = 1, backward = 2 (in units of forward traffic), + 1 when the memory-bound ops run again
    passes = 4.0 if cfg.recompute == "full" or matmul_rc else 3.0
    fusion = eager_traffic_ratio(model) if train.kernels == "eager" else 1.0
    elementwise = layers * produced * train.activation_bytes / 2.0 * eff.elementwise_traffic * fusion * passes / 3.0 \
        / (gpu.hbm_gbs * 1e9 * eff.hbm)
    elementwise += layers * ELEMENTWISE_KERNELS_PER_LAYER * passes / 3.0 * eff.kernel_launch_s
    if last_stage:
        logits = tokens * model.padded_vocab(t) / t * train.activation_bytes
        elementwise += logits * eff.logit_traffic / (gpu.hbm_gbs * 1e9 * eff.hbm)

    tp_comm = tp_exposed = 0.0
    shared = share if model.shared_expert_ffn_hidden_size else 0.0  # layers with a shared expert, their share
    if t > 1:
        msg = train.activation_bytes * tokens * model.hidden_size
        one = group_collective_time("all_gather", msg, t, 1, cluster, eff)  # = one reduce-scatter
        fwd_recompute = cfg.recompute == "full"
        style = train.tp_overlap_style  # how the software overlaps the SP collectives (tp_overlap.py)
        if cfg.sequence_parallel:
            per_layer = one * (4 + 6 + (4 if fwd_recompute else 0))
            head = 2 * one if last_stage else 0.0  # gather before the output layer, reduce-scatter its grad
            tp_comm = layers * per_layer + head
            if cfg.overlap_comm:
                exposed_fwd, exposed_bwd = sp_exposed(one, dense_linear, t, style)
                layer_exposed = exposed_fwd * (2 if fwd_recompute else 1) + exposed_bwd
                # the machine hides tp_overlap of what the software's overlap can hide
                layer_exposed = per_layer - eff.tp_overlap * (per_layer - layer_exposed)
            else:
                layer_exposed = per_layer
            if shared:  # the shared expert, a dense MLP beside the routed ones, gathers and reduces on its own
                extra = one * (2 + 3 + (2 if fwd_recompute else 0))
                up_s, down_s = moe["shared_up"], moe["shared_down"]
                hidden_fwd = ring_exposed(one, up_s[0], t) + ring_exposed(one, down_s[0], t)
                hidden_bwd = ring_exposed(one, down_s[1], t) + column_backward_exposed(one, up_s, style)
                extra_exposed = (hidden_fwd * (2 if fwd_recompute else 1) + hidden_bwd) if cfg.overlap_comm else extra
                extra_exposed = extra - eff.tp_overlap * (extra - extra_exposed)
                per_layer, layer_exposed = per_layer + shared * extra, layer_exposed + shared * extra_exposed
                tp_comm = layers * per_layer + head
            if share:  # a MoE layer's routed block has no SP gather / reduce-scatter (each TP rank routes its
                # own tokens): the dense MLP's give way to the expert-TP all-gathers / reduce-scatters
                up_d, down_d = dense_linear[2], dense_linear[3]
                mlp = one * (2 + 3 + (2 if fwd_recompute else 0))
                mlp_exposed = mlp
                if cfg.overlap_comm:
                    mlp_fwd = ring_exposed(one, up_d[0], t) + ring_exposed(one, down_d[0], t)
                    mlp_bwd = ring_exposed(one, down_d[1], t) + column_backward_exposed(one, up_d, style)
                    mlp_exposed = mlp - eff.tp_overlap * (mlp - (mlp_fwd * (2 if fwd_recompute else 1) + mlp_bwd))
                etp = passes_f * moe["etp_f"] + moe["etp_b"]
                per_layer, layer_exposed = per_layer + share * (etp - mlp), layer_exposed + share * (etp - mlp_exposed)
                tp_comm = layers * per_layer + head
            tp_exposed = layers * layer_exposed + head  # the output layer's gather / reduce-scatter: exposed
        else:
            ar = group_collective_time("all_reduce", msg, t, 1, cluster, eff)
            per_layer = ar * (2 + 2 + (2 if fwd_recompute else 0) + shared * (2 + (1 if fwd_recompute else 0)))
            if share:  # a MoE layer's routed block: expert-TP all-gathers / reduce-scatters for the MLP's all-reduces
                per_layer += share * (passes_f * moe["etp_f"] + moe["etp_b"] - ar * (2 + (1 if fwd_recompute else 0)))
            head = ar if last_stage else 0.0  # all-reduce of the output layer's input gradient
            tp_comm = tp_exposed = layers * per_layer + head
    p2p = p2p_one = 0.0
    if cfg.pp > 1:
        # Each TP rank sends only its 1/t slice (already sharded with SP; otherwise Megatron's
        # scatter/gather optimisation: slice, send, all-gather over the intra-node link).
        msg = train.activation_bytes * tokens * model.hidden_size
        neighbour_span = cfg.tp * cfg.cp * cfg.dp + 1  # the next stage starts tp·cp·dp ranks further
        bw = cluster.group_bandwidth_gbs(neighbour_span) * 1e9 * eff.link
        one = msg / t / bw + eff.p2p_latency_s
        if t > 1 and not cfg.sequence_parallel:
            one += group_collective_time("all_gather", msg, t, 1, cluster, eff)
        p2p_one = one
        p2p = 0.0 if train.overlap_p2p else 2 * cfg.virtual_stages * one
    ep_comm = ep_exposed = 0.0
    if moe is not None:
        moe_layers = layers * share
        ep_comm = moe_layers * (passes_f * moe["a2a_f"] + moe["a2a_b"])
        ep_exposed = moe_layers * (passes_f * moe["a2a_f_exposed"] + moe["a2a_b_exposed"])
    compute = gemm + elementwise
    # kernels of one micro-batch on this stage: each linear's forward, input- and weight-gradient GEMM
    # (and the recomputed forward), the attention core's forward and backward, the memory-bound
    # kernels, the TP collectives; the output layer's three GEMMs and its loss
    gemms_per_linear = 2 + (0 if frozen else 1) + (1 if cfg.recompute == "full" else 0)
    tp_ops = 0 if t == 1 else (10 + (4 if cfg.recompute == "full" else 0)) if cfg.sequence_parallel else \
        4 + (2 if cfg.recompute == "full" else 0)
    ops = layers * (4 * gemms_per_linear + (3 if matmul_rc else 0) + 2 + ELEMENTWISE_KERNELS_PER_LAYER * passes / 3.0
                    + tp_ops)
    if moe is not None:  # router and shared-expert GEMMs, the count exchange and the chunked all-to-alls
        a2a_ops = 0 if cfg.ep == 1 else (2 + 4 * cfg.moe_chunks) * (passes_f + 1) / 2
        # expert TP: per chunk a count all-gather, the rows' all-gather and reduce-scatter (each pass)
        a2a_ops += 0 if t == 1 else 3 * (cfg.moe_chunks if cfg.ep > 1 else 1) * (passes_f + 1)
        ops += layers * share * (gemms_per_linear * (1 + (2 if model.shared_expert_ffn_hidden_size else 0)) + a2a_ops)
    if last_stage:
        ops += 3 + 2
    # Elementwise work, exposed TP communication and P2P are charged to forward and backward in
    # proportion to their GEMM time, so the schedule simulation sees whole-pass costs.
    extra = elementwise + tp_exposed + cp_exposed + ep_exposed + p2p
    scale = 1.0 + extra / gemm
    return {"gemm": gemm, "elementwise": elementwise, "tp_comm": tp_comm, "tp_exposed": tp_exposed, "p2p": p2p,
            "cp_comm": cp_comm, "cp_exposed": cp_exposed, "ep_comm": ep_comm, "ep_exposed": ep_exposed,
            "f": f * scale, "b": bwd_in * scale, "w": bwd_w * scale,
            "total": compute + tp_exposed + cp_exposed + ep_exposed + p2p, "p2p_one": p2p_one, "ops": ops}


def _trained_split(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig) -> tuple[float, float]:
    """(other, expert) trained parameters of the fuller of the first and last stage on one rank."""
    stages = {0, cfg.pp - 1}
    if train.adapters:
        return max((lora_param_split(model, cfg, train.lora_rank, st) for st in stages), key=sum)
    return max((stage_param_split(model, cfg, st) for st in stages), key=sum)


def _dp_time(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec, eff: Efficiency,
             slow: dict[str, float]) -> tuple[float, float, float]:
    """(total DP communication, exposed part, optimizer parameters per rank) of one step. The
    gradients are reduced over DP × CP (CP replicates the weights), whose members are tp apart; the
    routed experts' over their expert-data-parallel group (DP × CP / EP ranks, tp · ep apart)."""
    other, experts = _trained_split(model, train, cfg)
    shard, expert_shard = optimizer_shards(cfg)
    opt_params = other / shard + experts / expert_shard
    group, edp = cfg.dp * cfg.cp, cfg.dp * cfg.cp // cfg.ep
    if group == 1:
        return 0.0, 0.0, opt_params
    # fp16 gradients are reduced in fp16 (Megatron 2021); bf16 ones in fp32 unless the software reduces
    # them in 16 bits (TrainingSetup.grad_reduce_fp32)
    grad_bytes = 4.0 if train.grad_reduce_fp32 and train.precision != "fp16" else 2.0
    kind = "reduce_scatter" if cfg.zero1 else "all_reduce"

    def both(kind_, nbytes_per_param):
        return (group_collective_time(kind_, other * nbytes_per_param, group, cfg.tp, cluster, eff)
                + group_collective_time(kind_, experts * nbytes_per_param, edp, cfg.tp * cfg.ep, cluster, eff))

    grads = both(kind, grad_bytes)
    buckets = max(1, round((other + experts) * grad_bytes / eff.dp_bucket_bytes))
    # The reduction overlaps the last micro-batch's backward on this rank.
    grads_exposed = (exposed_after_overlap(grads, slow["b"] + slow["w"], buckets) if train.overlap_grad_reduce
                     else grads)
    weights = weights_exposed = 0.0
    if cfg.zero1:  # each rank updated its shard of the weights; gather the 16-bit result
        weights = both("all_gather", 2.0)
        weights_exposed = (exposed_after_overlap(weights, slow["f"], buckets) if train.overlap_param_gather
                           else weights)
    return grads + weights, grads_exposed + weights_exposed, opt_params


def step_time(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec,
              eff: Efficiency) -> StepTime:
    """The step time of ``cfg`` run with its pipeline schedule (``cfg.pipeline_schedule``)."""
    errs = cfg.schedule_errors()
    if errs:
        raise ValueError(errs[0])
    schedule = cfg.pipeline_schedule
    m, p, v = cfg.num_microbatches, cfg.pp, cfg.virtual_stages
    stages = [_microbatch_time(model, train, cfg, cluster, eff, last_stage=True)]
    if p > 1:
        stages.append(_microbatch_time(model, train, cfg, cluster, eff, last_stage=False))
    slow = max(stages, key=lambda x: x["total"])
    bubble = 0.0
    if p > 1:
        split = schedule == "zb-h1"
        # Overlapped P2P: each transfer delays only its consumer, inside the simulation.
        comm = slow["p2p_one"] if train.overlap_p2p else 0.0
        bubble = bubble_time(schedule, p, m, v, slow["f"] / v, (slow["b"] if split else slow["b"] + slow["w"]) / v,
                             slow["w"] / v if split else 0.0, comm)
    dp_comm, dp_exposed, opt_params = _dp_time(model, train, cfg, cluster, eff, slow)
    optimizer = opt_params * eff.optimizer_bytes_per_param / (cluster.gpu.hbm_gbs * 1e9 * eff.hbm)
    a, c = eff.compute_scale, eff.comm_scale  # a machine's measured corrections (1, 1 unless fitted)
    # DPO's reference: forwards only (no backward, no recompute), the m micro-batches after the pipeline
    # fills (p − 1 stage forwards); its time is the policy's forward, the head's loss included
    reference = (m + (p - 1) / v) * slow["f"] if train.task == "dpo" else 0.0
    # kernels on the critical path: the busiest rank's m micro-batches, and the bubble's share of
    # them (the stage it waits for launches its kernels meanwhile)
    busy = m * slow["total"]
    ops = m * slow["ops"] * (1.0 + bubble / busy if busy > 0 else 1.0)
    # and the optimizer's: a few kernels per trained tensor of this stage, and one collective per DP bucket
    tensors = model.num_layers / cfg.pp * (LORA_TENSORS_PER_LAYER if train.adapters else PARAM_TENSORS_PER_LAYER) + 2
    ops += tensors * OPTIMIZER_KERNELS_PER_TENSOR
    return StepTime(
        gemm=a * m * slow["gemm"], elementwise=a * m * slow["elementwise"], tp_comm=c * m * slow["tp_comm"],
        tp_exposed=c * m * slow["tp_exposed"], p2p=c * m * slow["p2p"], bubble=a * bubble, dp_comm=c * dp_comm,
        dp_exposed=c * dp_exposed, optimizer=a * optimizer, schedule=schedule if p > 1 else "none",
        cp_comm=c * m * slow["cp_comm"], cp_exposed=c * m * slow["cp_exposed"], overhead=eff.op_overhead_s * ops,
        ep_comm=c * m * slow["ep_comm"], ep_exposed=c * m * slow["ep_exposed"],
        ops=ops,
        reference=a * reference if train.online_reference else 0.0,
        reference_prepass=a * reference if train.task == "dpo" and not train.online_reference else 0.0,
    )
