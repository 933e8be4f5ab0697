"""Activation bytes of one decoder layer for one micro-batch on one GPU.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count,
per layer, with 16-bit activations and 1-byte dropout masks:

    no parallelism:  s·b·h·(34 + 5·a·s/h)
    tensor parallel: s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + sequence parallel: s·b·h/t·(34 + 5·a·s/h)

The 10 is what TP leaves replicated: two norm inputs (4), the QKV and first-MLP GEMM inputs (2+2)
and two dropout masks (1+1). The 24 is split over TP: Q, K, V (6), the output-projection input (2),
the GeLU input and the second MLP GEMM input (8+8). The 5·a·s/h is the attention scores: the
softmax output (2), its dropout mask (1) and the dropout output (2). This module keeps those
terms but sizes them from the model, so that GQA (smaller K/V), SwiGLU (three MLP tensors of
ffn width), models without dropout and FlashAttention (no scores stored) are counted right; for
GPT shapes it reduces exactly to the formulas above (tests/test_planner_memory.py checks this).

Context parallelism (``cp`` > 1) gives each rank s/cp of the sequence: every term scales with the
local tokens, except the scores (local queries × all keys, so a·s/h keeps the full s). The
``allgather`` algorithm keeps the gathered K/V of the whole sequence for the backward (cp × the
local K/V); ``ring`` holds two K/V blocks in flight and fp32 dK/dV accumulators, ``a2a`` the
head-sharded copies of q, k, v and the output, both only while the layer's attention runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpkernels.description import ModelConfig


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per layer per micro-batch on one GPU.

    stored: kept from forward to backward under the chosen recompute policy.
    produced: written by the layer's forward without recompute (what the memory-bound kernels move).
    recompute_peak: extra bytes alive while one layer is recomputed in backward.
    """

    stored: float
    produced: float
    recompute_peak: float


def layer_activation_terms(model: ModelConfig, *, dropout: bool, flash_attention: bool) -> dict[str, float]:
    """The coefficients of s·b·h, per GPU before TP division: {"replicated", "split", "scores"},
    with "scores" multiplying a·s/h."""
    h = model.hidden_size
    replicated = 4.0 + 2.0 + 2.0 + (2.0 if dropout else 0.0)
    attn = 2.0 * model.q_dim / h + 2.0 * 2.0 * model.kv_dim / h + 2.0 * model.q_dim / h
    tensors_of_ffn_width = 3 if model.gated_mlp else 2  # gate, up, product | GeLU in, GeLU out
    mlp = 2.0 * tensors_of_ffn_width * model.ffn_hidden_size / h
    if flash_attention:
        scores = 0.0  # only the log-sum-exp (4·a·s·b bytes) is kept: negligible
    else:
        scores = 2.0 + (3.0 if dropout else 0.0)
    return {"replicated": replicated, "split": attn + mlp, "scores": scores}


def layer_activations(model: ModelConfig, *, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                      recompute: str, flash_attention: bool, cp: int = 1, cp_algo: str = "ring") -> LayerActivations:
    """``seq`` is the whole sequence; with ``cp`` > 1 this rank holds seq / cp of it."""
    terms = layer_activation_terms(model, dropout=model.dropout > 0, flash_attention=flash_attention)
    sbh = float(seq) / cp * micro_batch * model.hidden_size
    a_s_over_h = model.num_attention_heads * seq / model.hidden_size
    replicated = terms["replicated"] / (tp if sequence_parallel else 1)
    kv_replication = 1.0
    if tp > model.kv_heads:  # each TP rank keeps one whole KV head: K and V are not split further
        kv_replication = tp / model.kv_heads
    kv_part = 4.0 * model.kv_dim / model.hidden_size
    local_kv = kv_part * kv_replication / tp
    split = terms["split"] / tp - kv_part / tp + local_kv
    transient = 0.0
    if cp > 1 and cp_algo == "allgather":
        split += (cp - 1) * local_kv  # the whole sequence's K/V, kept for the backward
    elif cp > 1 and cp_algo == "ring":
        # the next block in flight; fp32 dK/dV of the block computed, of the one sent and of the one arriving
        transient = local_kv * (1.0 + 3 * 2.0)
    elif cp > 1:  # a2a: q, k, v and the output, head-sharded
        transient = 2.0 * (2.0 * model.q_dim / model.hidden_size / tp) + local_kv
    scores = terms["scores"] * a_s_over_h / tp
    produced = sbh * (replicated + split + scores)
    if recompute == "none":
        stored, peak = produced, 0.0
    elif recompute == "selective":
        stored, peak = sbh * (replicated + split), sbh * scores
    elif recompute == "full":
        stored = sbh * 2.0 / (tp if sequence_parallel else 1)  # the layer's input
        peak = produced
    else:
        raise ValueError(f"recompute ({recompute!r}) must be one of none, selective, full")
    return LayerActivations(stored=stored, produced=produced, recompute_peak=peak + sbh * transient)
