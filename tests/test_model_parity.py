"""Our GPT-2 / Llama / Qwen2 / Mistral models against ``transformers``, loaded from the same
safetensors checkpoint, at the layouts of the parity grid on gloo: loss, logits and every
parameter gradient in fp32 (after ``finish_grad_sync``: SP, replicated-KV, tied and DP sums)."""

from __future__ import annotations

import pytest

from model_checks import parity_worker, save_tiny_model

# (layout, schedule, overlap, layer_counts): TP×PP = 1×1, 2×1, 1×2, 2×2, SP on/off, overlap on/off,
# interleaved 1×2 v=2, zb-h1 2×2, DP2×TP2, uneven PP3
GRID = {
    "tp1pp1": (dict(num_microbatches=2), "1f1b", True, None),
    "tp2": (dict(tp=2, num_microbatches=2), "1f1b", True, None),
    "tp2-sp": (dict(tp=2, sequence_parallel=True, num_microbatches=2), "1f1b", True, None),
    "tp2-sp-serial": (dict(tp=2, sequence_parallel=True, num_microbatches=2), "1f1b", False, None),
    "pp2": (dict(pp=2, num_microbatches=4), "1f1b", True, None),
    "pp2-gpipe": (dict(pp=2, num_microbatches=2), "gpipe", True, None),
    "pp2-v2": (dict(pp=2, virtual_stages=2, num_microbatches=2), "interleaved", True, None),
    "tp2pp2-sp": (dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4), "1f1b", True, None),
    "tp2pp2": (dict(tp=2, pp=2, num_microbatches=2), "1f1b", True, None),
    "tp2pp2-zb": (dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4), "zb-h1", True, None),
    "dp2tp2-sp": (dict(tp=2, dp=2, sequence_parallel=True, num_microbatches=2), "1f1b", True, None),
    "pp3-uneven": (dict(pp=3, num_microbatches=4), "1f1b", True, [1, 2, 1]),
    "cp2": (dict(cp=2, num_microbatches=2), "1f1b", True, None),
    "tp2cp2-sp": (dict(tp=2, cp=2, sequence_parallel=True, num_microbatches=2), "1f1b", True, None),
    "cp2pp2-zb": (dict(cp=2, pp=2, num_microbatches=4), "zb-h1", True, None),
}
FAST = ["tp1pp1", "tp2-sp", "pp2-v2", "tp2pp2-zb", "dp2tp2-sp", "cp2", "tp2cp2-sp"]  # every family; the rest of the grid on Llama


def _world(layout):
    return layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1) * layout.get("cp", 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(family, **shape):
        key = (family, tuple(sorted(shape.items())))
        if key not in cache:
            cache[key] = save_tiny_model(family, tmp_path_factory.mktemp(family), 1234, **shape)
        return cache[key]

    return get


def _run(rank_pool, folder, case, seed):
    layout, schedule, overlap, counts = GRID[case]
    out = rank_pool(_world(layout)).run(parity_worker, folder, layout, seed, schedule, overlap, counts,
                                        timeout=120)
    assert min(out) > 10, out


@pytest.mark.parametrize("case", list(GRID))
def test_llama_gqa_llama3_rope(rank_pool, checkpoints, fresh_seed, case):
    _run(rank_pool, checkpoints("llama"), case, fresh_seed)


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "mistral"])
@pytest.mark.parametrize("case", FAST)
def test_other_families(rank_pool, checkpoints, fresh_seed, family, case):
    _run(rank_pool, checkpoints(family), case, fresh_seed)


@pytest.mark.parametrize("tp", [3, 4])
def test_kv_heads_replicated_over_tp(rank_pool, checkpoints, fresh_seed, tp):
    """TP=4 with 2 KV heads (each KV head on two ranks); TP=3 with 6 query heads and 1 KV head (MQA)."""
    shape = dict(heads=4, kv_heads=2) if tp == 4 else dict(heads=6, kv_heads=1, hidden=36, ffn=42)
    layout = dict(tp=tp, sequence_parallel=True, num_microbatches=1)
    out = rank_pool(tp).run(parity_worker, checkpoints("llama", **shape), layout, fresh_seed, "1f1b", True, None,
                            2, 12, timeout=120)
    assert min(out) > 10
