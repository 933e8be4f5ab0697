"""Hugging Face exports that stand alone (issue 44 §4): the base's special-token ids and generation config,
the run's tokenizer and chat template, and PEFT's base path — checked with transformers' own loaders
(AutoConfig, AutoTokenizer, GenerationConfig, pipeline), not by reading our files back with our code."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from data_checks import WORDS, make_tokenizer
from model_checks import save_tiny_model
from tpkernels.models.hf_export_files import write_standalone_files
from tpkernels.train import TrainConfig, Trainer
from tpkernels.train.checkpoint import export_hf, peft_base_path

BASE_IDS = {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 3}


def _base(tmp_path, seed: int, generation: dict | None, family: str = "llama"):
    """A tiny Llama base whose config.json sets bos 0 / eos [2, 0] / pad 3; ``generation``: its
    generation_config.json (None: the base has none)."""
    folder = tmp_path / "base"
    save_tiny_model(family, folder, seed, layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **BASE_IDS}))
    gen = folder / "generation_config.json"
    gen.unlink(missing_ok=True)
    if generation is not None:
        gen.write_text(json.dumps(generation))
    return folder


def _trained_export(tmp_path, seed: int):
    """A one-step run from the base with the chat tokenizer on text of its words, and its export-hf folder."""
    base = _base(tmp_path, seed, None)
    tok = make_tokenizer(tmp_path / "tok")
    rng = random.Random(seed)
    (tmp_path / "corpus.txt").write_text("\n\n".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 20)))
                                                      for _ in range(40)))
    cfg = TrainConfig.from_values({"model.name": str(base), "model.init_from": str(base), "data.tokenizer": str(tok),
                                   "data.source": str(tmp_path / "corpus.txt"), "data.seq_length": 16,
                                   "training.steps": 1, "training.seed": seed, "logging.progress": False,
                                   "checkpoint.save_dir": str(tmp_path / "ck")})
    Trainer(cfg).train()
    return tok, export_hf(tmp_path / "ck", tmp_path / "hf")


def test_the_export_stands_alone_and_pipeline_stops_at_eos(tmp_path, fresh_seed):
    """The base's ids round-trip (bos 0, eos [2, 0], pad 3), the generation config carries them (and the chat
    tokenizer's end of turn), the tokenizer and template come along, and transformers' pipeline loads the
    folder alone and stops at the first EOS."""
    import transformers

    tok, out = _trained_export(tmp_path, fresh_seed % 1000)
    config = transformers.AutoConfig.from_pretrained(str(out))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, [2, 0], 3)
    gen = transformers.GenerationConfig.from_pretrained(str(out))  # written from the base's ids (it had none)
    # and the chat tokenizer's end of turn (<|end|>, id 3), where the fine-tuned model ends its replies
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, [2, 0, 3], 3)
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (out, tok))
    chat = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}]
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert ours("the answer is five")["input_ids"] == theirs("the answer is five")["input_ids"]

    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    prompt = "hello how are you"
    n_prompt = len(pipe.tokenizer(prompt)["input_ids"])
    eos = {2, 0, 3}

    def new_tokens(**kw):
        got = pipe(prompt, max_new_tokens=12, do_sample=False, return_tensors=True, **kw)[0]["generated_token_ids"]
        return list(got)[n_prompt:]

    free = new_tokens()  # the trained model as is: it stops exactly at its first EOS, or runs to the limit
    first = next((i for i, t in enumerate(free) if t in eos), None)
    assert (len(free) == 12 and first is None) or first == len(free) - 1, free
    # a final norm of zeros makes every logit 0: greedy picks id 0, one of the base's EOS ids -> one token
    with torch.no_grad():
        pipe.model.model.norm.weight.zero_()
    assert new_tokens() == [0]
    assert new_tokens(eos_token_id=None, generation_config=transformers.GenerationConfig(
        eos_token_id=None, pad_token_id=3)) == [0] * 12  # without the export's EOS it would not stop


def test_a_bases_generation_config_is_copied_and_byte_level_gets_its_tokenizer(tmp_path, fresh_seed):
    import transformers

    gen = {"bos_token_id": 0, "eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    base = _base(tmp_path, fresh_seed % 1000, gen)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text((base / "config.json").read_text().replace('"bos_token_id": 0', '"bos_token_id": 1'))
    done = write_standalone_files(out, base=base, tokenizer=None, vocab_size=97)
    assert done["generation_config"] == "base" and done["tokenizer"] is None  # the base folder has no tokenizer
    got = transformers.GenerationConfig.from_pretrained(str(out))
    assert (got.eos_token_id, got.temperature, got.top_p) == ([2, 0], 0.6, 0.9)
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 0  # the base's, not the family's 1
    make_tokenizer(base)  # the base folder's own tokenizer: carried when the run had no data.tokenizer
    assert write_standalone_files(out, base=base, tokenizer=None, vocab_size=97)["tokenizer"] == str(base)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).chat_template is not None
    got = transformers.GenerationConfig.from_pretrained(str(out))  # the base's, with the tokenizer's <|end|> added
    assert (got.eos_token_id, got.temperature) == ([2, 0, 3], 0.6)

    # a base id past the vocabulary is left out, said (the base folder's tokenizer gives its own, <pad> = 1)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "pad_token_id": 97}))
    with pytest.warns(UserWarning, match=r"sets pad_token_id \(97\), not a token id .* vocab size 97"):
        assert write_standalone_files(out, base=base, tokenizer=None, vocab_size=97)["special_ids"]["pad_token_id"] \
            == 1
    (base / "config.json").write_text(json.dumps(cfg))

    # no base, no tokenizer: the run trained on bytes; the export's tokenizer gives the same ids
    (out / "generation_config.json").unlink()
    done = write_standalone_files(out, base=None, tokenizer=None, vocab_size=300)
    assert done["tokenizer"] == "byte-level" and done["special_ids"] == {"bos_token_id": None, "eos_token_id": 256,
                                                                        "pad_token_id": None}
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "héllo wörld\n\t" + "".join(chr(random.Random(fresh_seed).randrange(32, 0x2FFF)) for _ in range(20))
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert tok.eos_token_id == 256 == transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id
    # a vocabulary too small for bytes (a run on random tokens): no tokenizer, said why
    done = write_standalone_files(out, base=None, tokenizer=None, vocab_size=97)
    assert "257 tokens, more than the model's vocab (97)" in done["tokenizer"]


def test_a_tokenizers_json_file_keeps_the_runs_end_of_document_id(tmp_path):
    import transformers

    from tpkernels.data.tokenizer import load_tokenizer

    file = make_tokenizer(tmp_path / "tok") / "tokenizer.json"
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2}))
    write_standalone_files(out, base=None, tokenizer=str(file), vocab_size=97)
    encode, eod, _ = load_tokenizer(str(file))  # what the run's data layer used
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == eod and tok("the sky is blue")["input_ids"] == encode("the sky is blue")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eod
    # a tokenizer path that does not resolve from here: the weights' files are completed, the tokenizer is said missing
    with pytest.warns(UserWarning, match="does not exist from here"):
        done = write_standalone_files(out, base=None, tokenizer=str(tmp_path / "moved.json"), vocab_size=97)
    assert done["tokenizer"] is None and (out / "generation_config.json").is_file()


def test_peft_base_path_is_absolute(tmp_path, monkeypatch):
    (tmp_path / "models" / "base").mkdir(parents=True)
    (tmp_path / "models" / "base" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peft_base_path("models/base") == str(tmp_path.resolve() / "models" / "base")
    with pytest.warns(UserWarning, match="is not a Hugging Face folder from here"):
        assert peft_base_path("gone/base") == str(tmp_path.resolve() / "gone" / "base")
    with pytest.warns(UserWarning, match="base_model_name_or_path is null"):
        assert peft_base_path(None) is None


def test_a_tokenizer_transformers_would_reload_otherwise_is_named(tmp_path):
    """transformers loads any qwen2 folder's tokenizer as Qwen2Tokenizer (its own pre-tokenizer): a word-level
    tokenizer exported with a qwen2 model is warned about, with the loader that reads it as trained."""
    import transformers

    tok = make_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 3}))
    with pytest.warns(UserWarning, match="loads the tokenizer .* as Qwen2Tokenizer"):
        write_standalone_files(out, base=None, tokenizer=str(tok), vocab_size=97)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tok))
    ours = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    assert ours("what is two plus three")["input_ids"] == theirs("what is two plus three")["input_ids"]
