"""What is being trained: batch, sequence length, precision, optimizer, full fine-tune, LoRA or QLoRA."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tpkernels.description.source import FINETUNE_CHOICES, QUANT_CHOICES

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
OPTIMIZERS = ("adam", "sgd")
FINETUNE = FINETUNE_CHOICES  # the model section's (tpkernels.description.source)
QUANTS = tuple(q for q in QUANT_CHOICES if q != "none")  # formats of a QLoRA base ("none" is nf4 there)
TASKS = ("pretrain", "sft", "dpo")
DPO_REFERENCES = ("cached", "adapters", "model")
MOE_DISPATCH = ("alltoall", "dedup")
SELECTIVE_POLICIES = ("attention", "every_other_matmul")
TP_OVERLAP_STYLES = ("userbuffers", "async_tp")
KERNELS = ("fused", "eager")


@dataclass(frozen=True)
class TrainingSetup:
    """global_batch: sequences per optimizer step; seq_length: tokens per sequence.

    precision: GEMM precision ("fp8" = FP8 GEMMs with bf16 weights, as TransformerEngine does;
        "fp32" = everything in fp32, what ``tpkernels train`` runs on CPUs: activations and
        messages take 4 bytes, and the device needs a ``peak_tflops_fp32``).
    optimizer: "adam" (fp32 master weights + two moments: 12 bytes/param) or "sgd" (fp32 master +
        momentum: 8 bytes/param). Both keep 16-bit weights and fp32 gradients.
    finetune: "full" trains every weight; "lora" freezes them and trains rank-``lora_rank``
        adapters on every linear layer of every decoder layer; "qlora" is "lora" on a base whose
        decoder-layer linear weights are stored in ``quant``.
    quant: the format of a QLoRA base: "nf4" (4-bit NormalFloat, double quantisation, ≈ 0.516
        bytes/param) or "int8" (1 byte/param + an fp32 scale per output row); None for full and
        lora ("none" reads as None; with qlora None means "nf4"). Embeddings, head and norms stay 16-bit.
    flash_attention: the attention core never stores the (s × s) scores (FlashAttention / our
        tpkernels.flash_attn_func); False models the 2021 Megatron kernels that did.
    overlap_grad_reduce: the data-parallel gradient reduction runs in buckets during the last
        micro-batch's backward (our trainer's dp_overlap, Megatron's --overlap-grad-reduce);
        False reduces after the backward (Megatron-LM in 2021).
    overlap_param_gather: with ZeRO-1, the updated weights are all-gathered in buckets during the
        next step's first forward (Megatron's --overlap-param-gather); False gathers them right
        after the optimizer step (torch's ZeroRedundancyOptimizer, which our trainer uses).
    overlap_p2p: pipeline sends and receives run asynchronously beside the compute (Megatron's
        --overlap-p2p-communication): a transfer only delays the action that consumes it. False:
        each send/recv blocks its stage (our runtime, and Megatron in 2021).
    grad_reduce_fp32: bf16 runs reduce the fp32 gradients across data parallelism (our trainer,
        torchtitan's FSDP2 default); False reduces them in 16 bits (Megatron-Core's default,
        ``grad_reduce_in_fp32=False``, which the NeMo / Megatron-Bridge recipes keep). fp16 runs
        reduce in fp16 either way (Megatron-LM 2021).
    moe_imbalance: mixture of experts: rows the busiest expert-parallel rank processes over its
        balanced share, in the step time (the slowest EP rank sets the pace of the all-to-all and of
        the step). 1: balanced routing, what the published benchmarks force (Megatron-Bridge's MoE
        rows "force-balance the token distribution among experts").
    moe_peak_imbalance: the same ratio at its worst, for the dispatch buffers' memory when the model
        is dropless (a capacity factor bounds it instead: tpkernels.planner.activations
        .moe_peak_imbalance). 2: the busiest EP rank receives twice its share; raise it for a run
        whose routing is not balanced by an auxiliary loss.
    moe_dispatch: how tokens reach their experts' EP ranks: "alltoall" sends each of a token's k copies
        to its expert's rank (tpkernels.functional.moe_dispatch, Megatron-Core's alltoall dispatcher);
        "dedup" sends a token once to each rank and once across the network to each node that holds
        any of its experts, forwarding it inside the node over NVLink (DeepEP, HybridEP).
    selective_policy: what ``ParallelConfig.recompute = "selective"`` recomputes before each layer's
        backward. "attention": the attention core (Korthikanti et al. 2022: Megatron-Core,
        TransformerEngine, our trainer; nothing more with FlashAttention, which recomputes its scores in
        its own backward). "every_other_matmul": torchtitan's per-op selective checkpointing
        (``selective_ac_option = "op"``): every op's output is recomputed except the attention
        kernel's and the odd-numbered matmuls' of a layer (torchtitan's order: q, k, v, o, gate, up,
        down), so the k, output and up projections' forward GEMMs (a two-matrix MLP: its second) and
        every memory-bound op run twice. Only the time model reads it; the activation memory is
        "attention"'s, an upper bound of what torchtitan's policy keeps.
    tp_overlap_style: how the software overlaps the SP collectives with the GEMMs when the layout's
        ``overlap_comm`` is on (tp_overlap.py). "userbuffers": every all-gather / reduce-scatter that
        feeds or leaves a GEMM is pipelined with it in a ring, and the column-parallel linears' backward
        re-gather and reduce-scatter run beside the dgrad / wgrad GEMMs (TransformerEngine in Megatron-Core
        and NeMo, our ring ops). "async_tp": PyTorch's micro-pipelined async TP (torchtitan), which
        fuses a collective only with the single matmul that consumes or produces it: the
        column-parallel input gradient's reduce-scatter (a sum over the separate q/k/v and gate/up
        linears) stays exposed.
    kernels: how the memory-bound ops run: "fused" (TransformerEngine, torch.compile, our kernels) or
        "eager" (one PyTorch op per kernel, as torchtitan without torch.compile): their HBM traffic
        grows by the ratio tpkernels.planner.kernel_fusion counts for the model (3.2 for Llama-3-8B).
    task: "pretrain", "sft" or "dpo". SFT costs what pre-training does on the same tokens (the
        prompt's masked tokens still run forward and backward); DPO's rows hold both sequences of
        each pair (global_batch counts rows of seq_length tokens, as for the others).
    dpo_reference: where DPO's reference log-probs come from: "cached" (one forward-only pass over
        the data before training, read back each step: nothing per step), "adapters" (LoRA: the
        same weights with the adapters off, a forward-only pass per step) or "model" (a frozen
        16-bit copy of the weights beside the policy, a forward-only pass per step).
    """

    global_batch: int
    seq_length: int
    precision: str = "bf16"
    optimizer: str = "adam"
    finetune: str = "full"
    lora_rank: int = 16
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    overlap_p2p: bool = False
    task: str = "pretrain"
    dpo_reference: str = "cached"
    quant: str | None = None  # the positional order of the fields above is kept
    grad_reduce_fp32: bool = True
    moe_imbalance: float = 1.0
    moe_peak_imbalance: float = 2.0
    moe_dispatch: str = "alltoall"
    selective_policy: str = "attention"
    tp_overlap_style: str = "userbuffers"
    kernels: str = "fused"

    def __post_init__(self):
        for f in ("moe_imbalance", "moe_peak_imbalance"):
            value = getattr(self, f)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value >= 1):
                raise ValueError(f"{f} ({value!r}) must be a finite number >= 1 (the busiest expert-parallel rank's "
                                 "rows over its balanced share)")
        for f in ("global_batch", "seq_length", "lora_rank"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f} ({value!r}) must be a positive integer")
        for f, choices in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("finetune", FINETUNE),
                           ("task", TASKS), ("dpo_reference", DPO_REFERENCES), ("moe_dispatch", MOE_DISPATCH),
                           ("selective_policy", SELECTIVE_POLICIES), ("tp_overlap_style", TP_OVERLAP_STYLES),
                           ("kernels", KERNELS)):
            if getattr(self, f) not in choices:
                raise ValueError(f"{f} ({getattr(self, f)!r}) must be one of {', '.join(choices)}")
        if self.quant == "none":  # the model section's word for "no quantised base"
            object.__setattr__(self, "quant", None)
        if self.quant is not None and self.finetune != "qlora":
            raise ValueError(f"quant ({self.quant!r}) needs finetune 'qlora' (finetune is {self.finetune!r}): only a "
                             "frozen base is stored quantised")
        if self.finetune == "qlora" and self.quant is None:
            object.__setattr__(self, "quant", "nf4")  # QLoRA's format unless told otherwise
        if self.quant is not None and self.quant not in QUANTS:
            raise ValueError(f"quant ({self.quant!r}) must be one of {', '.join(QUANTS)} or None")
        if self.online_reference and self.dpo_reference == "adapters" and not self.adapters:
            raise ValueError("dpo_reference ('adapters') needs a LoRA fine-tune, lora or qlora (finetune is 'full': "
                             "there are no adapters to turn off); use 'cached' or 'model'")

    def replace(self, **changes) -> "TrainingSetup":
        return dataclasses.replace(self, **changes)

    @property
    def adapters(self) -> bool:
        """Only LoRA adapters train (lora and qlora): the base weights are frozen."""
        return self.finetune in ("lora", "qlora")

    @property
    def optimizer_state_bytes(self) -> int:
        """fp32 master weights + optimizer moments, per trained parameter."""
        return 12 if self.optimizer == "adam" else 8

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation value (16-bit training keeps activations in bf16/fp16)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def online_reference(self) -> bool:
        """DPO with a reference forward pass in every step (not read from the cache)."""
        return self.task == "dpo" and self.dpo_reference != "cached"

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_length
