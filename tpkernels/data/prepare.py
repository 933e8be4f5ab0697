"""``tpkernels prepare-data``: tokenize a corpus once into the indexed format, in shards, resumably.

    tpkernels prepare-data corpus/ tokens/ --tokenizer tok.json --workers 4
    prepare_data(["corpus/"], "tokens/", tokenizer="tok.json", workers=4)   # the same from Python

Inputs: .txt files (documents separated by blank lines), JSON lines (.jsonl/.json, the
``--text-key`` field of each line) or folders of them (sorted). Documents are cut into shards of
``shard_docs`` in input order; shard i is ``out/shard_{i:05d}.bin/.idx``, each document tokenized
and closed by the end-of-document id. The ``.idx`` of a shard is written last (renamed into place),
so a shard with one is complete and a rerun skips it: an interrupted run resumes. ``out`` also holds
``tpkernels_data.json``: the tokenizer (path, vocabulary size, end-of-document id, its files' sizes and
modification times), ``--shard-docs``, ``--text-key`` and every input file (path, size, modification
time). A rerun that differs in any of them is refused, naming what changed (its shards would cut the
corpus differently from the finished ones: documents dropped or repeated); the trainer checks the
model's vocabulary against it. A JSON line that is not an object with a ``--text-key`` string is an
error naming the file and the line. Several processes
tokenize the shards (``workers``); a tqdm bar counts them. The trainer reads ``out`` memory-mapped
(``data.source: tokens/``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpkernels.data.indexed import META, IndexedWriter
from tpkernels.data.sources import json_lines
from tpkernels.data.text import documents
from tpkernels.data.tokenizer import text_encoder

_ENCODER = None


def input_files(inputs: list[str]) -> list[Path]:
    out = []
    for i in inputs:
        p = Path(i)
        if not p.exists():
            raise ValueError(f"prepare-data: input {i!r} does not exist")
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.suffix in (".txt", ".jsonl", ".json"))
        else:
            out.append(p)
    if not out:
        raise ValueError(f"prepare-data: no .txt/.jsonl/.json file in {inputs}")
    return out


def corpus_documents(files: list[Path], text_key: str = "text"):
    """The documents of the input files, in order."""
    for f in files:
        if f.suffix in (".jsonl", ".json"):
            for n, record in json_lines(f, "prepare-data"):
                text = record.get(text_key)
                if not isinstance(text, str):
                    raise ValueError(f"prepare-data: {str(f)!r} line {n}: --text-key {text_key!r} must name a string "
                                     f"field (the line's keys: {sorted(record)[:10]})")
                if text.strip():
                    yield text
        else:
            yield from documents([f])


def fingerprint(paths: list[Path]) -> list[list]:
    """[path, bytes, mtime in ns] of each file (a folder: of each file in it): what a resume must find unchanged
    (a file edited, added, removed or renamed changes it)."""
    out = []
    for p in paths:
        for f in sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _differences(old: dict, new: dict) -> list[str]:
    """What a resume changes, in the user's words."""
    flags = {"shard_docs": "--shard-docs", "text_key": "--text-key", "tokenizer": "--tokenizer"}
    out = []
    for key in new:
        if old.get(key) == new[key]:
            continue
        if key not in old:
            out.append(f"{key} not recorded (an older prepare-data)")
        elif key in ("inputs", "tokenizer_files"):
            was, now = {f[0]: f[1:] for f in old[key]}, {f[0]: f[1:] for f in new[key]}
            what = "input" if key == "inputs" else "tokenizer file"
            out += [f"{what} {f} added" for f in now if f not in was][:3]
            out += [f"{what} {f} removed" for f in was if f not in now][:3]
            out += [f"{what} {f} changed (size or modification time)" for f in now if f in was and now[f] != was[f]][:3]
        else:
            out.append(f"{flags.get(key, key)} {old[key]!r} then, {new[key]!r} now")
    return out


def _init(tokenizer: str | None) -> None:
    global _ENCODER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _ENCODER = text_encoder(tokenizer)


def _write_shard(job: tuple[str, list[str], int]) -> int:
    prefix, docs, vocab = job
    encode, eod, _ = _ENCODER
    w = IndexedWriter(prefix, vocab)
    tokens = 0
    for doc in docs:
        ids = list(encode(doc)) + [eod]
        w.add_document(ids)
        tokens += len(ids)
    w.finish()
    return tokens


def _shards(files, text_key: str, shard_docs: int):
    batch = []
    for doc in corpus_documents(files, text_key):
        batch.append(doc)
        if len(batch) == shard_docs:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_data(inputs: list[str], out: str | Path, tokenizer: str | None = None, *, workers: int = 1,
                 shard_docs: int = 10_000, text_key: str = "text", progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``out`` (see the module docstring); {"shards", "written", "skipped", "tokens"}
    (tokens: of the shards written now)."""
    if shard_docs < 1 or workers < 1:
        raise ValueError(f"prepare-data: --shard-docs ({shard_docs}) and --workers ({workers}) must be >= 1")
    files = input_files(inputs)
    _, eod, vocab = text_encoder(tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": str(Path(tokenizer).resolve()) if tokenizer else None, "vocab_size": vocab, "eod": eod,
            "tokenizer_files": fingerprint([Path(tokenizer)]) if tokenizer else [], "shard_docs": shard_docs,
            "text_key": text_key, "inputs": fingerprint(files)}
    if (out / META).is_file():
        old = json.loads((out / META).read_text())
        diffs = _differences(old, meta)
        if diffs:
            raise ValueError(f"prepare-data: {str(out)!r} holds shards made with other settings or inputs ("
                             + "; ".join(diffs) + "): a resume must repeat the first run's exactly, or its shards "
                             "would mix two cuts of the corpus; give a new output folder (or empty this one)")
    else:
        (out / META).write_text(json.dumps(meta))
    jobs, skipped, shards = [], 0, 0

    def pending():
        nonlocal skipped, shards
        for i, docs in enumerate(_shards(files, text_key, shard_docs)):
            shards += 1
            prefix = str(out / f"shard_{i:05d}")
            if Path(prefix + ".idx").is_file():
                skipped += 1
                continue
            yield prefix, docs, vocab

    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(desc="prepare-data", unit="shard", disable=not progress)
    tokens = written = 0
    if workers == 1:
        _init(tokenizer)
        results = map(_write_shard, pending())
        for n in results:
            tokens, written = tokens + n, written + 1
            bar.update(1)
    else:
        import multiprocessing as mp  # noqa: PLC0415

        with mp.get_context("fork").Pool(workers, initializer=_init, initargs=(tokenizer,)) as pool:
            for n in pool.imap(_write_shard, pending()):
                tokens, written = tokens + n, written + 1
                bar.update(1)
    bar.close()
    return {"shards": shards, "written": written, "skipped": skipped, "tokens": tokens}
