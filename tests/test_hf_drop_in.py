"""``tpkernels.hf.apply_kernels``: a transformers model with our kernels swapped in gives the
unpatched model's loss, logits and every parameter gradient (fp32), for Llama (GQA, llama3
rope), Qwen2 (q/k/v bias), Mistral (sliding window) and GPT-2, on dense, padded and packed
batches."""

from __future__ import annotations

import copy

import pytest
import torch

from model_checks import VOCAB, hf_config

transformers = pytest.importorskip("transformers")


def _pair(family):
    ref = transformers.AutoModelForCausalLM.from_config(hf_config(family, layers=2), attn_implementation="eager")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.3)
    ours = copy.deepcopy(ref)
    from tpkernels.hf import apply_kernels

    swapped = apply_kernels(ours)
    return ref, ours, swapped


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_training_loss_and_gradients_match(family):
    ref, ours, swapped = _pair(family)
    expected_kinds = {"bias_gelu", "layer_norm"} if family == "gpt2" else {"rms_norm", "attention+rotary", "swiglu"}
    assert expected_kinds | {"linear_cross_entropy"} <= set(swapped), swapped
    assert swapped.get("layer_norm" if family == "gpt2" else "rms_norm") == 2 * 2 + 1  # two per layer + the final
    ids = torch.randint(0, VOCAB, (3, 17))
    want = ref(ids, labels=ids)
    want.loss.backward()
    ours.train()
    got = ours(ids, labels=ids)
    assert got.logits is None  # training with labels: no logits formed
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    g_ref, g_ours = _grads(ref), _grads(ours)
    assert set(g_ref) == set(g_ours)
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=2e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eval_logits_and_padding(family):
    ref, ours, _ = _pair(family)
    ref.eval(), ours.eval()
    ids = torch.randint(0, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding in row 1
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask), ours(ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(got.logits[keep], want.logits[keep], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        got_loss = ours(ids, labels=ids).loss
        want_loss = ref(ids, labels=ids).loss
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)


def test_packed_documents_do_not_attend_across():
    """Two documents in one row (position_ids restart) give the logits of each document alone."""
    _, ours, _ = _pair("llama")
    ours.eval()
    a, b = torch.randint(0, VOCAB, (1, 7)), torch.randint(0, VOCAB, (1, 10))
    pos = torch.cat([torch.arange(7), torch.arange(10)])[None]
    with torch.no_grad():
        packed = ours(torch.cat([a, b], 1), position_ids=pos).logits
        alone = torch.cat([ours(a).logits, ours(b).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_unknown_architecture_is_refused():
    from tpkernels.hf import apply_kernels

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    with pytest.raises(ValueError, match=r"model_type \('bert'\) is not supported"):
        apply_kernels(transformers.BertForMaskedLM(cfg))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_generation_with_left_padding_is_unchanged(family):
    """Prefill runs our kernels and fills the KV cache; decoding steps use the model's own path."""
    ref, ours, _ = _pair(family)
    ref.eval(), ours.eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert ours.generate(ids, **kw).tolist() == ref.generate(ids, **kw).tolist()
