"""Shared pieces of the generation tests: tiny random Hugging Face models whose greedy continuations
vary (transformers' 0.02-std init makes a tiny model repeat one token, which would hide a wrong
position or a stale cache), and transformers' own greedy ``generate`` as the oracle."""

from __future__ import annotations

import torch

from model_checks import VOCAB, hf_config


def save_varied_model(family: str, folder, seed: int, std: float = 0.25, **shape) -> str:
    """A tiny random ``family`` model (model_checks.hf_config shapes) with every weight drawn N(0, std)
    (norm weights around 1), saved in float64."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **shape)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name or "ln_" in name
            p.normal_(mean=1.0 if is_norm and name.endswith("weight") else 0.0, std=0.1 if is_norm else std)
    model.save_pretrained(str(folder))
    return str(folder)


def hf_greedy(folder: str, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (float64, eager attention)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
        out.append(ids[0, len(p):].tolist())
    return out


def random_prompts(seed: int, lengths, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
