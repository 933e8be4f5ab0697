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
    "pp2-interleaved": (2, dict(pp=2, virtual_stages=2, schedule="interleaved", num_microbatches=2), {}),
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


# ---- resume, checkpoints, export ----

def _bytes(model) -> dict[str, list[torch.Tensor]]:
    """Every quantised weight's buffers (codes, absmax codes, scales, offset) by layer, on the CPU."""
    from tpkernels.models.hf_io import quantized_layers

    return {name: [b.detach().cpu().clone() for b in m.qweight.buffers()] for name, m in quantized_layers(model).items()}


def _resume_worker(rank, world, folder, kw):
    """Losses of the run at ``kw``, its quantised bytes before the steps and after a resume (if it resumed)."""
    t = Trainer(_cfg(folder, **kw))
    return [h["loss"] for h in t.train()], _bytes(t.model), t.resumed_from is not None, _adapters(t.model, "data")


def test_resume_requantises_the_same_bytes_and_reshards_the_adapters(rank_pool, tmp_path, tiny_llama):
    ck = str(tmp_path / "ck")
    layout = dict(tp=2, sequence_parallel=True, num_microbatches=2)
    whole = rank_pool(2).run(_resume_worker, tiny_llama, {**layout, "steps": 4}, timeout=300)
    first = rank_pool(2).run(_resume_worker, tiny_llama, {**layout, "steps": 4, "stop_at_step": 2, "save_dir": ck},
                             timeout=300)
    again = rank_pool(2).run(_resume_worker, tiny_llama, {**layout, "steps": 4, "save_dir": ck}, timeout=300)
    assert again[0][2] and not first[0][2]
    # the same layout re-quantises the same bytes, and the run continues exactly as the uninterrupted one
    for r in range(2):
        assert first[r][1].keys() == again[r][1].keys()
        assert all(torch.equal(a, b) for k in first[r][1] for a, b in zip(first[r][1][k], again[r][1][k]))
    torch.testing.assert_close(torch.tensor(first[0][0] + again[0][0]), torch.tensor(whole[0][0]), **FP64)
    # the checkpoint holds the adapters, the norms, the embedding and the head, never a quantised base weight
    from tpkernels.train.checkpoint import latest
    from tpkernels.train.checkpoint_files import read_dcp_metadata

    keys = list(read_dcp_metadata(latest(ck)).state_dict_metadata)
    assert any("lora_A" in k for k in keys) and any("embed_tokens" in k for k in keys)
    assert not [k for k in keys if "lora" not in k and any(p in k for p in ("_proj.weight",))]
    # at another layout (one process): the adapters of step 4 resharded, the base quantised as one process does
    from tpkernels.models import ParallelTransformer

    one = Trainer(_cfg(tiny_llama, steps=4, save_dir=ck))
    assert one.resumed_from is not None and one.step_index == 4
    fresh = ParallelTransformer.from_hf(tiny_llama, quant="nf4", dtype=torch.float64)
    got, want = _bytes(one.model), _bytes(fresh)
    assert got.keys() == want.keys() and all(torch.equal(a, b) for k in got for a, b in zip(got[k], want[k]))
    saved = again[0][3]
    for k, v in _adapters(one.model, "data").items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)


def test_one_process_pieces_are_bitsandbytes_bytes_of_each_hugging_face_tensor(tiny_llama):
    """The fused q/k/v and gate/up layers quantise each Hugging Face tensor on its own: one process holds
    bitsandbytes' bytes of q_proj, k_proj, v_proj (quantize_nf4 equals bitsandbytes: test_nf4_quant.py)."""
    from safetensors.torch import load_file

    from tpkernels.models import ParallelTransformer
    from tpkernels.quant import quantize_nf4

    original = load_file(f"{tiny_llama}/model.safetensors")
    model = ParallelTransformer.from_hf(tiny_llama, quant="nf4")
    qkv = model.chunks[0].layers[1].attention.qkv.qweight.pieces()
    for piece, role in zip(qkv, ("q", "k", "v")):
        want = quantize_nf4(original[f"model.layers.1.self_attn.{role}_proj.weight"])
        for f in ("packed", "absmax_q", "absmax_scale", "absmax_offset"):
            assert torch.equal(getattr(piece, f), getattr(want, f)), (role, f)


