"""Step time of one layout: compute, TP / PP / DP communication, pipeline bubble, optimizer.

Per micro-batch on the slowest pipeline stage (the last one also runs the output layer):
  GEMMs      forward FLOPs (linear layers 2·tokens·weights, attention core 4·b·s²·heads·head_dim)
             + backward (2× forward; LoRA: 1× for the frozen linears, which need no weight
             gradient; FlashAttention's backward recomputes the scores: 2.5× for the core)
             + recompute (full: one more forward; selective without FlashAttention: the core)
             over peak × Efficiency.gemm, plus Efficiency.gemm_launch_s per GEMM kernel.
  elementwise  the bytes of activations the layer writes × Efficiency.elementwise_traffic over
             HBM bandwidth × Efficiency.hbm (norms, softmax, GeLU, dropout are memory-bound).
  TP comm    message = s·b·h 16-bit activations. Without SP, Megatron's form: 2 all-reduces per
             layer forward and 2 backward (+2 with full recompute), each 2(t−1)/t·bytes/bw, not
             hidden. With SP: all-gathers and reduce-scatters ((t−1)/t·bytes/bw each; 4 forward,
             6 backward counting the re-gather of the input for the weight gradient), of which
             Efficiency.tp_overlap is hidden behind the chunked GEMMs, but never more than the
             linear GEMMs' own time (on slow links the communication cannot all hide).
  P2P        one activation forward and one gradient backward per model chunk, 1/t of it per
             TP rank (Narayanan et al.'s scatter/gather), not hidden.
Step = (m + (p−1)/v) × slowest micro-batch   (1F1B and interleaved bubble: (p−1)/(v·m))
       + exposed DP gradient reduction (ring all-reduce 2(d−1)/d·bytes/bw, or reduce-scatter +
         all-gather with ZeRO-1; the part hidden behind the last micro-batch's backward removed)
       + optimizer step (memory-bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.activations import layer_activations
from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec
from tpkernels.planner.memory import lora_params_per_rank, padded_vocab, stage_params_per_rank
from tpkernels.planner.models import ModelSpec
from tpkernels.planner.workload import TrainingSetup


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest GPU, and what they are made of."""

    gemm: float  # GEMMs of all micro-batches
    elementwise: float  # memory-bound kernels of all micro-batches
    tp_comm: float  # TP collectives, total (hidden + exposed)
    tp_exposed: float
    p2p: float  # pipeline send/recv (exposed)
    bubble: float
    dp_comm: float  # DP gradient reduction, total
    dp_exposed: float
    optimizer: float

    @property
    def compute(self) -> float:
        return self.gemm + self.elementwise

    @property
    def total(self) -> float:
        return self.compute + self.tp_exposed + self.p2p + self.bubble + self.dp_exposed + self.optimizer

    @property
    def comm_ratio(self) -> float:
        """All communication time (hidden or not) over compute time."""
        return (self.tp_comm + self.p2p + self.dp_comm) / self.compute

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(compute=self.compute, total=self.total, comm_ratio=self.comm_ratio)
        return d


