"""Megatron's indexed format: write/read round trip, the trainer's memory-mapped rows equal text
packing's, a sentence-split corpus (several sequences per document) restarts positions per document
only, `tpkernels prepare-data` with several processes and resume (a resume with other settings or inputs
refused, a malformed JSON line named), corrupted .idx named."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from tpkernels.cli import main
from tpkernels.data.indexed import IndexedFile, IndexedTokens, IndexedWriter
from tpkernels.data.prepare import prepare_data
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


def megatron_files(prefix, documents: list[list[list[int]]]) -> None:
    """``prefix.bin``/``.idx`` as Megatron-LM's ``IndexedDatasetBuilder`` writes them (add_item per sentence,
    end_document per document), int32 tokens: written here from the layout, not by the package's writer."""
    sentences = [s for d in documents for s in d]
    lengths = np.array([len(s) for s in sentences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 4]).astype(np.int64)
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(np.array([t for s in sentences for t in s], dtype=np.int32).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", len(lengths))
                + struct.pack("<Q", len(doc_index)) + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())


def test_sentence_split_documents_restart_positions_per_document(tmp_path):
    """Positions (and so the varlen document mask and the targets) restart at each document of the index,
    not at each of its sentences: a sentence's last token predicts the next sentence of its document."""
    docs, tok = [], 0
    for d in range(int(torch.randint(5, 9, ()))):
        doc = []
        for _ in range(int(torch.randint(1 + (d == 0), 5, ()))):  # sentences of 1..6 tokens; 2+ in document 0
            n = int(torch.randint(1, 7, ()))
            doc.append(list(range(tok, tok + n)))
            tok += n
        docs.append(doc)
    megatron_files(tmp_path / "split", docs)
    ix = IndexedFile(tmp_path / "split")
    assert len(ix) == len(docs) and ix.document(1).tolist() == [t for s in docs[1] for t in s]
    seq = 7
    data = IndexedTokens(tmp_path / "split", seq, seed=0)
    doc_of = [d for d, doc in enumerate(docs) for s in doc for _ in s]  # token t (== its id) -> its document
    b = data.batch(0, data.rows)  # one epoch: every row once
    assert sorted(b.ids[:, 0].tolist()) == list(range(0, data.rows * seq, seq))
    for ids, pos in zip(b.ids.tolist(), b.position_ids.tolist()):
        want = [0]
        for t in range(1, seq):
            want.append(want[-1] + 1 if doc_of[ids[t]] == doc_of[ids[t - 1]] else 0)
        assert pos == want, (ids, pos)
    first = len(docs[0][0])  # document 0's second sentence starts in row 0 and continues its positions
    assert b.position_ids[b.ids[:, 0] == 0][0, first] == first
    target = b.targets()
    for r, ids in enumerate(b.ids.tolist()):  # within a document every next token is a target
        assert [target[r, t] != -100 for t in range(seq - 1)] == [doc_of[ids[t]] == doc_of[ids[t + 1]]
                                                                  for t in range(seq - 1)]


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


def test_prepare_data_refuses_a_resume_that_differs(tmp_path):
    """The first run's settings and inputs are recorded; a resume with another --shard-docs, --text-key or
    changed inputs would keep the finished shards and cut the rest differently (documents dropped or
    repeated): refused, naming what changed. Unchanged, it resumes."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n\n".join(DOCS[:3]))
    (tmp_path / "in" / "b.jsonl").write_text("".join(f'{{"text": "{d}", "body": "x"}}\n' for d in DOCS[3:]))
    out = tmp_path / "tokens"
    first = prepare_data([str(tmp_path / "in")], out, shard_docs=2, progress=False)
    (out / "shard_00001.idx").unlink()  # interrupted
    for kw, said in ((dict(shard_docs=3), "--shard-docs 2 then, 3 now"),
                     (dict(shard_docs=2, text_key="body"), "--text-key 'text' then, 'body' now")):
        with pytest.raises(ValueError, match=f"holds shards made with other settings or inputs \\({said}\\): a "
                                             "resume must repeat"):
            prepare_data([str(tmp_path / "in")], out, progress=False, **kw)
    with pytest.raises(ValueError, match=r"input .*a.txt removed"):
        prepare_data([str(tmp_path / "in" / "b.jsonl")], out, shard_docs=2, progress=False)
    (tmp_path / "in" / "c.txt").write_text("one more")
    with pytest.raises(ValueError, match=r"input .*c.txt added"):
        prepare_data([str(tmp_path / "in")], out, shard_docs=2, progress=False)
    (tmp_path / "in" / "c.txt").unlink()
    a, was = tmp_path / "in" / "a.txt", (tmp_path / "in" / "a.txt").stat()
    a.write_text("\n\n".join(["new"] + DOCS[:3]))
    with pytest.raises(ValueError, match=r"input .*a.txt changed \(size or modification time\)"):
        prepare_data([str(tmp_path / "in")], out, shard_docs=2, progress=False)
    a.write_text("\n\n".join(DOCS[:3]))
    os.utime(a, ns=(was.st_atime_ns, was.st_mtime_ns))  # the first run's file again
    again = prepare_data([str(tmp_path / "in")], out, shard_docs=2, progress=False)
    assert (first["shards"], again["written"], again["skipped"]) == (3, 1, 2)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "c.jsonl").write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(ValueError, match=r"prepare-data: '.*c.jsonl' line 3 is not JSON \(Expecting ',' delimiter"):
        prepare_data([str(tmp_path / "bad")], tmp_path / "o2", progress=False)
    (tmp_path / "bad" / "c.jsonl").write_text('{"text": "a"}\n[1]\n')
    with pytest.raises(ValueError, match=r"'.*c.jsonl' line 2 is a JSON list, not an object"):
        prepare_data([str(tmp_path / "bad")], tmp_path / "o3", progress=False)
    with pytest.raises(ValueError, match=r"data.source: '.*c.jsonl' line 2 is a JSON list, not an object"):
        make_data(str(tmp_path / "bad" / "c.jsonl"), 8, 0, 300)


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
    (tmp_path / "c.bin").write_bytes(b"\0" * 10)
    (tmp_path / "c.idx").write_bytes(raw[:-8] + np.array([1], dtype=np.int64).tobytes())  # doc index 0, 1, 1
    with pytest.raises(ValueError, match=r"its document index \(3 entries: \[0, 1, 1\] … \[0, 1, 1\]\) must run "
                                         r"from 0 to its 2 sequences"):
        IndexedFile(tmp_path / "c")
