"""Memory per GPU for one layout: weights, gradients, optimizer states, activations.

Bytes per trained parameter (mixed precision, Megatron-style): 16-bit weights (2) + fp32 gradients
(4) + fp32 master weights and Adam moments (12) = 18; with ZeRO-1 the 12 are sharded over DP:
6 + 12/DP (over DP × CP with context parallelism: the weights are replicated over CP, so the
trainer shards their states over the DP × CP group, as Megatron's distributed optimizer does). LoRA keeps
the frozen base weights at 2 bytes/param and trains only the adapters. QLoRA stores the decoder
layers' linear weights (q/k/v, o, gate/up, down) quantised: NF4 with double quantisation,
0.5 + 1/64 + 4/(64·256) ≈ 0.5159 bytes/param, or int8, 1 byte/param + an fp32 absmax per output row;
the embedding, the head, norms and biases stay 16-bit.

Activations follow tpkernels.planner.activations. Pipeline stage k holds the activations of the
micro-batches it has run forward but not yet backward: p − k under 1F1B, and
2(p − k − 1) + (v − 1)·p + 1 model chunks under interleaved 1F1B (Megatron's warm-up counts), so
the first stage is the fullest (Korthikanti et al.: l layers' worth, times 1 + (p−1)/(p·v)).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.activations import layer_activations
from tpkernels.description import ModelConfig
from tpkernels.planner.workload import TrainingSetup

GIB = 2**30
# CUDA context, NCCL channels and cuBLAS workspaces: memory torch's allocator never sees.
RUNTIME_RESERVED_BYTES = 2 * GIB
# Fraction of the card kept free for allocator fragmentation and transient buffers.
DEFAULT_MEMORY_MARGIN = 0.10
# NF4 with double quantisation: 4-bit codes + an 8-bit absmax per 64 values + an fp32 scale per 256
# absmax. The same number as tpkernels.quant.nf4_bytes_per_param() (the planner does not import the
# quant layer, tests/test_layering.py; tests/test_planner_qlora.py checks the two agree).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# int8: one byte per weight; the fp32 per-output-row absmax is counted per row (quantised_weight_bytes).
BASE_BYTES_PER_PARAM = {"nf4": NF4_BYTES_PER_PARAM, "int8": 1.0}


def _kv_replication(model: ModelConfig, tp: int) -> float:
    """Extra K/V projection weights over all TP ranks when tp > KV heads (each rank keeps a whole head)."""
    return 2 * model.hidden_size * model.kv_dim * (tp / model.kv_heads - 1) if tp > model.kv_heads else 0.0


def layer_params_per_rank(model: ModelConfig, tp: int) -> float:
    """Parameters of one decoder layer held by one TP rank (norms replicated; K/V replicated when
    tp > KV heads)."""
    norms = 2 * model.norm_params()
    sharded = model.params_per_layer() - norms + _kv_replication(model, tp)
    return sharded / tp + norms


def layer_linear_weights_per_rank(model: ModelConfig, tp: int) -> float:
    """Weights of one decoder layer's TP linears (q/k/v, o, gate/up, down; no biases) on one TP rank:
    what QLoRA quantises."""
    return (model.linear_weights_per_layer() + _kv_replication(model, tp)) / tp


def layer_linear_rows_per_rank(model: ModelConfig, tp: int) -> float:
    """Output rows of one layer's linear weights on one TP rank: column-parallel q/k/v and gate/up
    split theirs, row-parallel o and down keep all h (int8 stores an fp32 absmax per row)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    kv_rows = 2 * model.kv_dim * max(1.0, tp / model.kv_heads)
    return (model.q_dim + kv_rows + f * (model.mlp_matrices - 1)) / tp + 2 * h


def quantised_weight_bytes(model: ModelConfig, cfg: ParallelConfig, quant: str) -> float:
    """Bytes of a pipeline stage's quantised linear weights on one GPU (QLoRA's base)."""
    layers = model.num_layers / cfg.pp
    n = BASE_BYTES_PER_PARAM[quant] * layer_linear_weights_per_rank(model, cfg.tp)
    if quant == "int8":
        n += 4.0 * layer_linear_rows_per_rank(model, cfg.tp)
    return layers * n


def base_weight_bytes(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, stage: int) -> float:
    """Bytes of the stage's (non-adapter) weights on one GPU: 2 per parameter, except QLoRA's
    quantised decoder-layer linears."""
    params = stage_params_per_rank(model, cfg, stage)
    if train.finetune != "qlora":
        return 2.0 * params
    linears = model.num_layers / cfg.pp * layer_linear_weights_per_rank(model, cfg.tp)
    return 2.0 * (params - linears) + quantised_weight_bytes(model, cfg, train.quant)


