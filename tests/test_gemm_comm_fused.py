"""The fused GEMM-communication kernels on the CPU: Triton under the interpreter, ranks emulated by
the virtual-TP harness (producers launched before consumers, so every wait finds its signal),
world sizes 1–8, odd M, float16 (the interpreter computes bfloat16 wrongly). Checks the tile,
chunk and signal arithmetic, the epochs across back-to-back calls and the timeout error; the
same checks run on a GPU in test_gpu_gemm_comm.py."""

from __future__ import annotations

import re

import pytest
import torch

from gemm_comm_checks import check_all_gather_matmul, check_matmul_all_reduce, check_matmul_reduce_scatter
from tpkernels.functional.virtual_tp import VirtualTP
from tpkernels.kernels.triton.ag_matmul import rows_per_chunk
from tpkernels.parallel.symmetric_memory import SignalTimeoutError

WORLDS = [1, 2, 3, 4, 5, 8]
F16 = torch.float16


@pytest.fixture(autouse=True)
def few_spins(monkeypatch):
    monkeypatch.setenv("TPKERNELS_SIGNAL_SPINS", "20")  # producers ran first: a wait never needs more


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_matmul(world):
    vtp = VirtualTP(world, "cpu")
    # m = 1, 17, 33 on one harness: the arena grows, the epochs go on; chunks of whole 16-row blocks
    check_all_gather_matmul(vtp, F16, ms=[17, 1, 33], K=32, ns=[16, 48], chunks=3 if world < 5 else 2)


@pytest.mark.parametrize("rs_mode", ["pull", "push"])
@pytest.mark.parametrize("world", WORLDS)
def test_matmul_reduce_scatter(world, rs_mode):
    check_matmul_reduce_scatter(VirtualTP(world, "cpu", rs_mode=rs_mode), F16, ms=[19, 1], K=32, N=48)


@pytest.mark.parametrize("programs", [(1, 1), (7, 5)])
def test_any_number_of_persistent_programs_covers_every_tile_once(programs):
    # one program walks every tile; more programs than tiles leave some idle
    vtp = VirtualTP(3, "cpu", programs=programs)
    check_all_gather_matmul(vtp, F16, ms=[21], K=16, ns=[32], chunks=2)
    check_matmul_reduce_scatter(vtp, F16, ms=[21], K=16, N=32)
    for variant in ("one_shot", "two_shot"):
        check_matmul_all_reduce(vtp, F16, ms=[21], K=16, N=32, variant=variant)


def test_reduce_scatter_side_work_runs_once_per_rank_in_order():
    ran = []
    side = [[lambda r=r, j=j: ran.append((r, j)) for j in range(2)] for r in range(3)]
    a = [torch.randn(3 * 5, 16, dtype=F16) for _ in range(3)]
    VirtualTP(3, "cpu").matmul_reduce_scatter(a, torch.randn(16, 16, dtype=F16), side_work=side)
    assert ran == [(r, j) for r in range(3) for j in range(2)]


@pytest.mark.parametrize("world", [2, 3])
def test_matmul_reduce_scatter_avg(world):
    check_matmul_reduce_scatter(VirtualTP(world, "cpu"), F16, ms=[5], K=16, N=32, reduce_op="avg")


