"""ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding / vocab_parallel_cross_entropy on
gloo, world sizes 1–4: outputs and every gradient equal the dense single-process layers, a TP model
trains step by step like the dense one, bad configurations raise the same error on every rank."""

from __future__ import annotations

import contextlib
import copy
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkernels.functional.gemm_comm import poison_receive_buffers
from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpkernels.parallel.mappings import all_gather_dim
from tpkernels.testing.errors import error_messages
from tpkernels.testing.tolerance import assert_fa_close

WORLD_SIZES = [1, 2, 3, 4]


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank]


@contextlib.contextmanager
def _forced_algo(algo):
    """Force every GEMM-comm op to one algorithm through the environment (the tiny test shapes would
    make "auto" pick collective); the layers pass algo="auto", so the environment decides."""
    old = os.environ.get("TPKERNELS_BACKEND")
    if algo:
        os.environ["TPKERNELS_BACKEND"] = f"gemm_comm={algo}"
    try:
        yield
    finally:
        os.environ.pop("TPKERNELS_BACKEND", None)
        if old is not None:
            os.environ["TPKERNELS_BACKEND"] = old


def _pair_worker(rank, world, seed, sp, seq_dim, bias, overlap, regather, gather_output, input_is_parallel, force,
                 dtype_name):
    """column → tanh → row, against the dense pair in float64 and in the tested dtype. (A smooth activation:
    with ReLU a bf16 rounding difference can flip a unit on or off and the gradients then differ by O(1).)"""
    torch.manual_seed(seed)
    h, f, s, b = 6, 4 * world, 3 * world, 2
    fc1, fc2 = nn.Linear(h, f, bias=bias).double(), nn.Linear(f, h, bias=bias).double()
    x64 = torch.randn(s, b, h, dtype=torch.float64) if seq_dim == 0 else torch.randn(b, s, h, dtype=torch.float64)
    dy64 = torch.randn_like(x64)

    def dense(dtype):
        c1, c2 = copy.deepcopy(fc1).to(dtype), copy.deepcopy(fc2).to(dtype)
        x = x64.detach().to(dtype).clone().requires_grad_()
        y = c2(torch.tanh(c1(x)))
        y.backward(dy64.to(dtype))
        return y, x.grad, c1, c2

    lp = getattr(torch, dtype_name)
    y64, dx64, r1, r2 = dense(torch.float64)
    y32, dx32, q1, q2 = dense(lp)  # the same math in the tested dtype: the tolerance's yardstick
    kw = dict(overlap_comm=overlap, sequence_parallel=sp, sequence_dim=seq_dim)
    col = ColumnParallelLinear.from_linear(copy.deepcopy(fc1).to(lp), None, gather_output=gather_output,
                                           regather_input=regather, **kw)
    row = RowParallelLinear.from_linear(copy.deepcopy(fc2).to(lp), None,
                                        input_is_parallel=input_is_parallel and not gather_output, **kw)
    x = x64.detach().to(lp)
    if sp:
        x = _shard(x, seq_dim, rank, world)
    x = x.clone().requires_grad_()
    if rank == world - 1:
        time.sleep(0.02)  # one rank late
    with poison_receive_buffers(), _forced_algo(force):
        y = row(torch.tanh(col(x)))
        dy = _shard(dy64.to(lp), seq_dim, rank, world) if sp else dy64.to(lp)
        y.backward(dy)
    want_y64 = _shard(y64, seq_dim, rank, world) if sp else y64
    want_y32 = _shard(y32, seq_dim, rank, world) if sp else y32
    assert_fa_close(y, want_y64, want_y32, name="y")
    want_dx64 = _shard(dx64, seq_dim, rank, world) if sp else dx64
    want_dx32 = _shard(dx32, seq_dim, rank, world) if sp else dx32
    assert_fa_close(x.grad, want_dx64, want_dx32, grad=True, name="dx")
    rows = slice(rank * col.out_per_rank, (rank + 1) * col.out_per_rank)
    assert_fa_close(col.weight.grad, r1.weight.grad[rows], q1.weight.grad[rows], grad=True, name="fc1.weight.grad")
    assert_fa_close(row.weight.grad, r2.weight.grad[:, rows], q2.weight.grad[:, rows], grad=True,
                    name="fc2.weight.grad")
    if bias:
        assert_fa_close(col.bias.grad, r1.bias.grad[rows], q1.bias.grad[rows], grad=True, name="fc1.bias.grad")
        assert_fa_close(row.bias.grad, r2.bias.grad, q2.bias.grad, grad=True, name="fc2.bias.grad")
    # the dense layers come back out
    assert torch.equal(col.to_linear().weight, fc1.weight.to(lp)) and torch.equal(row.to_linear().weight,
                                                                                 fc2.weight.to(lp))
    return True


