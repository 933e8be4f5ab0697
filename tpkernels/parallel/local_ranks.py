"""Run a function on N ranks of a torch.distributed group on one machine, with a timeout.

    >>> with RankPool(world_size=3) as pool:          # spawns 3 processes, one gloo group
    ...     results = pool.run(my_fn, arg1, arg2)     # my_fn(rank, world_size, arg1, arg2) on each
    >>> run_on_ranks(my_fn, 4, timeout=60)            # one-shot: pool, run, close

``fn`` must be importable by name (a module-level function), as must its arguments be picklable;
an unpicklable call fails at once in the caller. The pool is reused across calls because starting
a process group costs seconds. It serves the test suite, ``tpkernels plan --measure`` (a 2-rank
collective) and other single-machine multi-rank runs; ``torchrun`` remains the launcher for jobs.
It guards against the ways multi-process runs go wrong:

* a rank raises: :class:`RankError` carries its rank, exception type, message and traceback;
  the other ranks may be stuck in a collective, so the pool is torn down (and respawned on the
  next call);
* a rank hangs: after ``timeout`` seconds a :class:`RankTimeoutError` names the ranks that did
  not answer, and the pool is killed; a test suite never hangs;
* a rank dies (segfault, abort): :class:`RankError` with its exit code;
* a rank is meant to die (a test of failure handling): ``run(..., expect_exit={1})`` returns
  :class:`RankExited` for it and the other ranks' results;
* gloo's teardown abort ("terminate called without an active exception" after
  ``destroy_process_group``): workers never destroy the group; they flush their result queue
  and leave with ``os._exit(0)``.

Workers come from a ``forkserver`` that has imported torch once, so starting a pool costs
about the process-group rendezvous, not N torch imports; each worker runs with
``torch.set_num_threads(threads_per_rank)``.

Why not ``torch.multiprocessing.spawn``: it returns no values, has no timeout (a hung collective
hangs the caller), starts fresh processes per call (seconds of torch import and rendezvous each
time) and kills every rank when one exits, which a test of failure handling needs to observe.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.reduction
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Collection

_STOP = "__tpkernels_stop__"
_RELEASE = "__tpkernels_release_groups__"


class RankError(RuntimeError):
    """A rank raised (or died). ``rank``, ``exc_type`` (name), ``remote_traceback`` describe it."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str = ""):
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, exc_type, message, remote_traceback
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback on rank {rank} ---\n"
                         f"{remote_traceback}")


class RankExited:
    """The result of a rank that was expected to die (``expect_exit``): its exit code."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode

    def __repr__(self) -> str:
        return f"RankExited({self.exitcode})"


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout; ``ranks`` lists them."""

    def __init__(self, ranks: list[int], timeout: float, what: str):
        self.ranks = ranks
        super().__init__(f"ranks {ranks} did not finish {what} within {timeout:.0f} s; the pool was killed")


def _worker(rank: int, world_size: int, backend: str, init_file: str, pg_timeout: float, threads: int,
            tasks: mp.Queue, results: mp.Queue) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        results.put((rank, "ready", None))
    except BaseException as e:  # report instead of dying silently
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
        _exit(results)
    created: list = []  # the process groups the last call made
    while True:
        try:
            task = tasks.get()
        except BaseException as e:  # e.g. a function the worker cannot import
            results.put((rank, "error", (type(e).__name__, f"cannot receive the call: {e}", traceback.format_exc())))
            continue
        if task == _STOP:
            break
        if task == _RELEASE:
            _release_groups(created)
            created = []
            continue
        call_id, fn, args, kwargs, seed = task
        try:
            if seed is not None:  # every rank alike, as a fresh process starts alike
                torch.manual_seed(seed)
            before = _groups()
            out = fn(rank, world_size, *args, **kwargs)
            created = [g for g in _groups() if g not in before]
            results.put((rank, "ok", (call_id, out)))
        except BaseException as e:
            results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    _exit(results)


def _groups() -> list:
    """The process groups this process holds, the world's excepted (none where torch keeps no registry)."""
    import torch.distributed as dist  # noqa: PLC0415

    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return [] if registry is None else [g for g in list(registry) if g is not dist.group.WORLD]


