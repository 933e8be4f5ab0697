"""Debug mode: check that every rank of a group passes the same shapes, dtypes and options to a
collective op, and raise a clear error naming the rank and the field when they do not.

Ranks that disagree make the communication go wrong in ways that are hard to trace: bfloat16 on
one rank and float16 on another (or two shapes of the same byte size) give silently wrong
results; different byte sizes abort the process inside gloo (SIGABRT, no Python exception) or
hang NCCL. With the check on, each op first all-gathers a small int64 fingerprint of its
arguments (one tiny collective per op call), and every rank raises the same ``ValueError``:

    matmul_reduce_scatter: ranks disagree on a.dtype: rank 1 has torch.float16, rank 0 has torch.bfloat16

Turn it on with ``TPKERNELS_CHECK_RANKS=1`` (read at every call; the test suite runs with it) or
``with check_ranks(): ...``. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (set before the processes start)
checks the fingerprints of collectives, but not of point-to-point transfers, so it does not cover
the ring algorithms of ``all_gather_matmul`` / ``matmul_reduce_scatter`` (measured on gloo with
torch 2.14: a dtype mismatch in ``batch_isend_irecv`` still aborts the receiving process); this
check covers both.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import torch
import torch.distributed as dist

from tpkernels import env_vars
from tpkernels._state import setting
from tpkernels.parallel import control

ENV_VAR = "TPKERNELS_CHECK_RANKS"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 8
_WIDTH = 2 + _MAX_DIMS  # per field: kind, length or value, dims
_KIND_INT, _KIND_DTYPE, _KIND_SHAPE, _KIND_STR = 1, 2, 3, 4
_STATE = threading.local()


def enabled() -> bool:
    forced = getattr(_STATE, "on", None)
    if forced is not None:
        return forced
    return env_vars.read(ENV_VAR)


def check_ranks(on: bool = True):
    """Check (or, with ``on=False``, do not check) cross-rank agreement inside the block."""
    return setting(_STATE, "on", on)


def _encode(value: Any) -> list[int]:
    if isinstance(value, torch.dtype):
        return [_KIND_DTYPE, _DTYPES.index(value) if value in _DTYPES else 99] + [0] * _MAX_DIMS
    if isinstance(value, (tuple, list, torch.Size)):
        dims = [int(d) for d in value]
        if len(dims) > _MAX_DIMS:  # compare a digest of the tail; the message still shows the shapes
            dims = dims[:_MAX_DIMS - 1] + [zlib.crc32(repr(dims).encode())]
        return [_KIND_SHAPE, len(value)] + dims + [0] * (_MAX_DIMS - len(dims))
    if isinstance(value, bool) or isinstance(value, int):
        return [_KIND_INT, int(value)] + [0] * _MAX_DIMS
    raw = str(value).encode()[:8 * _MAX_DIMS]  # eight bytes per int64 slot
    raw += b"\0" * (8 * _MAX_DIMS - len(raw))
    return [_KIND_STR, len(str(value).encode())] + [int.from_bytes(raw[i:i + 8], "little", signed=True)
                                                    for i in range(0, len(raw), 8)]


def _decode(row: list[int]) -> str:
    kind, v, dims = row[0], row[1], row[2:]
    if kind == _KIND_DTYPE:
        return str(_DTYPES[v]) if v < len(_DTYPES) else "another dtype"
    if kind == _KIND_SHAPE:
        return str(tuple(dims[:v])) if v <= _MAX_DIMS else f"a {v}-D shape"
    if kind == _KIND_INT:
        return str(v)
    raw = b"".join(d.to_bytes(8, "little", signed=True) for d in dims)
    return repr(raw[:min(v, len(raw))].decode(errors="replace"))


def agree(group, op: str, *, force: bool = False, **fields: Any) -> None:
    """When the check is on (or ``force``): raise ValueError on every rank if any rank of ``group``
    passed other ``fields`` (shapes, dtypes, ints, strings) than rank 0. A no-op for one rank or
    when off."""
    if not (force or enabled()) or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = list(fields)
    mine = torch.tensor([x for name in names for x in _encode(fields[name])], dtype=torch.int64)
    from tpkernels.parallel.trace import CommSpan  # noqa: PLC0415

    span = CommSpan(f"rank check ({op})", control.control_device(group).type,
                    bytes=world * mine.numel() * 8)  # waiting for a late rank is comm
    everyone = control.all_gather_ints(mine, group)
    span.done()
    rows = everyone.view(world, len(names), _WIDTH).tolist()
    for r in range(1, world):
        for i, name in enumerate(names):
            if rows[r][i] != rows[0][i]:
                raise ValueError(f"{op}: ranks disagree on {name}: rank {r} has {_decode(rows[r][i])}, rank 0 has "
                                 f"{_decode(rows[0][i])} (every rank of the group must pass the same {name})")

