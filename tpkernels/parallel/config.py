"""ParallelConfig: how one training job is laid out over GPUs, and the rules a layout must obey.

The planner searches over these; the model-building and pipeline code reuse the same object and
the same checks, so a layout that the planner recommends is one the runtime accepts.

Rank order (Megatron's default): tensor-parallel ranks vary fastest, then data-parallel, then
pipeline stages, so a TP group is ``tp`` consecutive ranks (inside one node) and a DP group
strides by ``tp``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

RECOMPUTE_CHOICES = ("none", "selective", "full")


# ---- the rules, one message each; ParallelConfig and the pipeline schedules both use these ----

def positive_int_errors(**values) -> list[str]:
    """``name (value) must be a positive integer`` for each value that is not one."""
    return [f"{name} ({value!r}) must be a positive integer" for name, value in values.items()
            if not isinstance(value, int) or isinstance(value, bool) or value < 1]


def pipeline_errors(pp: int, virtual_stages: int, num_microbatches: int) -> list[str]:
    """Rules of the pipeline schedules (sizes already positive integers)."""
    errs = []
    if virtual_stages > 1 and pp == 1:
        errs.append(
            f"virtual_stages ({virtual_stages}) > 1 requires pipeline_parallel_size > 1 "
            "(interleaving splits each pipeline rank's layers into chunks)"
        )
    elif virtual_stages > 1 and num_microbatches % pp != 0:
        errs.append(
            f"num_microbatches ({num_microbatches}) must be a multiple of pipeline_parallel_size ({pp}) "
            f"with the interleaved schedule (virtual_stages={virtual_stages}), as in Megatron-LM"
        )
    return errs


def fill_warning(pp: int, num_microbatches: int) -> str | None:
    """The warning for a pipeline that cannot fill (legal, but mostly bubble)."""
    if pp > 1 and num_microbatches < pp:
        bubble = (pp - 1) / (num_microbatches + pp - 1)
        return (f"pipeline cannot fill: num_microbatches ({num_microbatches}) < pipeline_parallel_size ({pp}); "
                f"bubble is {100 * bubble:.0f}% of the step")
    return None


class ParallelConfigError(ValueError):
    """A layout breaks a rule. ``errors`` lists every broken rule, one message each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid parallel layout:\n  - " + "\n  - ".join(self.errors))