PAIR_MODES = [
    # sp, seq_dim, bias, overlap, regather, gather_output, input_is_parallel, forced algo, dtype
    (False, 0, True, True, False, False, True, None, "float32"),
    (False, 1, False, False, False, False, True, None, "float32"),
    (False, 0, True, True, False, True, False, None, "float32"),  # gathered column output into a splitting row layer
    (True, 0, True, True, False, False, True, "ring", "float32"),
    (True, 1, True, True, True, False, True, "ring", "float32"),
    (True, 0, True, True, False, False, True, None, "float32"),  # auto
    (True, 1, False, False, False, False, True, None, "float32"),  # overlap_comm=False: collectives
    (True, 0, True, True, False, False, True, "ring", "bfloat16"),
    (False, 0, True, True, False, False, True, None, "bfloat16"),
]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("mode", PAIR_MODES, ids=lambda m: f"sp{int(m[0])}-d{m[1]}-b{int(m[2])}-ov{int(m[3])}-"
                         f"rg{int(m[4])}-go{int(m[5])}-{m[7] or 'default'}-{m[8]}")
def test_column_row_pair_matches_dense(rank_pool, fresh_seed, world, mode):
    assert rank_pool(world).run(_pair_worker, fresh_seed, *mode) == [True] * world


def _ce_worker(rank, world, seed, smoothing):
    torch.manual_seed(seed)
    vocab, tokens = 6 * world, 17
    logits64 = torch.randn(tokens, vocab, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (tokens,))
    target[::5] = -100
    dloss = torch.randn(tokens, dtype=torch.float64)

    def ref(dtype):
        z = logits64.detach().to(dtype).clone().requires_grad_()
        loss = F.cross_entropy(z, target, reduction="none", label_smoothing=smoothing, ignore_index=-100)
        loss.backward(dloss.to(dtype))
        return loss, z.grad

    l64, g64 = ref(torch.float64)
    l32, g32 = ref(torch.float32)
    z = _shard(logits64.float(), -1, rank, world).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(z, target, None, label_smoothing=smoothing, reduction="none")
    loss.backward(dloss.float())
    assert_fa_close(loss, l64, l32, name="loss")
    assert_fa_close(z.grad, _shard(g64, -1, rank, world), _shard(g32, -1, rank, world), grad=True, name="dlogits")
    mean = vocab_parallel_cross_entropy(z.detach(), target, None, label_smoothing=smoothing)
    want = F.cross_entropy(logits64, target, label_smoothing=smoothing)
    assert abs(mean.item() - want.item()) < 1e-5
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy(rank_pool, fresh_seed, world, smoothing):
    assert rank_pool(world).run(_ce_worker, fresh_seed, smoothing) == [True] * world


class DenseLM(nn.Module):
    """embedding → fc1 → GeLU → fc2 → head, loss = cross-entropy over the vocabulary."""

    def __init__(self, vocab, h, f):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(vocab, h), nn.Linear(h, f), nn.Linear(f, h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids, target):
        x = self.emb(ids)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=0.05)


