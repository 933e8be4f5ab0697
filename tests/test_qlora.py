"""QLoRA: LoRA adapters on a frozen NF4 (or int8) base that each rank quantises from its own slices.

The oracle of every layout is the one-process LoRA model in float64 whose base weights are the
layout's dequantised shards, gathered (to_hf_state_dict returns them): the NF4 GEMMs compute with
exactly those values (tests/test_nf4_linear.py), so losses, every adapter gradient at step 0 and
the adapters after the steps agree to reduction order. The tiny Llama's shards (hidden 32, MLP 40,
GQA) are not multiples of 64: every piece ends in a short block.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.config import ALIASES

from test_train import SMALL

SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
BASE = {k: v for k, v in SMALL.items() if k.split(".")[-1] not in SHAPE_KEYS}
FP64 = dict(rtol=1e-9, atol=1e-12)


def _cfg(folder: str, finetune: str = "qlora", **kw) -> TrainConfig:
    return TrainConfig.from_values({**BASE, "model.init_from": folder, "model.name": folder, "model.finetune": finetune,
                                    "model.lora_rank": 4, "training.precision": "fp64", "training.steps": 3,
                                    **{ALIASES.get(k, k): v for k, v in kw.items()}})


def _adapters(model, which: str) -> dict[str, torch.Tensor]:
    """Every adapter tensor (or its gradient) whole, in Hugging Face names, gathered over all ranks."""
    from tpkernels.parallel import control
    from tpkernels.train.checkpoint import rectangles

    mine = []
    for p, sl, name, rows, cols in rectangles(model):
        if name.startswith("lora_"):
            t = p.grad if which == "grad" else p.data
            mine.append((name, rows, cols, t[sl].detach().cpu().clone()))
    every = control.all_gather_objects(mine) if torch.distributed.is_initialized() else [mine]
    full: dict[str, torch.Tensor] = {}
    for pieces in every:
        for name, rows, cols, t in pieces:
            r1, c1 = rows[1], cols[1] if cols else t.shape[1]
            cur = full.get(name)
            if cur is None or cur.shape[0] < r1 or cur.shape[1] < c1:
                grown = torch.full((max(r1, 0 if cur is None else cur.shape[0]),
                                    max(c1, 0 if cur is None else cur.shape[1])), float("nan"), dtype=t.dtype)
                if cur is not None:
                    grown[:cur.shape[0], :cur.shape[1]] = cur
                full[name] = cur = grown
            cur[rows[0]:r1, (cols[0] if cols else 0):c1] = t
    assert all(not bool(v.isnan().any()) for v in full.values()), "an adapter rectangle was never covered"
    return full


def _run(cfg: TrainConfig, env: dict | None = None):
    """(losses of the steps, adapter gradients of step 0, adapters at the end, the dequantised base)."""
    from model_checks import all_stages

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        t = Trainer(cfg)
        base = all_stages(t.model.to_hf_state_dict())
        t.forward_backward(t.prepare_batch(0))
        t.reduce_gradients()
        grads = _adapters(t.model, "grad")
        history = t.train()
        return [h["loss"] for h in history], grads, _adapters(t.model, "data"), base
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(rank, world, folder, kw, env):
    return _run(_cfg(folder, **kw), env)


def _oracle(folder: str, base: dict, tmp: Path, kw: dict):
    """The one-process LoRA run in fp64 on ``base`` (the layout's dequantised weights), the whole global batch at
    once."""
    from safetensors.torch import save_file

    deq = tmp / "dequantised"
    shutil.rmtree(deq, ignore_errors=True)
    deq.mkdir(parents=True)
    shutil.copy(Path(folder) / "config.json", deq / "config.json")
    save_file({k: v.contiguous() for k, v in base.items()}, str(deq / "model.safetensors"), metadata={"format": "pt"})
    pc = _cfg(folder, **kw).parallel
    batch = pc.micro_batch_size * pc.num_microbatches * (pc.dp or 1)
    return _run(_cfg(str(deq), "lora", micro_batch_size=batch, num_microbatches=1))


@pytest.fixture
def tiny_llama(tmp_path, fresh_seed):
    from model_checks import save_tiny_model

    return save_tiny_model("llama", tmp_path / "base", fresh_seed % 1000, layers=4)


CASES = {
    "tp2pp2-sp-1f1b-ring": (4, dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, micro_batch_size=2),
                            {"TPKERNELS_BACKEND": "gemm_comm=ring"}),
    "tp2pp2-sp-zb-h1": (4, dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4, schedule="zb-h1"), {}),
    "dp2-zero1-recompute": (2, dict(dp=2, zero1=True, recompute="full", num_microbatches=2), {}),
    "cp2": (2, dict(cp=2, num_microbatches=2), {}),
    "tp2-sp-int8": (2, {"tp": 2, "sequence_parallel": True, "num_microbatches": 2, "model.quant": "int8"}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qlora_layout_equals_one_process_lora_on_the_same_dequantised_base(rank_pool, tmp_path, tiny_llama, case):
    world, kw, env = CASES[case]
    losses, grads, adapters, base = rank_pool(world).run(_worker, tiny_llama, kw, env, timeout=300)[0]
    from safetensors.torch import load_file

    original = load_file(f"{tiny_llama}/model.safetensors")
    # the base is quantised: near the original, never equal to it (and never trained)
    q = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(base[q], original[q].double())
    torch.testing.assert_close(base[q], original[q].double(), rtol=0, atol=float(original[q].abs().max()) / 4)
    assert all(torch.equal(base[k], original[k].double()) for k in original if "norm" in k or "embed" in k)
    want_losses, want_grads, want_adapters, _ = _oracle(tiny_llama, base, tmp_path, kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **FP64)
    assert losses[-1] != losses[0]
    # per layer: A of q/k/v and B of q, k, v; A, B of o; A of gate/up and B of gate, up; A, B of down
    assert sorted(grads) == sorted(want_grads) and len(grads) == 4 * 11
    for k in want_grads:
        torch.testing.assert_close(grads[k], want_grads[k], **FP64, msg=lambda m, k=k: f"{case} grad {k}: {m}")
        torch.testing.assert_close(adapters[k], want_adapters[k], **FP64, msg=lambda m, k=k: f"{case} {k}: {m}")
    assert any(float(v.abs().sum()) > 0 for k, v in grads.items() if k.startswith("lora_B"))
