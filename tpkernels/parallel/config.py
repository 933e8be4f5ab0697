"""ParallelConfig: how one training job is laid out over GPUs, and the rules a layout must obey.

The planner searches over these; the model-building, pipeline and training code reuse the same
object and the same checks, so a layout that the planner recommends is one the runtime accepts.
It is also the ``parallel`` section of the training config, as is: the keys of a config file, the
``--parallel.<key>`` flags and the names in these messages are its field names (the trainer adds
the ``parallel.`` prefix through ``key_prefix``).

Rank order (Megatron-Core's tp-cp-dp-pp): tensor-parallel ranks vary fastest, then context-parallel,
then data-parallel, then pipeline stages, so a TP group is ``tp`` consecutive ranks (inside one
node), a CP group strides by ``tp`` and a DP group by ``tp · cp``.

Expert parallelism (``ep``, mixture-of-experts models) folds into data × context parallelism, as
Megatron-Core does: ``ep`` divides ``dp · cp`` and the world size stays tp · cp · pp · dp. An EP group
is ``ep`` consecutive ranks of one (tp rank, pipeline stage)'s DP × CP ranks (so on one node first);
each holds E / ep of every MoE layer's experts, TP-split like the dense MLP. The ``dp · cp / ep``
ranks that hold the same experts form the expert-data-parallel group, over which the experts'
gradients are reduced (the other weights over DP × CP as without EP).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

RECOMPUTE_CHOICES = ("none", "selective", "full")
MOE_CHUNKS_DEFAULT = 2
CP_ALGOS = ("ring", "allgather", "a2a")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# The short spellings of ParallelConfig's fields in a layout string (``TP=4,SP=on,mbs=2``: ``tpkernels plan
# --fix / --explain``), beside each field's own name, in any case. The one table of them.
SHORT_NAMES = {"v": "virtual_stages", "vpp": "virtual_stages", "mbs": "micro_batch_size", "sp": "sequence_parallel",
               "rc": "recompute", "zero": "zero1"}


# ---- the rules, one message each; ParallelConfig and the pipeline schedules both use these ----

def positive_int_errors(**values) -> list[str]:
    """``name (value) must be a positive integer`` for each value that is not one."""
    return [f"{name} ({value!r}) must be a positive integer" for name, value in values.items()
            if not isinstance(value, int) or isinstance(value, bool) or value < 1]


def pipeline_errors(pp: int, virtual_stages: int, num_microbatches: int, key_prefix: str = "") -> list[str]:
    """Rules of the pipeline schedules (sizes already positive integers)."""
    k = key_prefix
    errs = []
    if virtual_stages > 1 and pp == 1:
        errs.append(
            f"{k}virtual_stages ({virtual_stages}) > 1 requires {k}pp > 1 "
            "(interleaving splits each pipeline rank's layers into chunks)"
        )
    elif virtual_stages > 1 and num_microbatches % pp != 0:
        errs.append(
            f"{k}num_microbatches ({num_microbatches}) must be a multiple of {k}pp ({pp}) "
            f"with the interleaved schedule ({k}virtual_stages={virtual_stages}), as in Megatron-LM"
        )
    return errs


def fill_warning(pp: int, num_microbatches: int) -> str | None:
    """The warning for a pipeline that cannot fill (legal, but mostly bubble)."""
    if pp > 1 and num_microbatches < pp:
        bubble = (pp - 1) / (num_microbatches + pp - 1)
        return (f"pipeline cannot fill: num_microbatches ({num_microbatches}) < pp ({pp}); "
                f"bubble is {100 * bubble:.0f}% of the step")
    return None


class ParallelConfigError(ValueError):
    """A layout breaks a rule. ``errors`` lists every broken rule, one message each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid parallel layout:\n  - " + "\n  - ".join(self.errors))


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One training layout (world size = tp · cp · pp · dp). Each field's ``help`` says what it is.
    Built by keyword: fifteen fields in a row are easy to misplace."""

    tp: int = field(default=1, metadata={"help": "tensor-parallel size: heads and FFN columns split over tp GPUs "
                                                 "of one node"})
    pp: int = field(default=1, metadata={"help": "pipeline stages"})
    dp: int | None = field(default=1, metadata={"help": "data-parallel replicas; none: world size / (tp · cp · pp)"})
    virtual_stages: int = field(default=1, metadata={"help": "model chunks per pipeline rank (> 1: the interleaved "
                                                             "schedule, Megatron's virtual pipeline)"})
    micro_batch_size: int = field(default=1, metadata={"help": "sequences per micro-batch"})
    num_microbatches: int = field(default=1, metadata={"help": "micro-batches per step per DP replica (global "
                                                               "batch = micro_batch_size · num_microbatches · dp)"})
    sequence_parallel: bool = field(default=False, metadata={"help": "shard the norm activations along the "
                                                                     "sequence over the TP group"})
    recompute: str = field(default="none", metadata={"help": "activation recompute: none, selective (attention "
                                                             "core) or full (whole layer)", "choices": RECOMPUTE_CHOICES})
    zero1: bool = field(default=False, metadata={"help": "shard the optimizer states over DP × CP (ZeRO stage 1)"})
    schedule: str | None = field(default=None, metadata={
        "help": "pipeline schedule: gpipe, 1f1b, interleaved, zb-h1; none: interleaved with virtual stages, "
                "else 1f1b", "choices": SCHEDULES})
    overlap_comm: bool = field(default=True, metadata={"help": "overlap the TP communication with the GEMMs"})
    overlap_dp: bool = field(default=True, metadata={"help": "DP gradient all-reduce in buckets during the "
                                                             "backward"})
    bucket_mb: float = field(default=25.0, metadata={"help": "DP gradient bucket size, MiB"})
    # last, so that positional construction of the older fields keeps working
    cp: int = field(default=1, metadata={"help": "context-parallel size: the sequence split over cp ranks "
                                                 "(zigzag chunks), attention across them"})
    cp_algo: str = field(default="ring", metadata={"help": "context-parallel attention: ring, allgather or a2a",
                                                   "choices": CP_ALGOS})
    ep: int = field(default=1, metadata={"help": "expert-parallel size (mixture-of-experts models): each MoE layer's "
                                                 "experts split over ep ranks of the dp · cp ranks (ep divides "
                                                 "dp · cp; the world size stays tp · cp · pp · dp)"})
    moe_chunks: int = field(default=MOE_CHUNKS_DEFAULT, metadata={"help": "pieces each MoE layer's expert-parallel token exchange is "
                                                         "cut into, the expert GEMMs of one overlapping the transfer "
                                                         "of the next, forward and backward (1: no overlap)"})

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self._dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self._dp

    @property
    def _dp(self) -> int:
        if self.dp is None:
            raise ValueError("dp is not set: ParallelConfig.for_world(world_size) derives it from the world size")
        return self.dp

    @property
    def pipeline_schedule(self) -> str:
        """The schedule that runs: ``schedule``, or by default interleaved with virtual stages, else 1F1B."""
        if self.schedule is not None:
            return self.schedule
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def for_world(self, world_size: int) -> "ParallelConfig":
        """This layout with ``dp`` derived from the world size when it is None (world / (tp · pp))."""
        if self.dp is not None:
            return self
        return self.replace(dp=max(1, world_size // (self.tp * self.cp * self.pp)) if not self.layout_errors() else 1)

    def short(self) -> str:
        """Compact label, e.g. ``TP4 PP2 DP8 v2 mbs1 SP rc=selective ZeRO1`` (``EP4`` after DP with experts split,
        then ``chunks4`` when its dispatch is cut into other than the default 2 pieces)."""
        parts = [f"TP{self.tp}"] + ([f"CP{self.cp}" + ("" if self.cp_algo == "ring" else f"-{self.cp_algo}")]
                                     if self.cp > 1 else []) + \
            [f"PP{self.pp}", f"DP{self.dp if self.dp is not None else 'auto'}"] + \
            ([f"EP{self.ep}"] if self.ep != 1 else []) + \
            ([f"chunks{self.moe_chunks}"] if self.ep > 1 and self.moe_chunks != MOE_CHUNKS_DEFAULT else [])
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
    def layout_errors(self, key_prefix: str = "") -> list[str]:
        """Rules that involve only the layout itself. Messages name the keys with ``key_prefix``
        (e.g. "parallel.")."""
        k = key_prefix
        sizes = dict(tp=self.tp, cp=self.cp, pp=self.pp, virtual_stages=self.virtual_stages,
                     micro_batch_size=self.micro_batch_size, num_microbatches=self.num_microbatches, ep=self.ep,
                     moe_chunks=self.moe_chunks)
        if self.dp is not None:
            sizes["dp"] = self.dp
        errs = positive_int_errors(**{k + name: v for name, v in sizes.items()})
        if not (isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
                and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            errs.append(f"{k}bucket_mb ({self.bucket_mb!r}) must be a finite number > 0")
        if errs:
            return errs
        if self.cp_algo not in CP_ALGOS:
            errs.append(f"{k}cp_algo ({self.cp_algo!r}) must be one of {', '.join(CP_ALGOS)}")
        if self.recompute not in RECOMPUTE_CHOICES:
            errs.append(f"{k}recompute ({self.recompute!r}) must be one of {', '.join(RECOMPUTE_CHOICES)}")
        if self.sequence_parallel and self.tp == 1:
            errs.append(
                f"{k}sequence_parallel=True requires {k}tp > 1 "
                f"(sequence parallelism shards activations over the TP group; with {k}tp (1) there is none)"
            )
        errs += pipeline_errors(self.pp, self.virtual_stages, self.num_microbatches, k)
        errs += self.schedule_errors(k)
        if self.dp is not None:
            errs += self.expert_layout_errors(self.dp, k)
        return errs

    def expert_layout_errors(self, dp: int, key_prefix: str = "") -> list[str]:
        """EP folds into DP × CP: ``ep`` must divide ``dp · cp``."""
        k = key_prefix
        if (dp * self.cp) % self.ep:
            cp = f" × {k}cp ({self.cp}) = {dp * self.cp}" if self.cp > 1 else ""
            return [f"{k}ep ({self.ep}) must divide {k}dp ({dp}){cp}: expert parallelism splits the experts over "
                    f"the data-parallel{' and context-parallel' if self.cp > 1 else ''} ranks"]
        return []

    def schedule_errors(self, key_prefix: str = "") -> list[str]:
        k = key_prefix
        s = self.schedule
        if s is None:
            return []
        if s not in SCHEDULES:
            return [f"{k}schedule ({s!r}) must be one of {', '.join(SCHEDULES)}"]
        if self.virtual_stages > 1 and s != "interleaved":
            return [f"{k}schedule ({s!r}) cannot run {k}virtual_stages ({self.virtual_stages}) > 1; only "
                    "'interleaved' does"]
        if self.virtual_stages == 1 and s == "interleaved" and self.pp > 1:
            return [f"{k}schedule ('interleaved') needs {k}virtual_stages > 1"]
        return []

    def model_errors(self, *, num_layers: int, num_attention_heads: int, num_kv_heads: int | None = None,
                     ffn_hidden_size: int | None = None, seq_length: int | None = None,
                     layer_counts=None, num_experts: int | None = None, experts_per_token: int | None = None,
                     moe_ffn_hidden_size: int | None = None, shared_expert_ffn_hidden_size: int | None = None,
                     key_prefix: str = "") -> list[str]:
        """Rules that tie the layout to a model's shape. ``layer_counts`` (layers per virtual stage, in
        pipeline order) replaces the even-split rule for uneven pipelines. The expert fields
        (``ModelConfig.layout_rules`` passes them for a MoE model) tie ``ep`` and ``tp`` to the experts."""
        k = key_prefix
        errs = self._expert_model_errors(num_experts, experts_per_token, moe_ffn_hidden_size,
                                         shared_expert_ffn_hidden_size, k)
        tp, pp, v = self.tp, self.pp, self.virtual_stages
        if num_attention_heads % tp:
            errs.append(f"num_attention_heads ({num_attention_heads}) must be divisible by {k}tp ({tp})")
        kv = num_kv_heads or num_attention_heads
        if kv % tp and tp % kv:
            errs.append(
                f"num_kv_heads ({kv}) and {k}tp ({tp}) must divide one another "
                f"(KV heads are split over TP ranks, or replicated when {k}tp > num_kv_heads)"
            )
        if ffn_hidden_size is not None and ffn_hidden_size % tp:
            errs.append(f"ffn_hidden_size ({ffn_hidden_size}) must be divisible by {k}tp ({tp})")
        if layer_counts is not None:
            counts = list(layer_counts)
            if len(counts) != pp * v or sum(counts) != num_layers or min(counts, default=0) < 1:
                errs.append(f"layer_counts ({counts}) must be {k}pp × {k}virtual_stages ({pp} × {v} = "
                            f"{pp * v}) positive numbers summing to num_layers ({num_layers})")
        elif num_layers % (pp * v):
            what = f"{k}pp ({pp})" if v == 1 else f"{k}pp ({pp}) × {k}virtual_stages ({v}) = {pp * v}"
            errs.append(f"num_layers ({num_layers}) must be divisible by {what}")
        cp = self.cp
        if seq_length is not None and cp > 1 and seq_length % (2 * cp):
            errs.append(f"sequence length ({seq_length}) must be divisible by 2 × {k}cp ({2 * cp}): context "
                        "parallelism splits it into 2·cp equal chunks (two per rank, for load balance)")
        elif seq_length is not None and self.sequence_parallel and (seq_length // cp) % tp:
            per = f"its share on each CP rank ({seq_length // cp})" if cp > 1 else f"sequence length ({seq_length})"
            errs.append(f"{per} must be divisible by {k}tp ({tp}) when {k}sequence_parallel=True")
        if cp > 1 and self.cp_algo == "a2a":
            kv_local = max(1, kv // tp)
            if (num_attention_heads // tp) % cp or kv_local % cp:
                errs.append(f"{k}cp_algo 'a2a' needs the heads per TP rank ({num_attention_heads // tp}) and KV heads "
                            f"per TP rank ({kv_local}) divisible by {k}cp ({cp}); use 'ring' or 'allgather'")
        return errs

    def _expert_model_errors(self, num_experts, experts_per_token, moe_ffn, shared_ffn, k: str) -> list[str]:
        ep, tp = self.ep, self.tp
        if not num_experts:
            if ep > 1:
                return [f"{k}ep ({ep}) > 1 needs a mixture-of-experts model (num_experts > 0); this model is dense"]
            return []
        errs = []
        if num_experts % ep:
            errs.append(f"num_experts ({num_experts}) must be divisible by {k}ep ({ep}): each EP rank holds "
                        "num_experts / ep whole experts")
        if experts_per_token is not None and not 1 <= experts_per_token <= num_experts:
            errs.append(f"experts_per_token ({experts_per_token}) must be between 1 and num_experts ({num_experts})")
        if moe_ffn is not None and moe_ffn % tp:
            errs.append(f"moe_ffn_hidden_size ({moe_ffn}) must be divisible by {k}tp ({tp}): each expert's FFN "
                        "columns are split over the TP ranks")
        if shared_ffn and shared_ffn % tp:
            errs.append(f"shared_expert_ffn_hidden_size ({shared_ffn}) must be divisible by {k}tp ({tp})")
        return errs

    def job_errors(self, *, world_size: int | None = None, global_batch_size: int | None = None,
                   key_prefix: str = "") -> list[str]:
        k = key_prefix
        errs = []
        if self.dp is None:
            model = self.tp * self.cp * self.pp
            if world_size is not None and world_size % model:
                cp = f"{k}cp ({self.cp}) × " if self.cp > 1 else ""
                errs.append(f"world_size ({world_size}) must be divisible by {k}tp ({self.tp}) × {cp}{k}pp ({self.pp}) "
                            f"= {model}")
            elif world_size is not None:
                errs += self.expert_layout_errors(world_size // model, k)
            return errs
        if world_size is not None and world_size != self.world_size:
            cp = f"{k}cp ({self.cp}) × " if self.cp > 1 else ""
            errs.append(
                f"world_size ({world_size}) must equal {k}tp ({self.tp}) × {cp}"
                f"{k}pp ({self.pp}) × {k}dp ({self.dp}) = {self.world_size}"
            )
        if global_batch_size is not None and global_batch_size != self.global_batch_size:
            errs.append(
                f"global_batch_size ({global_batch_size}) must equal {k}micro_batch_size ({self.micro_batch_size}) × "
                f"{k}num_microbatches ({self.num_microbatches}) × {k}dp ({self.dp}) = {self.global_batch_size}"
            )
        return errs

    def warnings(self) -> list[str]:
        """Legal but costly choices."""
        msg = fill_warning(self.pp, self.num_microbatches)
        return [msg] if msg else []

    def validate(self, *, world_size: int | None = None, global_batch_size: int | None = None,
                 num_layers: int | None = None, num_attention_heads: int | None = None,
                 num_kv_heads: int | None = None, ffn_hidden_size: int | None = None,
                 seq_length: int | None = None, layer_counts=None, key_prefix: str = "",
                 **experts) -> "ParallelConfig":
        """Raise ParallelConfigError listing every broken rule; return self when all hold. ``experts``:
        the expert keywords of :meth:`model_errors` (num_experts, experts_per_token, ...)."""
        errs = self.layout_errors(key_prefix)
        if not errs:
            errs += self.job_errors(world_size=world_size, global_batch_size=global_batch_size, key_prefix=key_prefix)
            if num_layers is not None and num_attention_heads is not None:
                errs += self.model_errors(num_layers=num_layers, num_attention_heads=num_attention_heads,
                                          num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size,
                                          seq_length=seq_length, layer_counts=layer_counts, key_prefix=key_prefix,
                                          **experts)
        if errs:
            raise ParallelConfigError(errs)
        return self
