"""Seconds of one mixture-of-experts (MoE) block per micro-batch on one GPU: router, grouped expert
GEMMs, shared expert, and the expert-parallel (EP) all-to-all with the overlap the code gives it.

Per MoE layer and micro-batch, with T = b·s/cp tokens of the TP group, each TP rank routing its own
T/tp of them (tpkernels.models.moe: the SP shard, or a 1/tp block of the replicated tokens; Megatron-
Core's alltoall dispatcher with expert TP = TP), k experts per token, E experts, expert width F, EP size
ep (inside DP × CP: ep ranks of one TP rank, ``tp`` apart) and ρ the busiest EP rank's rows over its
balanced share (:func:`busiest_share`):

  router        (T/tp × h)·(h × E) on each TP rank, forward, input gradient and weight gradient
                through the GEMM model.
  experts       one grouped GEMM per projection over the E/ep local experts, each with
                m = ρ · ep · T · k / E rows (the EP group's T·k token copies spread over E experts,
                all-gathered over TP: every TP rank runs every row of its local experts):
                gate|up (m × h)·(h × 2F/tp) and down (m × F/tp)·(F/tp × h), forward, input and weight
                gradient, timed by gemm_model.gemm_time at that shape with batch = E/ep (one launch,
                its tiles spread over the SMs together): small experts are small GEMMs, and the weight
                gradient's reduction over m rows is a short k. Only the active FLOPs (k of E) are run,
                plus the gate|up GEMM once more in the backward (tpkernels.functional.grouped_gemm's
                grouped_swiglu_mlp keeps only its input and recomputes it).
  shared        the shared expert as a dense MLP of its width on T tokens (with its own SP gather and
                reduce-scatter, overlapped as the dense MLP's: step_time.py).
  permutation   the permute / unpermute passes are memory-bound: their bytes are in the block's
                produced activations (activations.moe_block_activations), charged with the other
                memory-bound kernels (Efficiency.elementwise_traffic over HBM).
  all-to-all    dispatch and combine each move the rank's ρ·T·k/tp rows of h values (16-bit): forward
                2·ρ·T·k·h·bytes/tp, backward the same, (ep − 1)/ep of it leaving the rank
                (collectives.all_to_all_time: NVLink while ep · tp ≤ GPUs per node, else the share
                for other nodes over the NIC). 0 at ep = 1. Full recompute dispatches again.
                TrainingSetup.moe_dispatch "dedup" (DeepEP / HybridEP) sends a token once per rank
                and once per node that holds any of its experts instead (:func:`dispatch_time`).
  expert TP     (tp > 1) the rows a TP rank received are all-gathered over the TP group before the
                expert GEMMs and the partial results reduce-scattered back: each an all-gather of
                ρ·T·k·h·bytes over tp ranks (collectives.group_collective_time), forward AG + RS,
                backward RS + AG, again under full recompute; without SP also the all-gather of the
                combined T/tp-token blocks (forward) and of their input gradient (backward), which
                replace the dense MLP's all-reduces. They run inside each chunk's expert step
                (not hidden: "etp_f" / "etp_b"); step_time.py charges them in place of the dense
                MLP's SP collectives for the MoE layers.
  overlap       tpkernels.functional.moe_dispatch cuts the exchange into c chunks and runs the expert
                GEMMs of chunk i while chunk i + 1 is in flight (forward and backward). With A the
                pass's all-to-all seconds and G its expert GEMM seconds:

                    exposed = A / c + max(0, (c − 1)/c · (A − G))

                the first chunk's exchange has nothing to hide behind, and the other (c − 1)/c of
                the exchange hides behind (c − 1)/c of the GEMMs, exposing what it outlasts (the
                form of tp_overlap.ring_exposed). c = 1 exposes all of A; more chunks or more GEMM
                time never expose more. Efficiency.tp_overlap scales the hiding as for TP (0 where
                the collectives progress on the cores that run the GEMMs: gloo on CPUs).

No constant is fitted here: the GEMMs use the fitted GEMM ceiling, the exchange the link model.
"""

from __future__ import annotations

