"""TP tags: what each parameter is across the TP group is said once, where it is made, and the gradient
norm, sync, LoRA and checkpoints read it. A new sharded module that tags its parameter gets an exact
norm; one that does not is refused by name, never counted wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkernels.parallel.param_tags import TPTag, retag, tag, tag_of


class ShardedScale(nn.Module):
    """A module the package does not know: a per-feature scale whose features are split over TP
    (rank r owns features [r·n/P, (r+1)·n/P)), applied to an all-gathered output."""

    def __init__(self, features: int, group, seed: int):
        super().__init__()
        from tpkernels.parallel.groups import group_rank_size

        self.group = group
        rank, world = group_rank_size(group)
        full = torch.randn(features, generator=torch.Generator().manual_seed(seed))
        per = features // world
        self.scale = nn.Parameter(full[rank * per:(rank + 1) * per].clone())

    def forward(self, x):  # x: (tokens, features), replicated; output replicated
        from tpkernels.parallel.mappings import gather_from_tensor_parallel, scatter_to_tensor_parallel

        mine = scatter_to_tensor_parallel(x, self.group)
        return gather_from_tensor_parallel(mine * self.scale, self.group)


class Net(nn.Module):
    def __init__(self, group, seed: int, tagged: bool):
        super().__init__()
        from tpkernels.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        g = torch.Generator().manual_seed(seed)
        dense1, dense2 = nn.Linear(12, 24), nn.Linear(24, 12)
        for p in (*dense1.parameters(), *dense2.parameters()):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        self.fc1 = ColumnParallelLinear.from_linear(dense1, group)
        self.fc2 = RowParallelLinear.from_linear(dense2, group)
        self.extra = ShardedScale(12, group, seed + 1)
        if tagged:
            tag(self.extra.scale, split_dim=0)

    def forward(self, x):
        return self.extra(self.fc2(torch.relu(self.fc1(x))))


def _norm_worker(rank, world, seed, tagged):
    import torch.distributed as dist

    from tpkernels.train.optim import global_grad_norm

    torch.manual_seed(seed)
    x = torch.randn(7, 12, generator=torch.Generator().manual_seed(seed + 2))
    net = Net(dist.group.WORLD, seed, tagged)
    net(x).square().sum().backward()
    try:
        return float(global_grad_norm(net, dist.group.WORLD))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_new_sharded_module_that_tags_its_parameter_gets_an_exact_norm(rank_pool, world, fresh_seed):
    dense = Net(None, fresh_seed, tagged=True)
    x = torch.randn(7, 12, generator=torch.Generator().manual_seed(fresh_seed + 2))
    dense(x).square().sum().backward()
    want = torch.cat([p.grad.reshape(-1) for p in dense.parameters()]).double().norm().item()
    if world == 1:
        got = [_norm_worker(0, 1, fresh_seed, True)]
    else:
        got = rank_pool(world).run(_norm_worker, fresh_seed, True, timeout=120)
    assert got == pytest.approx([want] * world, rel=1e-5)


def test_an_untagged_parameter_is_refused_by_name(rank_pool):
    out = rank_pool(2).run(_norm_worker, 3, False, timeout=120)
    assert all("parameter extra.scale has no TP tag" in o for o in out), out


def test_tags_are_made_where_the_parameters_are():
    from tpkernels.models import ModelConfig, ParallelTransformer

    mc = ModelConfig.from_preset("GPT-1.7B").replace(num_layers=2, hidden_size=32, num_attention_heads=4,
                                                     ffn_hidden_size=48, vocab_size=97, max_position_embeddings=16)
    model = ParallelTransformer(mc)
    tags = {n: tag_of(p) for n, p in model.named_parameters()}
    assert all(t is not None for t in tags.values()), [n for n, t in tags.items() if t is None]
    assert tags["chunks.0.layers.0.attention.qkv.weight"].split_dim == 0
    assert tags["chunks.0.layers.0.attention.out.weight"].split_dim == 1
    assert tags["chunks.0.layers.0.attention.out.bias"].split_dim is None
    assert tags["chunks.0.layers.0.mlp.up_bias"].split_dim == 0
    assert tags["chunks.0.embedding.positions.weight"] == TPTag()


def test_tag_rules():
    p = tag(nn.Parameter(torch.zeros(4, 2)), split_dim=0)
    assert retag(p, kv_replica_rows=(1, 3), kv_replicas=2).tp_tag.kv_replica_rows == (1, 3)
    with pytest.raises(ValueError, match=r"split_dim \(3\) must be None, 0, 1 or 2"):
        tag(nn.Parameter(torch.zeros(1)), split_dim=3)
    with pytest.raises(ValueError, match=r"split_dim \(2\) is for stacked experts"):
        tag(nn.Parameter(torch.zeros(1)), split_dim=2)
    assert tag(nn.Parameter(torch.zeros(2, 3, 4)), split_dim=2, expert_parallel=True).tp_tag.expert_parallel
    with pytest.raises(ValueError, match="partial_grad is for replicated parameters"):
        tag(nn.Parameter(torch.zeros(1)), split_dim=0, partial_grad=True)
    with pytest.raises(ValueError, match="kv_replica_rows need split_dim=0"):
        tag(nn.Parameter(torch.zeros(1)), kv_replica_rows=(0, 1))
