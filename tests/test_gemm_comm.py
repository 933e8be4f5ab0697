"""all_gather_matmul / matmul_reduce_scatter on gloo, world sizes 1–4, every algo, against a float64
dense reference (FlashAttention rule), receive buffers poisoned with NaN."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tpkernels.functional.gemm_comm import (
    all_gather_matmul,
    choose_algo,
    matmul_all_reduce,
    matmul_reduce_scatter,
    poison_receive_buffers,
)
from gemm_comm_checks import summed_references
from tpkernels.backends import BackendUnavailableError
from tpkernels.parallel.trace import CommTrace
from tpkernels.testing.errors import error_messages
from tpkernels.testing.tolerance import assert_fa_close

WORLD_SIZES = [1, 2, 3, 4]
ALGOS = ["collective", "ring", "auto"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ag_worker(rank, world, seed, algo, dtype_name):
    dtype = getattr(torch, dtype_name)
    g = _gen(seed)
    # consecutive calls with different M (1, 17, 3), gather dims 0 and 1, with and without a_full
    for m, gather_dim, return_a in [(1, 0, True), (17, 1, False), (3, 0, False), (5, 1, True)]:
        shape = [world * m, 3] if gather_dim == 0 else [2, world * m]
        full64 = torch.randn(*shape, 13, generator=g, dtype=torch.float64)
        bs64 = [torch.randn(13, n, generator=g, dtype=torch.float64) for n in (7, 1)]
        shard = full64.narrow(gather_dim, rank * m, m).to(dtype)
        if rank == 0:
            time.sleep(0.05)  # one rank late
        with poison_receive_buffers():
            a_full, outs = all_gather_matmul(shard, [b.to(dtype) for b in bs64], None, gather_dim, algo, return_a)
        if return_a:
            assert torch.equal(a_full, full64.to(dtype)), "gathered A differs"
        else:
            assert a_full is None
        for j, (b64, out) in enumerate(zip(bs64, outs)):
            assert_fa_close(out, full64 @ b64, full64.to(dtype) @ b64.to(dtype), name=f"out[{j}] m={m}")
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("algo", ALGOS)
def test_all_gather_matmul(rank_pool, fresh_seed, world, algo):
    assert rank_pool(world).run(_ag_worker, fresh_seed, algo, "float32") == [True] * world


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_matmul_bf16(rank_pool, fresh_seed, world):
    assert rank_pool(world).run(_ag_worker, fresh_seed, "ring", "bfloat16") == [True] * world


def _rs_worker(rank, world, seed, algo, dtype_name, reduce_op):
    dtype = getattr(torch, dtype_name)
    g = _gen(seed)
    for m, scatter_dim in [(1, 0), (17, 1), (4, 0)]:
        shape = [world * m, 3] if scatter_dim == 0 else [2, world * m]
        parts = [torch.randn(*shape, 11, generator=g, dtype=torch.float64) for _ in range(world)]
        bs = [torch.randn(11, 6, generator=g, dtype=torch.float64) for _ in range(world)]
        ref64, ref_lp = summed_references(parts, bs, dtype, reduce_op)
        ran = []
        with poison_receive_buffers():
            out = matmul_reduce_scatter(parts[rank].to(dtype), bs[rank].to(dtype), None, scatter_dim, reduce_op,
                                        algo, side_work=[lambda i=i: ran.append(i) for i in range(world + 1)])
        assert ran == list(range(world + 1)), f"side work ran {ran}"
        sl = slice(rank * m, (rank + 1) * m)
        mine64 = ref64[sl] if scatter_dim == 0 else ref64[:, sl]
        mine_lp = ref_lp[sl] if scatter_dim == 0 else ref_lp[:, sl]
        assert out.dtype == dtype
        assert_fa_close(out, mine64, mine_lp.to(dtype), name=f"shard m={m}")
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("algo", ALGOS)
def test_matmul_reduce_scatter(rank_pool, fresh_seed, world, algo):
    assert rank_pool(world).run(_rs_worker, fresh_seed, algo, "float32", "sum") == [True] * world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["collective", "ring"])
def test_matmul_reduce_scatter_bf16_avg(rank_pool, fresh_seed, world, algo):
    assert rank_pool(world).run(_rs_worker, fresh_seed, algo, "bfloat16", "avg") == [True] * world


def _rs_ops_worker(rank, world, algo):
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    # a batch-major activation scattered on its sequence dim, as the SP layers' (batch, seq, hidden)
    a = torch.randn(2, 17 * world, 24)
    b = torch.randn(24, 9)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        matmul_reduce_scatter(a, b, None, 1, "sum", algo)
    return sorted({e.key for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm")})


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("algo", ["collective", "ring"])
def test_reduce_scatter_on_a_strided_dim_runs_2d_gemms(rank_pool, world, algo):
    """A sequence-major view of a batch-major tensor must reach the GEMM as rows, not as a bmm over
    copies of b (that made every TP+SP layer's forward and backward 2-4x slower on CPU)."""
    assert rank_pool(world).run(_rs_ops_worker, algo) == [["aten::mm"]] * world


def _ar_worker(rank, world, seed, algo, dtype_name, reduce_op):
    dtype = getattr(torch, dtype_name)
    g = _gen(seed)
    results = []
    for lead in [(1,), (2, 17), (5,)]:  # rows 1, 34, 5: never a multiple of every group size
        parts = [torch.randn(*lead, 11, generator=g, dtype=torch.float64) for _ in range(world)]
        bs = [torch.randn(11, 6, generator=g, dtype=torch.float64) for _ in range(world)]
        ref64, ref_lp = summed_references(parts, bs, dtype, reduce_op)
        with poison_receive_buffers():
            out = matmul_all_reduce(parts[rank].to(dtype), bs[rank].to(dtype), None, reduce_op, algo)
        assert out.dtype == dtype and out.shape == lead + (6,)
        assert_fa_close(out, ref64, ref_lp.to(dtype), name=f"all-reduced {lead}")
        results.append(out)
    return results


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("algo", ALGOS)
def test_matmul_all_reduce(rank_pool, fresh_seed, world, algo):
    per_rank = rank_pool(world).run(_ar_worker, fresh_seed, algo, "float32", "sum")
    for outs in per_rank[1:]:  # every rank holds the same sum, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(outs, per_rank[0]))


@pytest.mark.parametrize("algo", ["collective", "ring"])
def test_matmul_all_reduce_bf16_avg(rank_pool, fresh_seed, algo):
    rank_pool(3).run(_ar_worker, fresh_seed, algo, "bfloat16", "avg")


def _errors_worker(rank, world):
    return error_messages([
        lambda: matmul_reduce_scatter(torch.randn(2 * world + 1, 4), torch.randn(4, 3), None),
        lambda: all_gather_matmul(torch.randn(3, 4), [torch.randn(5, 2)], None),
        lambda: all_gather_matmul(torch.randn(3, 4), [torch.randn(4, 2)], None, gather_dim=1),
        lambda: matmul_reduce_scatter(torch.randn(world, 4), torch.randn(4, 3), None, algo="fast"),
        lambda: matmul_all_reduce(torch.randn(3, 4), torch.randn(5, 2), None),
    ]) + error_messages([
        lambda: all_gather_matmul(torch.randn(3, 16, dtype=torch.float16), [torch.randn(16, 16, dtype=torch.float16)],
                                  None, algo="fused"),
    ], exc=BackendUnavailableError)


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank(rank_pool, world):
    for msgs in rank_pool(world).run(_errors_worker, timeout=30):
        assert msgs == [
            f"a.shape[0] ({2 * world + 1}) must be divisible by the group size ({world})",
            "bs[0] must be (K, N) with K = 4 (the last dim of A), got shape (5, 2)",
            "gather_dim (1) must name a dim of a_shard other than the last (K) one; a_shard has shape (3, 4)",
            "algo ('fast') must be one of auto, collective, ring, fused",
            "b must be (K, N) with K = 4 (the last dim of A), got shape (5, 2)",
            "algo argument cannot run all_gather_matmul on cpu (torch.float16): the fused GEMM-communication "
            "kernels need CUDA tensors and torch symmetric memory, got a cpu tensor (on the CPU they run only in "
            "the virtual-TP harness, tpkernels.functional.virtual_tp, under TRITON_INTERPRET=1)",
        ]


def test_auto_picks_plain_matmul_collective_or_ring(monkeypatch):
    monkeypatch.delenv("TPKERNELS_BACKEND", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        assert choose_algo(op, "auto", 1, 1e15, cpu) == "local"
        assert choose_algo(op, "ring", 1, 1e3, cpu) == "local"
        assert choose_algo(op, "auto", 4, 1e3, cpu) == "collective"
        assert choose_algo(op, "auto", 4, 1e12, cpu) == "ring"
        assert choose_algo(op, "auto", 4, 1e10, cuda) == "collective"  # below the GPU threshold
        assert choose_algo(op, "auto", 4, 3e8, cpu) == "collective" and choose_algo(op, "auto", 2, 3e8, cpu) == "ring"
        assert choose_algo(op, "auto", 4, 1e12, cpu, overlap=False) == "collective"  # the serial form


def test_explicit_algo_beats_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TPKERNELS_BACKEND", "gemm_comm=collective")
    assert choose_algo("all_gather_matmul", "auto", 4, 1e12, cpu) == "collective"  # the environment decides "auto"
    assert choose_algo("all_gather_matmul", "ring", 4, 1e3, cpu) == "ring"  # an explicit algo wins
    monkeypatch.setenv("TPKERNELS_BACKEND", "matmul_reduce_scatter=ring,gemm_comm=collective")
    assert choose_algo("matmul_reduce_scatter", "auto", 4, 1e3, cpu) == "ring"  # the op's own entry wins
    assert choose_algo("all_gather_matmul", "auto", 4, 1e12, cpu) == "collective"
    monkeypatch.setenv("TPKERNELS_BACKEND", "ring")  # a bare algorithm name: every GEMM-comm op
    assert choose_algo("all_gather_matmul", "auto", 4, 1e3, cpu) == "ring"
    monkeypatch.setenv("TPKERNELS_BACKEND", "reference")  # a kernel name: GEMM-comm ops are not kernels
    assert choose_algo("all_gather_matmul", "auto", 4, 1e3, cpu) == "collective"
    with pytest.raises(ValueError, match=r"algo \('ring'\) overlaps communication by construction; overlap=False"):
        choose_algo("all_gather_matmul", "ring", 4, 1e3, cpu, overlap=False)


def _trace_worker(rank, world, path):
    a = torch.randn(64, 96)
    with CommTrace() as tr:
        all_gather_matmul(a, [torch.randn(96, 80)], None, algo="ring")
        matmul_reduce_scatter(torch.randn(64 * world, 96), torch.randn(96, 80), None, algo="ring")
    events = tr.save_chrome_trace(path)
    # the transfers of the rings (with TPKERNELS_CHECK_RANKS the trace also holds each op's rank check)
    checks = sum(s.name.startswith("rank check") for s in tr.spans)
    gemm, comm = tr.intervals("gemm"), tr.intervals("comm")
    return len(gemm), len(comm) - checks, tr.hidden_comm_fraction(), events is not None, checks


def test_trace_records_every_chunk(rank_pool, tmp_path):
    world = 3
    path = str(tmp_path / "trace.json")
    out = rank_pool(world).run(_trace_worker, path)
    for n_gemm, n_comm, hidden, wrote, _ in out:
        assert n_gemm == 2 * world and n_comm == 2 * (world - 1)
        assert 0.0 <= hidden <= 1.0
    assert [w for *_, w, _ in out] == [True] + [False] * (world - 1)
    data = json.load(open(path))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(world))
    checks = out[0][4]
    assert len(spans) == world * (2 * world + 2 * (world - 1) + checks)
    assert all(e["dur"] >= 0 for e in spans)


class _FakeCudaEvent:
    """Stands in for torch.cuda.Event: 'recorded' at a device time the test sets (ms)."""

    clock_ms = 0.0

    def __init__(self):
        self.t = _FakeCudaEvent.clock_ms

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def test_cuda_spans_share_the_device_time_base(monkeypatch):
    # On CUDA, host launch times say nothing about when a GEMM or a transfer runs: both kinds of span
    # are measured between device events, from one origin, so their overlap is the device's.
    from tpkernels.parallel import trace

    monkeypatch.setattr(trace, "_cuda_event", _FakeCudaEvent)
    with CommTrace() as tr:
        _FakeCudaEvent.clock_ms = 10.0
        comm = trace.CommSpan("ring chunk", "cuda")  # posted at device 10 ms
        with trace.gemm_span("matmul chunk", "cuda"):  # the GEMM runs 10..14 ms
            _FakeCudaEvent.clock_ms = 14.0
        _FakeCudaEvent.clock_ms = 16.0
        comm.done()  # the transfer completes at 16 ms: 4 of its 6 ms hidden
    (gs, ge), = tr.intervals("gemm")
    (cs, ce), = tr.intervals("comm")
    assert (ge - gs, ce - cs) == pytest.approx((4e-3, 6e-3))
    assert gs == pytest.approx(cs)  # one time base: the two start together on the device
    assert tr.hidden_comm_fraction() == pytest.approx(4 / 6)


def _fp64_worker(rank, world, seed):
    """float64 stays float64 end to end (the one accumulation policy): the reduce-scatter's partial sums
    and the vocabulary-parallel loss agree with a float64 reference to float64 precision."""
    from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415

    g = _gen(seed)
    parts = [torch.randn(2 * world, 9, generator=g, dtype=torch.float64) for _ in range(world)]
    bs = [torch.randn(9, 5, generator=g, dtype=torch.float64) for _ in range(world)]
    ref = sum(p @ b for p, b in zip(parts, bs))[2 * rank:2 * rank + 2]
    errs = []
    for algo in ("collective", "ring"):
        out = matmul_reduce_scatter(parts[rank], bs[rank], None, algo=algo)
        errs.append((out.dtype == torch.float64, float((out - ref).abs().max())))
    logits = torch.randn(7, 4 * world, generator=g, dtype=torch.float64) * 5
    target = torch.randint(0, 4 * world, (7,), generator=g)
    loss = vocab_parallel_cross_entropy(logits.chunk(world, -1)[rank], target, None, reduction="none")
    want = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    errs.append((loss.dtype == torch.float64, float((loss - want).abs().max())))
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_float64_stays_float64(rank_pool, fresh_seed, world):
    for errs in rank_pool(world).run(_fp64_worker, fresh_seed):
        for is_fp64, err in errs:
            assert is_fp64 and err < 1e-12, errs  # an fp32 round trip would leave ~1e-7
