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

Mixture of experts (``model.num_experts`` > 0) with expert parallelism ``cfg.ep`` (inside DP × CP):
a MoE layer's routed experts are split over the EP group and, like the dense MLP, their FFN columns
over TP: expert parameters / (ep · tp) per GPU. The router (hidden × E) is replicated on every rank
(each TP rank routes the tokens it holds); the shared expert is split over TP like a dense MLP. With
ZeRO-1 the expert optimizer states are sharded over the expert-data-parallel group (the dp · cp / ep
replicas of one expert shard, which reduce its gradients), every other state over dp · cp. LoRA's
expert adapters and QLoRA's quantised expert weights are split like the experts. The MoE layer's
activations and dispatch buffers: tpkernels.planner.activations.moe_block_activations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.activations import layer_activations, moe_peak_imbalance
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


def layer_param_split(model: ModelConfig, tp: int, ep: int = 1, layer: int = 0) -> tuple[float, float]:
    """(other, expert) parameters of decoder layer ``layer`` on one GPU: the routed experts split over
    EP and TP (ep · tp), everything else as a dense layer (norms, the router and the shared expert's
    gate replicated, K/V replicated when tp > KV heads, the rest split over TP)."""
    moe = model.moe_params(layer)
    experts = moe.get("experts", 0)
    # the norms, the router and the shared expert's gate (hidden → 1) are whole on every TP rank
    replicated = 2 * model.norm_params() + moe.get("router", 0) + (model.hidden_size if moe and model.shared_expert_gate
                                                                   else 0)
    sharded = model.layer_params(layer) - experts - replicated + _kv_replication(model, tp)
    return sharded / tp + replicated, experts / (ep * tp)


def layer_params_per_rank(model: ModelConfig, tp: int, ep: int = 1) -> float:
    """Parameters of one decoder layer held by one TP rank (of one EP rank), the mean over the layers."""
    return sum(sum(layer_param_split(model, tp, ep, i)) for i in range(model.num_layers)) / model.num_layers


def stage_layers(model: ModelConfig, cfg: ParallelConfig, stage: int) -> list[int] | None:
    """Ids of the decoder layers pipeline stage ``stage`` holds (its chunk j holds virtual stage
    j · pp + stage, Megatron's interleaving); None when the layers do not split evenly (a layout
    error, reported by layout_errors)."""
    chunks = cfg.pp * cfg.virtual_stages
    if model.num_layers % chunks:
        return None
    per = model.num_layers // chunks
    return [(j * cfg.pp + stage) * per + i for j in range(cfg.virtual_stages) for i in range(per)]


def _stage_sum(model: ModelConfig, cfg: ParallelConfig, stage: int, per_layer) -> tuple[float, ...]:
    """Sum of ``per_layer(layer)`` (a pair) over the stage's layers (their mean × layers / pp if they do not
    split evenly). Layers differ only by having experts or not: one call per kind."""
    ids = stage_layers(model, cfg, stage)
    scale = 1.0
    if ids is None:
        ids, scale = range(model.num_layers), 1.0 / cfg.pp
    kinds: dict[bool, list] = {}
    if model.moe_layers is None:  # every layer alike (dense, or experts on every layer)
        kinds[model.is_moe] = [ids[0], len(ids)]
    else:
        for i in ids:
            kinds.setdefault(model.is_moe_layer(i), [i, 0])[1] += 1
    total = [0.0, 0.0]
    for first, count in kinds.values():
        for j, x in enumerate(per_layer(first)):
            total[j] += scale * count * x
    return tuple(total)


def stage_param_split(model: ModelConfig, cfg: ParallelConfig, stage: int) -> tuple[float, float]:
    """(other, expert) parameters one GPU of pipeline stage ``stage`` holds: the routed experts (what
    EP shards and the expert-data-parallel group reduces) apart from the rest."""
    other, experts = _stage_sum(model, cfg, stage, lambda i: layer_param_split(model, cfg.tp, cfg.ep, i))
    vocab = model.padded_vocab(cfg.tp)
    if stage == 0:
        other += vocab * model.hidden_size / cfg.tp + model.learned_positions * model.hidden_size
    if stage == cfg.pp - 1:
        other += model.norm_params()
        # A tied head is the embedding itself on a one-stage pipeline, a copy on the last stage otherwise.
        if not model.tied_embeddings or cfg.pp > 1:
            other += vocab * model.hidden_size / cfg.tp
    return other, experts