def _release_groups(groups: list) -> None:
    """Destroy the groups a call made, on the parent's word that every rank has returned from it.

    Each call builds its layout's groups anew and gloo keeps polling threads per group: hundreds of
    idle groups from earlier calls swamp a small machine's CPUs (the suite ran 40% slower). Only
    after a call that every rank finished: none is still inside a collective of these groups, so
    no barrier is needed (a barrier would wait forever for a rank a test killed)."""
    import torch.distributed as dist  # noqa: PLC0415

    for g in groups:
        try:
            dist.destroy_process_group(g)
        except (RuntimeError, ValueError):  # already destroyed by the call itself
            pass


def _exit(results: mp.Queue) -> None:
    # Flush the queue's feeder thread first, or the parent may never see the last result.
    results.close()
    results.join_thread()
    os._exit(0)


class RankPool:
    """N worker processes joined in one torch.distributed group (gloo by default).

    ``seed``: when set, every rank seeds torch's generator with it before each call (the test suite
    sets the test's seed, so ``TPK_SEED`` replays what the ranks draw too, whatever ran before on the
    long-lived workers)."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 120.0,
                 threads_per_rank: int = 1, start_timeout: float = 120.0):
        if not isinstance(world_size, int) or not 1 <= world_size <= 64:
            raise ValueError(f"world_size ({world_size!r}) must be an int in 1..64")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.threads_per_rank, self.start_timeout = threads_per_rank, start_timeout
        self._procs: list[mp.Process] = []
        self._tasks: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._tmpdir: str | None = None
        self._calls = 0
        self.seed: int | None = None

    # -- lifecycle --
    def start(self) -> "RankPool":
        if self._procs:
            return self
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self._tmpdir = tempfile.mkdtemp(prefix="tpk_pool_")
        init_file = os.path.join(self._tmpdir, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        # The process group's own timeout (collectives, rendezvous) is the call timeout, so a
        # stuck collective raises inside the rank at about the time the pool gives up on it.
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, self.backend, init_file, self.timeout,
                                         self.threads_per_rank, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(lambda msg: msg is None, "process-group start", self.start_timeout)
        return self

    def close(self) -> None:
        """Stop the workers (politely, then by force) and forget them."""
        for q in self._tasks:
            try:
                q.put(_STOP)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        for q in [*self._tasks, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results = [], [], None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running --
    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None, expect_exit: Collection[int] = (),
            **kwargs) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; returns results by rank.

        ``expect_exit``: ranks that are meant to die during the call; their result is a
        :class:`RankExited` and the pool is restarted afterwards (its process group is broken)."""
        what = f"{getattr(fn, '__qualname__', fn)}"
        self._calls += 1
        call_id = self._calls
        try:  # the queue would pickle in a background thread and the ranks would wait for the timeout
            multiprocessing.reduction.ForkingPickler.dumps((call_id, fn, args, kwargs, self.seed))
        except Exception as e:
            raise TypeError(f"{what} and its arguments must be picklable to reach the ranks (a module-level "
                            f"function, picklable arguments): {type(e).__name__}: {e}") from None
        if not self.alive:
            self._kill()
            self.start()
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs, self.seed))
        out = self._collect(lambda msg: msg[0] == call_id, what, timeout or self.timeout, set(expect_exit))
        if expect_exit:
            self._kill()
        else:  # every rank returned: the groups the call made can go before the next call runs
            for q in self._tasks:
                q.put(_RELEASE)
        return [p if isinstance(p, RankExited) else p[1] for p in out]

    def _collect(self, accept: Callable[[Any], bool], what: str, timeout: float,
                 expect_exit: set[int] = frozenset()) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                self._kill()
                raise RankTimeoutError(missing, timeout, what)
            try:
                rank, status, payload = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                for r in [r for r in dead if r in expect_exit]:
                    got[r] = RankExited(self._procs[r].exitcode)
                dead = [r for r in dead if r not in expect_exit]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    self._kill()
                    raise RankError(dead[0], "ProcessDied", f"worker exited with code {code} during {what}")
                continue
            if status == "error":
                self._kill()  # the other ranks may be blocked in a collective with the failed one
                raise RankError(rank, *payload)
            if accept(payload):
                got[rank] = payload
        return [got[r] for r in range(self.world_size)]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
                 backend: str = "gloo", expect_exit: Collection[int] = (), **kwargs) -> list[Any]:
    """One-shot :class:`RankPool`: start, ``run(fn, ...)``, close. Returns results by rank."""
    with RankPool(world_size, backend=backend, timeout=timeout) as pool:
        return pool.run(fn, *args, expect_exit=expect_exit, **kwargs)
