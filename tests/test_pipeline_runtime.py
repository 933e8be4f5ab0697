"""The pipeline runtime on gloo: every schedule gives the loss and every gradient of a single-process
run; variable sequence length between steps; structured messages; a failing stage fails every rank."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkernels.pipeline import (
    P2P,
    PipelineAbortError,
    PipelineRuntime,
    PipelineTimeoutError,
    chunks_of_rank,
    split_layers,
)
from tpkernels.pipeline.p2p import KIND_ACT
from tpkernels.testing.distributed import RankExited, run_on_ranks
from tpkernels.pipeline.timeline import bubble_fraction, gather_timeline, plot_gantt, to_chrome_trace

H, VOCAB = 8, 5


class PreNormBlock(nn.Module):
    """A Transformer layer's shape: x + fc2(tanh(fc1(norm(x)))) — fc2's output gradient is the received
    gradient itself, passed through the residual add. ``post_norm``: a norm between fc2 and the residual."""

    def __init__(self, post_norm: bool):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.post = nn.LayerNorm(H) if post_norm else nn.Identity()

    def forward(self, x):
        return x + self.post(self.fc2(torch.tanh(self.fc1(self.norm(x)))))


def _model(p, v, seed, post_norm):
    torch.manual_seed(seed)
    layers = [PreNormBlock(post_norm) for _ in range(2 * p * v + 1)]  # odd: stages are uneven
    first, last = nn.Linear(3, H), nn.Sequential(nn.LayerNorm(H), nn.Linear(H, VOCAB))
    return layers, first, last


def _loss(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def _pipeline_worker(rank, world, seed, schedule, v, ms, post_norm):
    for m in ms:
        layers, first, last = _model(world, v, seed, post_norm)
        dense = nn.Sequential(first, *layers, last)
        ref = copy.deepcopy(dense)
        stages = split_layers(layers, world, v, first=first, last=last)
        rt = PipelineRuntime(chunks_of_rank(stages, rank, world), schedule, m, loss_fn=_loss, timeout_s=60)
        g = torch.Generator().manual_seed(seed + m)
        # steps back to back: the same shapes twice (any stale buffer would show), then a new one
        # (the metadata is re-sent); gradients accumulate over the steps, as without zero_grad
        for seq in (5, 5, 7):
            x = torch.randn(2 * m, seq, 3, generator=g)
            t = torch.randint(0, VOCAB, (2 * m, seq), generator=g)
            loss = rt.step(x if rank == 0 else None, t if rank == world - 1 else None)
            want = sum(_loss(ref(xx), tt) for xx, tt in zip(x.chunk(m), t.chunk(m))) / m
            want.backward()
            assert abs(loss - want.item()) < 1e-5, (m, seq, loss, want.item())
            mine = {id(prm) for c in rt.chunks for prm in c.parameters()}
            for (name, prm), (_, rprm) in zip(dense.named_parameters(), ref.named_parameters()):
                if id(prm) in mine:
                    assert prm.grad is not None, f"{name}: no gradient (m={m}, seq={seq})"
                    torch.testing.assert_close(prm.grad, rprm.grad, rtol=1e-5, atol=1e-6,
                                               msg=f"{name} (m={m}, seq={seq}, {schedule})")
    return True


@pytest.mark.parametrize("post_norm", [False, True], ids=["residual", "norm-before-residual"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_schedules_match_single_process_on_prenorm_blocks(rank_pool, fresh_seed, p, schedule, post_norm):
    # m ∈ {p, 2p+1}; the interleaved schedule needs multiples of p (Megatron's rule): {p, 2p}
    v, ms = (2, [p, 2 * p]) if schedule == "interleaved" else (1, [p, 2 * p + 1])
    assert rank_pool(p).run(_pipeline_worker, fresh_seed, schedule, v, ms, post_norm, timeout=300) == [True] * p


def test_one_stage_runs_every_schedule_locally(rank_pool, fresh_seed):
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        assert rank_pool(1).run(_pipeline_worker, fresh_seed, schedule, 1, [1, 3], False) == [True]


def _deferral_worker(rank, world, seed):
    """Record when each Linear weight's gradient lands (post-accumulate hook): under zb-h1 it must be
    inside a W action, once per micro-batch; the norms' gradients land in B."""
    m = 2 * world + 1
    layers, first, last = _model(world, 1, seed, False)
    stages = split_layers(layers, world, first=first, last=last)
    chunk = chunks_of_rank(stages, rank, world)[0]
    landed = {"linear": [], "norm": []}
    for mod in chunk.modules():
        kind = "linear" if isinstance(mod, nn.Linear) else "norm" if isinstance(mod, nn.LayerNorm) else None
        if kind:
            mod.weight.register_post_accumulate_grad_hook(lambda prm, k=kind: landed[k].append(time.perf_counter()))
    rt = PipelineRuntime([chunk], "zb-h1", m, loss_fn=_loss, timeout_s=60)
    rt.step(torch.randn(m, 4, 3) if rank == 0 else None, torch.randint(0, VOCAB, (m, 4)) if rank == world - 1 else None)

    def kind_at(t):
        return next((a.kind for a, s, e in rt.timeline if s <= t <= e), None)

    n_linear = sum(isinstance(mod, nn.Linear) for mod in chunk.modules())
    n_norm = sum(isinstance(mod, nn.LayerNorm) for mod in chunk.modules())
    w_spans = [(a, s, e) for a, s, e in rt.timeline if a.kind == "W"]
    b_end = {a.mb: e for a, s, e in rt.timeline if a.kind == "B"}
    w_start = {a.mb: s for a, s, e in w_spans}
    return ({kind_at(t) for t in landed["linear"]}, len(landed["linear"]) == m * n_linear,
            {kind_at(t) for t in landed["norm"]}, len(landed["norm"]) == m * n_norm,
            len(w_spans) == m and all(w_start[mb] >= b_end[mb] for mb in range(m)),
            any(w_start[mb] > b_end[mb + 1] for mb in range(m - 1) if mb + 1 in b_end))