class TPLM(nn.Module):
    def __init__(self, dense: DenseLM, sp: bool):
        super().__init__()
        self.sp = sp
        self.emb = VocabParallelEmbedding.from_embedding(dense.emb, None, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear.from_linear(dense.fc1, None, sequence_parallel=sp)
        self.fc2 = RowParallelLinear.from_linear(dense.fc2, None, sequence_parallel=sp)
        self.head = ColumnParallelLinear.from_linear(dense.head, None, sequence_parallel=sp)

    def forward(self, ids, target):
        x = self.emb(ids)  # SP: this rank's shard of the sequence
        x = x + self.fc2(F.gelu(self.fc1(x)))
        logits = self.head(x)  # (seq, batch, vocab/P) over the whole sequence
        return vocab_parallel_cross_entropy(logits, target, None, label_smoothing=0.05)


def _train_worker(rank, world, seed, sp, force):
    torch.manual_seed(seed)
    vocab, h, f, s, b = 4 * world, 8, 4 * world, 2 * world + (0 if sp else 1), 3
    dense = DenseLM(vocab, h, f)
    tp = TPLM(copy.deepcopy(dense), sp)
    opt_d, opt_t = torch.optim.SGD(dense.parameters(), lr=0.5), torch.optim.SGD(tp.parameters(), lr=0.5)
    for step in range(3):
        ids, target = torch.randint(0, vocab, (s, b)), torch.randint(0, vocab, (s, b))
        with _forced_algo(force):
            ld, lt = dense(ids, target), tp(ids, target)
            assert abs(ld.item() - lt.item()) < 1e-5, (step, ld.item(), lt.item())
            for opt, loss in ((opt_d, ld), (opt_t, lt)):
                opt.zero_grad()
                loss.backward()
                opt.step()
        full = {
            "emb": tp.emb.full_state_dict()["weight"], "fc1": tp.fc1.full_state_dict()["weight"],
            "fc2": tp.fc2.full_state_dict()["weight"], "head": tp.head.full_state_dict()["weight"],
            "fc2.bias": tp.fc2.bias.detach(),
        }
        want = {"emb": dense.emb.weight, "fc1": dense.fc1.weight, "fc2": dense.fc2.weight, "head": dense.head.weight,
                "fc2.bias": dense.fc2.bias}
        for k in full:
            torch.testing.assert_close(full[k], want[k].detach(), rtol=1e-5, atol=1e-6, msg=f"{k} after step {step}")
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("sp,force", [(False, None), (True, "ring"), (True, "collective")])
def test_tp_model_trains_like_dense(rank_pool, fresh_seed, world, sp, force):
    assert rank_pool(world).run(_train_worker, fresh_seed, sp, force) == [True] * world


def _config_errors_worker(rank, world):
    return error_messages([
        lambda: ColumnParallelLinear(8, 1000, tp_group=None),
        lambda: RowParallelLinear(1001, 8, tp_group=None),
        lambda: RowParallelLinear(4 * world, 8, sequence_parallel=True)(torch.randn(2 * world + 1, 2, 4)),
        lambda: VocabParallelEmbedding(12, 4, sequence_parallel=True)(torch.zeros(2 * world + 1, 2, dtype=torch.long)),
        lambda: ColumnParallelLinear(8, 12, gather_output=True, sequence_parallel=True),
        lambda: ColumnParallelLinear(8, 12)(torch.randn(3, 7)),
    ])


@pytest.mark.parametrize("world", [2, 3])
def test_invalid_configurations_raise_on_every_rank(rank_pool, world):
    results = rank_pool(world).run(_config_errors_worker, timeout=30)
    assert all(r == results[0] for r in results)
    msgs = results[0]
    assert msgs[0] == ("out_features (1000) must be divisible by tensor_parallel_size (3)" if world == 3 else None)
    assert msgs[1] == f"in_features (1001) must be divisible by tensor_parallel_size ({world})"
    assert msgs[2] == (f"sequence length ({2 * world + 1}) must be divisible by tensor_parallel_size ({world}) "
                       "when sequence_parallel=True")
    assert msgs[3] == msgs[2]
    assert msgs[4].startswith("gather_output=True cannot be combined with sequence_parallel=True")
    assert msgs[5] == "input's last dim (7) must equal in_features (8)"


def _gather_worker(rank, world):
    t = torch.full((2, 3), float(rank))
    return all_gather_dim(t, 1, None)[0].tolist()


def test_gather_along_a_middle_dim(rank_pool):
    for row in rank_pool(3).run(_gather_worker):
        assert row == [0.0] * 3 + [1.0] * 3 + [2.0] * 3
