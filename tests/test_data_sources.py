"""Records through Hugging Face datasets from local files only: JSONL, Parquet, Arrow and save_to_disk
give the same rows; formats from the columns; a missing path or column, non-UTF-8 bytes: named
errors; datasets imported only for such sources; weighted blends deterministic in (seed, step), with exact
long-run proportions (a weight below 1/2000 included) and a weight that cannot get a row refused."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from data_checks import CHATS, make_tokenizer, write_jsonl
from tpkernels.data.batch import TokenBatch
from tpkernels.data.blend import Blend
from tpkernels.train.data import make_data

SEQ = 32


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tok") / "tok"))


def test_every_file_kind_gives_the_same_rows(tmp_path, tok):
    import datasets

    src = write_jsonl(tmp_path / "chat.jsonl", CHATS * 3)
    ds = datasets.Dataset.from_list(CHATS * 3)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    want = make_data(str(src), SEQ, 3, 64, tok).batch(1, 4)
    for path in (tmp_path / "chat.parquet", tmp_path / "saved", arrow):
        data = make_data(str(path), SEQ, 3, 64, tok)
        assert data.format == "messages" and data.task == "sft"
        got = data.batch(1, 4)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.loss_mask, want.loss_mask), path


def test_text_records_pack_like_text_files(tmp_path):
    docs = ["hello world", "ab", "x" * 40]
    (tmp_path / "t.txt").write_text("\n\n".join(docs))
    write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    a, b = make_data(str(tmp_path / "t.txt"), 8, 0, 300), make_data(str(tmp_path / "t.jsonl"), 8, 0, 300)
    assert b.format == "text" and torch.equal(a.batch(2, 3).ids, b.batch(2, 3).ids)
    assert b.batch(0, 2).loss_mask is None


def test_bad_sources_are_named_errors(tmp_path, tok):
    with pytest.raises(ValueError, match=r"data.source \('.*nope.jsonl'\) does not exist.*never fetched from the hub"):
        make_data(str(tmp_path / "nope.jsonl"), SEQ, 0, 64, tok)
    write_jsonl(tmp_path / "q.jsonl", [{"question": "hi", "answer": "hello"}])
    with pytest.raises(ValueError, match=r"has columns \['answer', 'question'\]: none of the formats"):
        make_data(str(tmp_path / "q.jsonl"), SEQ, 0, 64, tok)
    write_jsonl(tmp_path / "c.jsonl", CHATS)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt', 'completion'\] of data.format "
                                         r"'prompt_completion'; its columns: \['messages'\]"):
        make_data(str(tmp_path / "c.jsonl"), SEQ, 0, 64, tok, fmt="prompt_completion")
    write_jsonl(tmp_path / "u.jsonl", [{"messages": CHATS[0]["messages"][:1]}])
    with pytest.raises(ValueError, match=r"record 0: the messages end with a 'user' turn"):
        make_data(str(tmp_path / "u.jsonl"), SEQ, 0, 64, tok)
    write_jsonl(tmp_path / "e.jsonl", [{"prompt": "hi", "completion": ""}])
    with pytest.raises(ValueError, match=r"record 0: the completion is empty"):
        make_data(str(tmp_path / "e.jsonl"), SEQ, 0, 64, tok)
    for name in ("bad.jsonl", "bad.txt"):
        (tmp_path / name).write_bytes(b'{"text": "caf\xe9"}\n')
        with pytest.raises(ValueError, match=rf"'.*{name}' is not UTF-8 text \(byte 13"):
            make_data(str(tmp_path / name), SEQ, 0, 300)
    with pytest.raises(ValueError, match="training.task sft needs a messages or prompt/completion dataset"):
        make_data("random-documents", SEQ, 0, 64, task="sft")
    with pytest.raises(ValueError, match="needs data.tokenizer"):
        make_data(str(tmp_path / "c.jsonl"), SEQ, 0, 64)


def test_text_training_never_imports_datasets(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n\nagain")
    code = ("import sys; from tpkernels.train.data import make_data; from tpkernels.train import Trainer; "
            f"make_data({str(tmp_path / 't.txt')!r}, 4, 0, 300).batch(0, 2); "
            "assert 'datasets' not in sys.modules, 'datasets imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_blend_is_deterministic_and_weighted(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 400)
    (tmp_path / "b.txt").write_text("b" * 400)
    spec = f"0.75 {tmp_path / 'a.txt'} 0.25 {tmp_path / 'b.txt'}"
    x, y = make_data(spec, 8, 1, 300), make_data(spec, 8, 1, 300)
    assert torch.equal(x.batch(5, 8).ids, y.batch(5, 8).ids)
    rows = torch.cat([x.batch(s, 8).ids for s in range(10)])
    share = (rows[:, 0] == ord("a")).float().mean().item()
    assert share == pytest.approx(0.75, abs=0.02)
    from tpkernels.train import TrainConfig

    cfg = TrainConfig.from_values({"data": {"source": [[0.75, str(tmp_path / "a.txt")],
                                                       {"weight": 0.25, "path": str(tmp_path / "b.txt")}]}})
    assert torch.equal(make_data(cfg.data.source, 8, 1, 300).batch(5, 8).ids, x.batch(5, 8).ids)
    with pytest.raises(ValueError, match="weight -1 of .* must be > 0"):
        make_data(f"-1 {tmp_path / 'a.txt'} 1 {tmp_path / 'b.txt'}", 8, 1, 300)


class _Probe:
    """A source whose row at stream position p is [its index, p]."""

    def __init__(self, j):
        self.j = j

    def rows_at(self, positions):
        return TokenBatch(torch.stack([torch.full_like(positions, self.j), positions], dim=1))


def test_blend_proportions_are_exact_and_every_weight_is_read():
    """Over whole periods each source gets exactly its share of the rows, every prefix is within a row per
    source of it, each source's rows are read in its own stream order, once; a weight below 1/2000 (which a
    1000-slot block never reads) gets its exact share too."""
    m = int(torch.randint(2, 5, ()))
    weights = [float(w) for w in torch.randint(1, 30, (m,))]
    for ws in (weights, [0.9995, 0.0005], [0.9985, 0.0015]):
        blend = Blend([_Probe(j) for j in range(len(ws))], ws)
        period = blend.period
        exact = [Fraction(repr(w)) / sum(Fraction(repr(v)) for v in ws) for w in ws]
        assert [Fraction(int(w), period) for w in blend.W] == exact  # the weights as written, exactly
        want = torch.tensor([float(f) for f in exact], dtype=torch.float64)
        rows = torch.cat([blend.batch(s, 97).ids for s in range(-(-2 * period // 97))])[:2 * period]
        src = rows[:, 0]
        counts = torch.stack([torch.cumsum(src == j, 0) for j in range(len(ws))], 1).double()
        k = torch.arange(1, len(src) + 1, dtype=torch.float64)[:, None]
        assert counts[-1].long().tolist() == [2 * int(w) for w in blend.W]  # two whole periods: exact
        assert float((counts - k * want).abs().max()) < len(ws)  # every prefix close
        for j in range(len(ws)):  # source j's rows: its own stream positions 0, 1, 2, ... in order
            assert rows[src == j, 1].tolist() == list(range(int(counts[-1, j])))
    assert Blend([_Probe(0), _Probe(1)], [0.9995, 0.0005]).batch(0, 2000).ids[:, 0].sum() == 1


def test_blend_refuses_a_weight_that_cannot_get_a_row(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 400)
    (tmp_path / "b.txt").write_text("b" * 400)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    with pytest.raises(ValueError, match=r"weight 1e-12 of '.*b.txt' is 1e-12 of the blend, below 2\*\*-31"):
        make_data(f"1 {a} 1e-12 {b}", 8, 1, 300)
    with pytest.raises(ValueError, match=r"weight 0.001 of '.*b.txt' \(0.000999 of the blend\) gets its first row at "
                                         r"stream position 500, after the run's 400 rows"):
        make_data(f"1 {a} 0.001 {b}", 8, 1, 300, run_rows=400)
    assert make_data(f"1 {a} 0.001 {b}", 8, 1, 300, run_rows=501).batch(0, 501).ids[500, 0] == ord("b")