def stage_params_per_rank(model: ModelConfig, cfg: ParallelConfig, stage: int) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds."""
    return sum(stage_param_split(model, cfg, stage))


def _layer_linear_split(model: ModelConfig, tp: int, ep: int, layer: int) -> tuple[float, float]:
    """(other, expert) weights of layer ``layer``'s TP linears on one GPU (q/k/v, o, the dense MLP or
    the shared expert, the routed experts' gate/up/down; no biases, not the router): what QLoRA
    quantises."""
    h = model.hidden_size
    attn = h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h + _kv_replication(model, tp)
    moe = model.moe_params(layer)
    if moe:
        mlp = 3 * h * model.shared_expert_ffn_hidden_size
        return (attn + mlp) / tp, moe["experts"] / (ep * tp)
    return (attn + model.mlp_matrices * h * model.ffn_hidden_size) / tp, 0.0


def layer_linear_weights_per_rank(model: ModelConfig, tp: int, ep: int = 1) -> float:
    """Weights of one decoder layer's TP linears (q/k/v, o, gate/up, down and every expert's; no biases)
    on one TP rank (of one EP rank), the mean over the layers: what QLoRA quantises."""
    return sum(sum(_layer_linear_split(model, tp, ep, i)) for i in range(model.num_layers)) / model.num_layers


def _layer_linear_rows(model: ModelConfig, tp: int, ep: int, layer: int) -> tuple[float, float]:
    """Output rows of layer ``layer``'s linear weights on one GPU: column-parallel q/k/v and gate/up split
    theirs, row-parallel o and down keep all h (int8 stores an fp32 absmax per row); (other, experts)."""
    h = model.hidden_size
    kv_rows = 2 * model.kv_dim * max(1.0, tp / model.kv_heads)
    attn = (model.q_dim + kv_rows) / tp + h
    if model.is_moe_layer(layer):
        shared = (2 * model.shared_expert_ffn_hidden_size / tp + h) if model.shared_expert_ffn_hidden_size else 0.0
        experts = model.num_experts / ep * (2 * model.expert_ffn / tp + h)
        return attn + shared, experts
    return attn + model.ffn_hidden_size * (model.mlp_matrices - 1) / tp + h, 0.0


def layer_linear_rows_per_rank(model: ModelConfig, tp: int, ep: int = 1) -> float:
    """Output rows of one layer's linear weights on one TP rank, the mean over the layers."""
    return sum(sum(_layer_linear_rows(model, tp, ep, i)) for i in range(model.num_layers)) / model.num_layers


def _stage_linear_weights(model: ModelConfig, cfg: ParallelConfig, stage: int) -> float:
    return sum(_stage_sum(model, cfg, stage, lambda i: _layer_linear_split(model, cfg.tp, cfg.ep, i)))


def quantised_weight_bytes(model: ModelConfig, cfg: ParallelConfig, quant: str, stage: int = 0) -> float:
    """Bytes of a pipeline stage's quantised linear weights on one GPU (QLoRA's base)."""
    n = BASE_BYTES_PER_PARAM[quant] * _stage_linear_weights(model, cfg, stage)
    if quant == "int8":
        n += 4.0 * sum(_stage_sum(model, cfg, stage, lambda i: _layer_linear_rows(model, cfg.tp, cfg.ep, i)))
    return n


def base_weight_bytes(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, stage: int) -> float:
    """Bytes of the stage's (non-adapter) weights on one GPU: 2 per parameter, except QLoRA's
    quantised decoder-layer linears."""
    params = stage_params_per_rank(model, cfg, stage)
    if train.finetune != "qlora":
        return 2.0 * params
    linears = _stage_linear_weights(model, cfg, stage)
    return 2.0 * (params - linears) + quantised_weight_bytes(model, cfg, train.quant, stage)


def _expert_lora_params(model: ModelConfig, rank: int, layer: int) -> float:
    """LoRA adapters on layer ``layer``'s routed experts (gate, up: hidden → F; down: F → hidden), all E."""
    if not model.is_moe_layer(layer):
        return 0.0
    return model.num_experts * 3 * rank * (model.hidden_size + model.expert_ffn)


def lora_param_split(model: ModelConfig, cfg: ParallelConfig, rank: int, stage: int = 0) -> tuple[float, float]:
    """(other, expert) LoRA adapter parameters of the stage on one GPU: the experts' adapters split
    like the experts (ep · tp), the others over TP."""
    def per_layer(i):
        experts = _expert_lora_params(model, rank, i)
        return (_layer_lora(model, rank, i) - experts) / cfg.tp, experts / (cfg.ep * cfg.tp)

    return _stage_sum(model, cfg, stage, per_layer)