def test_base_memory_per_rank_is_at_most_0_6_bytes_per_parameter(tmp_path):
    """A Llama whose shards are 64-multiples (hidden 256, MLP 704): the quantised base's storage over its
    parameters, no full-precision copy left on the model, and a load whose peak grows by the quantised
    bytes per layer (one tensor is full precision at a time), not by a 16-bit layer."""
    from model_checks import save_tiny_model

    from tpkernels.live_bytes import LiveTensorBytes
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.hf_io import quantized_layers

    peaks, sizes = [], []
    for layers in (2, 4):
        folder = save_tiny_model("llama", tmp_path / f"b{layers}", 3, layers=layers, hidden=256, heads=4, kv_heads=2,
                                 ffn=704)
        with LiveTensorBytes() as mem:
            model = ParallelTransformer.from_hf(folder, quant="nf4", dtype=torch.bfloat16)
        quantised = quantized_layers(model)
        params = sum(m.weight.numel() for m in quantised.values())
        stored = sum(m.qweight.nbytes for m in quantised.values())
        assert 0.5 < stored / params <= 0.6, stored / params  # 4 bits a weight is the floor: nothing left out
        assert not [n for n, _ in model.named_parameters() if n.endswith(("qkv.weight", "out.weight", "gate_up.weight",
                                                                         "down.weight"))]
        assert all(m.weight.device.type == "meta" for m in quantised.values())
        peaks.append(mem.peak_bytes)
        sizes.append((params, stored + sum(p.numel() * p.element_size() for p in model.parameters())))
    grown_params, grown_bytes = sizes[1][0] - sizes[0][0], sizes[1][1] - sizes[0][1]
    # two more layers: the peak grows by what they store (~0.52 B a weight), far from 2 B a weight
    assert peaks[1] - peaks[0] <= grown_bytes + 0.1 * grown_params, (peaks, sizes)
    assert peaks[1] - peaks[0] < 2 * grown_params / 2


def _export_worker(rank, world, folder, kw):
    """The run's A before any step (whole, every rank's), its dequantised base and its eval/loss after the
    last step."""
    from model_checks import all_stages

    t = Trainer(_cfg(folder, **kw))
    a = {k: v for k, v in _adapters(t.model, "data").items() if k.startswith("lora_A")}
    return a, all_stages(t.model.to_hf_state_dict()), t.train()[-1]["eval/loss"]


