"""TrainConfig: every setting of a training run, in sections, from a YAML or TOML file and/or flags.

    tpkernels train --config run.yaml --parallel.tp 2 --parallel.pp 2 --training.steps 20   # a flag beats the file
    tpkernels train --config run.yaml --tp 2 --pp 2 --steps 20                             # the short aliases
    TrainConfig.load("run.toml", overrides={"optimizer.lr": 1e-4})

The sections, as torchtitan's job config has them: ``model`` (a preset or a Hugging Face config
with shape overrides: :class:`~tpkernels.description.source.ModelSection`, the ``model`` section of
``tpkernels plan`` too), ``parallel`` (the :class:`~tpkernels.parallel.ParallelConfig` itself),
``training``, ``optimizer``, ``data``, ``checkpoint``, ``logging``; plus ``layout`` (manual or
auto) at the top. A file holds them nested (``parallel: {tp: 2}``) or dotted (``parallel.tp: 2``).
Every key of the old flat files (``tp``, ``steps``, ``save_dir``, …) is an alias: a file that uses
one is read with a note naming the real key, and each is a short flag (``--tp``). Keys, types and
allowed values are checked when the config is read (:mod:`tpkernels.options`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from tpkernels import options
from tpkernels.description import ModelConfig
from tpkernels.description.source import ModelSection
from tpkernels.options import opt, section
from tpkernels.parallel.config import ParallelConfig

PRECISIONS = ("fp32", "bf16", "fp16", "fp64", "fp8")
FP8_KINDS = ("qkv", "out", "gate_up", "up", "down", "experts")  # the decoder layers' TP linears, MoE experts
LAYOUTS = ("manual", "auto")


@dataclass(frozen=True)
class TrainingSection:
    steps: int = opt(10, "the schedule's length (the learning rate decays over it); or give training.epochs")
    epochs: float | None = opt(None, "the run's length in passes over the data instead of training.steps: steps = "
                                     "ceil(epochs × the data's packed rows / the global batch), said at the start "
                                     "(a finite data.source; not with training.steps in the same file or flags)")
    stop_at_step: int | None = opt(None, "end this run early, e.g. to resume later (default: steps)")
    seed: int = opt(0, "seed of the initial weights and of the data")
    precision: str = opt("fp32", "fp32, bf16 (fp32 masters and accumulation), fp16 (+ loss scaling), fp8 (bf16 with "
                                 "the decoder layers' linears in FP8: the fp8 section), or fp64 (every tensor in "
                                 "double: the oracle runs that layouts are checked against)", PRECISIONS)
    initial_loss_scale: float = opt(65536.0, "fp16: the dynamic loss scale's start (halved on overflow)")
    global_batch: int | None = opt(None, "layout auto: sequences per step, kept by every layout tried "
                                              "(default: the config's own, micro_batch_size × num_microbatches × dp)")
    check_memory: bool = opt(True, "refuse to start when the planner's memory estimate exceeds the host's available "
                                   "RAM (CPU) or the GPU's free memory (--dry-run prints it)")
    task: str = opt("auto", "pretrain (every token a target), sft (assistant turns / completions only: the loss is "
                            "the token mean over supervised tokens), dpo (preference pairs: the dpo section), or auto "
                            "(sft for a messages or prompt/completion dataset, dpo for prompt/chosen/rejected, pretrain "
                            "otherwise)", ("auto", "pretrain", "sft", "dpo"))
    moe_aux_loss_coeff: float | None = opt(None, "mixture-of-experts: the load-balancing loss's weight in the "
                                                 "objective (Megatron's moe_aux_loss_coeff; default: the model's "
                                                 "router_aux_loss_coef, e.g. Mixtral's 0.02)")
    moe_z_loss_coeff: float | None = opt(None, "mixture-of-experts: the router z-loss's weight (default: the "
                                               "model's router_z_loss_coef)")
    moe_aux_loss_style: str = opt("per_layer", "mixture-of-experts: per_layer (the mean over the MoE layers of "
                                               "each layer's switch loss, Megatron-Core's) or transformers (the "
                                               "tokens of every layer pooled, as transformers' Mixtral computes it; "
                                               "parallel.pp 1)", ("per_layer", "transformers"))
    moe_expert_bias_rate: float = opt(0.0, "mixture-of-experts: aux-loss-free balancing (DeepSeek-V3; Megatron's "
                                           "moe_router_bias_update_rate): each MoE layer's per-expert selection "
                                           "bias moves by this rate toward balance once per step, from the step's "
                                           "global expert load; 0 = off (docs/moe.md)")


@dataclass(frozen=True)
class OptimizerSection:
    lr: float = opt(3e-4, "peak learning rate (AdamW)")
    min_lr: float = opt(3e-5, "learning rate at the end of the cosine decay")
    warmup_steps: int = opt(0, "linear warm-up steps")
    weight_decay: float = opt(0.1, "AdamW weight decay (not on biases and norms)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this; 0: no clipping")


@dataclass(frozen=True)
class DataSection:
    source: str = opt("random", "random (uniform tokens), random-documents (packed documents of uneven length), "
                                "a text file / folder of .txt files, a local .jsonl/.json/.parquet/.arrow file or "
                                "datasets.save_to_disk folder, an indexed corpus (.bin/.idx prefix or folder: "
                                "tpkernels prepare-data), or a blend 'W1 SRC1 W2 SRC2 ...' (in a file: a list of "
                                "[weight, path])")
    tokenizer: str | None = opt(None, "a tokenizers JSON or Hugging Face tokenizer folder (default: byte-level; chat "
                                      "formats need a folder with a chat template)")
    seq_length: int = opt(128, "tokens per sequence")
    format: str = opt("auto", "records' format (auto: from the columns): text, messages, prompt_completion, "
                              "preference", ("auto", "text", "messages", "prompt_completion", "preference"))
    loss_on: str = opt("all_assistant", "conversations: the loss on every assistant turn or the last only",
                       ("all_assistant", "last_assistant"))
    overflow: str = opt("error", "a sample (or preference pair) longer than seq_length: error, or truncate it",
                        ("error", "truncate"))
    max_unknown: float = opt(0.05, "refuse data whose share of tokens the tokenizer maps to its unknown token is "
                                   "above this (a tokenizer made for other text); a warning with the rate below it")


@dataclass(frozen=True)
class Fp8Section:
    recipe: str = opt("current", "current (this tensor's amax), delayed (an amax history: TransformerEngine's "
                                 "default) or rowwise (a scale per row: torchao's)", ("current", "delayed", "rowwise"))
    history: int = opt(16, "delayed: casts in each tensor's amax history")
    amax_reduction: str = opt("max", "delayed: max or most_recent of the history", ("max", "most_recent"))
    grad_format: str = opt("e5m2", "output gradients' format: e5m2, or e4m3 with its own scale", ("e5m2", "e4m3"))
    margin: int = opt(0, "powers of two of headroom below the format's max")
    layers: str = opt("auto", "auto (FP8 where the planner predicts the linear faster), all, none, or linears by "
                              "kind, comma-separated: " + ",".join(FP8_KINDS))
    measure: bool = opt(False, "auto: measure this machine's bf16 and FP8 GEMM rates (instead of the GPU preset's)")
    min_gain: float = opt(1.05, "auto: the predicted speed-up a linear needs to run in FP8")
    learn: bool = opt(True, "after the first step, time each kind of linear in bf16 and in FP8 at this run's shapes "
                            "(communication included) and keep the gains: later auto choices on this machine use "
                            "them instead of the prediction")
    max_saturation: float = opt(1e-3, "guardrail: share of a linear's cast values beyond the FP8 range")
    max_underflow: float = opt(0.25, "guardrail: share of a linear's nonzero cast values flushed to 0")
    guard_steps: int = opt(3, "guardrail: consecutive steps over a threshold that move the linear back to bf16; "
                              "0: no guardrail (and no counting)")

    def kinds(self) -> list[str] | None:
        """The linear kinds ``layers`` names (None for auto)."""
        v = str(self.layers).strip().lower()
        if v == "auto":
            return None
        if v == "all":
            return list(FP8_KINDS)
        if v in ("none", ""):
            return []
        return [k.strip() for k in v.split(",") if k.strip()]


@dataclass(frozen=True)
class DpoSection:
    beta: float = opt(0.1, "the KL weight β of the preference loss (TRL's beta)")
    loss_type: str = opt("sigmoid", "sigmoid (DPO), ipo, hinge (SLiC) or simpo (reference-free)",
                         ("sigmoid", "ipo", "hinge", "simpo"))
    label_smoothing: float = opt(0.0, "sigmoid / simpo: the probability that a preference label is flipped (cDPO)")
    sft_weight: float = opt(0.0, "weight of the chosen completions' token-mean NLL added to the loss (RPO)")
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin γ")
    reference: str = opt("cached", "the reference log-probs: cached (one forward pass over the data before training, "
                                   "kept on disk for the next run), adapters (LoRA: the same model with its adapters "
                                   "off, a forward pass every step) or model (a frozen copy of the initial weights, "
                                   "a forward pass every step)", ("cached", "adapters", "model"))
    cache_dir: str | None = opt(None, "reference cache folder (default: ~/.cache/tpkernels/dpo_reference, or "
                                      "$XDG_CACHE_HOME; one the nodes share when there are several)")


@dataclass(frozen=True)
class EvalSection:
    source: str | None = opt(None, "held-out data, read as data.source is (same format, tokenizer, task and "
                                   "seq_length); none: no validation")
    every: int = opt(0, "steps between validations (and after the last step); 0: off")
    batches: int = opt(4, "at most this many global batches per validation: each held-out row once, the "
                          "first ones when eval.source holds more")
    samples: str | None = opt(None, "a JSONL file of prompts (a string, {\"prompt\": ...} or {\"messages\": [...]} a "
                                    "line, as tpkernels generate --prompts reads) continued greedily at each "
                                    "validation, written to the metrics file and TensorBoard as text")
    sample_tokens: int = opt(24, "eval.samples: new tokens per prompt at most")


@dataclass(frozen=True)
class CheckpointSection:
    save_dir: str | None = opt(None, "checkpoints go to save_dir/step_NNNNNNNN, the step number in 8 digits (DCP, reshardable)")
    save_every: int = opt(0, "steps between checkpoints (0: only at the end)")
    resume: bool = opt(True, "start from the latest complete checkpoint in save_dir, if any")
    async_save: bool = opt(False, "write checkpoints in the background while training goes on")


@dataclass(frozen=True)
class LoggingSection:
    log_every: int = opt(10, "steps between progress updates (a line each when stdout is not a terminal) and "
                             "between the worst rank's comm/compute ratio (one all-reduce; other steps report each "
                             "rank's own)")
    progress: bool = opt(True, "progress on rank 0: a bar on a terminal, a plain line per log_every steps else")
    metrics_file: str | None = opt(None, "a JSON line per step (rank 0)")
    tensorboard_dir: str | None = opt(None, "TensorBoard event files (rank 0): every metrics-file record (scalars "
                                            "by key, strings as text), the config as text; a resumed run "
                                            "continues the same curves")
    wandb_project: str | None = opt(None, "Weights & Biases project for the same scalars, in offline mode (needs "
                                          "wandb installed; `wandb sync` uploads)")
    trace: str | None = opt(None, "a Perfetto trace (Chrome JSON) of step trace_step: pipeline + TP spans")
    trace_step: int = opt(1, "the step the trace records")


@dataclass(frozen=True)
class AutotuneSection:
    candidates: int = opt(0, "layout auto: run the planner's best K layouts on these ranks, then go on with the "
                             "fastest measured (0: off)")
    steps: int = opt(2, "timed steps per candidate, after its first (warm-up) step; every trial step trains")
    max_share: float = opt(0.5, "the trial phase may use at most this share of training.steps (fewer candidates "
                                "otherwise)")
    cache: bool = opt(True, "layout auto: plan with this machine's corrections fitted by earlier trials, and keep "
                            "the new fit (tpkernels.planner.fit)")
    monitor_every: int = opt(0, "every N steps, compare each rank's phase times with the first N steps' and report "
                                "a sustained slowdown: which rank, which phase (0: off)")
    slowdown: float = opt(0.2, "the step-time increase (a fraction) the monitor reports")
    sustain: int = opt(2, "monitor windows in a row the slowdown must last")
    adapt: bool = opt(False, "layout auto: when the monitor reports a slowdown, refit the planner's corrections to "
                             "it and switch to a candidate predicted faster by more than autotune.slowdown")


def _parallel_default() -> ParallelConfig:
    return ParallelConfig(dp=None)  # dp: what the world size leaves


@dataclass(frozen=True)
class TrainConfig:
    layout: str = opt("manual", "manual (the parallel section) or auto (the planner picks it)", LAYOUTS)
    model: ModelSection = section(ModelSection, "the model: a preset or a Hugging Face config, with overrides")
    parallel: ParallelConfig = section(_parallel_default, "the layout (tpkernels.parallel.ParallelConfig)")
    training: TrainingSection = section(TrainingSection, "steps, seed, precision")
    optimizer: OptimizerSection = section(OptimizerSection, "AdamW and its schedule")
    data: DataSection = section(DataSection, "tokens")
    dpo: DpoSection = section(DpoSection, "preference training (training.task dpo)")
    fp8: Fp8Section = section(Fp8Section, "FP8 linears (training.precision fp8)")
    eval: EvalSection = section(EvalSection, "validation: forward-only passes over held-out data")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoints")
    logging: LoggingSection = section(LoggingSection, "progress, metrics, traces")
    autotune: AutotuneSection = section(AutotuneSection, "layout auto: measure the planner's best layouts in the run")
    # set by the job itself (layout auto: the planner's step time, bubble, comm ratio), not a key
    predicted: dict | None = dataclasses.field(default=None, metadata={"internal": True})

    # ---- derived ----
    def model_config(self) -> ModelConfig:
        """The model of this run (refused if ``tpkernels.models`` cannot build it). A rotary model's
        position cache grows to ``data.seq_length`` when it is shorter (no weights change: said in a
        warning); a learned position table cannot: a longer sequence is an error."""
        mc = self.model.config()
        seq, table = self.data.seq_length, mc.max_position_embeddings
        if table < seq:
            if mc.positions == "learned":
                raise ValueError(f"data.seq_length ({seq}) must be <= the model's learned position table "
                                 f"(max_position_embeddings {table}): its rows are weights, not a cache")
            warnings.warn(f"data.seq_length ({seq}) > max_position_embeddings ({table}) of {mc.name or mc.model_type}: "
                          f"its rotary cache is extended to {seq} positions (the model was not trained on them)",
                          UserWarning, stacklevel=2)
            mc = mc.replace(max_position_embeddings=seq)
        return mc

    def parallel_config(self, world: int) -> ParallelConfig:
        """The layout on ``world`` ranks (``dp`` none: what the world size leaves)."""
        return self.parallel.for_world(world)

    def _fp8_errors(self) -> list[str]:
        f, t, errs = self.fp8, self.training, []
        kinds = f.kinds()
        bad = [k for k in kinds or [] if k not in FP8_KINDS]
        if bad:
            errs.append(f"fp8.layers ({f.layers!r}) names {bad}: give auto, all, none or kinds among "
                        f"{', '.join(FP8_KINDS)}")
        if f.history < 1:
            errs.append(f"fp8.history ({f.history}) must be a positive integer")
        if f.guard_steps < 0 or not 0 <= f.max_saturation <= 1 or not 0 <= f.max_underflow <= 1:
            errs.append(f"fp8.guard_steps ({f.guard_steps}) must be >= 0, fp8.max_saturation ({f.max_saturation}) "
                        f"and fp8.max_underflow ({f.max_underflow}) in [0, 1]")
        if not (math.isfinite(f.min_gain) and f.min_gain > 0):
            errs.append(f"fp8.min_gain ({f.min_gain!r}) must be a finite number > 0")
        if t.precision == "fp8":
            if self.model.finetune == "qlora":
                errs.append("training.precision fp8 with model.finetune qlora: the 4-bit base runs the dequantising "
                            "NF4 / int8 GEMM, not FP8 (FP8 on a QLoRA base is not supported); use bf16")
            if t.initial_loss_scale != TrainingSection.initial_loss_scale:
                errs.append(f"training.initial_loss_scale ({t.initial_loss_scale}) is fp16's loss scaling: fp8 trains "
                            "bf16 weights and activations with FP8 GEMMs and scales each tensor itself (no loss "
                            "scale); leave it unset")
        return errs

    def with_values(self, values: dict) -> "TrainConfig":
        """This config with ``values`` (dotted keys or aliases, typed) on top, checked as a file's are."""
        return TrainConfig.from_values(values, base=self)

    def errors(self) -> list[str]:
        """Every rule the values break, naming the keys (the world-size rules wait for the world)."""
        t, o, d, c, lg = self.training, self.optimizer, self.data, self.checkpoint, self.logging
        errs = []
        for path, v in (("training.steps", t.steps), ("logging.log_every", lg.log_every),
                        ("logging.trace_step", lg.trace_step)):
            if v < 1:
                errs.append(f"{path} ({v}) must be a positive integer")
        if d.seq_length < 2:
            errs.append(f"data.seq_length ({d.seq_length}) must be at least 2: a token and the next one it is trained "
                        "to predict")
        if c.save_every < 0:
            errs.append(f"checkpoint.save_every ({c.save_every}) must be an integer >= 0")
        if t.stop_at_step is not None and t.stop_at_step < 0:
            errs.append(f"training.stop_at_step ({t.stop_at_step}) must be >= 0 or none")
        if t.global_batch is not None and t.global_batch < 1:
            errs.append(f"training.global_batch ({t.global_batch}) must be a positive integer or none")
        for f in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(t, f)
            if v is not None and not (math.isfinite(v) and v >= 0):
                errs.append(f"training.{f} ({v!r}) must be a finite number >= 0, or none (the model's)")
        r = t.moe_expert_bias_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r >= 0):
            errs.append(f"training.moe_expert_bias_rate ({r!r}) must be a finite number >= 0 (0: off)")
        if t.moe_aux_loss_style == "transformers" and (self.parallel.pp > 1 or self.parallel.virtual_stages > 1):
            errs.append(f"training.moe_aux_loss_style (transformers) pools the tokens of every MoE layer, which needs "
                        f"them all on one pipeline stage (parallel.pp 1, now {self.parallel.pp}; virtual_stages "
                        f"{self.parallel.virtual_stages}); use per_layer")
        if not t.initial_loss_scale > 0:
            errs.append(f"training.initial_loss_scale ({t.initial_loss_scale}) must be > 0")
        for f in ("lr", "min_lr", "weight_decay", "clip_grad"):
            v = getattr(o, f)
            if not math.isfinite(v) or v < 0:
                errs.append(f"optimizer.{f} ({v!r}) must be a finite number >= 0")
        if not (math.isfinite(o.adam_eps) and o.adam_eps > 0):
            errs.append(f"optimizer.adam_eps ({o.adam_eps!r}) must be a finite number > 0 (AdamW divides by "
                        "sqrt(v) + adam_eps: 0 gives NaN where a gradient is 0)")
        if o.min_lr > o.lr:
            errs.append(f"optimizer.min_lr ({o.min_lr}) must be <= optimizer.lr ({o.lr})")
        if t.epochs is not None and not (math.isfinite(t.epochs) and t.epochs > 0):
            errs.append(f"training.epochs ({t.epochs!r}) must be a finite number > 0 (passes over the data)")
        # with epochs, steps come from the data: the rules on steps wait for them
        if t.epochs is None and t.stop_at_step is not None and t.stop_at_step > t.steps:
            errs.append(f"training.stop_at_step ({t.stop_at_step}) must be <= training.steps ({t.steps}): the run "
                        "ends at training.steps, so a later stop never happens")
        if not 0 <= o.warmup_steps <= (t.steps if t.epochs is None else math.inf):
            errs.append(f"optimizer.warmup_steps ({o.warmup_steps}) must be in [0, training.steps ({t.steps})]")
        for f in ("beta1", "beta2"):
            if not 0 <= getattr(o, f) < 1:
                errs.append(f"optimizer.{f} ({getattr(o, f)}) must be in [0, 1)")
        at = self.autotune
        if at.candidates < 0:
            errs.append(f"autotune.candidates ({at.candidates}) must be an integer >= 0")
        if at.steps < 1:
            errs.append(f"autotune.steps ({at.steps}) must be a positive integer")
        if at.monitor_every < 0 or at.sustain < 1:
            errs.append(f"autotune.monitor_every ({at.monitor_every}) must be >= 0 and autotune.sustain ({at.sustain}) "
                        ">= 1")
        if not at.slowdown > 0:
            errs.append(f"autotune.slowdown ({at.slowdown!r}) must be > 0")
        if not 0 <= d.max_unknown <= 1:
            errs.append(f"data.max_unknown ({d.max_unknown!r}) must be in [0, 1] (a share of the tokens)")
        if not 0 < at.max_share <= 1:
            errs.append(f"autotune.max_share ({at.max_share!r}) must be in (0, 1]")
        if at.adapt and not (at.candidates and at.monitor_every):
            errs.append("autotune.adapt needs autotune.candidates (the layouts to switch to) and "
                        f"autotune.monitor_every (now {at.monitor_every}) > 0")
        if at.candidates and self.layout != "auto":
            errs.append(f"autotune.candidates ({at.candidates}) needs layout: auto (the planner proposes the "
                        f"candidates), not {self.layout!r}")
        from tpkernels.train.experiment_log import tensorboard_available, wandb_available  # noqa: PLC0415

        if lg.tensorboard_dir and not tensorboard_available():
            errs.append(f"logging.tensorboard_dir ({lg.tensorboard_dir!r}) needs the tensorboard package, which is "
                        "not installed (pip install tensorboard), or leave logging.tensorboard_dir unset")
        if lg.wandb_project:
            if not wandb_available():
                errs.append(f"logging.wandb_project ({lg.wandb_project!r}) needs the wandb package, which is not "
                            "installed (pip install wandb), or leave logging.wandb_project unset")
        ev = self.eval
        if ev.every < 0 or ev.batches < 1:
            errs.append(f"eval.every ({ev.every}) must be >= 0 and eval.batches ({ev.batches}) >= 1")
        if ev.every and not ev.source:
            errs.append(f"eval.every ({ev.every}) needs eval.source (the held-out data)")
        if ev.samples is not None:
            if not ev.every:
                errs.append(f"eval.samples ({ev.samples!r}) needs eval.every (samples are taken at each validation)")
            if not Path(ev.samples).is_file():
                errs.append(f"eval.samples ({ev.samples!r}) must be a JSONL file of prompts")
            if ev.sample_tokens < 1:
                errs.append(f"eval.sample_tokens ({ev.sample_tokens}) must be >= 1")
            pc = self.parallel
            bad = [f"{k} ({v})" for k, v, ok in (("parallel.pp", pc.pp, pc.pp == 1), ("parallel.cp", pc.cp, pc.cp == 1),
                                                   ("parallel.sequence_parallel", pc.sequence_parallel,
                                                    not (pc.sequence_parallel and pc.tp > 1))) if not ok]
            if bad:  # the generator's needs (tpkernels.train.eval_samples)
                errs.append(f"eval.samples generates at the run's layout, which needs parallel.pp 1, parallel.cp 1 "
                            f"and parallel.sequence_parallel false when tp > 1 (now {', '.join(bad)}); leave "
                            "eval.samples unset, or sample from the checkpoints with tpkernels generate")
        dpo = self.dpo
        if not (math.isfinite(dpo.beta) and dpo.beta > 0):
            errs.append(f"dpo.beta ({dpo.beta!r}) must be a finite number > 0")
        if not 0 <= dpo.label_smoothing < 0.5:
            errs.append(f"dpo.label_smoothing ({dpo.label_smoothing!r}) must be in [0, 0.5) (a flip probability)")
        elif dpo.label_smoothing and dpo.loss_type in ("ipo", "hinge"):
            errs.append(f"dpo.label_smoothing ({dpo.label_smoothing}) applies to loss_type sigmoid or simpo, not "
                        f"{dpo.loss_type}")
        if not (math.isfinite(dpo.sft_weight) and dpo.sft_weight >= 0):
            errs.append(f"dpo.sft_weight ({dpo.sft_weight!r}) must be a finite number >= 0")
        if not math.isfinite(dpo.simpo_gamma):
            errs.append(f"dpo.simpo_gamma ({dpo.simpo_gamma!r}) must be a finite number")
        if t.task == "dpo" and dpo.reference == "adapters" and not self.model.adapters:
            errs.append(f"dpo.reference (adapters) needs model.finetune lora or qlora (now {self.model.finetune!r}: "
                        "there are no adapters to turn off); use dpo.reference cached or model")
        errs += self._fp8_errors()
        errs += self.model.errors("model.")
        errs += self.parallel.layout_errors("parallel.")
        return errs

    def check(self) -> "TrainConfig":
        errs = self.errors()
        if errs:
            raise ValueError("invalid training config:\n  - " + "\n  - ".join(errs))
        return self

    # ---- reading ----
    @classmethod
    def from_values(cls, values: dict, *, text: bool = False, base: "TrainConfig | None" = None,
                    where: str | None = None, check: bool = True) -> "TrainConfig":
        """A config from a mapping (nested or dotted keys, or the aliases) over ``base`` (default: the
        defaults); ``text``: values are command-line text; ``where``: the file they came from.
        ``check=False``: keys and types only, the rules wait (for the flags still to come)."""
        flat = options.flatten(_old_sections(values, where), cls, where=where)
        if isinstance(flat.get("data.source"), list):  # a file's blend: [[weight, path], ...]
            from tpkernels.data.blend import blend_spec  # noqa: PLC0415

            flat["data.source"] = blend_spec(flat["data.source"])
        flat = options.resolve_aliases(flat, ALIASES, where=where)
        cfg = options.build(cls, flat, text=text, base=base)
        cfg = _one_run_length(cfg, flat, where)
        return cfg.check() if check else cfg

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict | None = None, *,
             text_overrides: bool = False) -> "TrainConfig":
        """From a YAML (.yaml/.yml) or TOML (.toml) file, then ``overrides`` (flags) on top.

        The rule of precedence: a flag beats the file, the file beats the defaults, and the rules are
        checked once, on the merged config (a file's ``warmup_steps: 100`` with ``--steps 1000`` is
        judged against 1000 steps, not the default 10). Keys and types are checked as each is read."""
        base = cls()
        if path is not None:
            base = cls.from_values(options.read_file(path, "config"), where=str(path), check=False)
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        merged = cls.from_values(given, text=text_overrides, base=base, check=False) if given else base
        return merged.check()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _one_run_length(cfg: TrainConfig, given: dict, where: str | None) -> TrainConfig:
    """``training.steps`` and ``training.epochs`` are two spellings of the run's length: both in one file (or
    in the flags) is refused; a later layer's one replaces an earlier layer's other (a flag beats the file)."""
    t = cfg.training
    if "training.steps" in given and "training.epochs" in given and t.epochs is not None:
        raise ValueError(f"training.steps ({t.steps}) and training.epochs ({t.epochs}) are both set"
                         f"{f' in {where}' if where else ''}: give the run's length once, in steps or in passes over "
                         "the data")
    if "training.steps" in given and "training.epochs" not in given and t.epochs is not None:
        return dataclasses.replace(cfg, training=dataclasses.replace(t, epochs=None))
    return cfg


