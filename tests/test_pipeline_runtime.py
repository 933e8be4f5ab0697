"""The pipeline runtime on gloo: every schedule gives the loss and every gradient of a single-process
run; variable sequence length between steps; structured messages; a failing stage fails every rank."""

from __future__ import annotations

import copy
import json
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
from tpkernels.testing.distributed import run_on_ranks
from tpkernels.pipeline.timeline import bubble_fraction, gather_timeline, plot_gantt, to_chrome_trace

H, VOCAB = 8, 5


class Block(nn.Module):
    """Linear + LayerNorm + tanh, residual: has Linear weights (deferred in ZB) and norm weights (not)."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(H, H), nn.LayerNorm(H)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


def _model(p, v, seed):
    torch.manual_seed(seed)
    layers = [Block() for _ in range(2 * p * v + 1)]  # odd: stages are uneven
    first, last = nn.Linear(3, H), nn.Linear(H, VOCAB)
    return layers, first, last


def _loss(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def _pipeline_worker(rank, world, seed, schedule, v, ms):
    for m in ms:
        layers, first, last = _model(world, v, seed)
        dense = nn.Sequential(first, *layers, last)
        ref = copy.deepcopy(dense)
        stages = split_layers(layers, world, v, first=first, last=last)
        rt = PipelineRuntime(chunks_of_rank(stages, rank, world), schedule, m, loss_fn=_loss, timeout_s=60)
        g = torch.Generator().manual_seed(seed + m)
        for seq in (5, 7):  # the second step changes the activation shape: metadata is re-sent
            x = torch.randn(2 * m, seq, 3, generator=g)
            t = torch.randint(0, VOCAB, (2 * m, seq), generator=g)
            for prm in list(dense.parameters()) + list(ref.parameters()):
                prm.grad = None
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


def _ms(p):
    return sorted({1, p, 2 * p + 1})


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_schedules_match_single_process(rank_pool, fresh_seed, p, schedule):
    assert rank_pool(p).run(_pipeline_worker, fresh_seed, schedule, 1, _ms(p), timeout=300) == [True] * p


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_matches_single_process(rank_pool, fresh_seed, p):
    # Megatron's interleaving needs num_microbatches to be a multiple of the stages: m = p and 2p
    assert rank_pool(p).run(_pipeline_worker, fresh_seed, "interleaved", 2, [p, 2 * p], timeout=300) == [True] * p


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
    layers, first, last = _model(world, 1, 0)
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
