"""A test module's independent subprocess runs (the documentation pages, the example programs), two at a
time, each test then reading its own.

Why: each run is a fresh interpreter that imports torch and the package (single-threaded, seconds) and
then trains a tiny model with one thread per process, so one run at a time leaves one of CI's 2 cores
idle most of the time; two lanes took the pages from 229 s to about 150 s. Only runs that assert
on their output, never on their speed, go here: a lane shares the machine with the other lane and
nothing else (pytest runs the module's tests, which only wait, one at a time).

    @pytest.fixture(scope="module")
    def runs(request, tmp_path_factory):
        with lanes(request, "test_page_code_runs", "page", lambda page: run(page, tmp_path_factory)) as out:
            yield out            # {test node id: Future of the run's result}

    def test_page_code_runs(page, runs, request):
        r = runs[request.node.nodeid].result()
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

LANES = 2


@contextlib.contextmanager
def lanes(request, test_name: str, param: str, job: Callable[[Any], Any]) -> Iterator[dict[str, Future]]:
    """``job(value)`` for the ``param`` value of every collected item of ``test_name`` in this module (in
    collection order, :data:`LANES` at a time), keyed by the item's node id. Items that were deselected
    do not run. Leaving the block waits for the runs still going and drops those not started."""
    items = [it for it in request.session.items
             if it.module is request.module and getattr(it, "originalname", it.name) == test_name]
    pool = ThreadPoolExecutor(LANES, thread_name_prefix="lane")
    try:
        yield {it.nodeid: pool.submit(job, it.callspec.params[param]) for it in items}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