def test_zero_bubble_defers_weight_gradients_to_w(rank_pool, fresh_seed):
    world = 4
    out = rank_pool(world).run(_deferral_worker, fresh_seed)
    for r, (linear_in, linear_count_ok, norm_in, norm_count_ok, w_after_b, some_w_later) in enumerate(out):
        assert linear_in == {"W"}, f"rank {r}: Linear weight gradients landed during {linear_in}, not only in W"
        assert linear_count_ok, f"rank {r}: a Linear weight's hook did not fire once per micro-batch"
        assert norm_in == {"B"} and norm_count_ok, f"rank {r}: norm gradients landed during {norm_in}"
        assert w_after_b
    # ZB-H1 fills the drain with W: on the first stage some W runs after the next micro-batch's B
    assert out[0][5], "no W of rank 0 was deferred past a later B: deferral had no effect on the schedule"


class Fails(nn.Module):
    def __init__(self, rank_to_fail):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.rank_to_fail, self.calls = rank_to_fail, 0

    def forward(self, x):
        import torch.distributed as dist  # noqa: PLC0415

        self.calls += 1
        if dist.get_rank() == self.rank_to_fail and self.calls == 2:
            raise ValueError("deliberate failure in micro-batch 1")
        return self.fc(x)


def _failing_worker(rank, world, schedule):
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(3, H), Fails(1))] + [nn.Sequential(Fails(1)) for _ in range(world - 2)] + \
             [nn.Sequential(Fails(1), nn.Linear(H, VOCAB))]
    rt = PipelineRuntime([stages[rank]], schedule, 4, loss_fn=_loss, timeout_s=20)
    t0 = time.perf_counter()
    try:
        rt.step(torch.randn(8, 2, 3) if rank == 0 else None, torch.randint(0, VOCAB, (8, 2)) if rank == world - 1
                else None)
        return "no error", "", time.perf_counter() - t0
    except (ValueError, PipelineAbortError, PipelineTimeoutError) as e:
        return type(e).__name__, str(e), time.perf_counter() - t0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_failing_stage_fails_every_rank(schedule):
    world = 4
    # a fresh group: transfers left pending by the failure must not reach the next test's ranks
    out = run_on_ranks(_failing_worker, world, schedule, timeout=120)
    kinds = [k for k, _, _ in out]
    assert kinds[1] == "ValueError"
    for r, (kind, msg, elapsed) in enumerate(out):
        assert kind != "no error", f"rank {r} did not notice the failure"
        assert elapsed < 15, f"rank {r} took {elapsed:.0f} s to fail (the abort did not propagate)"
        if kind == "PipelineAbortError":
            assert "pipeline stage on rank 1 raised ValueError: deliberate failure" in msg


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box["calls"] += 1
        if ctx.box["calls"] == ctx.box["fail_at"]:
            raise ValueError("deliberate failure in the last backward")
        return g, None


