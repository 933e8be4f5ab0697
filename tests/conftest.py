"""Test set-up shared by every test file.

* Without a CUDA GPU, Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be set
  before triton decorates our kernels, i.e. before tpkernels.kernels.triton.* is imported, which
  this file guarantees by running first. (Kernels are imported lazily by the package.)
* Tests marked ``cuda`` skip without a GPU (they run in benchmarks/gpu_check.sh).
* The cross-rank check (TPKERNELS_CHECK_RANKS=1) is on: ranks that pass different shapes or
  dtypes to a collective op fail with a clear error instead of a wrong result or a hang.
* The planner's fitted corrections go to a temporary cache folder (TPKERNELS_CACHE_DIR), never the
  user's: an autotune test must not change another test's plan.
* Every test gets fresh random inputs: the global seed comes from os.urandom and is printed
  when the test fails, so a failure can be replayed with TPK_SEED=<seed>. The ranks of a
  ``rank_pool`` are seeded with it too before each call, so a replay replays what they draw.
* ``--seeds N`` (the seed sweep, benchmarks/seed_sweep.py) runs every collected test under N seeds
  of its own from os.urandom, in one session (the rank pools are reused); the item's id ends in
  ``seed<N>``. Without it nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
os.environ.setdefault("TPKERNELS_CHECK_RANKS", "1")  # inherited by the rank pools' workers
# one intra-op thread in every rank and subprocess a test starts: 2-4 ranks with their default threads
# oversubscribe CI's 2 cores and spin-wait (test_moe_train + test_validation 46 s -> 40 s; a docs page's
# tpkernels generate 23 s -> 14 s); in-process tests measured the same either way
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the planner's per-machine corrections (autotune writes them): a folder of this session's, not the user's
os.environ["TPKERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpk_test_cache_")
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


SEED_ID = re.compile(r"\[seed\d+\]|(?<=\[)seed\d+-|-seed\d+(?=[\]-])")  # the sweep's part of an item's id


def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=0, metavar="N",
                     help="run every test under N fresh seeds (a seed sweep: benchmarks/seed_sweep.py)")
    parser.addoption("--sweep-id", action="append", default=[], metavar="NODEID",
                     help="with --seeds: keep only this test id (as written without --seeds; repeatable)")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("seeds")
    if n > 0 and "fresh_seed" in metafunc.fixturenames:  # autouse: every test
        seeds = sorted({int.from_bytes(os.urandom(4), "little") for _ in range(n)})
        metafunc.parametrize("fresh_seed", seeds, indirect=True, ids=[f"seed{s}" for s in seeds])


def pytest_collection_modifyitems(config, items):
    keep = set(config.getoption("sweep_id"))
    if keep:
        chosen = [item for item in items if SEED_ID.sub("", item.nodeid, count=1) in keep]
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        items[:] = chosen
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in benchmarks/gpu_check.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_SEED: list[int | None] = [None]  # the running test's, for the rank pools


@pytest.fixture(autouse=True)
def fresh_seed(request):
    seed = getattr(request, "param", None)  # the sweep's (--seeds)
    if seed is None:
        seed = int(os.environ.get("TPK_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    _SEED[0] = seed
    yield seed
    _SEED[0] = None


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            item.add_report_section("call", "seed", f"replay with TPK_SEED={seeds[0]}")


_POOLS: dict[int, object] = {}


@pytest.fixture(scope="session")
def rank_pool():
    """rank_pool(n) -> a started RankPool of n gloo ranks, shared by the whole session."""
    from tpkernels.testing.distributed import RankPool

    def get(world_size: int, timeout: float = 120.0):
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = RankPool(world_size, timeout=timeout)
        pool.seed = _SEED[0]  # every call seeds the ranks with the test's seed
        return pool.start()

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


_AOT: dict = {}


def pytest_collection_finish(session):
    """The sm_80/sm_90 compiles of every Triton config start now, in the background (niced): on a 2-core
    machine the multi-rank tests leave about half of the CPU idle, which they use."""
    if any(item.path.name == "test_triton_aot.py" for item in session.items) and \
            importlib.util.find_spec("triton") is not None:
        from test_triton_aot import start_compiles

        _AOT.update(start_compiles())


@pytest.fixture(scope="session")
def aot_compiles():
    """{arch: the aot_check process} (tests/test_triton_aot.py reads each once, into a module fixture)."""
    if not _AOT:
        from test_triton_aot import start_compiles

        _AOT.update(start_compiles())
    yield dict(_AOT)
    _AOT.clear()


def pytest_unconfigure(config):
    for p in _AOT.values():  # a session that ended early
        if p.poll() is None:
            p.kill()