def stage_params_per_rank(model: ModelConfig, cfg: ParallelConfig, stage: int) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds."""
    vocab = model.padded_vocab(cfg.tp)
    n = model.num_layers / cfg.pp * layer_params_per_rank(model, cfg.tp)
    if stage == 0:
        n += vocab * model.hidden_size / cfg.tp + model.learned_positions * model.hidden_size
    if stage == cfg.pp - 1:
        n += model.norm_params()
        # A tied head is the embedding itself on a one-stage pipeline, a copy on the last stage otherwise.
        if not model.tied_embeddings or cfg.pp > 1:
            n += vocab * model.hidden_size / cfg.tp
    return n


def lora_params_per_rank(model: ModelConfig, cfg: ParallelConfig, rank: int) -> float:
    return model.num_layers / cfg.pp * model.lora_params_per_layer(rank) / cfg.tp


def inflight_layers(model: ModelConfig, cfg: ParallelConfig, stage: int) -> float:
    """Layers' worth of micro-batch activations alive at the peak on ``stage``. GPipe runs every
    forward before any backward, so all m micro-batches are alive; 1F1B and ZB-H1 hold at most
    p − stage (ZB-H1 frees a micro-batch's activations after its W, which it schedules within the
    same window)."""
    p, v, m = cfg.pp, cfg.virtual_stages, cfg.num_microbatches
    if p == 1:
        return float(model.num_layers)  # gradient accumulation frees each micro-batch after its backward
    if cfg.pipeline_schedule == "gpipe":
        return m * model.num_layers / p
    if v == 1:
        return min(m, p - stage) * model.num_layers / p
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks * model.num_layers / (p * v)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the fullest GPU (pipeline stage ``stage``)."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    runtime: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.runtime

    def as_gib(self) -> dict[str, float]:
        d = {k: v / GIB for k, v in asdict(self).items() if k != "stage"}
        d["total"] = self.total / GIB
        return d


def stage_memory(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, stage: int) -> MemoryBreakdown:
    params = stage_params_per_rank(model, cfg, stage)
    opt_bytes = train.optimizer_state_bytes / (cfg.dp * cfg.cp if cfg.zero1 else 1)
    if not train.adapters:
        weights, grads, optim = 2.0 * params, 4.0 * params, opt_bytes * params
    else:
        # QLoRA adds no dequantised copy of a weight: the NF4/int8 GEMMs dequantise tiles in registers
        # (tpkernels/kernels/triton/nf4_linear.py), forward and input gradient alike, and there is no
        # weight gradient, so no transient beyond the runtime reserve.
        adapters = lora_params_per_rank(model, cfg, train.lora_rank)
        weights = base_weight_bytes(model, train, cfg, stage) + 2.0 * adapters
        grads, optim = 4.0 * adapters, opt_bytes * adapters
    if train.online_reference and train.dpo_reference == "model":
        # DPO's frozen reference, a 16-bit copy sharded like the policy; its forward keeps no activations
        # (no gradient): one layer's transient at a time, within the runtime reserve
        weights += 2.0 * params
    act = layer_activations(model, seq=train.seq_length, micro_batch=cfg.micro_batch_size, tp=cfg.tp,
                            sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
                            flash_attention=train.flash_attention or cfg.cp > 1, cp=cfg.cp, cp_algo=cfg.cp_algo)
    activations = inflight_layers(model, cfg, stage) * act.stored + act.recompute_peak
    logits = 0.0
    if stage == cfg.pp - 1:
        # 16-bit logits plus the fp32 copy the vocab-parallel cross-entropy works on, for one micro-batch.
        logits = 6.0 * train.seq_length / cfg.cp * cfg.micro_batch_size * model.padded_vocab(cfg.tp) / cfg.tp
    return MemoryBreakdown(stage, weights, grads, optim, activations, logits, float(RUNTIME_RESERVED_BYTES))


def peak_memory(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig) -> MemoryBreakdown:
    """The fullest stage: the first (most activations in flight) or the last (head and logits)."""
    stages = {0, cfg.pp - 1}
    return max((stage_memory(model, train, cfg, s) for s in stages), key=lambda m: m.total)


def fits(mem: MemoryBreakdown, capacity_gib: float, margin: float = DEFAULT_MEMORY_MARGIN) -> bool:
    return mem.total <= capacity_gib * GIB * (1.0 - margin)