import math

from tpkernels.description import ModelConfig
from tpkernels.parallel import ParallelConfig
from tpkernels.planner.collectives import all_to_all_time, exchange_time, group_collective_time, members_per_node
from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.gemm_model import gemm_time, linear_time
from tpkernels.planner.hardware import ClusterSpec
from tpkernels.planner.workload import TrainingSetup


def moe_layer_share(model: ModelConfig) -> float:
    """Share of the decoder layers that have routed experts (0 for a dense model)."""
    if not model.is_moe:
        return 0.0
    return 1.0 if model.moe_layers is None else len(model.moe_layers) / model.num_layers


def chunked_exposed(comm: float, compute: float, chunks: int) -> float:
    """Exposed seconds of an exchange of ``comm`` s cut into ``chunks`` pipelined with ``compute`` s of
    GEMMs (module docstring): comm / c + max(0, (c − 1)/c · (comm − compute))."""
    if comm <= 0:
        return 0.0
    c = max(1, int(chunks))
    return comm / c + max(0.0, (c - 1) / c * (comm - max(0.0, compute)))


def busiest_share(model: ModelConfig, ep: int, imbalance: float) -> float:
    """ρ for the step time: ``imbalance`` (TrainingSetup.moe_imbalance), at most what a capacity
    factor lets an EP rank receive and what routing can send it (ep · min(k, E/ep) / k); at ep = 1
    one rank runs all of its own rows (fewer if a capacity factor below 1 drops some)."""
    k, e = model.experts_per_token, model.num_experts
    cap = model.capacity_factor if model.capacity_factor is not None else float("inf")
    if ep <= 1:
        return min(1.0, cap)
    return min(imbalance, cap, ep * min(k, e / ep) / k)


def _hit(experts: int, held: float, k: int) -> float:
    """Chance that a token's k distinct experts (uniform over ``experts``) include one of ``held`` of them."""
    held = min(experts, int(round(held)))
    return 1.0 - math.comb(experts - held, k) / math.comb(experts, k)


def dispatch_time(model: ModelConfig, tokens: float, row_bytes: float, ep: int, stride: int, cluster: ClusterSpec,
                  eff: Efficiency, how: str = "alltoall") -> float:
    """Seconds of one dispatch (or combine: the same volume back) of ``tokens`` tokens of ``row_bytes`` over
    an EP group of ``ep`` ranks ``stride`` apart. "alltoall": each of a token's k copies goes to its
    expert's rank, (ep − 1)/ep of them leave the rank (collectives.all_to_all_time). "dedup" (DeepEP,
    HybridEP): one copy per other rank holding any of its experts inside the node, one per other node
    holding any across the network (forwarded there over NVLink), with uniform routing."""
    if ep <= 1 or tokens <= 0:
        return 0.0
    k, e = model.experts_per_token, model.num_experts
    if how == "alltoall":
        return all_to_all_time(tokens * k * row_bytes, ep, stride, cluster, eff)
    g = members_per_node(cluster, ep, stride)
    intra = tokens * row_bytes * (g - 1) * _hit(e, e / ep, k)
    # the (ep − g) members elsewhere, g to a node: each remote node holds E·g/ep experts
    inter = tokens * row_bytes * (ep - g) / g * _hit(e, e * g / ep, k)
    return exchange_time(intra, inter, ep - 1, cluster, eff)


