"""Tensor parallelism with sequence parallelism inside a pipeline, every schedule (zero-bubble
included): TP2 × PP2 on gloo, a pre-norm residual Transformer built from the package's
vocab-parallel embedding, Column/RowParallelLinear with SP and the vocab-parallel loss, against
the dense single-process model (loss and every gradient). Under zb-h1 the TP layers' weight
gradients are deferred to W and still land through autograd (post-accumulate hooks count them)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpkernels.functional.vocab_parallel import vocab_parallel_cross_entropy
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpkernels.pipeline import PipelineRuntime, chunks_of_rank, split_layers

H, FFN, VOCAB, SEQ, LAYERS = 8, 16, 10, 6, 4
TP, PP = 2, 2


class DenseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class DenseHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


class TPBlock(nn.Module):
    """The same block, its Linears split over TP with SP: x and the output are this rank's slice of
    the sequence (dim 1)."""

    def __init__(self, dense: DenseBlock, tp_group):
        super().__init__()
        kw = dict(sequence_parallel=True, sequence_dim=1)
        self.norm = copy.deepcopy(dense.norm)
        self.fc1 = ColumnParallelLinear.from_linear(dense.fc1, tp_group, **kw)
        self.fc2 = RowParallelLinear.from_linear(dense.fc2, tp_group, **kw)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class TPHead(nn.Module):
    def __init__(self, dense: DenseHead, tp_group):
        super().__init__()
        self.norm = copy.deepcopy(dense.norm)
        self.head = ColumnParallelLinear.from_linear(dense.head, tp_group, sequence_parallel=True, sequence_dim=1)

    def forward(self, x):
        return self.head(self.norm(x))  # (batch, seq, vocab / TP): the whole sequence


def _groups(rank):
    """TP fastest (ParallelConfig's rank order): TP groups {0,1}, {2,3}; PP groups {0,2}, {1,3}."""
    tps = [dist.new_group([p * TP + t for t in range(TP)]) for p in range(PP)]
    pps = [dist.new_group([p * TP + t for p in range(PP)]) for t in range(TP)]
    return tps[rank // TP], pps[rank % TP], rank % TP, rank // TP


def _worker(rank, world, seed, schedule, v, m):
    tp_group, pp_group, tp_rank, pp_rank = _groups(rank)
    torch.manual_seed(seed)
    emb, blocks, head = nn.Embedding(VOCAB, H), [DenseBlock() for _ in range(LAYERS)], DenseHead()
    ids = torch.randint(0, VOCAB, (3 * m, SEQ))
    target = torch.randint(0, VOCAB, (3 * m, SEQ))
    # the dense model, one process: the mean loss over micro-batches, as the pipeline computes it
    dense = nn.ModuleList([emb, *blocks, head])
    ref = copy.deepcopy(dense)

    def dense_loss(i, t):
        x = ref[0](i)
        for blk in ref[1:-1]:
            x = blk(x)
        return F.cross_entropy(ref[-1](x).reshape(-1, VOCAB), t.reshape(-1))

    want = sum(dense_loss(i, t) for i, t in zip(ids.chunk(m), target.chunk(m))) / m
    want.backward()

    tp_emb = VocabParallelEmbedding.from_embedding(emb, tp_group, sequence_parallel=True, sequence_dim=1)
    tp_blocks = [TPBlock(b, tp_group) for b in blocks]
    tp_head = TPHead(head, tp_group)
    stages = split_layers(tp_blocks, PP, v, first=tp_emb, last=tp_head)
    chunks = chunks_of_rank(stages, pp_rank, PP)
    landed: dict[str, int] = {}
    for ci, c in enumerate(chunks):
        for name, mod in c.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                mod.weight.register_post_accumulate_grad_hook(
                    lambda prm, n=f"chunk{ci}.{name}": landed.__setitem__(n, landed.get(n, 0) + 1))

    def loss_fn(logits, t):
        return vocab_parallel_cross_entropy(logits, t, tp_group)

    rt = PipelineRuntime(chunks, schedule, m, loss_fn=loss_fn, group=pp_group, timeout_s=60)
    loss = rt.step(ids if pp_rank == 0 else None, target if pp_rank == PP - 1 else None)
    assert abs(loss - want.item()) < 1e-5, (schedule, loss, want.item())
    assert landed and set(landed.values()) == {m}, f"weight-gradient hooks fired {landed} times, not {m} each"

    # norms see this rank's slice of the sequence under SP: their gradients add up over the TP group
    checked = 0
    for c in chunks:
        for mod in c.modules():
            if isinstance(mod, nn.LayerNorm):
                for prm in mod.parameters():
                    dist.all_reduce(prm.grad, group=tp_group)
    rows = slice(tp_rank * FFN // TP, (tp_rank + 1) * FFN // TP)
    vrows = slice(tp_rank * VOCAB // TP, (tp_rank + 1) * VOCAB // TP)
    ref_emb, ref_blocks, ref_head = ref[0], list(ref[1:-1]), ref[-1]
    pairs = []
    if pp_rank == 0:
        pairs.append(("emb", tp_emb.weight.grad, ref_emb.weight.grad[vrows]))
    owned = {id(b) for c in chunks for b in c}
    for i, (tb, rb) in enumerate(zip(tp_blocks, ref_blocks)):
        if id(tb) not in owned:
            continue
        pairs += [(f"block{i}.fc1.weight", tb.fc1.weight.grad, rb.fc1.weight.grad[rows]),
                  (f"block{i}.fc1.bias", tb.fc1.bias.grad, rb.fc1.bias.grad[rows]),
                  (f"block{i}.fc2.weight", tb.fc2.weight.grad, rb.fc2.weight.grad[:, rows]),
                  (f"block{i}.fc2.bias", tb.fc2.bias.grad, rb.fc2.bias.grad),
                  (f"block{i}.norm.weight", tb.norm.weight.grad, rb.norm.weight.grad),
                  (f"block{i}.norm.bias", tb.norm.bias.grad, rb.norm.bias.grad)]
    if pp_rank == PP - 1:
        pairs += [("head.weight", tp_head.head.weight.grad, ref_head.head.weight.grad[vrows]),
                  ("head.norm.weight", tp_head.norm.weight.grad, ref_head.norm.weight.grad)]
    for name, got, exp in pairs:
        assert got is not None, f"{name}: no gradient ({schedule})"
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6, msg=f"{name} ({schedule}, m={m})")
        checked += 1
    return checked


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "gpipe", "interleaved"])
def test_tp2_pp2_sequence_parallel_matches_dense(rank_pool, fresh_seed, schedule):
    v, ms = (2, [2, 4]) if schedule == "interleaved" else (1, [2, 5])
    for m in ms:
        checked = rank_pool(TP * PP).run(_worker, fresh_seed, schedule, v, m, timeout=300)
        assert min(checked) >= 3, checked
