"""Guard rails on defaults and data (issue 44 §4): a run that cannot fit in memory is refused before the
model is built, naming the keys to turn; a tokenizer that maps the data to its unknown token is refused
(or warned) with the rate."""

from __future__ import annotations

import random
import warnings

import pytest
from data_checks import WORDS, make_tokenizer, write_jsonl
from tpkernels.train import TrainConfig
from tpkernels.train import memory_guard
from tpkernels.train.memory_guard import CPU_PROCESS_BYTES, GIB, check_memory, host_available_bytes, run_memory

TINY = {"model.layers": 3, "model.hidden": 48, "model.heads": 4, "model.kv_heads": 2, "model.ffn": 80,
        "model.vocab": 101, "data.seq_length": 16, "logging.progress": False}


def test_the_estimate_counts_the_models_parameters(fresh_seed):
    """Weights, gradients and optimizer states of the estimate: 2 + 4 + 12 bytes per parameter of the model the
    trainer builds (counted on the built module, not by the planner's formula); fp64 doubles everything."""
    from tpkernels.models import ParallelTransformer

    rng = random.Random(fresh_seed)
    values = {**TINY, "model.layers": rng.randint(1, 4), "model.ffn": rng.choice([40, 72, 96])}
    cfg = TrainConfig.from_values(values)
    n = sum(p.numel() for p in ParallelTransformer(cfg.model_config(), None).parameters())
    need = run_memory(cfg, 1)
    got = {k: need.breakdown[k] * GIB / n for k in ("weights", "gradients", "optimizer")}
    assert got == pytest.approx({"weights": 2, "gradients": 4, "optimizer": 12}, rel=0.02), got  # vocab padding
    assert "runtime" not in need.breakdown and need.breakdown["process"] * GIB == CPU_PROCESS_BYTES
    assert need.where == "host" and need.per_rank == need.here
    assert need.per_rank == pytest.approx(sum(need.breakdown.values()) * GIB)
    double = run_memory(cfg.with_values({"training.precision": "fp64"}), 1)
    assert double.per_rank - CPU_PROCESS_BYTES == pytest.approx(2 * (need.per_rank - CPU_PROCESS_BYTES))
    # 4 ranks on this host, TP2 × PP2: two ranks per stage; the host holds each stage's share twice
    even = cfg.with_values({"model.layers": 4})
    need = run_memory(even, 1)
    four = run_memory(even.with_values({"parallel.tp": 2, "parallel.pp": 2, "parallel.num_microbatches": 2}), 4)
    assert four.per_rank < need.per_rank < four.here <= 4 * four.per_rank and four.local_ranks == 4
    avail = host_available_bytes()
    assert avail is None or avail > 0


def test_a_run_that_cannot_fit_is_refused_before_the_model_is_built(monkeypatch, capsys):
    from tpkernels.train.cli import main

    monkeypatch.setattr(memory_guard, "host_available_bytes", lambda: 20 * GIB)
    built = []
    monkeypatch.setattr("tpkernels.models.ParallelTransformer.__init__", lambda *a, **k: built.append(1))
    assert main(["--progress", "false"]) == 2  # no model flags: the Llama-2-7B preset, 6.7B params in fp32
    err = capsys.readouterr().err
    assert "does not fit in this machine's memory" in err and "host memory available: 20.00 GiB" in err, err
    for key in ("model.layers", "training.precision", "parallel.tp", "parallel.micro_batch_size",
                "training.check_memory false", "Llama-2-7B"):
        assert key in err, (key, err)
    assert not built
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory (planner estimate, TP1 PP1 DP1 mbs1): 114." in out and "-- does not fit: tpkernels train refuses" in out
    cfg = TrainConfig.from_values({"training.check_memory": False})
    assert not check_memory(cfg, 1).fits  # told to start anyway: the estimate is returned, nothing raised
    small = TrainConfig.from_values(TINY)
    assert check_memory(small, 1).fits


def _corpus(tmp_path, rng, unknown_share: float):
    """Documents of k words (k + 1 tokens with the end-of-document: one row each at seq_length k + 1), a share of
    them words the tokenizer does not know; the exact count of unknown tokens."""
    k = rng.randint(5, 12)
    docs, unknown = [], 0
    for _ in range(rng.randint(20, 40)):
        words = [rng.choice(WORDS) if rng.random() >= unknown_share else f"zz{rng.randrange(999)}" for _ in range(k)]
        unknown += sum(w.startswith("zz") for w in words)
        docs.append(" ".join(words))
    (tmp_path / "c.txt").write_text("\n\n".join(docs) + "\n")
    return tmp_path / "c.txt", k + 1, unknown, len(docs) * (k + 1)


def test_a_tokenizer_for_other_text_is_refused_or_warned_with_the_rate(tmp_path, fresh_seed):
    from tpkernels.train.data import data_of

    rng = random.Random(fresh_seed)
    tok = make_tokenizer(tmp_path / "tok")
    path, seq, unknown, total = _corpus(tmp_path, rng, rng.uniform(0.3, 0.7))
    cfg = TrainConfig.from_values({**TINY, "data.source": str(path), "data.tokenizer": str(tok),
                                   "data.seq_length": seq})
    with pytest.raises(ValueError, match=rf"maps {unknown / total:.1%} of the data's tokens \({unknown} of {total}\) "
                                         r"to its unknown token \(id 0\), above data.max_unknown \(0.05\)"):
        data_of(cfg, 101)
    with pytest.warns(UserWarning, match=rf"maps {unknown / total:.1%} .* data.max_unknown \(0.9\) allows it"):
        data_of(cfg.with_values({"data.max_unknown": 0.9}), 101)
    clean, seq, _, _ = _corpus(tmp_path, rng, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data_of(cfg.with_values({"data.source": str(clean), "data.seq_length": seq}), 101)
    with pytest.raises(ValueError, match=r"data.max_unknown \(1.5\) must be in \[0, 1\]"):
        cfg.with_values({"data.max_unknown": 1.5})


def test_chat_records_count_unknown_tokens_without_the_padding(tmp_path, fresh_seed):
    """Chats packed with padding (whose id is not [UNK]'s, but padding must not count either way): the count of
    [UNK] equals transformers' own rendering of each chat through the template."""
    import transformers

    from tpkernels.data.unknown_tokens import unknown_count
    from tpkernels.train.data import data_of

    rng = random.Random(fresh_seed)
    tok = make_tokenizer(tmp_path / "tok")
    records = []
    for _ in range(12):
        said = [" ".join(rng.choice(WORDS + ["qq", "xyz"]) for _ in range(rng.randint(1, 5))) for _ in range(2)]
        records.append({"messages": [{"role": "user", "content": said[0]}, {"role": "assistant", "content": said[1]}]})
    write_jsonl(tmp_path / "chat.jsonl", records)
    hf = transformers.AutoTokenizer.from_pretrained(str(tok))
    want = sum(hf.apply_chat_template(r["messages"], tokenize=True, return_dict=False).count(hf.unk_token_id)
               for r in records)
    cfg = TrainConfig.from_values({**TINY, "data.source": str(tmp_path / "chat.jsonl"), "data.tokenizer": str(tok),
                                   "data.seq_length": 64, "data.max_unknown": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = data_of(cfg, 101)
    unk, total = unknown_count(data, hf.unk_token_id)
    assert unk == want and total == int(data.packed.filled.sum()) < data.packed.ids.numel()
    rendered = sum(len(hf.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) for r in records)
    assert total >= rendered  # every rendered token is counted (an end-of-sequence may be added to each)
