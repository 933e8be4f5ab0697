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

A mixture-of-experts layer (``moe=True``) keeps the attention terms and replaces the dense MLP's by
its MoE block (:func:`moe_block_activations`): T = b·s/cp tokens on the rank, k copies of each routed
to experts; with expert parallelism the busiest EP rank receives ρ·T·k of the EP group's rows
(ρ: :func:`moe_peak_imbalance`). Bytes, 16-bit activations:

  stored    the rows the experts received, 2·ρTk·h (every TP rank holds whole rows and F/tp columns
            of each expert, as the dense MLP): the only tensor tpkernels.functional.grouped_gemm's
            grouped_swiglu_mlp keeps, its backward recomputes gate|up; the expert outputs combined
            back on this rank 2·Tk·h (the combine weights' gradient reads them), the router's fp32
            logits and scores 8·T·E (every TP rank routes the gathered tokens), the routing metadata
            (fp32 weights, int64 expert ids and row map: 20·Tk), and the shared expert as a dense MLP
            of its width.
  produced  stored + the SwiGLU gate|up output and product 2·ρTk·3F/tp, the permuted copy 2·Tk·h
            and the expert outputs 2·ρTk·h (written once per forward: the SwiGLU's and the
            permutation's memory-bound passes).
  transient the experts' gate|up output and product, 2·ρTk·3F/tp, while their GEMMs run (forward,
            and again in the backward that recomputes them), and at ep > 1 the all-to-all's send
            buffers (the permuted copy before dispatch, the expert outputs before the combine),
            2·h·(Tk + ρTk); the larger of the two (the exchange waits while the GEMMs hold theirs).
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


def layer_activation_terms(model: ModelConfig, *, dropout: bool, flash_attention: bool,
                           mlp: bool = True) -> dict[str, float]:
    """The coefficients of s·b·h, per GPU before TP division: {"replicated", "split", "scores"},
    with "scores" multiplying a·s/h. ``mlp=False`` leaves the dense MLP's tensors of ffn width out (a
    MoE layer, whose block is counted by :func:`moe_block_activations`)."""
    h = model.hidden_size
    replicated = 4.0 + 2.0 + 2.0 + (2.0 if dropout else 0.0)
    attn = 2.0 * model.q_dim / h + 2.0 * 2.0 * model.kv_dim / h + 2.0 * model.q_dim / h
    tensors_of_ffn_width = 3 if model.gated_mlp else 2  # gate, up, product | GeLU in, GeLU out
    mlp = 2.0 * tensors_of_ffn_width * model.ffn_hidden_size / h if mlp else 0.0
    if flash_attention:
        scores = 0.0  # only the log-sum-exp (4·a·s·b bytes) is kept: negligible
    else:
        scores = 2.0 + (3.0 if dropout else 0.0)
    return {"replicated": replicated, "split": attn + mlp, "scores": scores}


def layer_activations(model: ModelConfig, *, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                      recompute: str, flash_attention: bool, cp: int = 1, cp_algo: str = "ring", moe: bool = False,
                      ep: int = 1, imbalance: float = 1.0, mlp: bool = True) -> LayerActivations:
    """``seq`` is the whole sequence; with ``cp`` > 1 this rank holds seq / cp of it. ``moe``: a MoE
    layer of ``model`` with expert parallelism ``ep`` and the busiest EP rank at ``imbalance`` × its
    balanced share of rows (:func:`moe_block_activations` in place of the dense MLP). ``mlp=False``:
    without any MLP (the attention part alone)."""
    if moe:
        kw = dict(seq=seq, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel,
                  recompute=recompute, flash_attention=flash_attention, cp=cp, cp_algo=cp_algo)
        rest = layer_activations(model, mlp=False, **kw)
        block = moe_block_activations(model, seq=seq, micro_batch=micro_batch, tp=tp, cp=cp, ep=ep,
                                      recompute=recompute, imbalance=imbalance)
        # full recompute rebuilds the whole layer at once; otherwise the attention's transients (scores,
        # CP buffers) and the block's dispatch buffers are alive at different times
        peak = (rest.recompute_peak + block.recompute_peak if recompute == "full"
                else max(rest.recompute_peak, block.recompute_peak))
        return LayerActivations(rest.stored + block.stored, rest.produced + block.produced, peak)
    terms = layer_activation_terms(model, dropout=model.dropout > 0, flash_attention=flash_attention, mlp=mlp)
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


def moe_peak_imbalance(model: ModelConfig, ep: int, imbalance: float) -> float:
    """ρ: rows the busiest EP rank receives over its balanced share T·k, for the dispatch buffers.
    With a capacity factor cf each expert keeps at most cf·T·k/E rows of each sender, so an EP rank
    gets at most cf·T·k (ρ = cf); dropless routing has no such bound and is sized at ``imbalance``
    (the user's worst case, TrainingSetup.moe_peak_imbalance). Neither exceeds what routing can do:
    each token sends at most min(k, E/ep) copies to one EP rank, ρ ≤ ep·min(k, E/ep)/k (1 at ep = 1,
    where one rank holds every expert and processes its own T·k rows, fewer if a capacity drops some)."""
    k, e = model.experts_per_token, model.num_experts
    most = ep * min(k, e / ep) / k
    bound = model.capacity_factor if model.capacity_factor is not None else (imbalance if ep > 1 else 1.0)
    return min(bound, most)


def moe_block_activations(model: ModelConfig, *, seq: int, micro_batch: int, tp: int, cp: int = 1, ep: int = 1,
                          recompute: str = "none", imbalance: float = 1.0) -> LayerActivations:
    """Bytes of one MoE block (router, dispatch, routed experts, combine, shared expert) per micro-batch
    on one GPU; the terms are in the module docstring. ``imbalance``: ρ of the busiest EP rank. SP
    changes nothing here: the block works on the tokens gathered over TP (its input, sharded under
    SP, is the dense layer's "MLP input" term)."""
    h, k, e = model.hidden_size, model.experts_per_token, model.num_experts
    tokens = float(seq) / cp * micro_batch
    copies = tokens * k  # this rank's token copies (sent), and the rows it receives when balanced
    rows = imbalance * copies
    f = model.expert_ffn
    stored = 2.0 * rows * h + 2.0 * copies * h + 8.0 * tokens * e + 20.0 * copies
    if model.shared_expert_ffn_hidden_size:
        stored += 2.0 * tokens * 3 * model.shared_expert_ffn_hidden_size / tp
    swiglu = 2.0 * rows * 3 * f / tp  # gate|up and their product: recomputed in the backward, not kept
    sent = 2.0 * copies * h + 2.0 * rows * h  # the permuted copy and the expert outputs, before each exchange
    produced = stored + swiglu + sent
    transient = max(swiglu, sent if ep > 1 else 0.0)
    if recompute == "full":
        return LayerActivations(stored=0.0, produced=produced, recompute_peak=stored + transient)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute ({recompute!r}) must be one of none, selective, full")
    return LayerActivations(stored=stored, produced=produced, recompute_peak=transient)
