"""The model to generate with, at this world's TP layout: from a training checkpoint (any finetune
kind, without exporting it first) or a Hugging Face folder.

    state = ParallelState.create(ParallelConfig(tp=world_size))
    loaded = load_for_generation("runs/sft", state)        # a checkpoint, a save_dir or an HF folder
    loaded.model, loaded.tokenizer                         # tokenizer: data.tokenizer / the folder / None (bytes)

A checkpoint gives the model its run trained, as ``export-hf`` writes it, resharded to this TP size
on load (checkpoints are layout independent):
- full fine-tuning / pre-training: its weights;
- LoRA: the base and the adapters it holds, merged (W + alpha/r · B·A: one GEMM per linear, and
  the same model ``export-hf`` writes);
- QLoRA: the checkpoint holds no base: it is read from ``model.init_from`` (or the run's seed) and
  each training rank's shard quantised as that rank quantised it, dequantised and put back together
  (``dequantize_as_trained_at_``: NF4 blocks depend on the training TP size), then the adapters
  merged. So the base is held dense in the generation dtype (the model the run computed with,
  not a second quantisation at another TP size);
- FP8 runs: their weights in bf16 (FP8 casts were a training-step matter; the weights are bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpkernels.models import ParallelTransformer
from tpkernels.models.hf_io import dequantize_as_trained_at_, random_init
from tpkernels.models.lora import apply_lora, merge_lora_
from tpkernels.train import checkpoint as ckpt
from tpkernels.train.precision import DTYPES

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Loaded:
    """model: this rank's ParallelTransformer; tokenizer: the tokenizer path it was trained with / ships
    with (None: byte-level for a checkpoint, none known for an HF folder); kind: "checkpoint" or "hf";
    path: what was loaded (a save_dir resolves to its latest checkpoint); describe: one line for the user."""

    model: ParallelTransformer
    tokenizer: str | None
    kind: str
    path: Path
    describe: str


def resolve(path: str | Path) -> tuple[str, Path]:
    """("checkpoint" | "hf", the folder): a checkpoint (meta.json), a save_dir (its newest complete
    checkpoint) or a Hugging Face folder (config.json). Anything else is a named error."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"checkpoint ({str(path)!r}) does not exist: give a checkpoint folder (step_NNNNNNNN), the "
                         "save_dir holding them, or a Hugging Face model folder (config.json + safetensors)")
    if not p.is_dir():
        raise ValueError(f"checkpoint ({str(path)!r}) is a file: give a checkpoint folder, a save_dir or a Hugging "
                         "Face model folder")
    if (p / "meta.json").is_file():
        return "checkpoint", p
    if (p / "config.json").is_file():
        return "hf", p
    found = ckpt.latest(p)
    if found is None:
        raise ValueError(f"{str(path)!r} is neither a checkpoint, a folder of complete checkpoints nor a Hugging Face "
                         "model folder (no meta.json, step_* folders or config.json)")
    return "checkpoint", found


def generation_dtype(name: str | None, trained: str | None, device: torch.device) -> torch.dtype:
    """``name`` if given; "auto"/None: the run's precision on a GPU (fp8 runs in bf16), fp32 on the CPU
    (where 16-bit GEMMs are slow and the saved masters are fp32 anyway)."""
    if name not in (None, "auto"):
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype ({name!r}) must be auto or one of {', '.join(DTYPE_NAMES)}")
        return DTYPE_NAMES[name]
    if device.type == "cpu":
        return torch.float64 if trained == "fp64" else torch.float32
    return DTYPES.get(trained or "bf16", torch.bfloat16)


def load_for_generation(path: str | Path, state, *, dtype: str | None = None, device=None) -> Loaded:
    """Build and load this rank's model (collective over the world: each rank reads its own slices)."""
    kind, folder = resolve(path)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if kind == "hf":
        dt = generation_dtype(dtype, None, device)
        # dropout is a training matter: a config that trains with it (GPT-2's 0.1) generates without it
        model = ParallelTransformer.from_hf(str(folder), state, dtype=dt, device=device, drop_dropout=True)
        tok = str(folder) if any((folder / f).is_file() for f in _TOKENIZER_FILES) else None
        return Loaded(model, tok, "hf", folder, f"{folder} (Hugging Face, {model.config.family}, {_dt(dt)})")
    meta = ckpt.read_meta(folder)
    cfg = ckpt.config_of(meta)
    ms, precision = cfg.model, cfg.training.precision
    dt = generation_dtype(dtype, precision, device)
    spec = ckpt.saved_adapters(folder, meta)
    model = ParallelTransformer(ckpt.saved_model(meta), state, init=None, quant=ms.base_quant, dtype=dt,
                                device=device)
    if spec is not None:
        apply_lora(model, spec.rank, spec.alpha, spec.targets)
    bias = None
    if cfg.training.moe_expert_bias_rate and model.config.num_experts:  # the run's routing biases, frozen (rate 0)
        from tpkernels.train.moe_bias import ExpertBias

        bias = ckpt.RunState([ExpertBias(model, 0.0)])
    ckpt.load(folder, model, run_state=bias)  # verified, resharded to this layout
    if ms.base_quant is not None:  # QLoRA: the base as the run computed with it
        source = ms.init_from or random_init(model, cfg.training.seed)
        dequantize_as_trained_at_(model, source, cfg.parallel.tp, DTYPES[precision])
    if spec is not None:
        merge_lora_(model)
    what = ms.finetune + (f" {ms.base_quant}" if ms.base_quant else "")
    return Loaded(model, cfg.data.tokenizer, "checkpoint", folder,
                  f"{folder} (step {meta['step']}, {what}, trained {precision}, generating in {_dt(dt)})")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["DTYPE_NAMES", "Loaded", "generation_dtype", "load_for_generation", "resolve"]
