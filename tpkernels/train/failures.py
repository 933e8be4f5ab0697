"""Which rank is gone: after a step fails with a communication error, the surviving ranks meet in
the rendezvous store (the one ``init_process_group`` used: torchrun's TCPStore, a FileStore...)
and every one of them names the ranks that did not check in.

A gloo or NCCL error says "connection reset by peer [address]", not which rank died; the store
is the one place every rank can still reach. Each survivor writes ``tpk_alive/<probe>/<rank>``
and waits up to ``wait_s`` for the others; the missing ones are reported, with the latest
complete checkpoint to restart from.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class RankLostError(RuntimeError):
    """One or more ranks stopped during a step. ``ranks``: their global ranks."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


_PROBES = [0]


def lost_ranks(wait_s: float = 3.0) -> list[int]:
    """Global ranks that do not check in within ``wait_s`` (collective over the survivors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    store = dist.distributed_c10d._get_default_store()
    _PROBES[0] += 1
    probe, me, world = _PROBES[0], dist.get_rank(), dist.get_world_size()
    store.set(f"tpk_alive/{probe}/{me}", "1")
    deadline = time.monotonic() + wait_s
    missing = list(range(world))
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"tpk_alive/{probe}/{r}"])]
        if missing:
            time.sleep(0.05)
    return missing
