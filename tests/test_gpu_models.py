"""Whole models on a GPU in bf16 (the interpreter computes bf16 wrongly, so these run only in
benchmarks/gpu_check.sh): ours (Triton kernels) and a transformers model patched with
``apply_kernels``, against the same model in float64, with the FlashAttention rule (the error of
transformers' own bf16 model sets the scale)."""

from __future__ import annotations

import pytest
import torch

from model_checks import save_tiny_model
from tpkernels.testing.tolerance import assert_fa_close

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")
SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512)


def _hf(folder, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).cuda()


def _loss_and_grads(model, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_parallel_transformer_bf16(tmp_path, family):
    from tpkernels.models import ParallelTransformer, next_token_targets

    folder = save_tiny_model(family, tmp_path, 0, **SHAPE)
    ids = torch.randint(0, 97, (2, 63), device="cuda")
    loss64, grads64 = _loss_and_grads(_hf(folder, torch.float64), ids)
    loss_lp, grads_lp = _loss_and_grads(_hf(folder, torch.bfloat16), ids)
    ours = ParallelTransformer.from_hf(folder, dtype=torch.bfloat16, device="cuda")
    loss = ours.step(ids, next_token_targets(ids), num_microbatches=1)
    # the loss is an fp32 mean over bf16 logits: a floor of ~1e-4 relative on top of the rule
    assert_fa_close(torch.tensor(loss, dtype=torch.float32), loss64.cpu(), loss_lp.cpu(), ulps=1024, name="loss")
    grads = ours.to_hf_state_dict("grad")
    for name in grads64:
        assert_fa_close(grads[name], grads64[name], grads_lp[name], grad=True, ulps=64, name=name)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_apply_kernels_bf16(tmp_path, family):
    from tpkernels.hf import apply_kernels

    folder = save_tiny_model(family, tmp_path, 0, **SHAPE)
    ids = torch.randint(0, 97, (2, 61), device="cuda")
    loss64, grads64 = _loss_and_grads(_hf(folder, torch.float64), ids)
    loss_lp, grads_lp = _loss_and_grads(_hf(folder, torch.bfloat16), ids)
    patched = _hf(folder, torch.bfloat16)
    apply_kernels(patched)
    loss, grads = _loss_and_grads(patched, ids)
    assert_fa_close(loss.float(), loss64, loss_lp, ulps=1024, name="loss")
    for name in grads64:
        assert_fa_close(grads[name], grads64[name], grads_lp[name], grad=True, ulps=64, name=name)