EXPORT_CASES = {  # hidden 128, MLP 128: at TP2 every shard's in_features is 64; at TP4 32 (blocks span two rows)
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "tp4-32-columns": (4, dict(tp=4)),  # and KV heads replicated (2 < 4)
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_is_the_model_the_tp_run_trained(rank_pool, tmp_path, fresh_seed, case):
    """Trained at TP2 / TP4, exported by export-hf: each rank's shards of the base quantised and dequantised as
    that rank did, bit for bit (the one-process quantisation is another model: 1.5e-5 and 2.8e-3 away in
    relative loss), plus the merged adapters, so the export's held-out loss equals the run's eval/loss to
    the fp32 rounding of the export (~1e-9).
    The adapters' A started as one process draws them from training.seed (never from seed 0). TP2 also
    writes the adapters alone (export-peft): PEFT on the base as one process quantises it gives our
    one-process QLoRA model's logits."""
    import transformers

    from model_checks import save_tiny_model
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.hf_io import dequantize_as_trained_at_
    from tpkernels.models.lora import apply_lora
    from tpkernels.train.checkpoint import export_hf, export_peft, latest, load

    world, layout = EXPORT_CASES[case]
    seed = fresh_seed % 1000 + 1
    folder = save_tiny_model("llama", tmp_path / "base", seed, layers=2, hidden=128, ffn=128)
    ck, out = tmp_path / "ck", tmp_path / "export-hf"
    held_out = {"eval.source": "random-documents", "eval.every": 2, "eval.batches": 1, "training.seed": seed}
    kw = dict(num_microbatches=2, steps=2, save_dir=str(ck), **held_out)
    a, base, eval_loss = rank_pool(world).run(_export_worker, folder, {**layout, **kw}, timeout=300)[0]
    # the base the export rebuilds in one process is the run's, bit for bit
    one = ParallelTransformer(_cfg(folder).model_config(), None, init=None, quant="nf4", dtype=torch.float64)
    quantised = [k for k in base if k.endswith("proj.weight")]
    got = dequantize_as_trained_at_(one, folder, world).to_hf_state_dict()
    assert len(quantised) == 2 * 7 and all(torch.equal(got[k], base[k]) for k in quantised), case
    for s, same in ((seed, True), (0, False)):
        one = ParallelTransformer.from_hf(folder, dtype=torch.float64)
        apply_lora(one, 4, seed=s)
        drawn = {k: v for k, v in _adapters(one, "data").items() if k.startswith("lora_A")}
        assert drawn.keys() == a.keys() and all(torch.equal(a[k], drawn[k]) == same for k in a), (s, same)
    export_hf(ck, out)  # what the export-hf command calls (its CLI: test_train)
    evaluation = Trainer(TrainConfig.from_values({**BASE, "model.name": str(out), "model.init_from": str(out),
                                                  "training.precision": "fp64", ALIASES["num_microbatches"]: 2,
                                                  **held_out}))
    assert evaluation.validate()["eval/loss"] == pytest.approx(eval_loss, rel=1e-7, abs=0)
    if world != 2:
        return
    import peft

    export_peft(ck, tmp_path / "export-peft")
    ours = ParallelTransformer.from_hf(folder, quant="nf4")
    apply_lora(ours, 4)
    load(latest(ck), ours)
    assert any(float(m.lora.B.detach().abs().sum()) > 0 for m in ours.modules() if hasattr(m, "lora"))
    ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        # PEFT on the base whose linears hold the dequantised NF4 values (what bitsandbytes' Linear4bit computes with)
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        base.load_state_dict(ours.to_hf_state_dict(), strict=False)
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "export-peft")).eval()
        torch.testing.assert_close(adapted(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
        config = json.loads((tmp_path / "export-peft" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["base_model_name_or_path"] == folder


# ---- bad input ----

def test_bad_inputs_are_named_on_every_rank(rank_pool, tmp_path, tiny_llama):
    from tpkernels.nn import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(ValueError, match=r"model.quant \('nf4'\) needs model.finetune qlora \(now 'full'\)"):
        _cfg(tiny_llama, "full", **{"model.quant": "nf4"}).check()
    with pytest.raises(ValueError, match=r"model.quant \('int8'\) needs model.finetune qlora \(now 'lora'\)"):
        _cfg(tiny_llama, "lora", **{"model.quant": "int8"}).check()
    with pytest.raises(ValueError, match="model.quant"):
        _cfg(tiny_llama, **{"model.quant": "fp4"}).check()
    # the CUDA kernels step K one NF4 block at a time: named before anything is allocated on the GPU
    with pytest.raises(ValueError, match=r"in_features per rank \(40\) must be a multiple of 64"):
        RowParallelLinear(40, 64, bias=False, device="cuda", quant="nf4")
    with pytest.raises(ValueError, match=r"algo \('fused'\) reads a 16-bit weight"):
        ColumnParallelLinear(64, 64, algo="fused", quant="nf4")
    with pytest.raises(ValueError, match=r"quant \('nf3'\) must be one of nf4, int8"):
        ColumnParallelLinear(64, 64, quant="nf3")
    # a checkpoint of another base: every rank names it
    ck = str(tmp_path / "ck")
    layout = dict(tp=2, num_microbatches=2, steps=2, save_dir=ck)
    rank_pool(2).run(_resume_worker, tiny_llama, layout, timeout=300)
    for other, says in (({"model.quant": "int8"}, "builds a int8 base"), ({"finetune": "lora"}, "full-precision base")):
        errors = rank_pool(2).run(_refused_worker, tiny_llama, {**layout, "steps": 3, **other}, timeout=300)
        assert all("was saved with model.finetune qlora with model.quant nf4" in e and says in e for e in errors), errors
    # adapters of another rank: refused by name on every rank (it loaded them and their moments truncated)
    errors = rank_pool(2).run(_refused_worker, tiny_llama, {**layout, "steps": 3, "model.lora_rank": 2}, timeout=300)
    assert all("model.lora_rank (4 in the checkpoint, 2 here)" in e for e in errors) and len(errors) == 2, errors


def _refused_worker(rank, world, folder, kw):
    finetune = kw.pop("finetune", "qlora")
    try:
        Trainer(_cfg(folder, finetune, **kw))
    except ValueError as e:
        return str(e)
    return "no error"


# ---- the fine-tuning tasks on a quantised base ----

def test_dpo_on_qlora_cached_reference_equals_adapters_off(tmp_path):
    """DPO with QLoRA: the cached reference and the adapters-off reference of every step (the quantised base
    alone) give the same run."""
    from test_dpo import cached_equals_adapters_off

    cached_equals_adapters_off(tmp_path, "qlora")


def _sft_worker(rank, world, tmp_path, kw):
    from test_sft import _train as sft_train

    return sft_train(tmp_path, kw)


def test_sft_on_qlora_at_dp2_zero1_equals_one_process_and_bf16_tracks_fp64(rank_pool, tmp_path):
    """SFT (prompts masked) on an NF4 base: DP2 with ZeRO-1 and full recompute trains what one process trains
    (the same base: TP1 quantises alike); bf16 with fp32 masters stays within 2% of the fp64 losses."""
    from test_sft import _train as sft_train

    q = {"model.finetune": "qlora", "model.lora_rank": 4}
    want = sft_train(tmp_path, dict(micro_batch_size=2, num_microbatches=1, **q))
    assert want[0][-1] != want[0][0]
    for loss, norm in rank_pool(2).run(_sft_worker, tmp_path, dict(dp=2, micro_batch_size=1, num_microbatches=1,
                                                                   zero1=True, recompute="full", **q), timeout=300):
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want[0]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want[1]), rtol=1e-6, atol=0)
    bf16 = sft_train(tmp_path, {"micro_batch_size": 2, "num_microbatches": 1, "training.precision": "bf16", **q})[0]
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(want[0]), rtol=2e-2, atol=0)
