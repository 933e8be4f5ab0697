"""``--nproc N``: N ranks on this machine through torch's elastic launcher, the code path of
``torchrun --standalone --nproc-per-node N`` (c10d rendezvous on a free local port, restarts and
failure handling by torch's agent), called as a library
(``torch.distributed.launcher.api.elastic_launch``) so that rank 0's return value comes back.

    histories = launch(rank_fn, 4, cfg)      # rank_fn(cfg) on 4 ranks; their return values by rank

Each worker joins the process group from the launcher's environment (``env://``: gloo without
GPUs, NCCL with one GPU per rank), runs ``fn`` and returns its value; a rank that raises ends its
process, the agent stops the others at once, and :class:`LaunchError` carries the first failure's
rank and message. There is no time cap: a run takes as long as it takes (collectives keep their
process-group timeout).

Teardown: torch + gloo may abort at interpreter exit after a successful run ("terminate called
without an active exception"), which the agent would report as a failed rank although every
value had come back. A worker whose function returned therefore leaves with ``os._exit(0)`` from
an ``atexit`` hook, after torch's wrapper has delivered the value (a failed one with its code).
"""

from __future__ import annotations

import atexit
import datetime
import json
import multiprocessing
import logging
import os
import re
import tempfile
import uuid
from pathlib import Path

_DONE = {"ok": False}
# what the ranks import once, in the server they fork from (a fresh interpreter per rank would import
# them N times, seconds each)
PRELOAD = ["torch", "torch.distributed", "tpkernels.train.trainer"]
_SERVER: dict = {"env": None}  # this process's environment when it started the fork server
# what torch's agent sets in each worker (local_elastic_agent._start_workers); never the launcher's to override
_AGENT_KEYS = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                         "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING"})


def launches_ranks(argv: list[str]) -> bool:
    """Whether the arguments of ``tpkernels train`` or ``generate`` start ranks: ``--nproc`` given, not a
    dry run, not help."""
    if {"--dry-run", "-h", "--help"} & set(argv):
        return False
    return any(a == "--nproc" or a.startswith("--nproc=") for a in argv)


def start_workers_early(argv: list[str] | None = None) -> None:
    """Start the server the ranks fork from now, importing :data:`PRELOAD` on another core while this
    process parses and checks the config (the command line calls it first thing, with its arguments,
    and it starts only if they launch ranks): a 2-rank launch on 2 cores starts its ranks seconds
    sooner. The ranks still get the launcher's environment as it is at the launch (see :func:`worker`)."""
    if argv is not None and not launches_ranks(argv):
        return
    if _SERVER["env"] is not None or "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver  # noqa: PLC0415

    multiprocessing.set_forkserver_preload(PRELOAD)
    _SERVER["env"] = dict(os.environ)
    forkserver.ensure_running()  # a no-op if this process runs one already (a RankPool's, say)


def _launcher_env() -> tuple[dict, list]:
    """(the launcher's environment now, less the agent's own variables; what it removed since it started
    the fork server). A forked rank has the server's environment, from before the launcher's later
    changes (the warnings it said, a test's setenv); the agent passes only its own variables."""
    env = {k: v for k, v in os.environ.items() if k not in _AGENT_KEYS and not k.startswith("TORCHELASTIC_")}
    return env, [k for k in (_SERVER["env"] or {}) if k not in os.environ]


class LaunchError(RuntimeError):
    """A rank of a ``--nproc`` run failed. ``rank``, ``message``: the first failure; ``kind``: its
    exception's type name (``ValueError``...) where the rank raised one, else None; ``detail``: the
    message without that name."""

    def __init__(self, rank: int, message: str):
        self.rank, self.message = rank, message
        m = re.match(r"([A-Za-z_][\w.]*(?:Error|Exception)): (.*)", message, re.S)
        self.kind, self.detail = (m.group(1).rsplit(".", 1)[-1], m.group(2)) if m else (None, message)
        super().__init__(f"rank {rank} failed: {message}")


def _leave() -> None:
    os._exit(0 if _DONE["ok"] else 1)


