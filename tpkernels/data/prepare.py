"""``tpkernels prepare-data``: tokenize a corpus once into the indexed format, in shards, resumably.

    tpkernels prepare-data corpus/ tokens/ --tokenizer tok.json --workers 4
    prepare_data(["corpus/"], "tokens/", tokenizer="tok.json", workers=4)   # the same from Python

Inputs: .txt files (documents separated by blank lines), JSON lines (.jsonl/.json, the
``--text-key`` field of each line) or folders of them (sorted). Documents are cut into shards of
``shard_docs`` in input order; shard i is ``out/shard_{i:05d}.bin/.idx``, each document tokenized
and closed by the end-of-document id. The ``.idx`` of a shard is written last (renamed into place),
so a shard with one is complete and a rerun skips it: an interrupted run resumes. ``out`` also holds
``tpkernels_data.json`` (tokenizer, vocabulary size, end-of-document id): a rerun with another
tokenizer is refused, and the trainer checks the model's vocabulary against it. Several processes
tokenize the shards (``workers``); a tqdm bar counts them. The trainer reads ``out`` memory-mapped
(``data.source: tokens/``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpkernels.data.indexed import META, IndexedWriter
from tpkernels.data.sources import check_utf8
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
            check_utf8(f)
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_key]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"prepare-data: {str(f)!r} line {n} is not a JSON object with a "
                                         f"{text_key!r} string ({type(e).__name__}: {e})") from None
                    if not isinstance(text, str):
                        raise ValueError(f"prepare-data: {str(f)!r} line {n}: {text_key!r} must be a string")
                    if text.strip():
                        yield text
        else:
            yield from documents([f])


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
    meta = {"tokenizer": str(Path(tokenizer).resolve()) if tokenizer else None, "vocab_size": vocab, "eod": eod}
    if (out / META).is_file():
        old = json.loads((out / META).read_text())
        if old != meta:
            raise ValueError(f"prepare-data: {str(out)!r} holds shards of another tokenizer ({old}); give a new "
                             "output folder")
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
