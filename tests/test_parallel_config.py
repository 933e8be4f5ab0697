"""ParallelConfig: every validation rule raises its documented message; valid layouts pass."""

from __future__ import annotations

import random

import pytest

from tpkernels.parallel import ParallelConfig, ParallelConfigError


def errors_of(cfg: ParallelConfig, **job) -> list[str]:
    with pytest.raises(ParallelConfigError) as info:
        cfg.validate(**job)
    return info.value.errors


MODEL = dict(num_layers=32, num_attention_heads=32, num_kv_heads=8, ffn_hidden_size=14336, seq_length=4096)


def test_valid_layout_passes_and_derives_sizes():
    cfg = ParallelConfig(tp=4, pp=2, dp=8, virtual_stages=2, micro_batch_size=2, num_microbatches=8,
                         sequence_parallel=True, recompute="selective", zero1=True)
    assert cfg.validate(world_size=64, global_batch_size=128, **MODEL) is cfg
    assert (cfg.world_size, cfg.global_batch_size, cfg.pipeline_schedule) == (64, 128, "interleaved")
    assert cfg.short() == "TP4 PP2 DP8 v2 mbs2 SP rc=selective ZeRO1"
    assert cfg.warnings() == []


@pytest.mark.parametrize("field,value,name", [
    ("tp", 0, "tp"), ("pp", -1, "pp"), ("dp", 1.5, "dp"),
    ("virtual_stages", 0, "virtual_stages"), ("micro_batch_size", True, "micro_batch_size"),
    ("num_microbatches", 0, "num_microbatches"),
])
def test_sizes_must_be_positive_integers(field, value, name):
    assert errors_of(ParallelConfig(**{field: value})) == [f"{name} ({value!r}) must be a positive integer"]


def test_recompute_choice():
    assert errors_of(ParallelConfig(recompute="some")) == [
        "recompute ('some') must be one of none, selective, full"]


def test_sequence_parallel_needs_tensor_parallel():
    (msg,) = errors_of(ParallelConfig(sequence_parallel=True))
    assert msg.startswith("sequence_parallel=True requires tp > 1")


def test_interleaving_needs_pipeline_and_microbatch_multiple():
    (msg,) = errors_of(ParallelConfig(virtual_stages=2))
    assert msg.startswith("virtual_stages (2) > 1 requires pp > 1")
    (msg,) = errors_of(ParallelConfig(pp=4, virtual_stages=2, num_microbatches=6))
    assert msg.startswith("num_microbatches (6) must be a multiple of pp (4) with the interleaved")


def test_world_size_and_global_batch():
    cfg = ParallelConfig(tp=4, pp=2, dp=2, micro_batch_size=3, num_microbatches=5)
    assert errors_of(cfg, world_size=12, global_batch_size=64) == [
        "world_size (12) must equal tp (4) × pp (2) × dp (2) = 16",
        "global_batch_size (64) must equal micro_batch_size (3) × num_microbatches (5) × dp (2) = 30",
    ]


def test_model_rules_each_have_their_message():
    cfg = ParallelConfig(tp=3, pp=5, sequence_parallel=True)
    errs = errors_of(cfg, num_layers=32, num_attention_heads=40, num_kv_heads=8, ffn_hidden_size=1000, seq_length=10)
    assert errs == [
        "num_attention_heads (40) must be divisible by tp (3)",
        "num_kv_heads (8) and tp (3) must divide one another "
        "(KV heads are split over TP ranks, or replicated when tp > num_kv_heads)",
        "ffn_hidden_size (1000) must be divisible by tp (3)",
        "num_layers (32) must be divisible by pp (5)",
        "sequence length (10) must be divisible by tp (3) when sequence_parallel=True",
    ]
    errs = errors_of(ParallelConfig(pp=4, virtual_stages=3, num_microbatches=8), num_layers=32, num_attention_heads=8)
    assert errs == ["num_layers (32) must be divisible by pp (4) × virtual_stages (3) = 12"]


def test_kv_heads_replicated_when_tp_exceeds_them():
    ParallelConfig(tp=8).validate(num_layers=4, num_attention_heads=64, num_kv_heads=2)  # 2 | 8: replicated