class RaisesInBackward(nn.Module):
    def __init__(self, fail_at):
        super().__init__()
        self.box = {"calls": 0, "fail_at": fail_at}

    def forward(self, x):
        return _RaiseInBackward.apply(x, self.box)


class DiesInForward(nn.Module):
    def __init__(self, at_call):
        super().__init__()
        self.calls, self.at_call = 0, at_call

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            os._exit(7)  # no exception, no goodbye: the process is gone
        return x


def _broken_worker(rank, world, case, schedule):
    """Break one rank in one way; report what every rank raised and how long it took."""
    m = 4
    layers, first, last = _model(world, 1, 0, False)
    stages = split_layers(layers, world, first=first, last=last)
    chunk = chunks_of_rank(stages, rank, world)[0]
    x, t = torch.randn(2 * m, 2, 3), torch.randint(0, VOCAB, (2 * m, 2))
    inputs, targets = (x if rank == 0 else None), (t if rank == world - 1 else None)
    timeout = 30
    if case == "no-inputs" and rank == 0:
        inputs = None
    if case == "bad-batch" and rank == world - 1:
        targets = t[:2 * m - 1]
    if case == "no-targets" and rank == world - 1:
        targets = None
    if case == "last-backward" and rank == 0:  # rank 0's last action is the backward of the last micro-batch
        chunk = nn.Sequential(chunk[0], RaisesInBackward(fail_at=m), *chunk[1:])  # after the first Linear
    if case == "dies" and rank == 1:
        chunk = nn.Sequential(DiesInForward(at_call=2), *chunk)
    if case == "slow-peer":
        timeout = 2
        if rank == 1:
            time.sleep(6)
    rt = PipelineRuntime([chunk], schedule, m, loss_fn=_loss, timeout_s=timeout)
    t0 = time.perf_counter()
    try:
        rt.step(inputs, targets)
        return "no error", "", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (the test inspects whatever each rank raised)
        return type(e).__name__, str(e), time.perf_counter() - t0


@pytest.mark.parametrize("case,schedule,world,origin,origin_error,cause", [
    ("no-inputs", "1f1b", 3, 0, "ValueError", "inputs are required on rank 0 (the first pipeline stage)"),
    ("bad-batch", "zb-h1", 3, 2, "ValueError", "targets: batch size (7) must be divisible by num_microbatches (4)"),
    ("no-targets", "gpipe", 2, 1, "ValueError", "targets are required on rank 1 (the last pipeline stage)"),
    ("last-backward", "1f1b", 4, 0, "ValueError", "deliberate failure in the last backward"),
    ("last-backward", "zb-h1", 3, 0, "ValueError", "deliberate failure in the last backward"),
])
def test_a_failing_rank_fails_every_rank_fast_with_its_cause(case, schedule, world, origin, origin_error, cause):
    # a fresh group: transfers left pending by the failure must not reach the next test's ranks
    out = run_on_ranks(_broken_worker, world, case, schedule, timeout=120)
    assert out[origin][0] == origin_error and cause in out[origin][1], out[origin]
    for r, (kind, msg, elapsed) in enumerate(out):
        assert kind != "no error", f"rank {r} did not notice the failure"
        assert elapsed < 10, f"rank {r} took {elapsed:.0f} s to fail (the abort did not reach it)"
        if r != origin:
            assert kind == "PipelineAbortError", (r, kind, msg)
            assert f"pipeline stage on rank {origin} raised {origin_error}: {cause}" in msg, (r, msg)


def test_a_rank_that_dies_is_named_by_every_other_rank():
    world = 4
    out = run_on_ranks(_broken_worker, world, "dies", "1f1b", timeout=120, expect_exit={1})
    assert isinstance(out[1], RankExited) and out[1].exitcode == 7
    for r in (0, 2, 3):
        kind, msg, elapsed = out[r]
        assert kind in ("PipelinePeerLostError", "PipelineAbortError"), (r, kind, msg)
        assert "rank 1 stopped responding (connection lost)" in msg, (r, msg)
        assert elapsed < 20, f"rank {r} took {elapsed:.0f} s (timeout 30 s)"
    assert out[0][0] == out[2][0] == "PipelinePeerLostError"  # the neighbours saw the connection close


