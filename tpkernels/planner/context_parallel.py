"""Seconds of one layer's context-parallel (CP) attention communication, and how much of it hides.

Per layer and micro-batch on one rank, with B = the bytes of this rank's K/V block
(2 · b · s/cp · kv heads per TP rank · head dim · bytes per value) and the attention core's own
forward time A_f and backward time A_b on this rank (tpkernels.functional.context_parallel):

  ring       forward: cp − 1 hops of B (isend/irecv to the next rank), each overlapping the
             computation of the block already held (A_f / cp): exposed = Σ max(0, hop − A_f / cp).
             Backward: cp − 1 hops of B (K/V) and cp hops of the fp32 dK/dV accumulators (2B in
             16-bit training). The code posts block i's accumulators once its gradient is added and
             waits for them after block i + 1's backward (A_b / cp), beside block i + 1's K/V hop:
             block 0 hides a K/V hop, blocks 1 .. cp−2 a K/V hop and an accumulator hop together
             (one link), block cp−1 an accumulator hop, and the last hop home hides behind nothing.
  allgather  forward: an all-gather of K/V (cp · B) over the CP group; backward: a reduce-scatter
             of dK/dV. Not overlapped.
  a2a        forward: all-to-all of q, k, v (to head-sharded) and of the output (back); backward:
             the same volume. Not overlapped; each all-to-all moves (cp − 1)/cp of its bytes.

The CP group's ranks are ``tp`` apart (rank order tp-cp-dp-pp), so it stays inside a node when
tp · cp ≤ gpus per node (NVLink) and crosses the network otherwise.
"""

from __future__ import annotations

from tpkernels.description import ModelConfig
from tpkernels.parallel import ParallelConfig
from tpkernels.planner.collectives import group_collective_time
from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec


def kv_block_bytes(model: ModelConfig, cfg: ParallelConfig, seq: int, value_bytes: int) -> float:
    """Bytes of one rank's K and V for one micro-batch: (b, seq/cp, kv heads per TP rank, dhead) × 2."""
    kv_heads_local = max(1.0, model.kv_heads / cfg.tp)
    return 2.0 * cfg.micro_batch_size * seq / cfg.cp * kv_heads_local * model.dhead * value_bytes


def cp_attention_comm(model: ModelConfig, cfg: ParallelConfig, seq: int, value_bytes: int, att_f: float,
                      att_b: float, cluster: ClusterSpec, eff: Efficiency) -> dict[str, float]:
    """{"fwd", "fwd_exposed", "bwd", "bwd_exposed"}: seconds of one layer's CP communication for one
    micro-batch (0 when cp = 1). ``att_f``/``att_b``: this rank's attention-core seconds."""
    n = cfg.cp
    if n <= 1:
        return {"fwd": 0.0, "fwd_exposed": 0.0, "bwd": 0.0, "bwd_exposed": 0.0}
    B = kv_block_bytes(model, cfg, seq, value_bytes)
    if cfg.cp_algo == "ring":
        bw = cluster.group_bandwidth_gbs(cfg.tp * n) * 1e9 * eff.link
        hop = B / bw + eff.p2p_latency_s
        acc_hop = 2.0 * B / bw + eff.p2p_latency_s  # fp32 accumulators of a 16-bit block
        fwd = (n - 1) * hop
        fwd_exposed = (n - 1) * max(0.0, hop - att_f / n)
        bwd = (n - 1) * hop + n * acc_hop
        block = att_b / n
        bwd_exposed = (max(0.0, hop - block) + (n - 2) * max(0.0, hop + acc_hop - block)
                       + max(0.0, acc_hop - block) + acc_hop)
        return {"fwd": fwd, "fwd_exposed": fwd_exposed, "bwd": bwd, "bwd_exposed": bwd_exposed}
    if cfg.cp_algo == "allgather":
        fwd = group_collective_time("all_gather", n * B, n, cfg.tp, cluster, eff)
        bwd = group_collective_time("reduce_scatter", n * B, n, cfg.tp, cluster, eff)
        return {"fwd": fwd, "fwd_exposed": fwd, "bwd": bwd, "bwd_exposed": bwd}
    # a2a: q, k, v there, the output back; (cp − 1)/cp of each leaves the rank
    q_bytes = cfg.micro_batch_size * seq / n * model.q_dim / cfg.tp * value_bytes
    volume = 2.0 * q_bytes + B
    bw = cluster.group_bandwidth_gbs(cfg.tp * n) * 1e9 * eff.link
    one = (n - 1) / n * volume / bw + 4 * (n - 1) * eff.collective_latency_s
    return {"fwd": one, "fwd_exposed": one, "bwd": one, "bwd_exposed": one}
