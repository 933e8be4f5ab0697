"""Megatron's indexed token format (``.bin`` + ``.idx``), memory-mapped with numpy.

    w = IndexedWriter("out/shard_00000", vocab_size=32000)   # uint16 below 65500 ids, else int32
    w.add_document([5, 9, 2]); w.finish()                    # writes .bin, then .idx (atomically)
    ix = IndexedFile("out/shard_00000")                      # ix.tokens: a read-only memmap (n_tokens,)
    data = IndexedTokens(["out/shard_00000"], seq, seed)     # rows of seq tokens, positions per document

The ``.idx`` layout (little-endian), as Megatron-LM's ``MMapIndexedDataset`` writes it:

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code of the .bin tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
             7 float32, 8 uint16)
    u64      sequence count S
    u64      document-index count D (documents + 1)
    i32[S]   tokens per sequence
    i64[S]   byte offset of each sequence in .bin
    i64[D]   sequence index at which each document starts (0 first, S last)

A document is a run of sequences (Megatron's ``document_indices``): one sequence per document as
``tpkernels prepare-data`` writes them, or one per sentence in a ``--split-sentences`` corpus, whose
sentences then belong to one document: positions and the document mask restart at each document,
not at each sequence. A header that is not this (bad magic, version, dtype, a file shorter than its
counts say, a .bin shorter than its pointers, a document index that does not run from 0 to S) is a
named error.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from tpkernels.data.batch import TokenBatch
from tpkernels.data.stream import step_positions, stream_rows

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
META = "tpkernels_data.json"  # written by prepare-data beside its shards: tokenizer, vocabulary, eod


def prefix_of(path: str | Path) -> str:
    p = str(path)
    return p[:-4] if p.endswith((".idx", ".bin")) else p


class IndexedFile:
    """One ``.bin``/``.idx`` pair, read-only and memory-mapped (no corpus-sized RAM)."""

    def __init__(self, path: str | Path):
        self.prefix = prefix_of(path)
        idx, binf = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for f in (idx, binf):
            if not f.is_file():
                raise ValueError(f"data.source: {str(f)!r} does not exist (an indexed corpus is a .bin and an .idx "
                                 "with one prefix)")
        raw = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
        head = 9 + 8 + 1 + 8 + 8

        def bad(why: str) -> ValueError:
            return ValueError(f"data.source: {str(idx)!r} is not a valid indexed-dataset index ({why}); rebuild it "
                              "with `tpkernels prepare-data`")

        if len(raw) < head:
            raise bad(f"{len(raw)} bytes, shorter than the {head}-byte header")
        if bytes(raw[:9]) != MAGIC:
            raise bad(f"magic {bytes(raw[:9])!r}, not {MAGIC!r}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(raw[9:head]))
        if version != 1:
            raise bad(f"version {version}, not 1")
        if code not in DTYPES:
            raise bad(f"dtype code {code}, not one of {sorted(DTYPES)}")
        need = head + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(raw) < need:
            raise bad(f"truncated: {len(raw)} bytes, its counts ({n_seq} sequences, {n_doc} document indices) need "
                      f"{need}")
        self.dtype = np.dtype(DTYPES[code])
        self.lengths = np.frombuffer(raw, np.int32, n_seq, head)
        self.pointers = np.frombuffer(raw, np.int64, n_seq, head + 4 * n_seq)
        self.doc_index = np.frombuffer(raw, np.int64, n_doc, head + 12 * n_seq)
        if n_doc < 1 or self.doc_index[0] != 0 or self.doc_index[-1] != n_seq or \
                (n_doc > 1 and int(np.diff(self.doc_index).min()) < 0):
            raise bad(f"its document index ({n_doc} entries: {self.doc_index[:3].tolist()} … "
                      f"{self.doc_index[-3:].tolist()}) must run from 0 to its {n_seq} sequences, non-decreasing")
        size = binf.stat().st_size
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if n_seq and (int(self.lengths.min()) < 0 or end > size):
            raise bad(f"its sequences end at byte {end} of {str(binf)!r}, which has {size}")
        self.tokens = np.memmap(binf, dtype=self.dtype, mode="r", shape=(size // self.dtype.itemsize,)) \
            if size else np.zeros(0, self.dtype)
        self.starts = self.pointers // self.dtype.itemsize  # token offset of each sequence
        self.n_tokens = end // self.dtype.itemsize
        # token offset of each non-empty document (its first sequence's): where positions restart
        first = np.unique(self.doc_index[:-1])
        self.doc_starts = self.starts[first[first < n_seq]]

    def __len__(self) -> int:
        """The number of documents."""
        return len(self.doc_index) - 1

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (its sequences, back to back)."""
        a, b = int(self.doc_index[i]), int(self.doc_index[i + 1])
        if a == b:
            return np.zeros(0, self.dtype)
        return np.asarray(self.tokens[self.starts[a]:self.starts[b - 1] + self.lengths[b - 1]])


