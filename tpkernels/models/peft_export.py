"""LoRA adapters as a PEFT folder: ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(hf_base, folder)`` loads onto the Hugging Face base model.

    write_peft(model, "adapters/", base_model="path/to/hf_base")   # model: one process, adapters applied

Our fused layers hold one adapter where the Hugging Face model has several linears: q/k/v in one
column-parallel GEMM (and gate/up) share A (r × in) and split B's rows, so each Hugging Face module
gets A itself and its own rows of B — the same update, B_q·A = (B·A)_q. A row-parallel layer's HF
linear is the whole layer. PEFT's scale is lora_alpha / r, ours alpha / rank: the same number.
Written on the CPU in float32 (PEFT casts to the base's dtype when it loads). Models whose Hugging
Face layers are stored transposed (GPT-2's Conv1D) are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tpkernels.models.lora import LoRA

PEFT_PREFIX = "base_model.model."


def peft_tensors(model) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{PEFT key: tensor} of every adapter of ``model`` (a one-process ``ParallelTransformer`` with LoRA)
    and the sorted target module names (the last component of each adapted HF linear)."""
    base = model.param_parts()
    slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
    a_of: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        lora = getattr(m, "lora", None)
        if not isinstance(lora, LoRA):
            continue
        if lora.tp > 1:
            raise ValueError(f"PEFT export takes a one-process model; {name}'s adapter is a TP shard (tp {lora.tp})")
        A, B = lora.A.detach().float().cpu(), lora.B.detach().float().cpu()
        parts = [p for p in base[f"{name}.weight"] if p.name is not None]
        if any(p.transpose for p in parts):
            raise ValueError(f"PEFT export: {parts[0].name} is stored transposed in the Hugging Face model (GPT-2's "
                             "Conv1D): only Llama-family models (Llama, Qwen2, Mistral) are exported as PEFT adapters")
        if lora.column:  # B's rows follow the base rows, part by part
            off = 0
            for p in parts:
                lo, hi = p.rows if p.rows is not None else (0, m.weight.shape[0])
                slices.setdefault(p.name, []).append((lo, B[off:off + hi - lo]))
                a_of[p.name] = A
                off += hi - lo
        else:
            (p,) = parts
            slices[p.name] = [(0, B)]
            a_of[p.name] = A
    if not slices:
        raise ValueError("PEFT export: the model has no LoRA adapter (model.finetune is not lora)")
    out, targets = {}, set()
    for hf, pieces in slices.items():
        pieces.sort(key=lambda x: x[0])
        module = hf.removesuffix(".weight")
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a_of[hf].clone()  # one file entry each: PEFT loads per module
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.cat([b for _, b in pieces]).contiguous()
        targets.add(module.rsplit(".", 1)[-1])
    return out, sorted(targets)


def write_peft(model, out: str | Path, *, base_model: str | None, rank: int, alpha: float) -> Path:
    """``out``/adapter_config.json + adapter_model.safetensors of ``model``'s adapters (see the module
    docstring); ``base_model``: the Hugging Face base they apply to (recorded, as PEFT does)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    tensors, targets = peft_tensors(model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True,
              "init_lora_weights": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


__all__ = ["PEFT_PREFIX", "peft_tensors", "write_peft"]