def test_a_wait_past_the_timeout_raises_the_timeout_error():
    out = run_on_ranks(_broken_worker, 2, "slow-peer", "1f1b", timeout=120)
    kind, msg, elapsed = out[0]
    assert kind == "PipelineTimeoutError", out[0]
    assert "rank 0 waited more than 2 s for the gradient of micro-batch 0 (chunk 0) from rank 1" in msg
    assert 1.5 < elapsed < 6
    # gloo closes the connection of a wait that timed out: the peer hears of it either way
    assert out[1][0] in ("PipelineAbortError", "PipelinePeerLostError") and "rank 0" in out[1][1], out[1]


def _p2p_worker(rank, world):
    p2p = P2P(None, timeout_s=30)
    msgs = [
        {"h": torch.randn(2, 3), "pair": (torch.arange(4), [torch.ones(1, dtype=torch.float16)])},
        {"h": torch.randn(2, 3), "pair": (torch.arange(4), [torch.ones(1, dtype=torch.float16)])},  # same meta
        {"h": torch.randn(5, 3), "pair": (torch.arange(2), [torch.ones(3, dtype=torch.float16)])},  # new shapes
    ]
    if rank == 0:
        for i, msg in enumerate(msgs):
            p2p.send(msg, 1, KIND_ACT, i, 0)
        sent_meta = [len(p2p._inflight)]
        p2p.wait_sends()
        return sent_meta, [m["h"].tolist() for m in msgs]
    got = [p2p.recv(0, KIND_ACT, i, 0) for i in range(3)]
    for g, m in zip(got, msgs):
        assert set(g) == {"h", "pair"} and isinstance(g["pair"], tuple) and isinstance(g["pair"][1], list)
        assert g["pair"][0].dtype == torch.int64 and g["pair"][1][0].dtype == torch.float16
        assert g["h"].shape == m["h"].shape and g["pair"][0].shape == m["pair"][0].shape
    return None, [g["h"].tolist() for g in got]


def test_p2p_structures_and_metadata_cache(rank_pool):
    (sent_meta, sent), (_, got) = rank_pool(2).run(_p2p_worker)
    assert sent == got
    # 3 messages × (header + 3 tensors) + metadata for the first and the third only
    assert sent_meta == [3 * 4 + 2]


def _timeline_worker(rank, world, path_json, path_png):
    layers, first, last = _model(world, 1, 0, False)
    stages = split_layers(layers, world, first=first, last=last)
    rt = PipelineRuntime(chunks_of_rank(stages, rank, world), "1f1b", 4, loss_fn=_loss)
    rt.step(torch.randn(8, 4, 3) if rank == 0 else None, torch.randint(0, VOCAB, (8, 4)) if rank == world - 1 else None)
    tl = gather_timeline(rt.timeline)
    if rank == 0:
        to_chrome_trace(tl, path_json, "1f1b")
        plot_gantt(tl, path_png, "1f1b", predicted_bubble=0.4)
    return len(tl), [len(r) for r in tl], bubble_fraction(tl)


def test_timeline_trace_and_gantt(rank_pool, tmp_path):
    js, png = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    out = rank_pool(2).run(_timeline_worker, js, png)
    for n, per_rank, bubble in out:
        assert n == 2 and per_rank == [8, 8] and 0 <= bubble < 1
    events = [e for e in json.load(open(js))["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 16 and {e["tid"] for e in events} == {0, 1}
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_split_layers_rules():
    layers = [nn.Linear(4, 4) for _ in range(7)]
    assert [len(s) for s in split_layers(layers, 3)] == [3, 2, 2]
    assert [len(s) for s in split_layers(layers, 2, layer_counts=[2, 5])] == [2, 5]
    assert [len(s) for s in split_layers(layers, 2, 2, first=nn.Linear(4, 4))] == [3, 2, 2, 1]
    big = [nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 4), nn.Linear(4, 4)]
    assert [len(s) for s in split_layers(big, 2, balance="params")] == [2, 2]
    assert [len(s) for s in split_layers(big, 3, balance="params")] == [1, 1, 2]
    with pytest.raises(ValueError, match=r"number of layers \(7\) must be at least num_stages × virtual_stages "
                                         r"\(4 × 2 = 8\)"):
        split_layers(layers, 4, 2)
    with pytest.raises(ValueError, match=r"layer_counts \(\[3, 3\]\) must be 2 positive numbers summing"):
        split_layers(layers, 2, layer_counts=[3, 3])
    assert [s for s in chunks_of_rank(list("abcdef"), 1, 3)] == ["b", "e"]
