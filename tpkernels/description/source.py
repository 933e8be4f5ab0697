"""ModelSection: which model a run or a plan is about — a preset or a Hugging Face config, with shape
overrides — read the same way by ``tpkernels train`` and ``tpkernels plan`` (the ``model`` section
of both configs, so the two CLIs take the same ``--model.*`` flags and say the same things).

    ModelSection(name="Llama-3-8B", layers=4, hidden=256).config()       # a small Llama-3 for a test
    ModelSection(name="path/to/checkpoint").config(buildable=False)      # for planning
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpkernels.description.model import MODEL_PRESETS, ModelConfig, model_preset
from tpkernels.options import opt

FINETUNE_CHOICES = ("full", "lora", "qlora")
QUANT_CHOICES = ("none", "nf4", "int8")
_OVERRIDES = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
              "kv_heads": "num_kv_heads", "ffn": "ffn_hidden_size", "vocab": "vocab_size"}


@dataclass(frozen=True)
class ModelSection:
    name: str = opt("Llama-2-7B", "a preset (" + ", ".join(MODEL_PRESETS) + ") or a Hugging Face config.json / "
                    "checkpoint folder")
    init_from: str | None = opt(None, "a Hugging Face checkpoint folder whose weights the run starts from")
    layers: int | None = opt(None, "override: number of layers")
    hidden: int | None = opt(None, "override: hidden size")
    heads: int | None = opt(None, "override: attention heads")
    kv_heads: int | None = opt(None, "override: key/value heads")
    ffn: int | None = opt(None, "override: MLP width")
    vocab: int | None = opt(None, "override: vocabulary size")
    drop_dropout: bool = opt(False, "train (and plan) a Hugging Face model whose config has dropout > 0 without it")
    finetune: str = opt("full", "full; lora: adapters on the TP linears, base weights frozen; qlora: lora on a "
                        "quantised base (model.quant)", FINETUNE_CHOICES)
    quant: str = opt("none", "the frozen base of a qlora run: nf4 (4-bit NormalFloat, double quantisation; none "
                     "means nf4 with qlora) or int8 (per-channel absmax)", QUANT_CHOICES)
    lora_rank: int = opt(16, "LoRA rank")
    lora_alpha: float | None = opt(None, "LoRA alpha (default 2 · lora_rank)")

    def errors(self, key_prefix: str = "model.") -> list[str]:
        k = key_prefix
        errs = [f"{k}{f} ({getattr(self, f)!r}) must be a positive integer or none" for f in _OVERRIDES
                if getattr(self, f) is not None and (not isinstance(getattr(self, f), int) or getattr(self, f) < 1)]
        if not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            errs.append(f"{k}lora_rank ({self.lora_rank!r}) must be a positive integer")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            errs.append(f"{k}lora_alpha ({self.lora_alpha!r}) must be > 0 or none")
        if self.quant not in ("none", None) and self.finetune != "qlora":
            errs.append(f"{k}quant ({self.quant!r}) needs {k}finetune qlora (now {self.finetune!r}): a quantised base "
                        "is frozen, so only adapters can train on it")
        return errs

    @property
    def base_quant(self) -> str | None:
        """The format of the frozen base: "nf4" or "int8" for qlora, None otherwise."""
        if self.finetune != "qlora":
            return None
        return "nf4" if self.quant in ("none", None) else self.quant

    @property
    def adapters(self) -> bool:
        """LoRA adapters train (lora and qlora)."""
        return self.finetune in ("lora", "qlora")

    def config(self, *, buildable: bool = True, key_prefix: str = "model.") -> ModelConfig:
        """The ModelConfig this section describes. ``buildable``: refuse what ``tpkernels.models`` cannot
        build (training); False: keep it, for planning (``ModelConfig.build_errors`` says what)."""
        k = key_prefix
        src = self.init_from or self.name
        path = Path(str(src))
        if path.exists():
            mc = ModelConfig.read_hf(path, what=f"{k}init_from" if self.init_from else f"{k}name")
        elif str(src).lower() in {p.lower() for p in MODEL_PRESETS}:
            mc = model_preset(str(src))
        elif self.init_from or str(src).endswith(".json") or "/" in str(src):
            raise ValueError(f"{k}{'init_from' if self.init_from else 'name'} ({str(src)!r}) does not exist: give a "
                             "Hugging Face config.json or checkpoint folder, or a preset")
        else:
            raise ValueError(f"{k}name ({str(src)!r}) is not a known preset; choose one of {', '.join(MODEL_PRESETS)} "
                             "or give a Hugging Face config.json / checkpoint folder")
        overrides = {_OVERRIDES[f]: getattr(self, f) for f in _OVERRIDES if getattr(self, f) is not None}
        if self.init_from and overrides:
            raise ValueError(f"shape overrides {sorted(f'{k}{f}' for f in _OVERRIDES if getattr(self, f) is not None)} "
                             f"cannot change a model loaded from {k}init_from ({self.init_from!r})")
        if overrides.get("hidden_size") and "num_attention_heads" in overrides and mc.head_dim:
            overrides["head_dim"] = None
        if "num_attention_heads" in overrides and "num_kv_heads" not in overrides and mc.kv_heads == \
                mc.num_attention_heads:  # a multi-head preset stays multi-head
            overrides["num_kv_heads"] = None
        try:
            mc = mc.replace(**overrides)
        except ValueError as e:  # the rule is the description's; say which keys made the shape
            given = ", ".join(f"{k}{f}={getattr(self, f)}" for f in _OVERRIDES if getattr(self, f) is not None)
            raise ValueError(f"{e} (the model {mc.name or mc.model_type} with {given})") from None
        if self.drop_dropout:
            mc = mc.without_dropout()
        return mc.require_buildable() if buildable else mc


__all__ = ["FINETUNE_CHOICES", "ModelSection"]