class IndexedWriter:
    """Writes documents to ``prefix.bin`` and, on ``finish``, ``prefix.idx`` (written to a temporary name and
    renamed: an ``.idx`` that exists is complete)."""

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix = prefix_of(prefix)
        self.dtype = np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
        self.lengths: list[int] = []
        self._bin = open(self.prefix + ".bin", "wb")

    def add_document(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.lengths.append(len(arr))

    def finish(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        doc = np.arange(len(lengths) + 1, dtype=np.int64)
        tmp = self.prefix + ".idx.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", 1, CODES[self.dtype], len(lengths), len(doc)))
            f.write(lengths.tobytes() + pointers.tobytes() + doc.tobytes())
        os.replace(tmp, self.prefix + ".idx")


def indexed_prefixes(source: str | Path) -> list[str]:
    """The prefixes of an indexed source: a prefix (or its .bin/.idx) or a folder of them, sorted."""
    p = Path(source)
    if p.is_dir():
        found = sorted(prefix_of(f) for f in p.glob("*.idx"))
        if not found:
            raise ValueError(f"data.source ({str(source)!r}) is a folder without .idx files")
        return found
    return [prefix_of(source)]


def read_meta(source: str | Path) -> dict | None:
    p = Path(source)
    f = (p if p.is_dir() else p.parent) / META
    return json.loads(f.read_text()) if f.is_file() else None


class IndexedTokens:
    """Pre-training rows from indexed files: each file's tokens cut into rows of ``seq`` (a file's last
    partial row dropped), a document cut by a row end continuing in the next row; positions restart at
    each document start (from the document index: not at an end-of-document id, nor at each sequence of
    a multi-sequence document). Rows visited in a fresh
    permutation per epoch: row k of the stream depends only on (seed, k). Memory-mapped: a batch reads
    only its rows."""

    def __init__(self, source: str | Path, seq: int, seed: int, vocab_size: int | None = None):
        self.files = [IndexedFile(p) for p in indexed_prefixes(source)]
        meta = read_meta(source)
        if meta and vocab_size is not None and vocab_size < int(meta["vocab_size"]):
            raise ValueError(f"vocab ({vocab_size}) must be at least {meta['vocab_size']} for data.source "
                             f"({str(source)!r}, tokenized with {meta.get('tokenizer') or 'bytes'}) (model.vocab sets it)")
        self.per_file = np.array([f.n_tokens // seq for f in self.files], dtype=np.int64)
        self.rows = int(self.per_file.sum())
        if self.rows < 1:
            raise ValueError(f"data.source ({str(source)!r}) has {sum(f.n_tokens for f in self.files)} tokens: fewer "
                             f"than one row of data.seq_length ({seq}) in any file")
        self.first = np.concatenate([[0], np.cumsum(self.per_file)])
        self.seq, self.seed = seq, seed

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, position_ids) of packed row ``r``, each (seq,)."""
        fi = int(np.searchsorted(self.first, r, side="right") - 1)
        f, a = self.files[fi], (r - int(self.first[fi])) * self.seq
        t = a + np.arange(self.seq)
        doc = np.searchsorted(f.doc_starts, t, side="right") - 1
        pos = t - np.maximum(f.doc_starts[np.maximum(doc, 0)], a)
        return np.asarray(f.tokens[a:a + self.seq]).astype(np.int64), pos

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        got = [self.row(int(r)) for r in stream_rows(positions, self.rows, self.seed)]
        return TokenBatch(torch.from_numpy(np.stack([g[0] for g in got])),
                          torch.from_numpy(np.stack([g[1] for g in got])))
