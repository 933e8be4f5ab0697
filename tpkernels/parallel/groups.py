"""Process-group helpers shared by every distributed part of the package.

Everything takes a ``ProcessGroup`` (``None`` = the default group) and works on gloo and NCCL
alike. Without an initialised ``torch.distributed`` a ``None`` group is a group of one rank, so
the TP layers and ops also run in a plain single-process script.
"""

from __future__ import annotations

import torch.distributed as dist


def group_rank_size(group) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size). Raises when torch.distributed is not
    initialised but a group was given, or when this rank is not a member of ``group``."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is None:
            return 0, 1
        raise RuntimeError("torch.distributed is not initialized but a process group was given")
    rank = dist.get_rank(group)
    if rank < 0:
        members = dist.get_process_group_ranks(group)
        shown = members if len(members) <= 16 else members[:16] + ["…"]
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group (its global ranks: "
                         f"{shown}); every rank must pass a group it belongs to")
    return rank, dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (what ``isend``/``irecv`` take)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def group_by_name(name: str):
    """The process group behind a custom op's group name ("" for none): torch.library ops take names,
    not ProcessGroup objects."""
    return None if not name else dist.distributed_c10d._resolve_process_group(name)
