"""Shared pieces of the model tests: tiny random Hugging Face models saved as safetensors, and the
rank worker that checks our model at a layout against ``transformers`` (loss, logits, every
parameter gradient, fp32)."""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB = 97  # odd: padding rows on every layout


def hf_config(family: str, *, layers: int = 4, heads: int = 4, kv_heads: int = 2, hidden: int = 32, ffn: int = 40):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=None, eos_token_id=None)
    if family == "llama":  # GQA and Llama 3.1's rope scaling
        return transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0})
    if family == "qwen2":  # q/k/v bias
        return transformers.Qwen2Config(**common)
    if family == "mistral":  # sliding window shorter than the sequence, explicit head_dim
        return transformers.MistralConfig(**{**common, "hidden_size": 24}, head_dim=8, sliding_window=5)
    raise ValueError(family)


def save_tiny_model(family: str, folder, seed: int, **shape) -> str:
    """A random tiny model of ``family`` written with ``save_pretrained`` (safetensors). Biases are
    random too (transformers initialises them to zero, which would hide a bias mix-up)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **shape)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.normal_(mean=1.0 if name.endswith("weight") else 0.0, std=0.3)
    model.save_pretrained(str(folder))
    return str(folder)


def hf_reference(folder: str, ids: torch.Tensor, position_ids=None):
    """(logits, loss, {name: grad}) of the transformers model (eager attention, fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    out = hf(ids, labels=ids, position_ids=position_ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


def all_stages(sd: dict) -> dict:
    """Merge per-stage dicts of every rank (copies from TP/DP ranks are equal)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sd
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sd)
    out = {}
    for d in every:
        out.update(d)
    return out


def parity_worker(rank, world, folder, layout: dict, seed: int, schedule: str = "1f1b", overlap: bool = True,
                  layer_counts=None, batch: int = 4, seq: int = 12):
    from tpkernels.functional.context_parallel import zigzag_split
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    pc = ParallelConfig(**layout)
    state = ParallelState.create(pc)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    ref_logits, ref_loss, ref_grads = hf_reference(folder, ids)

    model = ParallelTransformer.from_hf(folder, state, overlap_comm=overlap, layer_counts=layer_counts)
    rows = slice(state.dp_rank * batch // pc.dp, (state.dp_rank + 1) * batch // pc.dp)
    my_ids = ids[rows]
    targets = next_token_targets(my_ids)
    cp = pc.cp
    share = (lambda t: zigzag_split(t, cp, state.cp_rank, dim=1)) if cp > 1 else (lambda t: t)  # noqa: E731
    loss = model.step(share(my_ids), share(targets), schedule=schedule)  # positions: the zigzag's, by default
    model.finish_grad_sync()
    if pc.dp * cp > 1:  # each CP rank's loss is its part of the token mean: average them with DP's
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=state.dp_cp_group)
        loss = t.item() / (pc.dp * cp)
    assert abs(loss - ref_loss.item()) < 1e-5, (loss, ref_loss.item())

    grads = all_stages(model.to_hf_state_dict("grad"))
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")

    if pc.pp == 1:  # logits (the last stage only exists alone without PP), and gradients through them
        model.zero_grad(set_to_none=True)
        logits = model(share(my_ids))
        torch.testing.assert_close(logits.detach(), share(ref_logits[rows]), rtol=1e-5, atol=1e-5)
        # this rank's token sum over the replica's token count, × CP: the DP × CP mean is the token mean
        local = share(targets)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), local.reshape(-1),
                                          ignore_index=-100, reduction="sum").mul(
            cp / int((targets != -100).sum())).backward()
        model.finish_grad_sync()
        grads = model.to_hf_state_dict("grad")
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=2e-6,
                                       msg=lambda m, n=name: f"{n} (through the logits): {m}")
    return len(grads)
