"""Which rank is gone: after a step fails with a communication error, the surviving ranks meet in
the rendezvous store (the one ``init_process_group`` used: torchrun's TCPStore, a FileStore...)
and every one of them names the ranks that did not check in.

A gloo or NCCL error says "connection reset by peer [address]", not which rank died; the store
is the one place every rank can still reach. Each survivor writes ``tpk_alive/<probe>/<rank>``
and waits up to ``wait_s`` for the others; the missing ones are reported, with the latest
complete checkpoint to restart from.
"""

from __future__ import annotations

import os
import socket
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


def abort_process_groups() -> None:
    """Close this rank's process groups, so that a survivor still blocked in a transfer with this rank
    (gloo waits for a send until the group's timeout) errors at once and checks in too. The run is
    over for this process: it raises RankLostError next."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001  (best effort: a backend without abort keeps its timeout)
        pass


def close_process_groups() -> None:
    """The end of a rank's run under torchrun: destroy the process groups, unless
    :func:`abort_process_groups` closed them already (after a lost rank torch has no default group
    left, and ``destroy_process_group`` would raise "Process group cannot be None" over the
    RankLostError that says what happened)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def register_rank() -> None:
    """Write this rank's host and process id into the rendezvous store (once, at start), so that a
    survivor can tell a rank that died from one that is alive but blocked in a transfer."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"tpk_pid/{dist.get_rank()}", f"{socket.gethostname()}:{os.getpid()}")


def _alive_here(rank: int, store) -> bool:
    """The rank runs on this host and its process still exists (a remote rank: unknown, False)."""
    key = f"tpk_pid/{rank}"
    if not store.check([key]):
        return False
    host, _, pid = store.get(key).decode().rpartition(":")
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError):
        return False


def dead_and_blocked(missing: list[int]) -> tuple[list[int], list[int]]:
    """``missing`` split into (ranks whose process is gone or unknown, ranks alive on this host but
    blocked: still waiting in a transfer with a lost one)."""
    if not missing or not dist.is_initialized():
        return missing, []
    store = dist.distributed_c10d._get_default_store()
    blocked = [r for r in missing if _alive_here(r, store)]
    return [r for r in missing if r not in blocked], blocked
