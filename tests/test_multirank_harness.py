"""The multi-rank test harness itself: results, errors, hangs and deaths on gloo."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tpkernels.testing.distributed import RankError, RankExited, RankPool, RankTimeoutError, run_on_ranks


def _all_reduce_rank(rank, world_size, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    return rank, world_size, dist.get_rank(), dist.get_world_size(), t.item()


def _raise_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the healthy ranks block in a collective with the failed one
    return rank


def _hang_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        time.sleep(3600)
    return rank


def _die_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        os._exit(3)
    return rank


def _delayed_all_gather(rank, world_size):
    if rank == world_size - 1:
        time.sleep(0.5)  # one rank late: the collective must still complete and match
    out = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([rank, rank * 10.0]))
    return torch.stack(out).tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_by_rank(world_size, rank_pool):
    pool = rank_pool(world_size)
    scale = float(torch.randint(1, 9, ()).item())
    out = pool.run(_all_reduce_rank, scale)
    total = scale * world_size * (world_size + 1) / 2
    assert out == [(r, world_size, r, world_size, total) for r in range(world_size)]


def _draw(rank, world_size, n):
    return torch.rand(n)


def test_every_call_seeds_the_ranks_with_the_tests_seed(rank_pool, fresh_seed):
    """TPK_SEED replays a multi-rank test whole: before each call every rank seeds torch with the test's
    seed, whatever earlier calls drew on the long-lived workers."""
    pool = rank_pool(2)
    torch.manual_seed(fresh_seed)
    want = torch.rand(5)
    for _ in range(2):  # the first call draws more than the second reads
        got = pool.run(_draw, 7)
        assert all(torch.equal(g[:5], want) for g in got), (got, want)


@pytest.mark.parametrize("world_size", [2, 3])
def test_pool_is_reused_and_handles_a_late_rank(world_size, rank_pool):
    pool = rank_pool(world_size)
    for _ in range(2):
        out = pool.run(_delayed_all_gather)
        assert out == [[[float(r), r * 10.0] for r in range(world_size)]] * world_size


def test_rank_exception_is_raised_with_rank_and_traceback():
    with RankPool(3, timeout=60) as pool:
        with pytest.raises(RankError, match="rank 1 raised ValueError: deliberate failure on rank 1") as ei:
            pool.run(_raise_on, 1)
        assert ei.value.rank == 1 and "_raise_on" in ei.value.remote_traceback
        assert pool.run(_all_reduce_rank, 1.0)[0][4] == 6.0  # respawned and usable again


def test_hanging_rank_times_out_instead_of_hanging_the_suite():
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[2\] did not finish") as ei:
        run_on_ranks(_hang_on, 3, 2, timeout=4)
    assert ei.value.ranks == [2]
    assert time.monotonic() - start < 60


def test_dead_rank_is_reported():
    with pytest.raises(RankError, match="rank 0 raised ProcessDied: worker exited with code 3"):
        run_on_ranks(_die_on, 2, 0, timeout=60)


def test_world_size_eight():
    out = run_on_ranks(_all_reduce_rank, 8, 1.0, timeout=120)
    assert [o[4] for o in out] == [36.0] * 8


def test_bad_world_size():
    with pytest.raises(ValueError, match=r"world_size \(0\) must be an int in 1..64"):
        RankPool(0)


def test_an_unpicklable_call_fails_at_once(rank_pool):
    pool = rank_pool(2)
    start = time.monotonic()
    with pytest.raises(TypeError, match=r"must be picklable to reach the ranks"):
        pool.run(lambda rank, world: rank)  # a lambda cannot be pickled
    with pytest.raises(TypeError, match=r"must be picklable"):
        pool.run(_all_reduce_rank, (x for x in range(3)))  # nor can a generator argument
    assert time.monotonic() - start < 5
    assert pool.run(_all_reduce_rank, 1.0)[0][4] == 3.0  # the pool is still usable


def test_an_expected_death_returns_the_other_ranks_results():
    out = run_on_ranks(_die_on, 3, 1, timeout=60, expect_exit={1})
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], RankExited) and out[1].exitcode == 3