@pytest.mark.parametrize("variant", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world", WORLDS)
def test_matmul_all_reduce(world, variant):
    check_matmul_all_reduce(VirtualTP(world, "cpu"), F16, ms=[37, 1], K=16, N=48, variant=variant)


def test_matmul_all_reduce_avg():
    check_matmul_all_reduce(VirtualTP(3, "cpu"), F16, ms=[9], K=16, N=16, variant="two_shot", reduce_op="avg")


@pytest.mark.parametrize("rank,src,chunk", [(0, 2, 1), (0, 1, 0), (2, 0, 1), (1, 2, 0)])
def test_a_lost_signal_is_an_error_naming_rank_and_chunk(rank, src, chunk):
    # every (source, chunk) is waited on under its own signal: dropping exactly that one is what times out
    vtp = VirtualTP(3, "cpu", lose_signal=(rank, src, chunk))
    shards = [torch.randn(40, 16, dtype=F16) for _ in range(3)]  # 3 row blocks of 16: chunks of 32 and 8 rows
    b = torch.randn(16, 16, dtype=F16)
    with pytest.raises(SignalTimeoutError, match=rf"all_gather_matmul on rank {rank}: rank {src} never signalled "
                                                 rf"chunk {chunk} of its shard \(call 1; gave up after 20 reads\)"):
        vtp.all_gather_matmul(shards, [b], chunks=2)
    vtp.lose_signal = None  # the error is cleared; the next call (epoch 2) is right
    (a_full, (out,)) = vtp.all_gather_matmul(shards, [b], chunks=2)[rank]
    torch.testing.assert_close(out.float(), a_full.float() @ b.float(), atol=2e-2, rtol=2e-2)


def test_a_reducer_that_times_out_poisons_its_tiles():
    from tpkernels.functional.gemm_comm_fused import reduce_describe  # noqa: PLC0415
    from tpkernels.kernels.triton.tile_reduce import tile_reduce  # noqa: PLC0415
    from tpkernels.parallel.symmetric_memory import ErrorWord  # noqa: PLC0415

    world, m, N, config = 2, 20, 32, (16, 16, 16, 1, 1)
    parts = [torch.randn(world * m, N) for _ in range(world)]
    sigs = [torch.zeros(world * 2 * 2, dtype=torch.int32) for _ in range(world)]
    sigs[1][:] = 1  # rank 1 signalled every tile of call 1, rank 0 none
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    out, acc, err = torch.full((m, N), 7.0, dtype=F16), torch.empty(m, N), ErrorWord(torch.device("cpu"))
    tile_reduce(out, acc, table(parts), table(sigs), table(parts), table(sigs), err.tensor, mode="reduce_scatter",
                epoch=1, max_spins=5, rank=1, world=world, m=m, scale=1.0, config=config, programs=2)
    assert torch.isnan(out).all(), "tiles whose partials never arrived must be NaN, not a partial sum"
    code = int(err.tensor[0])
    src, sig = divmod(code - 1, world * 4)
    assert src == 0 and sig // 4 == 1, f"error code {code} should name rank 0 and a tile of rank 1's rows"
    msg = reduce_describe("matmul_reduce_scatter", 1, world * 4, 2, 2, 1, 5)(code)
    assert re.fullmatch(r"matmul_reduce_scatter on rank 1: rank 0 never signalled tile [0-3] \(row block [01], column "
                        r"block [01]\) of the partial sums this rank reduces \(call 1; gave up after 5 reads\)", msg), msg


@pytest.mark.parametrize("block_m", [16, 128])
def test_chunks_are_whole_row_blocks_covering_the_shard(block_m):
    for m in list(range(1, 70)) + [129, 1000]:
        for chunks in range(1, 6):
            rows = rows_per_chunk(m, chunks, block_m)
            n = -(-m // rows)
            assert rows % block_m == 0 and 1 <= n <= chunks, (m, chunks, rows)
            assert (n - 1) * rows < m <= n * rows  # no empty chunk, nothing left over


def test_the_cuda_movers_need_a_gpu():
    with pytest.raises(ValueError, match=r"copy='kernel' / reducer='triton' run the CUDA kernels of csrc/comm"):
        VirtualTP(2, "cpu", copy="kernel")
    with pytest.raises(ValueError, match=r"reducer \('fast', TPKERNELS_FUSED_REDUCER\) must be 'triton' or 'cuda'"):
        VirtualTP(2, "cpu", reducer="fast")
    with pytest.raises(ValueError, match=r"rs_mode \('both', TPKERNELS_FUSED_RS\) must be 'pull' or 'push'"):
        VirtualTP(2, "cpu", rs_mode="both")