def _microbatch_time(model: ModelSpec, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec,
                     eff: Efficiency, last_stage: bool) -> dict[str, float]:
    """Seconds of one micro-batch (forward + backward) on one GPU of a stage."""
    t, b, s = cfg.tp, cfg.micro_batch_size, train.seq_length
    layers = model.num_layers / cfg.pp
    peak = cluster.gpu.peak_tflops(train.precision) * 1e12 * eff.gemm
    lin, core = model.forward_flops_per_layer(b, s)
    lin, core = lin / t, core / t
    lin_bwd = 1.0 if train.finetune == "lora" else 2.0
    core_bwd = 2.5 if train.flash_attention else 2.0
    lin_passes = 1 + lin_bwd + (1 if cfg.recompute == "full" else 0)
    core_passes = 1 + core_bwd + (1 if cfg.recompute == "full" or
                                  (cfg.recompute == "selective" and not train.flash_attention) else 0)
    flops_linear = layers * lin * lin_passes
    flops = flops_linear + layers * core * core_passes
    # Four linear GEMMs per layer and pass (QKV, output projection, MLP up (+gate, fused), down) and
    # two attention-core GEMMs; each pays a fixed launch cost on top of its FLOPs.
    launches = layers * (4 * lin_passes + 2 * core_passes)
    if last_stage:
        logits = model.logits_forward_flops(b, s) * padded_vocab(model, t) / model.vocab_size / t
        flops += 3.0 * logits
        launches += 3
    gemm = flops / peak + launches * eff.gemm_launch_s

    act = layer_activations(model, seq=s, micro_batch=b, tp=t, sequence_parallel=cfg.sequence_parallel,
                            recompute="none", flash_attention=train.flash_attention)
    passes = 4.0 if cfg.recompute == "full" else 3.0  # forward = 1, backward = 2 (in units of forward traffic)
    elementwise = layers * act.produced * eff.elementwise_traffic * passes / 3.0 / (cluster.gpu.hbm_gbs * 1e9 * eff.hbm)

    tp_comm = tp_exposed = 0.0
    if t > 1:
        msg = 2.0 * s * b * model.hidden_size
        bw = cluster.group_bandwidth_gbs(t) * 1e9 * eff.link
        one = (t - 1) / t * msg / bw  # one all-gather or reduce-scatter; an all-reduce is two
        fwd_recompute = cfg.recompute == "full"
        if cfg.sequence_parallel:
            per_layer = one * (4 + 6 + (4 if fwd_recompute else 0))
            head = 2 * one if last_stage else 0.0  # gather before the output layer, reduce-scatter its grad
            tp_comm = layers * per_layer + head
            # The ring hides communication behind the chunk GEMMs: never more than those GEMMs last.
            linear_gemm_time = flops_linear / peak
            tp_exposed = tp_comm - min(eff.tp_overlap * tp_comm, linear_gemm_time)
        else:
            per_layer = 2 * one * (2 + 2 + (2 if fwd_recompute else 0))
            head = 2 * one if last_stage else 0.0  # all-reduce of the output layer's input gradient
            tp_comm = tp_exposed = layers * per_layer + head
    p2p = 0.0
    if cfg.pp > 1:
        # Each TP rank sends only its 1/t slice (already sharded with SP; otherwise Megatron's
        # scatter/gather optimisation: slice, send, all-gather over the intra-node link).
        msg = 2.0 * s * b * model.hidden_size
        neighbour_span = cfg.tp * cfg.dp + 1  # the next stage starts tp·dp ranks further
        bw = cluster.group_bandwidth_gbs(neighbour_span) * 1e9 * eff.link
        one = msg / t / bw + eff.p2p_latency_s
        if t > 1 and not cfg.sequence_parallel:
            one += (t - 1) / t * msg / (cluster.intra_gbs * 1e9 * eff.link)
        p2p = 2 * cfg.virtual_stages * one
    return {"gemm": gemm, "elementwise": elementwise, "tp_comm": tp_comm, "tp_exposed": tp_exposed, "p2p": p2p,
            "backward": (gemm + elementwise) * 2.0 / 3.0,
            "total": gemm + elementwise + tp_exposed + p2p}


def step_time(model: ModelSpec, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec,
              eff: Efficiency) -> StepTime:
    m = cfg.num_microbatches
    stages = [_microbatch_time(model, train, cfg, cluster, eff, last_stage=True)]
    if cfg.pp > 1:
        stages.append(_microbatch_time(model, train, cfg, cluster, eff, last_stage=False))
    slow = max(stages, key=lambda x: x["total"])
    bubble = (cfg.pp - 1) / cfg.virtual_stages * slow["total"]

    # Data-parallel gradient reduction of the largest stage (the first, or the last with the head).
    trained = max(stage_params_per_rank(model, cfg, 0), stage_params_per_rank(model, cfg, cfg.pp - 1))
    if train.finetune == "lora":
        trained = lora_params_per_rank(model, cfg, train.lora_rank)
    dp_comm = dp_exposed = 0.0
    if cfg.dp > 1:
        # fp16 gradients are reduced in fp16 (Megatron 2021); bf16 training reduces the fp32 main grads.
        grad_bytes = 2.0 if train.precision == "fp16" else 4.0
        bw = cluster.group_bandwidth_gbs(cfg.tp * cfg.dp) * 1e9 * eff.link
        ring = (cfg.dp - 1) / cfg.dp / bw
        if cfg.zero1:
            dp_comm = ring * trained * (grad_bytes + 2.0)  # reduce-scatter grads, all-gather 16-bit weights
        else:
            dp_comm = ring * trained * 2.0 * grad_bytes
        dp_exposed = max(0.0, dp_comm - eff.dp_overlap * slow["backward"])
    opt_params = trained / (cfg.dp if cfg.zero1 else 1)
    optimizer = opt_params * eff.optimizer_bytes_per_param / (cluster.gpu.hbm_gbs * 1e9 * eff.hbm)
    return StepTime(
        gemm=m * slow["gemm"], elementwise=m * slow["elementwise"], tp_comm=m * slow["tp_comm"],
        tp_exposed=m * slow["tp_exposed"], p2p=m * slow["p2p"], bubble=bubble, dp_comm=dp_comm,
        dp_exposed=dp_exposed, optimizer=optimizer,
    )
