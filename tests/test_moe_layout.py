"""Expert parallelism in the layout (issue 42): ParallelConfig.ep's rules, each with its message, and the EP /
expert-data-parallel groups of layout_ranks at worlds 1-8 (pure rank arithmetic: no processes)."""

from __future__ import annotations

import itertools
import random

import pytest

from tpkernels.description import ModelConfig
from tpkernels.parallel import ParallelConfig, ParallelConfigError
from tpkernels.parallel.state import ParallelState, layout_ranks

MOE = ModelConfig("mixtral", num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=24,
                  vocab_size=64, num_experts=6, experts_per_token=2)


def errors_of(cfg: ParallelConfig, **job) -> list[str]:
    with pytest.raises(ParallelConfigError) as info:
        cfg.validate(**job)
    return info.value.errors


def test_ep_defaults_to_one_and_shows_in_the_label():
    assert ParallelConfig().ep == 1 and "EP" not in ParallelConfig(dp=4).short()
    assert ParallelConfig(tp=2, dp=4, ep=2).short() == "TP2 PP1 DP4 EP2 mbs1"
    assert "expert-parallel" in ParallelConfig.__dataclass_fields__["ep"].metadata["help"]


@pytest.mark.parametrize("ep", [0, -2, 1.5, True])
def test_ep_must_be_a_positive_integer(ep):
    assert errors_of(ParallelConfig(ep=ep), key_prefix="parallel.") == [
        f"parallel.ep ({ep!r}) must be a positive integer"]


def test_ep_must_divide_dp_times_cp_naming_both():
    (msg,) = errors_of(ParallelConfig(dp=3, ep=2))
    assert msg.startswith("ep (2) must divide dp (3):")
    (msg,) = errors_of(ParallelConfig(dp=2, cp=3, ep=4), key_prefix="parallel.")
    assert msg.startswith("parallel.ep (4) must divide parallel.dp (2) × parallel.cp (3) = 6")
    ParallelConfig(dp=2, cp=2, ep=4).validate(world_size=4)  # EP over DP × CP: 4 divides 2 · 2
    # dp derived from the world size: the rule is checked once the world is known
    (msg,) = errors_of(ParallelConfig(tp=2, dp=None, ep=4), world_size=12)
    assert msg.startswith("ep (4) must divide dp (6)")
    assert ParallelConfig(tp=2, dp=None, ep=3).validate(world_size=12).for_world(12).dp == 6


def test_model_rules_of_ep():
    rules = MOE.layout_rules()
    assert rules["num_experts"] == 6 and rules["experts_per_token"] == 2 and rules["moe_ffn_hidden_size"] == 24
    ParallelConfig(dp=6, ep=6).validate(**rules)
    (msg,) = errors_of(ParallelConfig(dp=4, ep=4), **rules)
    assert msg.startswith("num_experts (6) must be divisible by ep (4)")
    dense = ModelConfig("llama", num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=24,
                        vocab_size=64)
    (msg,) = errors_of(ParallelConfig(dp=2, ep=2), key_prefix="parallel.", **dense.layout_rules())
    assert msg.startswith("parallel.ep (2) > 1 needs a mixture-of-experts model")
    errs = errors_of(ParallelConfig(tp=4, dp=2, ep=2), **{**rules, "experts_per_token": 7,
                                                         "moe_ffn_hidden_size": 30, "ffn_hidden_size": 32})
    assert errs[0].startswith("experts_per_token (7) must be between 1 and num_experts (6)")
    assert errs[1].startswith("moe_ffn_hidden_size (30) must be divisible by tp (4)")
    errs = errors_of(ParallelConfig(tp=2), **{**rules, "shared_expert_ffn_hidden_size": 7})
    assert errs == ["shared_expert_ffn_hidden_size (7) must be divisible by tp (2)"]


def _coords(pc, rank):
    tp, cp, dp = pc.tp, pc.cp, pc.dp
    return dict(t=rank % tp, c=rank // tp % cp, d=rank // (tp * cp) % dp, p=rank // (tp * cp * dp))


LAYOUTS = [dict(tp=t, cp=c, pp=p, dp=d, ep=e)
           for t, c, p, d in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 3, 4, 8))
           if t * c * p * d <= 8 for e in range(1, d * c + 1) if d * c % e == 0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(f"{k}{v}" for k, v in lay.items()))
def test_ep_and_edp_groups(layout):
    """Independent of layout_ranks' own formula: an EP group is ep ranks of one (tp rank, stage) whose
    (dp, cp) index i = dp_rank · cp + cp_rank shares i // ep; its edp group those sharing i % ep."""
    pc = ParallelConfig(**layout).validate(world_size=ParallelConfig(**layout).world_size)
    g = layout_ranks(pc)
    world = pc.world_size
    for name, size in (("ep", pc.ep), ("edp", pc.dp * pc.cp // pc.ep)):
        groups = g[name]
        assert sorted(r for grp in groups for r in grp) == list(range(world))  # a partition of the world
        assert all(len(grp) == size for grp in groups)
    for r in range(world):
        a = _coords(pc, r)
        i = a["d"] * pc.cp + a["c"]
        ep_group = next(grp for grp in g["ep"] if r in grp)
        edp_group = next(grp for grp in g["edp"] if r in grp)
        for other in range(world):
            b = _coords(pc, other)
            j = b["d"] * pc.cp + b["c"]
            same = a["t"] == b["t"] and a["p"] == b["p"]
            assert (other in ep_group) == (same and i // pc.ep == j // pc.ep)
            assert (other in edp_group) == (same and i % pc.ep == j % pc.ep)
        state = ParallelState(pc, rank=r)
        assert state.ep_rank == ep_group.index(r) == i % pc.ep and state.edp_size * state.ep_size == pc.dp * pc.cp
        assert state.group_ranks("ep") == ep_group and state.group_ranks("edp") == edp_group
    if pc.ep == 1:
        assert g["edp"] == g["dp_cp"]
        assert all(len(grp) == 1 for grp in g["ep"])


def test_world_of_one_has_no_ep_groups():
    state = ParallelState.create(ParallelConfig())
    assert (state.ep_group, state.edp_group, state.ep_rank, state.ep_size) == (None, None, 0, 1)


def test_random_layouts_keep_every_existing_rule(fresh_seed):
    """ep=1 changes nothing: a random layout validates with ep=1 exactly when it did before (its errors
    are those of the same layout without the field)."""
    rng = random.Random(fresh_seed)
    for _ in range(200):
        kw = dict(tp=rng.choice([1, 2, 4]), dp=rng.choice([1, 2, 3]), cp=rng.choice([1, 2]), pp=rng.choice([1, 2]),
                  num_microbatches=rng.choice([1, 2, 3]), virtual_stages=rng.choice([1, 2]))
        base = ParallelConfig(**kw)
        assert base.layout_errors() == base.replace(ep=1).layout_errors()
        ep = rng.choice([1, 2, 3, 4])
        errs = ParallelConfig(**kw, ep=ep).layout_errors()
        divides = (kw["dp"] * kw["cp"]) % ep == 0
        assert any(e.startswith(f"ep ({ep}) must divide") for e in errs) == (not divides)