def worker(fn, pg_timeout_s: float, env: tuple[dict, list], *args):
    """One rank: join the group (torchrun's environment), run ``fn(*args)``, return its value.
    ``env``: the launcher's environment (:func:`_launcher_env`), laid over the server's."""
    launcher, removed = env
    for key in removed:
        if key not in launcher and key not in _AGENT_KEYS:
            os.environ.pop(key, None)
    os.environ.update(launcher)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    atexit.register(_leave)
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 default gives each rank
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=pg_timeout_s))
    out = fn(*args)
    _DONE["ok"] = True
    return out


def launch(fn, nproc: int, *args, pg_timeout_s: float = 1800.0, max_restarts: int = 0, quiet: bool = True) -> list:
    """``fn(*args)`` on ``nproc`` local ranks (module-level ``fn``, picklable ``args``); returns the values
    by rank. Raises :class:`LaunchError` naming the first rank that failed. ``max_restarts``: times the
    agent restarts the whole group after a failure (torchrun's ``--max-restarts``; ``fn`` runs again
    from its start: the trainer resumes from its latest complete checkpoint). ``quiet``: the agent's
    own log of a failure (the rank's traceback) is not printed; the LaunchError says what failed."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc ({nproc!r}) must be a positive integer")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts ({max_restarts!r}) must be an integer >= 0")
    logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in logs]
    if quiet:  # the agent's and the process pool's own accounts of a failure (tracebacks, SIGTERMs sent)
        for log in logs:
            log.setLevel(logging.CRITICAL)
    try:
        return _launch(fn, nproc, args, pg_timeout_s, max_restarts)
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _launch(fn, nproc: int, args, pg_timeout_s: float, max_restarts: int) -> list:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    start_workers_early()  # if the command line has not: "forkserver" is one of the agent's start methods
    # The workers' process group gets a store of its own (rank 0 hosts it), not the agent's rendezvous
    # store: a restarted group would read the dead attempt's addresses there and fail to connect
    # (pytorch/pytorch#135712, with gloo and NCCL alike).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="tpk_launch_") as logs:  # each rank's error.json lands here
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"tpk-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
                              monitor_interval=0.1, start_method="forkserver", logs_specs=DefaultLogsSpecs(logs))
        try:
            out = elastic_launch(config, worker)(fn, pg_timeout_s, _launcher_env(), *args)
        except ChildFailedError as e:
            rank, message = _root_cause(e, Path(logs))
            raise LaunchError(rank, message) from None
    return [out[r] for r in range(nproc)]


# what a rank says when a peer died first: a consequence, not the cause
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def _root_cause(err, logs: Path) -> tuple[int, str]:
    """(rank, message) of the cause. The agent reports the first failed process it notices, which may
    be a rank that died of its peer's death; every rank that raised wrote its error file, so the
    cause is the earliest error that is not a lost peer."""
    errors = []
    for path in logs.rglob("error.json"):
        try:
            data = json.loads(path.read_text())["message"]
            rank = int(path.parent.name)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        text = data.get("message", "") if isinstance(data, dict) else str(data)
        stamp = int((data.get("extraInfo") or {}).get("timestamp", 0)) if isinstance(data, dict) else 0
        errors.append((any(p in text for p in _PEER_LOST), stamp, rank, text))
    if errors:
        _, _, rank, text = min(errors)
        return rank, _short(text)
    rank, failure = err.get_first_failure()
    return rank, _message(failure)


def _message(failure) -> str:
    """The failed rank's exception, or how it died."""
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "") or ""
    text = str(msg).strip()
    if not text or text.startswith("To enable traceback") or "exitcode" in text and "Signal" in text:
        return f"exited with code {failure.exitcode} ({failure.signal_name() if failure.exitcode < 0 else 'error'})"
    return _short(text)


def _short(text: str) -> str:
    """An exception's message without a traceback around it."""
    text = text.strip()
    return text.splitlines()[-1] if text.startswith("Traceback") else text


__all__ = ["PRELOAD", "LaunchError", "launch", "launches_ranks", "start_workers_early", "worker"]
