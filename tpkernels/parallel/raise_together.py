"""One rank's error, raised on every rank: a check that fails on one rank must not leave its peers
waiting in the next collective until the process-group timeout.

    with raise_together("loading the Hugging Face weights"):
        model.load_hf_(folder)          # may raise on the ranks that hold a bad tensor

Every rank of ``group`` runs the block, then all of them exchange one small object (the failure,
or None: one ``all_gather_object``, so use it where a step is not hot: set-up, loading, a save). If
any rank failed, every rank raises the error of the lowest failing rank, of the same type where it
is a standard error (``ValueError``, ``FileNotFoundError``...), its message saying which rank
found it. Without a process group, or with one rank, the block's own error passes as it is.

The block must not itself hold a collective that a failing rank would skip (that collective would
hang before the exchange); checks and reads go inside, collectives after.
"""

from __future__ import annotations

import builtins
import contextlib

import torch.distributed as dist

from tpkernels.parallel import control


class PeerError(RuntimeError):
    """Raised on every rank when another rank's failure was not a standard error type."""


def _rebuild(kind: str, message: str, types=()) -> BaseException:
    cls = next((t for t in types if t.__name__ == kind), None) or getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls not in (KeyError,):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001  (an exception type whose constructor wants more)
            pass
    if kind == "KeyError":  # KeyError quotes its message: a ValueError reads better
        return ValueError(message)
    return PeerError(message)


@contextlib.contextmanager
def raise_together(what: str, group=None, *, active: bool = True, types: tuple = ()):
    """Run the block on every rank of ``group`` (default: the world); any rank's error is raised on all.
    ``active=False``: the block runs alone (e.g. a one-process model built inside a multi-rank job).
    ``types``: exception classes of the caller's that the other ranks raise as they are (by name)."""
    if not active or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        yield
        return
    failure = None
    try:
        yield
    except Exception as e:  # noqa: BLE001  (exchanged, then re-raised below)
        failure = e
    mine = None if failure is None else (type(failure).__name__, str(failure).strip("'\""))
    everyone = control.all_gather_objects(mine, group)
    failed = [(r, f) for r, f in enumerate(everyone) if f is not None]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    if rank == me and failure is not None and len(failed) == 1:
        raise failure
    others = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    raise _rebuild(kind, f"{message} [{what}: rank {rank}{others}]", types) from failure


__all__ = ["PeerError", "raise_together"]