@dataclass(frozen=True)
class ParallelConfig:
    """One training layout.

    tp: tensor-parallel size (heads and FFN columns split over ``tp`` GPUs of one node).
    pp: pipeline stages.  dp: data-parallel replicas.  world size = tp * pp * dp.
    virtual_stages: model chunks per pipeline rank (> 1 = interleaved 1F1B, Megatron's
        virtual pipeline).
    micro_batch_size: sequences per micro-batch.  num_microbatches: micro-batches per step per
        DP replica, so global batch = micro_batch_size * num_microbatches * dp.
    sequence_parallel: shard the norm/dropout activations along the sequence over the TP group
        (all-gather/reduce-scatter instead of all-reduce).
    recompute: "none", "selective" (attention core recomputed, Korthikanti et al. 2022) or
        "full" (only each layer's input is kept; the layer is recomputed in backward).
    zero1: shard optimizer states over DP (Megatron's distributed optimizer / ZeRO stage 1).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    zero1: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        """Compact label, e.g. ``TP4 PP2 DP8 v2 mbs1 SP rc=selective ZeRO1``."""
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        parts.append(f"mbs{self.micro_batch_size}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.zero1:
            parts.append("ZeRO1")
        return " ".join(parts)

    # ------------------------------------------------------------------ validation
    def layout_errors(self) -> list[str]:
        """Rules that involve only the layout itself."""
        errs = positive_int_errors(tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp,
                                   data_parallel_size=self.dp, virtual_stages=self.virtual_stages,
                                   micro_batch_size=self.micro_batch_size, num_microbatches=self.num_microbatches)
        if errs:
            return errs
        if self.recompute not in RECOMPUTE_CHOICES:
            errs.append(f"recompute ({self.recompute!r}) must be one of {', '.join(RECOMPUTE_CHOICES)}")
        if self.sequence_parallel and self.tp == 1:
            errs.append(
                "sequence_parallel=True requires tensor_parallel_size > 1 "
                "(sequence parallelism shards activations over the TP group; with tensor_parallel_size (1) there is none)"
            )
        errs += pipeline_errors(self.pp, self.virtual_stages, self.num_microbatches)
        return errs

    def model_errors(self, *, num_layers: int, num_attention_heads: int, num_kv_heads: int | None = None,
                     ffn_hidden_size: int | None = None, seq_length: int | None = None,
                     layer_counts=None) -> list[str]:
        """Rules that tie the layout to a model's shape. ``layer_counts`` (layers per virtual stage, in
        pipeline order) replaces the even-split rule for uneven pipelines."""
        errs = []
        tp, pp, v = self.tp, self.pp, self.virtual_stages
        if num_attention_heads % tp:
            errs.append(f"num_attention_heads ({num_attention_heads}) must be divisible by tensor_parallel_size ({tp})")
        kv = num_kv_heads or num_attention_heads
        if kv % tp and tp % kv:
            errs.append(
                f"num_kv_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another "
                "(KV heads are split over TP ranks, or replicated when tensor_parallel_size > num_kv_heads)"
            )
        if ffn_hidden_size is not None and ffn_hidden_size % tp:
            errs.append(f"ffn_hidden_size ({ffn_hidden_size}) must be divisible by tensor_parallel_size ({tp})")
        if layer_counts is not None:
            counts = list(layer_counts)
            if len(counts) != pp * v or sum(counts) != num_layers or min(counts, default=0) < 1:
                errs.append(f"layer_counts ({counts}) must be pipeline_parallel_size × virtual_stages ({pp} × {v} = "
                            f"{pp * v}) positive numbers summing to num_layers ({num_layers})")
        elif num_layers % (pp * v):
            what = f"pipeline_parallel_size ({pp})" if v == 1 else \
                f"pipeline_parallel_size ({pp}) × virtual_stages ({v}) = {pp * v}"
            errs.append(f"num_layers ({num_layers}) must be divisible by {what}")
        if seq_length is not None and self.sequence_parallel and seq_length % tp:
            errs.append(
                f"sequence length ({seq_length}) must be divisible by tensor_parallel_size ({tp}) "
                "when sequence_parallel=True"
            )
        return errs

    def job_errors(self, *, world_size: int | None = None, global_batch_size: int | None = None) -> list[str]:
        errs = []
        if world_size is not None and world_size != self.world_size:
            errs.append(
                f"world_size ({world_size}) must equal tensor_parallel_size ({self.tp}) × "
                f"pipeline_parallel_size ({self.pp}) × data_parallel_size ({self.dp}) = {self.world_size}"
            )
        if global_batch_size is not None and global_batch_size != self.global_batch_size:
            errs.append(
                f"global_batch_size ({global_batch_size}) must equal micro_batch_size ({self.micro_batch_size}) × "
                f"num_microbatches ({self.num_microbatches}) × data_parallel_size ({self.dp}) = {self.global_batch_size}"
            )
        return errs

    def warnings(self) -> list[str]:
        """Legal but costly choices."""
        msg = fill_warning(self.pp, self.num_microbatches)
        return [msg] if msg else []

    def validate(self, *, world_size: int | None = None, global_batch_size: int | None = None,
                 num_layers: int | None = None, num_attention_heads: int | None = None,
                 num_kv_heads: int | None = None, ffn_hidden_size: int | None = None,
                 seq_length: int | None = None, layer_counts=None) -> "ParallelConfig":
        """Raise ParallelConfigError listing every broken rule; return self when all hold."""
        errs = self.layout_errors()
        if not errs:
            errs += self.job_errors(world_size=world_size, global_batch_size=global_batch_size)
            if num_layers is not None and num_attention_heads is not None:
                errs += self.model_errors(num_layers=num_layers, num_attention_heads=num_attention_heads,
                                          num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size,
                                          seq_length=seq_length, layer_counts=layer_counts)
        if errs:
            raise ParallelConfigError(errs)
        return self