def moe_layer_time(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, cluster: ClusterSpec,
                   eff: Efficiency, *, precision: str, quant: dict | None = None) -> dict[str, float]:
    """Seconds of one MoE block for one micro-batch on one GPU: "f", "b", "w" (forward, input-gradient,
    weight-gradient GEMMs of router, experts and shared expert), "up" / "down" ((f, b, w) of the
    expert projections, what the SP collectives pair with), "shared_up" / "shared_down" (the shared
    expert's), "a2a_f" / "a2a_b" (all-to-all per
    forward / backward pass) and their "a2a_f_exposed" / "a2a_b_exposed", "etp_f" / "etp_b" (the
    expert-TP all-gathers / reduce-scatters per forward / backward pass, exposed), "rows" (ρ·T·k, the
    rows every TP rank of the busiest EP rank runs).
    ``precision``/``quant``: the linear GEMMs' (FP8; QLoRA's dequantising kernels: linear_time's
    ``weight_bytes`` / ``compute_scale``)."""
    gpu, t, ep = cluster.gpu, cfg.tp, cfg.ep
    quant = quant or {}
    frozen = train.adapters
    h, k, e, f = model.hidden_size, model.experts_per_token, model.num_experts, model.expert_ffn
    tokens = cfg.micro_batch_size * (train.seq_length // cfg.cp)
    rho = busiest_share(model, ep, train.moe_imbalance)
    rows = rho * tokens * k
    local = e / ep
    m = rows / local  # rows per local expert
    gate_up, down_k = (model.mlp_matrices - 1) * f / t, f / t

    def grouped(mm, n, kk):  # forward and input gradient read the (possibly quantised) expert weights
        return gemm_time(mm, n, kk, gpu, eff, precision, batch=local, b_bytes=quant.get("weight_bytes"),
                         compute_scale=quant.get("compute_scale", 1.0))

    up = (grouped(m, gate_up, h), grouped(m, h, gate_up),
          0.0 if frozen else gemm_time(h, gate_up, m, gpu, eff, precision, batch=local))
    dn = (grouped(m, h, down_k), grouped(m, down_k, h),
          0.0 if frozen else gemm_time(down_k, h, m, gpu, eff, precision, batch=local))
    # the router stays in 16 bits under FP8 (a tiny GEMM whose scores pick the experts) and trains under
    # LoRA only if it is a LoRA target (it is not: ModelConfig.lora_params_per_layer)
    router_precision = "bf16" if precision == "fp8" else precision
    # each TP rank routes its own T/tp tokens (tpkernels.models.moe)
    router = linear_time(tokens / t, h, e, gpu, eff, router_precision, weight_grad=not frozen)
    shared_up = shared_down = (0.0, 0.0, 0.0)
    if model.shared_expert_ffn_hidden_size:
        s = model.shared_expert_ffn_hidden_size
        shared_up = linear_time(tokens, h, 2 * s / t, gpu, eff, precision, weight_grad=not frozen, **quant)
        shared_down = linear_time(tokens, s / t, h, gpu, eff, precision, weight_grad=not frozen, **quant)
    shared = tuple(x + y for x, y in zip(shared_up, shared_down))
    f_, b_, w_ = (up[i] + dn[i] + router[i] + shared[i] for i in range(3))
    b_ += up[0]  # grouped_swiglu_mlp keeps only its input: the backward recomputes gate|up first
    # dispatch + combine, each ρ·T·k/tp rows of h values on the busiest rank; EP members are tp apart
    one = dispatch_time(model, rho * tokens / t, h * train.activation_bytes, ep, t, cluster, eff,
                        train.moe_dispatch)
    a2a = 2.0 * one
    chunks = cfg.moe_chunks
    # expert TP: the received rows all-gathered over TP, the results reduce-scattered back (each pass);
    # without SP the combined token blocks are all-gathered too (forward: output; backward: input gradient)
    etp = 2.0 * group_collective_time("all_gather", rows * h * train.activation_bytes, t, 1, cluster, eff)
    if t > 1 and not cfg.sequence_parallel:
        etp += group_collective_time("all_gather", tokens * h * train.activation_bytes, t, 1, cluster, eff)

    def exposed(gemms):
        hidden = a2a - chunked_exposed(a2a, gemms, chunks)
        return a2a - eff.tp_overlap * hidden

    return {"f": f_, "b": b_, "w": w_, "up": up, "down": dn, "shared_up": shared_up, "shared_down": shared_down,
            "a2a_f": a2a, "a2a_b": a2a,
            "a2a_f_exposed": exposed(up[0] + dn[0]), "a2a_b_exposed": exposed(up[0] + up[1] + dn[1] + up[2] + dn[2]),
            "etp_f": etp, "etp_b": etp, "rows": rows}

