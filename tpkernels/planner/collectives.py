"""Seconds of the collectives a training step runs, and how much of them overlap can hide.

Bandwidths are per GPU and per direction (hardware.ClusterSpec); ``eff.link`` is the share of it
NCCL's bus bandwidth reaches. Latency follows the ring's α–β model: a phase over n members takes
n − 1 steps, each paying ``eff.collective_latency_s`` (microseconds on NVLink, hundreds of
microseconds for gloo over TCP, where it dominates small messages).

Data-parallel groups: ranks are numbered TP fastest, then DP, then PP (ParallelConfig's order), so
the members of one DP group are ``tp`` ranks apart and ``g = gpus_per_node // tp`` of them share a
node. NCCL then runs the collective hierarchically: a reduce-scatter over NVLink inside the node,
the inter-node part on 1/g of the bytes (each GPU drives its own NIC, so the node's g members use g
NICs at once), and an all-gather inside the node. A flat ring at the NIC's bandwidth would charge
the whole message to one NIC and overstate large-DP runs by up to g×.
"""

from __future__ import annotations

from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec


def _members_per_node(cluster: ClusterSpec, n: int, stride: int) -> int:
    """How many of a group's ``n`` members (``stride`` ranks apart) share one node."""
    if n * stride <= cluster.gpus_per_node:
        return n
    return max(1, min(n, cluster.gpus_per_node // stride))


def ring_phase_time(nbytes: float, n: int, bw_gbs: float, eff: Efficiency) -> float:
    """One reduce-scatter or all-gather of ``nbytes`` (the full tensor) over an n-member ring."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / (bw_gbs * 1e9 * eff.link)


def group_collective_time(kind: str, nbytes: float, n: int, stride: int, cluster: ClusterSpec,
                          eff: Efficiency) -> float:
    """Seconds of ``kind`` ("all_reduce", "reduce_scatter", "all_gather") of ``nbytes`` over a group
    of ``n`` ranks spaced ``stride`` apart, hierarchical when the group spans nodes."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    phases = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind]
    g = _members_per_node(cluster, n, stride)
    nodes = n // g
    t = phases * ring_phase_time(nbytes, g, cluster.intra_gbs, eff)
    t += phases * ring_phase_time(nbytes / g, nodes, cluster.inter_gbs, eff)
    return t + phases * (g - 1 + nodes - 1) * eff.collective_latency_s


def members_per_node(cluster: ClusterSpec, n: int, stride: int) -> int:
    """How many of a group's ``n`` members (``stride`` ranks apart) share one node."""
    return _members_per_node(cluster, n, stride)


def exchange_time(intra_bytes: float, inter_bytes: float, peers: int, cluster: ClusterSpec, eff: Efficiency) -> float:
    """Seconds of a point-to-point exchange in which a rank sends ``intra_bytes`` to peers in its node
    (NVLink) and ``inter_bytes`` to other nodes (its NIC), both at once: the slower of the two, plus
    one latency step per peer."""
    if peers <= 0 or intra_bytes + inter_bytes <= 0:
        return 0.0
    intra = intra_bytes / (cluster.intra_gbs * 1e9 * eff.link)
    inter = inter_bytes / (cluster.inter_gbs * 1e9 * eff.link)
    return max(intra, inter) + peers * eff.collective_latency_s


def all_to_all_time(nbytes: float, n: int, stride: int, cluster: ClusterSpec, eff: Efficiency) -> float:
    """Seconds of one all-to-all in which every rank of an ``n``-member group (members ``stride`` ranks
    apart) sends ``nbytes`` in total, ``nbytes / n`` to each member, itself included: (n − 1)/n of it
    leaves the rank, the share for the g − 1 others in its node over NVLink, the rest over its NIC."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    g = _members_per_node(cluster, n, stride)
    return exchange_time(nbytes * (g - 1) / n, nbytes * (n - g) / n, n - 1, cluster, eff)


def exposed_after_overlap(comm: float, compute: float, buckets: int) -> float:
    """Communication left over when ``comm`` is split into ``buckets`` equal buckets, each sent as soon
    as its share of ``compute`` is done (DDP / Megatron bucketed overlap): a two-stage pipeline.
    The last bucket can never hide (it starts when the compute ends); with slower communication than
    compute the rest queues behind it."""
    if comm <= 0:
        return 0.0
    if compute <= 0:
        return comm
    buckets = max(1, int(buckets))
    c, b = comm / buckets, compute / buckets
    return c if c <= b else comm - (buckets - 1) * b