def _old_sections(values: dict, where: str | None = None) -> dict:
    """Old flat files named the model and the data by a string (``model: Llama-3-8B``, ``data: corpus.txt``),
    where the sections now are: read them as ``model.name`` / ``data.source`` (both given: refused)."""
    out = dict(values)
    for key, leaf in (("model", "name"), ("data", "source")):
        if isinstance(out.get(key), str):
            if f"{key}.{leaf}" in out:
                raise ValueError(f"config key '{key}.{leaf}' is given twice (as {key!r} and as '{key}.{leaf}')"
                                 f"{f' in {where}' if where else ''}; give each key once")
            out[f"{key}.{leaf}"] = out.pop(key)
    return out


# The old flat keys (and short flags) -> the real keys.
ALIASES: dict[str, str] = {
    **{k: f"model.{k}" for k in ("init_from", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "finetune",
                                 "quant", "lora_rank", "lora_alpha", "drop_dropout")},
    "hf_config": "model.name",
    **{f.name: f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)},
    **{f.name: f"training.{f.name}" for f in dataclasses.fields(TrainingSection)},
    **{f.name: f"optimizer.{f.name}" for f in dataclasses.fields(OptimizerSection)},
    "tokenizer": "data.tokenizer", "seq_length": "data.seq_length", "seq_len": "data.seq_length",
    **{f.name: f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointSection)},
    **{f.name: f"logging.{f.name}" for f in dataclasses.fields(LoggingSection)},
    "autotune": "autotune.candidates", "autotune_steps": "autotune.steps",
}
# flags only (a file's `model:` / `data:` is its section, or the old string: see _old_sections)
FLAG_ALIASES = {**ALIASES, "model": "model.name", "data": "data.source"}


def add_flags(parser) -> None:
    """``--<section>.<key>`` for every key, and the short aliases (``--tp``, ``--steps``, ``--model``)."""
    options.add_flags(parser, TrainConfig, FLAG_ALIASES)


def flag_values(args) -> dict:
    return options.flag_values(args, TrainConfig)


__all__ = ["ALIASES", "AutotuneSection", "CheckpointSection", "DataSection", "LAYOUTS", "LoggingSection", "OptimizerSection",
           "PRECISIONS", "TrainConfig", "TrainingSection", "add_flags", "flag_values"]
