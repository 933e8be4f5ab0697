"""Megatron's indexed format: write/read round trip, the trainer's memory-mapped rows equal text
packing's, `tpkernels prepare-data` with several processes and resume, corrupted .idx named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpkernels.cli import main
from tpkernels.data.indexed import IndexedFile, IndexedTokens, IndexedWriter
from tpkernels.train.data import make_data

DOCS = ["hello world", "ab", "x" * 40, "the quick brown fox", "jumps", "over the lazy dog " * 3]


def test_round_trip(tmp_path):
    w = IndexedWriter(tmp_path / "c", vocab_size=300)
    docs = [[1, 2, 3], [7], list(range(250))]
    for d in docs:
        w.add_document(d)
    w.finish()
    ix = IndexedFile(tmp_path / "c.idx")
    assert ix.dtype == np.uint16 and len(ix) == 3
    assert [ix.document(i).tolist() for i in range(3)] == docs
    assert ix.doc_index.tolist() == [0, 1, 2, 3] and isinstance(ix.tokens, np.memmap)
    big = IndexedWriter(tmp_path / "big", vocab_size=100_000)
    big.add_document([70_000])
    big.finish()
    assert IndexedFile(tmp_path / "big").document(0).tolist() == [70_000]


def test_prepare_data_matches_text_packing_and_resumes(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n\n".join(DOCS[:3]))
    (tmp_path / "in" / "b.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in DOCS[3:]))
    out = tmp_path / "tokens"
    assert main(["prepare-data", str(tmp_path / "in"), str(out), "--workers", "2", "--shard-docs", "2",
                 "--no-progress"]) == 0
    assert "3 shard(s), 3 written" in capsys.readouterr().out
    (out / "shard_00001.idx").unlink()  # an interrupted run: that shard is redone, the others skipped
    assert main(["prepare-data", str(tmp_path / "in"), str(out), "--shard-docs", "2", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "3 shard(s), 1 written" in said and "2 already done" in said
    data = make_data(str(out), 8, 0, 300)
    assert isinstance(data, IndexedTokens)
    stream = np.concatenate([f.tokens[:f.n_tokens] for f in data.files])
    want = [t for d in DOCS for t in list(d.encode()) + [256]]
    assert stream.tolist() == want
    b = data.batch(0, data.rows)  # one epoch: every row, positions restart after each document
    for r in range(b.rows):
        ids, pos = b.ids[r].tolist(), b.position_ids[r].tolist()
        assert all(p == 0 or ids[t - 1] != 256 for t, p in enumerate(pos) if t)
        assert all(pos[t] == 0 for t in range(1, 8) if ids[t - 1] == 256)
    assert torch.equal(data.batch(3, 2).ids, make_data(str(out), 8, 0, 300).batch(3, 2).ids)
    with pytest.raises(ValueError, match=r"vocab \(100\) must be at least 257"):
        make_data(str(out), 8, 0, 100)
    assert main(["prepare-data", str(tmp_path / "in"), str(out), "--tokenizer", str(tmp_path / "nope"),
                 "--no-progress"]) == 2
    assert "data.tokenizer" in capsys.readouterr().err


def test_corrupted_index_is_a_named_error(tmp_path):
    w = IndexedWriter(tmp_path / "c", vocab_size=300)
    for d in ([1, 2, 3], [4, 5]):
        w.add_document(d)
    w.finish()
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX!" + raw[9:])
    with pytest.raises(ValueError, match=r"c.idx' is not a valid indexed-dataset index \(magic"):
        IndexedFile(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(raw[:-5])
    with pytest.raises(ValueError, match=r"\(truncated: .* bytes, its counts \(2 sequences"):
        IndexedFile(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(raw[:10])
    with pytest.raises(ValueError, match="shorter than the 34-byte header"):
        IndexedFile(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(raw)
    (tmp_path / "c.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match=r"its sequences end at byte 10 of .*c.bin', which has 2"):
        IndexedFile(tmp_path / "c")