def test_warning_when_pipeline_cannot_fill():
    (msg,) = ParallelConfig(pp=4, num_microbatches=2).warnings()
    assert msg == ("pipeline cannot fill: num_microbatches (2) < pp (4); bubble is 60% of the step")


def test_random_layouts_validate_iff_every_rule_holds(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(300):
        tp, pp, dp = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4]), rng.randint(1, 5)
        v = rng.choice([1, 1, 2, 3]) if pp > 1 else 1
        m = rng.randint(1, 12)
        heads, layers = rng.choice([12, 16, 24, 40]), rng.choice([12, 24, 30, 32])
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, virtual_stages=v, micro_batch_size=1, num_microbatches=m,
                             sequence_parallel=rng.random() < 0.5 and tp > 1, recompute="none")
        ok = heads % tp == 0 and layers % (pp * v) == 0 and (v == 1 or m % pp == 0)
        try:
            cfg.validate(world_size=tp * pp * dp, num_layers=layers, num_attention_heads=heads)
            assert ok, cfg
        except ParallelConfigError as e:
            assert not ok and e.errors, cfg


def test_messages_name_the_keys_of_the_training_config():
    """With the training config's prefix every message names a key the user can write."""
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(tp=3, sequence_parallel=True).validate(world_size=3, num_layers=2, num_attention_heads=4,
                                                             seq_length=7, key_prefix="parallel.")
    assert info.value.errors == [
        "num_attention_heads (4) must be divisible by parallel.tp (3)",
        "num_kv_heads (4) and parallel.tp (3) must divide one another (KV heads are split over TP ranks, or "
        "replicated when parallel.tp > num_kv_heads)",
        "sequence length (7) must be divisible by parallel.tp (3) when parallel.sequence_parallel=True"]
    assert ParallelConfig(bucket_mb=0).layout_errors("parallel.") == [
        "parallel.bucket_mb (0) must be a finite number > 0"]


@pytest.mark.parametrize("schedule, v, pp, message", [
    ("pipedream", 1, 2, "schedule ('pipedream') must be one of gpipe, 1f1b, interleaved, zb-h1"),
    ("1f1b", 2, 2, "schedule ('1f1b') cannot run virtual_stages (2) > 1; only 'interleaved' does"),
    ("interleaved", 1, 2, "schedule ('interleaved') needs virtual_stages > 1"),
])
def test_schedule_is_a_layout_field_with_its_rules(schedule, v, pp, message):
    assert errors_of(ParallelConfig(pp=pp, virtual_stages=v, num_microbatches=4, schedule=schedule)) == [message]


def test_schedule_default_follows_virtual_stages_and_dp_follows_the_world():
    assert ParallelConfig(pp=2).pipeline_schedule == "1f1b"
    assert ParallelConfig(pp=2, virtual_stages=2).pipeline_schedule == "interleaved"
    cfg = ParallelConfig(tp=2, pp=3, dp=None)
    assert cfg.for_world(12).dp == 2 and cfg.for_world(12).world_size == 12
    assert errors_of(cfg, world_size=10) == ["world_size (10) must be divisible by tp (2) × pp (3) = 6"]
    with pytest.raises(ValueError, match=r"dp is not set"):
        cfg.world_size


def test_moe_chunks_is_a_layout_field():
    assert ParallelConfig().moe_chunks == 2
    assert errors_of(ParallelConfig(moe_chunks=0)) == ["moe_chunks (0) must be a positive integer"]
    assert errors_of(ParallelConfig(moe_chunks=True)) == ["moe_chunks (True) must be a positive integer"]
    # shown in the label only where it changes something (ep > 1) and differs from the default
    assert ParallelConfig(dp=4, ep=2, moe_chunks=3).short() == "TP1 PP1 DP4 EP2 chunks3 mbs1"
    assert ParallelConfig(dp=4, ep=2).short() == "TP1 PP1 DP4 EP2 mbs1"
    assert ParallelConfig(dp=4, moe_chunks=3).short() == "TP1 PP1 DP4 mbs1"
