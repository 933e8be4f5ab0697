"""Where records come from: local files read through Hugging Face ``datasets``, never the hub.

    kind = source_kind("chat.jsonl")          # "records" | "indexed" | "text" | "synthetic"
    rows = open_records("chat.jsonl")         # a datasets.Dataset: column names, records as dicts

* JSON lines (``.jsonl``, ``.json``), Parquet (``.parquet``), Arrow files (``.arrow``, as
  ``datasets`` writes them) and folders written by ``Dataset.save_to_disk`` (a ``DatasetDict``
  folder: its ``train`` split) are records. ``datasets`` is imported only here, only when such a
  source is opened: text files and the indexed format work without it.
* A path that does not exist is a named error (never a hub lookup for a typo); a JSON/text file
  that is not UTF-8 is a named error naming the file and the byte offset; a JSON-lines line that is
  not a JSON object, one naming the file and the line.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
SYNTHETIC = ("random", "random-documents")


def source_kind(source: str) -> str:
    """``synthetic``, ``indexed`` (a ``.bin``/``.idx`` prefix or a folder of them), ``records`` (a
    ``datasets`` file or ``save_to_disk`` folder) or ``text`` (a .txt file or a folder of them)."""
    if source in SYNTHETIC:
        return "synthetic"
    p = Path(source)
    if p.suffix in (".idx", ".bin") or Path(source + ".idx").exists() or (p.is_dir() and any(p.glob("*.idx"))):
        return "indexed"
    if p.suffix in RECORD_SUFFIXES or (p.is_dir() and ((p / "dataset_info.json").exists()
                                                     or (p / "dataset_dict.json").exists())):
        return "records"
    return "text"


def check_utf8(path: str | Path, chunk: int = 1 << 20, what: str = "data.source") -> None:
    """Raise a ValueError naming ``what``, ``path`` and the byte offset of its first byte that is not UTF-8."""
    dec, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ValueError(f"{what}: {str(path)!r} is not UTF-8 text (byte {offset + e.start}: "
                                 f"{e.reason}); re-encode it as UTF-8") from None
            if not block:
                return
            offset += len(block)


def read_utf8(path: str | Path) -> str:
    """The text of ``path``, strictly UTF-8 (a named error otherwise)."""
    check_utf8(path)
    return Path(path).read_text(encoding="utf-8")


def json_lines(path: str | Path, what: str = "data.source"):
    """(line number, object) of each non-blank line of a JSON-lines file; a line that is not a JSON object
    is a ValueError naming ``what``, the file and the line."""
    check_utf8(path, what=what)
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what}: {str(path)!r} line {n} is not JSON ({e.msg} at column {e.colno}): "
                                 "JSON lines hold one JSON object per line") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{what}: {str(path)!r} line {n} is a JSON {type(obj).__name__}, not an object: "
                                 "JSON lines hold one JSON object per line")
            yield n, obj


def open_records(source: str | Path):
    """The records of a local ``datasets`` source (see the module docstring) as a ``datasets.Dataset``."""
    p = Path(source)
    if not p.exists():
        raise ValueError(f"data.source ({str(source)!r}) does not exist: give a local .jsonl/.json, .parquet or "
                         ".arrow file or a datasets.save_to_disk folder (data is never fetched from the hub)")
    import datasets  # noqa: PLC0415 (only for these sources: the GPU image lacks it)

    datasets.disable_progress_bars()
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"data.source ({str(source)!r}) is a DatasetDict without a 'train' split "
                                 f"(splits: {sorted(ds)}): save the split to train on")
            ds = ds["train"]
        return ds
    if p.suffix in (".jsonl", ".json"):
        check_utf8(p)
        try:
            return datasets.Dataset.from_json(str(p), keep_in_memory=True)
        except Exception as e:  # a line that is not JSON: datasets' own error is deep in pyarrow, without the line
            if p.suffix == ".jsonl":
                for _ in json_lines(p):
                    pass
            raise ValueError(f"data.source ({str(source)!r}) is not JSON lines (one JSON object per line): "
                             f"{type(e).__name__}: {str(e)[:300]}") from e
    if p.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(p), keep_in_memory=True)
    if p.suffix == ".arrow":
        return datasets.Dataset.from_file(str(p))
    raise ValueError(f"data.source ({str(source)!r}) has suffix {p.suffix!r}: records are read from "
                     f"{', '.join(RECORD_SUFFIXES)} files or a datasets.save_to_disk folder")
