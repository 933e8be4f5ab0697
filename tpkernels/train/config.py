"""TrainConfig: every setting of a training run, from a YAML or TOML file and/or command-line flags.

    tpkernels train --config run.yaml --tp 2 --pp 2 --steps 20      # a flag beats the file
    TrainConfig.load("run.toml", overrides={"lr": 1e-4})

Every field is a key of the file and a flag (``--micro-batch-size`` for ``micro_batch_size``).
The model is a planner preset (``Llama-3-8B``), a Hugging Face ``config.json`` / checkpoint
folder (``init_from`` loads its weights), with shape overrides (``layers``, ``hidden``, …) for
small runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
NOT_FLAGS = ("predicted",)  # set by the job itself (layout auto), not by users


@dataclass
class TrainConfig:
    # ---- model ----
    model: str = "Llama-2-7B"          # planner preset or HF config.json / checkpoint folder
    init_from: str | None = None       # HF checkpoint folder whose weights to start from
    layers: int | None = None          # shape overrides of the model (small runs, tests)
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    finetune: str = "full"             # "full", or "lora": adapters on the TP linears, base weights frozen
    lora_rank: int = 16
    lora_alpha: float | None = None    # default 2 · lora_rank
    # ---- layout ----
    layout: str = "manual"             # "manual" (the keys below) or "auto" (the planner picks them)
    global_batch: int | None = None    # layout auto: sequences per step (default: the config's at pure DP)
    tp: int = 1
    pp: int = 1
    dp: int | None = None              # default: world size / (tp · pp)
    virtual_stages: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    overlap_comm: bool = True
    recompute: str = "none"            # "none", "selective" (attention core) or "full" (whole layer)
    zero1: bool = False                # shard AdamW's states over DP (torch's ZeroRedundancyOptimizer)
    overlap_dp: bool = True            # DP gradient all-reduce in buckets during the backward
    bucket_mb: float = 25.0            # DP bucket size
    # ---- batch ----
    seq_length: int = 128
    micro_batch_size: int = 1
    num_microbatches: int = 1          # per DP replica per step
    # ---- optimisation ----
    steps: int = 10                    # the schedule's length (the LR decays over it)
    stop_at_step: int | None = None    # end this run early, e.g. to resume later (default: steps)
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0             # global gradient norm; 0 = no clipping
    seed: int = 0
    precision: str = "fp32"            # "fp32", "bf16" (fp32 masters and accumulation), "fp16" (+ loss scaling)
    initial_loss_scale: float = 65536.0  # fp16: the dynamic loss scale's start (halved on overflow)
    # ---- data ----
    data: str = "random"               # "random" tokens, or a text file / folder of .txt files
    tokenizer: str | None = None       # a tokenizers JSON or HF tokenizer folder (default: byte-level)
    # ---- checkpoints ----
    save_dir: str | None = None        # checkpoints go to save_dir/step_XXXXXXXX (DCP, reshardable)
    save_every: int = 0                # steps between checkpoints (0: only at the end)
    resume: bool = True                # start from the latest complete checkpoint in save_dir, if any
    async_save: bool = False           # write checkpoints in the background while training goes on
    # ---- logging ----
    log_every: int = 1
    progress: bool = True              # a progress bar on rank 0
    metrics_file: str | None = None    # a JSON line per step (rank 0)
    trace: str | None = None           # a Perfetto trace (Chrome JSON) of step ``trace_step``: pipeline + TP spans
    trace_step: int = 1
    predicted: dict | None = None      # set by layout auto: the planner's step time, bubble, comm ratio

    # ---- derived ----
    def global_batch_size(self, dp: int) -> int:
        return self.micro_batch_size * self.num_microbatches * dp

    def errors(self) -> list[str]:
        errs = []
        if not isinstance(self.save_every, int) or self.save_every < 0:
            errs.append(f"save_every ({self.save_every!r}) must be an integer >= 0")
        for f in ("steps", "seq_length", "micro_batch_size", "num_microbatches", "log_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{f} ({v!r}) must be a positive integer")
        if self.precision not in ("fp32", "bf16", "fp16"):
            errs.append(f"precision ({self.precision!r}) must be one of fp32, bf16, fp16")
        if self.layout not in ("manual", "auto"):
            errs.append(f"layout ({self.layout!r}) must be 'manual' or 'auto'")
        if self.finetune not in ("full", "lora"):
            errs.append(f"finetune ({self.finetune!r}) must be 'full' or 'lora'")
        if self.schedule not in SCHEDULES:
            errs.append(f"schedule ({self.schedule!r}) must be one of {', '.join(SCHEDULES)}")
        for f in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                errs.append(f"{f} ({v!r}) must be a finite number >= 0")
        if self.min_lr > self.lr:
            errs.append(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        if not 0 <= self.warmup_steps <= self.steps:
            errs.append(f"warmup_steps ({self.warmup_steps}) must be in [0, steps ({self.steps})]")
        for f in ("beta1", "beta2"):
            if not 0 <= getattr(self, f) < 1:
                errs.append(f"{f} ({getattr(self, f)}) must be in [0, 1)")
        return errs

    # ---- loading ----
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict | None = None) -> "TrainConfig":
        """From a YAML (.yaml/.yml) or TOML (.toml) file, then ``overrides`` (flags) on top."""
        values: dict = {}
        if path is not None:
            values.update(read_config_file(path))
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {', '.join(sorted(names))}")
        cfg = cls(**values)
        errs = cfg.errors()
        if errs:
            raise ValueError("invalid training config:\n  - " + "\n  - ".join(errs))
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config ({str(path)!r}) does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib  # noqa: PLC0415

        data = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml  # noqa: PLC0415

        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config ({str(path)!r}) must be a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ValueError(f"config ({str(path)!r}) must hold a mapping of keys to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def add_flags(parser) -> None:
    """One flag per TrainConfig field (``--micro-batch-size``), default None (= the file's or the field's)."""
    for f in dataclasses.fields(TrainConfig):
        if f.name in NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if "bool" in kind:
            parser.add_argument(flag, dest=f.name, type=_bool, default=None, metavar="true|false")
        elif "int" in kind and "float" not in kind:
            parser.add_argument(flag, dest=f.name, type=int, default=None)
        elif "float" in kind:
            parser.add_argument(flag, dest=f.name, type=float, default=None)
        else:
            parser.add_argument(flag, dest=f.name, default=None)


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {s!r}")


def flag_values(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
            if f.name not in NOT_FLAGS and getattr(args, f.name, None) is not None}