def _layer_lora(model: ModelConfig, rank: int, layer: int) -> float:
    """LoRA adapters of layer ``layer`` (ModelConfig.lora_params_per_layer's shapes, for one layer)."""
    h = model.hidden_size
    shapes = [(h, model.q_dim), (h, model.kv_dim), (h, model.kv_dim), (model.q_dim, h)]

    def mlp(f):
        return [(h, f)] * (model.mlp_matrices - 1) + [(f, h)]

    if model.is_moe_layer(layer):
        shapes += mlp(model.expert_ffn) * model.num_experts
        if model.shared_expert_ffn_hidden_size:
            shapes += mlp(model.shared_expert_ffn_hidden_size)
    else:
        shapes += mlp(model.ffn_hidden_size)
    return float(sum(rank * (a + b) for a, b in shapes))


def lora_params_per_rank(model: ModelConfig, cfg: ParallelConfig, rank: int, stage: int = 0) -> float:
    return sum(lora_param_split(model, cfg, rank, stage))


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


def optimizer_shards(cfg: ParallelConfig) -> tuple[int, int]:
    """Ranks over which ZeRO-1 shards the optimizer states of (other, expert) parameters: DP × CP, and
    the expert-data-parallel group (DP × CP / EP, the replicas of one expert shard); 1 without ZeRO-1."""
    if not cfg.zero1:
        return 1, 1
    return cfg.dp * cfg.cp, max(1, cfg.dp * cfg.cp // cfg.ep)


def stage_memory(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, stage: int) -> MemoryBreakdown:
    other, experts = stage_param_split(model, cfg, stage)
    params = other + experts
    shard, expert_shard = optimizer_shards(cfg)
    opt = train.optimizer_state_bytes
    if not train.adapters:
        weights, grads = 2.0 * params, 4.0 * params
        optim = opt * (other / shard + experts / expert_shard)
    else:
        # QLoRA adds no dequantised copy of a weight: the NF4/int8 GEMMs dequantise tiles in registers
        # (tpkernels/kernels/triton/nf4_linear.py), forward and input gradient alike, and there is no
        # weight gradient, so no transient beyond the runtime reserve.
        a_other, a_experts = lora_param_split(model, cfg, train.lora_rank, stage)
        adapters = a_other + a_experts
        weights = base_weight_bytes(model, train, cfg, stage) + 2.0 * adapters
        grads, optim = 4.0 * adapters, opt * (a_other / shard + a_experts / expert_shard)
    if train.online_reference and train.dpo_reference == "model":
        # DPO's frozen reference, a 16-bit copy sharded like the policy; its forward keeps no activations
        # (no gradient): one layer's transient at a time, within the runtime reserve
        weights += 2.0 * params
    activations = stage_activation_bytes(model, train, cfg, stage)
    logits = 0.0
    if stage == cfg.pp - 1:
        # 16-bit logits plus the fp32 copy the vocab-parallel cross-entropy works on, for one micro-batch.
        logits = 6.0 * train.seq_length / cfg.cp * cfg.micro_batch_size * model.padded_vocab(cfg.tp) / cfg.tp
    return MemoryBreakdown(stage, weights, grads, optim, activations, logits, float(RUNTIME_RESERVED_BYTES))


def stage_activation_bytes(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig, stage: int) -> float:
    """Activation bytes alive at the stage's peak: the in-flight micro-batches' stored activations of
    its layers (a MoE layer's block in place of the dense MLP's) and the largest transient of one
    layer (recompute, CP buffers, the MoE dispatch buffers at the worst-case imbalance)."""
    kw = dict(seq=train.seq_length, micro_batch=cfg.micro_batch_size, tp=cfg.tp,
              sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
              flash_attention=train.flash_attention or cfg.cp > 1, cp=cfg.cp, cp_algo=cfg.cp_algo)
    act = layer_activations(model, **kw)
    stored, peak = act.stored, act.recompute_peak
    ids = stage_layers(model, cfg, stage) or range(model.num_layers)
    share = float(model.is_moe) if model.moe_layers is None else sum(map(model.is_moe_layer, ids)) / len(ids)
    if share:
        moe = layer_activations(model, moe=True, ep=cfg.ep,
                                imbalance=moe_peak_imbalance(model, cfg.ep, train.moe_peak_imbalance), **kw)
        stored = share * moe.stored + (1 - share) * stored
        peak = moe.recompute_peak if share == 1 else max(peak, moe.recompute_peak)
    return inflight_layers(model, cfg, stage) * stored + peak


def peak_memory(model: ModelConfig, train: TrainingSetup, cfg: ParallelConfig) -> MemoryBreakdown:
    """The fullest stage: the first (most activations in flight) or the last (head and logits)."""
    stages = {0, cfg.pp - 1}
    return max((stage_memory(model, train, cfg, s) for s in stages), key=lambda m: m.total)


def fits(mem: MemoryBreakdown, capacity_gib: float, margin: float = DEFAULT_MEMORY_MARGIN) -> bool:
    return mem.total <= capacity_gib * GIB * (1.0 - margin)
