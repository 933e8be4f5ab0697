"""How much of a layer's sequence-parallel communication stays exposed when the software overlaps it
with the GEMMs, collective by collective (what TransformerEngine's userbuffers, PyTorch's async TP and
our own ``all_gather_matmul`` / ``matmul_reduce_scatter`` rings do at TP ≥ 2 in one NVLink domain).

With SP a layer's linears talk to their TP group as follows (c = one all-gather = one reduce-scatter
of the layer's s·b·h activations over t ranks; per linear ``(forward, dgrad, wgrad)`` GEMM seconds):

  forward   QKV, MLP-up (column-parallel): all-gather the input   → ring over the forward GEMM
            proj, MLP-down (row-parallel): reduce-scatter output  → ring over the forward GEMM
  backward  proj, MLP-down: all-gather the output gradient        → ring over the dgrad GEMM
            QKV, MLP-up: re-gather the input for the wgrad        → bulk, beside the dgrad GEMM
                         reduce-scatter the input gradient        → bulk, beside the wgrad GEMM

A ring splits the GEMM into t chunks and passes one shard per step: the first shard (gather) or the
last partial sum (reduce-scatter) has no GEMM to hide behind, c / t stays exposed, and the other
(t − 1) / t of the collective hides behind (t − 1) / t of the GEMM, exposing what it outlasts. A bulk
overlap runs the whole collective beside an independent GEMM: only what it outlasts is exposed.
PyTorch's async TP (inductor's micro-pipelining, ``TrainingSetup.tp_overlap_style = "async_tp"``) fuses
a collective only with the one matmul that consumes or produces it: the column-parallel input
gradient sums the q, k, v (gate, up) linears' products before its reduce-scatter, which matches no
pattern and runs exposed (torch/_inductor/fx_passes/micro_pipeline_tp.py, ``_find_producer_matmul``;
no bulk overlap unless inductor's ``reorder_for_compute_comm_overlap``, off by default and in
torchtitan). The LayerNorm, dropout and residual kernels between the linears do not overlap anything (they are in
the elementwise term, not here). Without a weight gradient (LoRA's frozen base) the bulk
reduce-scatter has nothing to hide behind and is exposed whole. No constant is fitted here.
"""

from __future__ import annotations


def ring_exposed(comm: float, gemm: float, t: int) -> float:
    """Exposed seconds of a collective of ``comm`` s pipelined with a GEMM of ``gemm`` s in ``t`` chunks."""
    if t <= 1 or comm <= 0:
        return 0.0
    rest = (t - 1) / t
    return comm / t + max(0.0, rest * (comm - gemm))


def bulk_exposed(comm: float, gemm: float) -> float:
    """Exposed seconds of a collective run beside an independent GEMM."""
    return max(0.0, comm - gemm)


def column_backward_exposed(one: float, linear: tuple[float, float, float], style: str = "userbuffers") -> float:
    """Exposed seconds of a column-parallel linear's two backward collectives: the re-gather of its
    input for the weight gradient (beside the dgrad GEMM) and the reduce-scatter of its input gradient
    (beside the wgrad GEMM under "userbuffers"; exposed whole under "async_tp", see
    TrainingSetup.tp_overlap_style)."""
    rs = bulk_exposed(one, linear[2]) if style == "userbuffers" else one
    return bulk_exposed(one, linear[1]) + rs


def sp_exposed(one: float, per_linear: list[tuple[float, float, float]], t: int,
               style: str = "userbuffers") -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's SP collectives; ``one``: one all-gather (=
    one reduce-scatter) of the layer's activations; ``per_linear``: (forward, dgrad, wgrad) seconds of
    QKV, output projection, MLP up(+gate), MLP down on one TP rank; ``style``: the software's overlap
    (TrainingSetup.tp_overlap_style)."""
    qkv, proj, up, down = per_linear
    fwd = sum(ring_exposed(one, lin[0], t) for lin in per_linear)
    bwd = (ring_exposed(one, proj[1], t) + ring_exposed(one, down[1], t)
           + column_backward_exposed(one, qkv, style) + column_backward_exposed(one, up, style))
    return fwd, bwd
