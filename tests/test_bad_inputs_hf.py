"""A Hugging Face checkpoint that does not match its config is refused before any slice is read,
naming the tensor, the shape or dtype found and what the config needs; damaged files and shard
indexes are named too. At TP2×PP2 the rank that finds the bad tensor stops every rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_checks import save_tiny_model
from tpkernels.description import ModelConfig
from tpkernels.models import ParallelTransformer


def _rewrite(folder: Path, fn) -> None:
    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _double_rows(sd):
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.cat([sd["model.layers.0.self_attn.q_proj.weight"]] * 2)


def _extra_vocab(sd):
    e = sd["model.embed_tokens.weight"]
    sd["model.embed_tokens.weight"] = torch.cat([e, torch.randn(5, e.shape[1])])


def _int_q(sd):
    sd["model.layers.1.self_attn.q_proj.weight"] = sd["model.layers.1.self_attn.q_proj.weight"].to(torch.int32)


def _bool_norm(sd):
    sd["model.layers.3.input_layernorm.weight"] = sd["model.layers.3.input_layernorm.weight"] > 0


def _transposed_head(sd):
    sd["lm_head.weight"] = sd["lm_head.weight"].t().contiguous()


def _missing(sd):
    del sd["model.layers.2.mlp.down_proj.weight"]


TENSOR_CASES = {
    "q_proj with twice the rows": (_double_rows, r"model.layers.0.self_attn.q_proj.weight: shape \(64, 32\), the "
                                                 r"model's config needs \(32, 32\)"),
    "embed_tokens with extra rows": (_extra_vocab, r"model.embed_tokens.weight: shape \(102, 32\), the model's config "
                                                   r"needs \(97, 32\)"),
    "q_proj stored as int32": (_int_q, r"model.layers.1.self_attn.q_proj.weight: dtype int32, weights must be "
                                       r"floating point"),
    "norm weight stored as bool": (_bool_norm, r"model.layers.3.input_layernorm.weight: dtype bool"),
    "transposed lm_head": (_transposed_head, r"lm_head.weight: shape \(32, 97\), the model's config needs \(97, 32\)"),
    "missing tensor": (_missing, r"lacks tensor\(s\) \['model.layers.2.mlp.down_proj.weight'\] that the model's "
                                 r"config needs"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_a_tensor_that_does_not_match_the_config_is_refused(tmp_path, fresh_seed, case):
    fn, message = TENSOR_CASES[case]
    folder = Path(save_tiny_model("llama", tmp_path, fresh_seed % 1000))
    _rewrite(folder, fn)
    with pytest.raises(ValueError, match=message):
        ParallelTransformer.from_hf(str(folder))
    if case == "q_proj stored as int32":  # the same, from an in-memory state dict
        sd = load_file(str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=r"the state dict does not match the model's config: model.layers.1"):
            ParallelTransformer(ModelConfig.from_hf(str(folder)), init=None).load_hf_(sd)


def test_gpt2_conv1d_tensors_are_checked_in_their_stored_orientation(tmp_path, fresh_seed):
    folder = Path(save_tiny_model("gpt2", tmp_path, fresh_seed % 1000))
    ParallelTransformer.from_hf(str(folder))  # stored (in, out): loads as it is
    sd = load_file(str(folder / "model.safetensors"))
    key = next(k for k in sd if k.endswith("h.1.attn.c_attn.weight"))
    sd[key] = sd[key].t().contiguous()  # (96, 32) where (32, 96) is stored
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key}: shape \(96, 32\), the model's config needs \(32, 96\)"):
        ParallelTransformer.from_hf(str(folder))


def _truncate(folder: Path):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])


def _garbage(folder: Path):
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


def _shard(folder: Path):
    """The single file split into two shards with an index, as save_pretrained writes large models."""
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(folder / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def _missing_shard(folder: Path):
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()


def _index_as_list(folder: Path):
    index = _shard(folder)
    index["weight_map"] = sorted(index["weight_map"])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_wrong_file(folder: Path):
    index = _shard(folder)
    k = sorted(index["weight_map"])[0]
    index["weight_map"][k] = "model-00002-of-00002.safetensors" if index["weight_map"][k].startswith(
        "model-00001") else "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_not_json(folder: Path):
    _shard(folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {')


FILE_CASES = {
    "truncated file": (_truncate, r"model.safetensors' is not a readable safetensors file \(truncated or damaged\?\)"),
    "not a safetensors file": (_garbage, r"is not a readable safetensors file"),
    "index names a missing shard": (_missing_shard, r"lists shard\(s\) \['model-00002-of-00002.safetensors'\] that "
                                                    r"are not in"),
    "index weight_map is a list": (_index_as_list, r"must hold a 'weight_map' mapping each tensor name to its file "
                                                   r"name, got list"),
    "index places a tensor in the wrong shard": (_index_wrong_file, r"places tensor\(s\) \[.*\] in "
                                                                    r"'model-0000\d-of-00002.safetensors', which does "
                                                                    r"not hold them"),
    "index is not JSON": (_index_not_json, r"shard index .* is unreadable: JSONDecodeError"),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_damaged_files_and_indexes_are_named(tmp_path, fresh_seed, case):
    fn, message = FILE_CASES[case]
    folder = Path(save_tiny_model("llama", tmp_path, fresh_seed % 1000))
    cfg = ModelConfig.from_hf(str(folder))
    fn(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ParallelTransformer(cfg, init=None).load_hf_(str(folder))


def _stage_worker(rank, world, folder):
    from tpkernels.parallel.config import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(tp=2, pp=2))
    t0 = time.monotonic()
    try:
        ParallelTransformer.from_hf(folder, state)
        return None, time.monotonic() - t0
    except ValueError as e:
        return str(e), time.monotonic() - t0


def test_a_bad_tensor_of_one_stage_stops_every_rank(rank_pool, tmp_path, fresh_seed):
    """Layer 3 lives on the second stage only: its ranks find it, the first stage's are told."""
    folder = Path(save_tiny_model("llama", tmp_path, fresh_seed % 1000))
    _rewrite(folder, _bool_norm)
    results = rank_pool(4).run(_stage_worker, str(folder), timeout=60)
    for rank, (msg, took) in enumerate(results):
        assert msg is not None and "model.layers.3.input_layernorm.weight: dtype bool" in msg, (rank, msg)
        assert took < 30, (rank, took)
    assert all("[loading Hugging Face weights: rank 2 (and on rank(s) [3])]" in m for m, _ in results[:2])
