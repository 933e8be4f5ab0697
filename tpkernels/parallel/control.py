"""Host-side collectives: what ranks exchange to decide together (flags, counts, agreements,
metrics, small objects, barriers), each on the device its group's backend takes.

    dev = control_device(group)                       # cpu for gloo, the current GPU for NCCL
    loss, tokens = all_reduce_values([loss, tokens], group=dp_group)   # host floats in and out
    ok = agree_all(fits_here)                         # True on every rank iff true on every rank
    every = all_gather_objects({"phases": ...}, group)
    name = broadcast_object(path_on_rank0)
    barrier()

Why one module: NCCL reduces device tensors only (a CPU tensor raises "No backend type associated
with device type cpu"), gloo takes CPU tensors; a CPU-only test suite never meets NCCL, so the
only way to keep every such call right is to have one way in. ``tests/test_control_collectives.py``
fails on a ``torch.distributed`` collective anywhere in the package outside this module and the
listed data-plane functions (those move model tensors that are on the model's device already),
and checks the device chosen for a group that refuses CPU tensors (``backend="cuda:gloo"``,
which behaves as NCCL does for CPU tensors, without a GPU).

A group of one rank (or no initialised ``torch.distributed``) needs no exchange: every function
returns its own input then. ``group=None`` is the default (world) group.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def group_size(group=None) -> int:
    """The number of ranks in ``group`` (1 without an initialised torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def control_device(group=None) -> torch.device:
    """Where this group's host-side tensors must live: the CPU when its backend takes CPU tensors
    (gloo: no device round trip), else the current accelerator (NCCL, ``cuda:gloo``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)
    if types is None:  # older torch: the backend name says it
        takes_cpu = dist.get_backend(pg) in ("gloo", "mpi", "ucc")
    else:
        takes_cpu = any(d.type == "cpu" for d in types)
    if takes_cpu:
        return torch.device("cpu")
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator().type, acc.current_device_index())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")


def all_reduce_values(values: Sequence[float], op: str = "sum", group=None) -> list[float]:
    """Host numbers reduced over ``group`` (float64; one collective; one host read on a GPU)."""
    if group_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=control_device(group))
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t.tolist()


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """``t`` reduced in place over ``group`` and returned, without a host read: a device tensor stays
    where it is when the backend takes it; otherwise it travels through the control device and back."""
    if group_size(group) == 1:
        return t
    dev = control_device(group)
    if t.device == dev or (dev.type == "cpu" and t.device.type != "cpu"):  # gloo also reduces CUDA tensors
        dist.all_reduce(t, op=_OPS[op], group=group)
        return t
    moved = t.to(dev)
    dist.all_reduce(moved, op=_OPS[op], group=group)
    t.copy_(moved)
    return t


def agree_all(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is true on every rank of ``group``."""
    return bool(all_reduce_values([float(bool(flag))], "min", group)[0])


def agree_any(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group``."""
    return bool(all_reduce_values([float(bool(flag))], "max", group)[0])


def all_gather_ints(t: torch.Tensor, group=None) -> torch.Tensor:
    """(ranks, *t.shape) int64 on the host: every rank's ``t`` (same shape on every rank)."""
    n = group_size(group)
    host = t.detach().to("cpu", torch.int64)
    if n == 1:
        return host[None]
    dev = control_device(group)
    from tpkernels.parallel.collectives import all_gather_into  # noqa: PLC0415  (a thin torch wrapper)

    out = torch.empty((n * host.numel(),), dtype=torch.int64, device=dev)
    all_gather_into(out, host.reshape(-1).to(dev), group)
    return out.cpu().view(n, *host.shape)


def all_gather_objects(obj: Any, group=None) -> list:
    """Every rank's picklable ``obj``, in group-rank order. torch puts the bytes on the device the
    group's backend takes (set the current CUDA device first on NCCL, as ``init`` code does)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out: list = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Group rank ``src``'s ``obj`` on every rank (``src`` is the rank in ``group``)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]


def barrier(group=None) -> None:
    """Every rank of ``group`` has reached this point: a one-element all-reduce on the control device
    (``dist.barrier`` on NCCL guesses a device, and on ``cuda:gloo`` allocates a CPU tensor)."""
    if group_size(group) > 1:
        dist.all_reduce(torch.zeros(1, device=control_device(group)), group=group)


__all__ = ["agree_all", "agree_any", "all_gather_ints", "all_gather_objects", "all_reduce_", "all_reduce_values",
           "barrier", "broadcast_object", "control_device", "group_size"]
