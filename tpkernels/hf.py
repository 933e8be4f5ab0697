"""Our kernels inside an existing ``transformers`` model, in place, weights kept.

    model = AutoModelForCausalLM.from_pretrained(...)
    tpkernels.hf.apply_kernels(model)        # Llama / Qwen2 / Mistral / GPT-2; returns what it swapped

What is swapped, per module instance (no global monkey-patching: other models in the process are
untouched, as in Liger-Kernel's ``apply_liger_kernel_to_llama`` but scoped to one model):

* RMSNorm -> :func:`tpkernels.rms_norm`; ``nn.LayerNorm`` over the last dim (GPT-2's ``ln_1``,
  ``ln_2``, ``ln_f``) -> :func:`tpkernels.layer_norm`. (Hugging Face's blocks add the residual
  outside the norm, so these run unfused; our own models fuse it.)
* attention (Llama family) -> q/k/v projections, :func:`tpkernels.apply_rotary` (on Hugging
  Face's own cos/sin, so every rope type and its attention scaling stays exact), and the
  attention core through the registered "tpkernels" attention implementation:
  :func:`tpkernels.flash_attn_func`, varlen for padded batches (unpadded by the 2-D mask) and for
  documents packed with restarting ``position_ids``; sliding windows as the model asks.
  GPT-2 keeps its projections and uses the same attention core.
* MLP: SwiGLU -> :func:`tpkernels.swiglu`; GPT-2 -> :func:`tpkernels.bias_gelu` fused with
  ``c_fc``'s bias.
* loss: with ``labels``, the causal-LM forward computes :func:`tpkernels.linear_cross_entropy`
  on the hidden states (logits never formed in training: ``logits`` is None then; in eval mode
  they are computed as usual), honouring ``num_items_in_batch`` as ``ForCausalLMLoss`` does.

Generation: the prefill runs our kernels and fills the KV cache; decoding steps (a cache that
already holds tokens) take the original attention forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.attention import flash_attn_func, flash_attn_varlen_func
from tpkernels.functional.bias_gelu import bias_gelu
from tpkernels.functional.linear_cross_entropy import linear_cross_entropy
from tpkernels.functional.norms import layer_norm, rms_norm
from tpkernels.functional.rotary import apply_rotary
from tpkernels.functional.swiglu import swiglu
from tpkernels.models.sequence import SequenceInfo

ATTN_NAME = "tpkernels"
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, is_causal=None, **kwargs):
    """The "tpkernels" attention implementation: query (b, nh, s, hd), key/value (b, nkv, s, hd),
    attention_mask None or the 2-D padding mask (b, s) -> ((b, s, nh, hd), None)."""
    if dropout > 0:
        raise ValueError(f"attention dropout ({dropout}) > 0 is not supported by the tpkernels attention")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = (-1, 0 if causal else -1) if not sliding_window else (sliding_window - 1, 0)
    sq, sk = query.shape[2], key.shape[2]
    if attention_mask is not None and sq != sk:  # decoding a padded batch: masked SDPA
        keep = attention_mask.bool()[:, None, None, -sk:]
        i, j = torch.arange(sq, device=query.device)[:, None], torch.arange(sk, device=query.device)[None]
        seen = j <= i + sk - sq if causal else torch.ones_like(i * j, dtype=torch.bool)
        if sliding_window:
            seen = seen & (j > i + sk - sq - sliding_window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=keep & seen, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, heads, hd) views
    b, s = q.shape[:2]
    kw = dict(softmax_scale=scaling, causal=causal, window_size=window)
    if attention_mask is not None:  # padding (full sequences): attend over the real tokens only
        keep = attention_mask.bool().reshape(-1)
        idx = keep.nonzero().reshape(-1)
        lens = attention_mask.bool().sum(1)
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        n = int(lens.max())
        out_tok = flash_attn_varlen_func(*(t.reshape(b * s, *t.shape[2:])[idx] for t in (q, k, v)), cu, cu, n, n,
                                         **kw)
        out = out_tok.new_zeros(b * s, *out_tok.shape[1:]).index_copy(0, idx, out_tok)
        return out.view(b, s, *out.shape[1:]), None
    position_ids = kwargs.get("position_ids")
    info = SequenceInfo.of(position_ids.expand(b, s)) if position_ids is not None and b * s > 0 else None
    if info is not None and info.cu_seqlens is not None:  # packed documents
        cu, n = info.cu_seqlens, info.max_seqlen
        out = flash_attn_varlen_func(*(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)), cu, cu, n, n, **kw)
        return out.view(b, s, *out.shape[1:]), None
    return flash_attn_func(q, k, v, **kw), None


def _register() -> None:
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask  # noqa: PLC0415

    AttentionInterface.register(ATTN_NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, flash_attention_mask)  # None unless there is padding


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _layer_norm_forward(self, hidden_states):
    return layer_norm(hidden_states, self.weight, self.bias, self.eps)


def _swiglu_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _gpt2_mlp_forward(self, hidden_states):
    fc = self.c_fc  # Conv1D: y = x @ W + b, W (in, out)
    y = bias_gelu(hidden_states @ fc.weight, fc.bias, self._tpk_gelu)
    return self.dropout(self.c_proj(y))


def _llama_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs):
    if past_key_values is not None and past_key_values.get_seq_length(self.layer_idx) > 0:  # decoding
        return self._tpk_original_forward(hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

    b, s = hidden_states.shape[:2]
    shape = (b, s, -1, self.head_dim)
    q, k, v = (proj(hidden_states).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
    cos, sin = position_embeddings  # (b or 1, s, hd): Hugging Face's angles, scaling included
    half = self.head_dim // 2
    cos_tok = cos[..., :half].expand(b, s, half).reshape(b * s, half).float().contiguous()
    sin_tok = sin[..., :half].expand(b, s, half).reshape(b * s, half).float().contiguous()
    tok = torch.arange(b * s, device=q.device).view(b, s)
    q, k = apply_rotary(q, k, cos_tok, sin_tok, position_ids=tok)
    if past_key_values is not None:  # prefill: the cache starts with this sequence's keys and values
        past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
    attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    # Qwen2 sets a per-layer window on the module (None on full-attention layers); Mistral's is the config's
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    out, weights = attn(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask,
                        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                        sliding_window=window, **kwargs)
    return self.o_proj(out.reshape(b, s, -1).contiguous()), weights


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    if labels is None:
        return self._tpk_original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_values=past_key_values,
                                          inputs_embeds=inputs_embeds, use_cache=use_cache,
                                          logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: PLC0415

    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              **kwargs)
    h = outputs.last_hidden_state
    head = self.get_output_embeddings()
    target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(h.device)  # ForCausalLMLoss's shift
    loss = linear_cross_entropy(h, head.weight, target, ignore_index=ignore_index,
                                reduction="sum" if num_items is not None else "mean")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    logits = None if self.training else head(h)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _swap(module, fn, what: str, done: dict) -> None:
    if not hasattr(module, "_tpk_original_forward"):
        module._tpk_original_forward = module.forward
    module.forward = types.MethodType(fn, module)
    done[what] = done.get(what, 0) + 1


def apply_kernels(model) -> dict[str, int]:
    """Swap, in place, ``model``'s norms (RMSNorm, LayerNorm), rotary, attention, MLP activation and loss
    for ours (see the module docstring). Returns how many modules of each kind were swapped. Raises
    ValueError for an architecture it does not know."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in ("llama", "qwen2", "mistral", "gpt2"):
        raise ValueError(f"model_type ({kind!r}) is not supported by apply_kernels; supported: llama, qwen2, "
                         "mistral, gpt2")
    if getattr(model.config, "hidden_act", "silu") not in ("silu", "swish") and kind != "gpt2":
        raise ValueError(f"hidden_act ({model.config.hidden_act!r}) must be 'silu' for the SwiGLU kernel")
    _register()
    done: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            _swap(m, _rms_norm_forward, "rms_norm", done)
        elif isinstance(m, torch.nn.LayerNorm) and len(m.normalized_shape) == 1:
            _swap(m, _layer_norm_forward, "layer_norm", done)
        elif name.endswith("Attention") and all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            _swap(m, _llama_attention_forward, "attention+rotary", done)
        elif name.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            _swap(m, _swiglu_forward, "swiglu", done)
        elif name == "GPT2MLP":
            act = model.config.activation_function
            if act not in _GELU:
                raise ValueError(f"activation_function ({act!r}) must be one of {', '.join(_GELU)}")
            m._tpk_gelu = _GELU[act]
            _swap(m, _gpt2_mlp_forward, "bias_gelu", done)
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        _swap(model, _causal_lm_forward, "linear_cross_entropy", done)
    model.config._attn_implementation = ATTN_NAME
    for sub in model.modules():  # sub-configs (and copies) that modules keep
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_NAME
    done["attention core"] = sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
    return done


__all__ = ["apply_kernels", "attention_forward"]
