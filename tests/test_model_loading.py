"""Loading Hugging Face weights into ParallelTransformer in one process: from an in-memory
transformers model, from a folder with an index over several files, from the Hub's old GPT-2
names (no "transformer." prefix), in bf16; and the errors for a checkpoint that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_checks import VOCAB, hf_config, save_tiny_model
from tpkernels.models import ModelConfig, ParallelTransformer

transformers = pytest.importorskip("transformers")


def _ids():
    return torch.randint(0, VOCAB, (2, 13))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_from_an_in_memory_model(family):
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    ids = _ids()
    ours = ParallelTransformer.from_hf(hf)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_from_a_sharded_folder_with_an_index(tmp_path, fresh_seed):
    folder = save_tiny_model("llama", tmp_path / "one", fresh_seed % 1000)
    sd = load_file(f"{folder}/model.safetensors")
    names = sorted(sd)
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(out / fname))
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = _ids()
    a, b = ParallelTransformer.from_hf(folder), ParallelTransformer.from_hf(str(out))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_old_gpt2_names_without_prefix():
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("gpt2"), attn_implementation="eager")
    bare = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    assert "h.0.attn.c_attn.weight" in bare
    ours = ParallelTransformer(ModelConfig.from_hf(hf.config), init=None).load_hf_(bare)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_bf16_load_keeps_the_checkpoint_values(tmp_path, fresh_seed):
    folder = save_tiny_model("llama", tmp_path, fresh_seed % 1000)
    ours = ParallelTransformer.from_hf(folder, dtype=torch.bfloat16)
    sd = ours.to_hf_state_dict()
    ref = load_file(f"{folder}/model.safetensors")
    for k, v in ref.items():
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16)), k


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path, fresh_seed):
    folder = save_tiny_model("llama", tmp_path, fresh_seed % 1000)
    wider = ModelConfig.from_hf(folder).replace(ffn_hidden_size=48)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: shape \(32, 40\), the model's config "
                                         r"needs \(32, 48\)"):
        ParallelTransformer(wider, init=None).load_hf_(folder)
    sd = load_file(f"{folder}/model.safetensors")
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match=r"the state dict lacks tensor\(s\) \['model.norm.weight'\]"):
        ParallelTransformer(ModelConfig.from_hf(folder), init=None).load_hf_(sd)


def test_step_without_pipeline_and_forward_errors():
    mc = ModelConfig.from_hf(hf_config("llama"))
    model = ParallelTransformer(mc, seed=3)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(IndexError, match=r"input_ids \(97\) must be in \[0, vocab_size \(97\)\)"):
        model(torch.full((1, 4), 97))
    with pytest.raises(ValueError, match=r"position_ids must be in \[0, max_position_embeddings \(64\)\)"):
        model(torch.zeros(1, 70, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens must contain every row start"):
        model(torch.zeros(2, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32))
