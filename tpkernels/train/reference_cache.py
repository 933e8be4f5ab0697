"""The reference log-prob cache of DPO: each sample's reference (chosen, rejected) sequence
log-probs, computed once and kept on disk for the runs that follow.

    key = reference_cache_key(model="ckpt/", data=["pairs.jsonl"], tokenizer="ckpt/", seq_length=2048,
                              tokens={"ids": packed.ids, "mask": packed.mask, ...},
                              settings={"finetune": "qlora", "quant": "nf4", "precision": "bf16", ...})
    cache = ReferenceCache("out/ref_cache", key)      # ReferenceCacheKeyError if the folder holds another key
    if not cache.complete:
        cache.put(indices, chosen, rejected)          # every writer: its own samples (any DP layout)
        ...                                           # after a barrier, one process:
        cache.finalize(num_samples)                   # True; False if another writer completed it first
    chosen, rejected = cache.get(indices)             # float64 (len(indices),) each

The key (``CacheKey``: a JSON dict and its SHA-256) names everything the values depend on and
nothing else, so any layout (TP, PP, CP, DP, micro-batching) reads the same cache:
- the model: the SHA-256 of config.json and an identity of each weight file (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth`` and their index JSON), below;
- the data: the SHA-256 of every dataset file in the order given (a folder: its files, sorted by
  relative path), names relative to the path given (moving the data keeps the key);
- the tokenizer: the SHA-256 of its files (tokenizer.json, tokenizer_config.json and the chat
  template in it, chat_template.jinja/.json, the vocabulary and merges, special_tokens_map.json,
  added_tokens.json, sentencepiece models);
- ``tokens``: the SHA-256 of the encoded, packed dataset itself (ids, positions, masks, the pairs'
  numbering): what the model actually reads. Files name the inputs, this digest their result, so
  a change in how records become tokens (the chat template's rendering, the tokenizer library,
  the packing, the encoding code of another tpkernels version) misses too;
- ``seq_length`` and ``settings``: anything else the values depend on, any JSON object (the DPO
  trainer puts the fine-tuning kind and the base's quantisation, the compute dtype, the seed, the
  mask and packing settings there: ``tpkernels.train.dpo.cache_key``).
What does not change a reference log-prob stays out, so runs that differ only there share a cache:
the layout, the preference loss and its β.

The weight files' identity (``weights``). ``"content"``: each file's SHA-256 (survives any copy;
reads the whole checkpoint every run). ``"fingerprint"`` (the default) reads a few MB at most:
- a file up to ``SMALL_FILE`` (64 MiB: a config, an index, a small model) by its SHA-256, so a
  copy of it keeps the key;
- a larger file by its size, mtime_ns, ctime_ns and inode, and the SHA-256 of its safetensors
  header (every tensor's name, dtype, shape and offsets) and of ``SAMPLE_BLOCKS`` blocks of
  ``SAMPLE_BYTES`` spread evenly over it, first and last included. The kernel sets ctime to the
  current time on every write, rename or metadata change, and no tool can set it back (``cp -p``,
  ``rsync -t`` and ``touch -d`` set mtime only), while a new file (a copy, a move from elsewhere)
  has a new inode: a rewritten or replaced file misses even when its size and mtime were kept.
  What ctime cannot see, a rewrite within the same timestamp tick (a few ms; a second or two on
  coarse file systems), the sampled bytes see for any other set of weights (another training
  run or export changes every block); an edit confined to bytes between the samples within the
  same tick is the one change it misses: ``weights="content"`` closes that gap. The cost is a
  miss where a file was copied or touched with the same bytes (recomputed, never wrong).
Why not size + mtime alone (the old default): ``cp -p`` of other weights, or a same-size rewrite
in the same mtime tick, kept the key and read another model's reference.

The store is sharded by the dataset's own sample index: shard k holds samples
[k·shard_size, (k+1)·shard_size). Writers add part files (``part-<time_ns>-<uuid>-<n>.safetensors``: index,
chosen, rejected), never touching another writer's; ``finalize`` merges them into the shards,
checks that every sample in [0, num_samples) is there, records each shard's size and SHA-256 in
``key.json`` and marks the cache complete. Parts left by an interrupted pass stay valid for the
same key (``missing`` lists what is still to compute). Everything is safetensors and JSON: nothing
is unpickled. A shard whose bytes differ from the record, or that does not parse, is a
``ReferenceCacheCorruptError``.

Several runs may fill one folder at once (two jobs launched with the same key): creating
``key.json`` and ``finalize`` hold an exclusive lock on ``key.json.lock`` (``filelock``: flock,
released if the process dies; a folder several nodes share needs a file system whose flock works
across them, as NFSv4 and Lustre mounted with ``flock`` do), so one writer at a time merges, and the others find the cache complete: their ``finalize`` returns False
(a success: the key, so the values, are the same) and their ``put`` drops what is already there.
Parts of one sample from two writers must agree to ``rtol`` (two runs at other layouts round
differently: 1e-6 suits fp32 and fp64; pass a looser one for 16-bit runs); the earliest written is
kept. A complete cache never changes again, so readers need no lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tpkernels.train.checkpoint_files import sha256_of

FORMAT = "tpkernels-reference-cache"
VERSION = 2  # 2: weight fingerprints, the tokens digest, finalize under a lock
KEY_FILE = "key.json"
LOCK_FILE = "key.json.lock"
LOCK_TIMEOUT_S = 600.0  # the longest a merge of another writer may hold the lock (a merge takes seconds)
DEFAULT_SHARD_SIZE = 1 << 16  # samples per shard: 1 MiB of float64 pairs
DEFAULT_RTOL = 1e-6  # two writers' values of one sample: fp32 reduction-order differences are ~1e-7
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_IDENTITIES = ("fingerprint", "content")
SMALL_FILE = 64 << 20  # weight files up to 64 MiB are hashed whole (~0.1 s): their copies keep the key
SAMPLE_BLOCKS = 64  # blocks hashed from a larger file, evenly spread, first and last included ...
SAMPLE_BYTES = 64 << 10  # ... of 64 KiB each: 4 MiB read per file, whatever its size
MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")


class ReferenceCacheError(ValueError):
    """A reference cache that cannot be used as asked (names the folder and the reason)."""


class ReferenceCacheKeyError(ReferenceCacheError):
    """The folder holds a cache made for another model, data, tokenizer or settings."""


class ReferenceCacheCorruptError(ReferenceCacheError):
    """A cache file that is damaged: unreadable JSON or safetensors, or bytes that differ from the record."""


# ---- the key ----

def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class CacheKey:
    """What the cached values depend on (a JSON object) and its SHA-256 (``digest``)."""

    fields: dict = field(hash=False)

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.fields).encode()).hexdigest()


def _dir(path, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ReferenceCacheError(f"{what} {str(path)!r} is not a folder")
    return p


def _sampled_sha256(path: Path, size: int) -> str:
    """SHA-256 of a safetensors file's header (dtype, shape and offsets of every tensor) and of
    SAMPLE_BLOCKS blocks of SAMPLE_BYTES spread evenly over the file (module docstring)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if path.name.endswith(".safetensors"):
            n = int.from_bytes(f.read(8), "little")
            if 0 < n <= min(MAX_HEADER, size - 8):
                h.update(f.read(n))
        last = max(size - SAMPLE_BYTES, 0)
        for k in range(SAMPLE_BLOCKS):
            f.seek(k * last // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weight_file_identity(path, *, weights: str = "fingerprint") -> dict:
    """The identity of one weight file (module docstring): ``{"bytes", "sha256"}`` for ``weights="content"``
    or a file up to SMALL_FILE; else ``{"bytes", "mtime_ns", "ctime_ns", "inode", "sampled_sha256"}``."""
    if weights not in WEIGHT_IDENTITIES:
        raise ReferenceCacheError(f"weights ({weights!r}) must be one of {', '.join(WEIGHT_IDENTITIES)}")
    p = Path(path)
    st = p.stat()
    if weights == "content" or st.st_size <= SMALL_FILE:
        return {"bytes": st.st_size, "sha256": sha256_of(p)}
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "sampled_sha256": _sampled_sha256(p, st.st_size)}


def model_identity(model_dir, *, weights: str = "fingerprint") -> dict:
    """config.json's SHA-256 and each weight file's identity (:func:`weight_file_identity`)."""
    if weights not in WEIGHT_IDENTITIES:
        raise ReferenceCacheError(f"weights ({weights!r}) must be one of {', '.join(WEIGHT_IDENTITIES)}")
    folder = _dir(model_dir, "model")
    config = folder / "config.json"
    if not config.is_file():
        raise ReferenceCacheError(f"model folder {str(folder)!r} has no config.json")
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(tuple(s + ".index.json" for s in WEIGHT_SUFFIXES))))
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ReferenceCacheError(f"model folder {str(folder)!r} has no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    return {"config_sha256": sha256_of(config), "weights": weights,
            "files": {p.name: weight_file_identity(p, weights=weights) for p in files}}


def data_identity(paths: Iterable) -> list:
    """[{path, files: {relative name: sha256}}] of the dataset paths in the order given."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for path in paths:
        p = Path(path)
        if p.is_file():
            files = {p.name: sha256_of(p)}
        elif p.is_dir():
            files = {str(f.relative_to(p)): sha256_of(f) for f in sorted(p.rglob("*")) if f.is_file()}
        else:
            raise ReferenceCacheError(f"dataset path {str(path)!r} does not exist")
        if not files:
            raise ReferenceCacheError(f"dataset path {str(path)!r} holds no file")
        out.append({"name": p.name, "files": files})
    if not out:
        raise ReferenceCacheError("data must name at least one dataset path")
    return out


def tokenizer_identity(tokenizer_dir) -> dict:
    """{file: sha256} of the tokenizer's files in ``tokenizer_dir``."""
    folder = _dir(tokenizer_dir, "tokenizer")
    files = {n: sha256_of(folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()}
    if not files:
        raise ReferenceCacheError(f"tokenizer folder {str(folder)!r} has none of the tokenizer files "
                                  f"({', '.join(TOKENIZER_FILES)})")
    return files


def tokens_identity(tensors: dict) -> str:
    """SHA-256 of named tensors (the encoded, packed dataset: ``{"ids": (rows, seq), ...}``): every
    name, dtype, shape and byte, names in sorted order."""
    if not isinstance(tensors, dict) or not tensors:
        raise ReferenceCacheError("tokens must be a non-empty dict of named tensors (the packed dataset)")
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ReferenceCacheError(f"tokens[{name!r}] must be a tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        h.update(_canonical([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the bytes as they are: no copy
    return h.hexdigest()


def reference_cache_key(*, model, data, tokenizer, seq_length: int, settings: dict | None = None,
                        tokens: dict | None = None, weights: str = "fingerprint") -> CacheKey:
    """The key of a reference cache (module docstring): model and tokenizer folders, dataset paths,
    ``seq_length``, ``tokens`` (the packed dataset's tensors: recommended, see the module docstring)
    and ``settings`` (a JSON object: fine-tuning kind, quantisation, dtype, the mask and packing
    settings and the like). ``model`` may also be a JSON dict that identifies it (a model
    initialised from a seed: the seed and its shape)."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ReferenceCacheError(f"seq_length ({seq_length!r}) must be a positive integer")
    settings = {} if settings is None else settings
    if not isinstance(settings, dict):
        raise ReferenceCacheError(f"settings must be a dict, got {type(settings).__name__}")
    try:
        settings = json.loads(_canonical(settings))
    except (TypeError, ValueError) as e:
        raise ReferenceCacheError(f"settings must be JSON (strings, numbers, booleans, lists, dicts): {e}") from None
    if isinstance(model, dict):  # an identity given as is (a model made from a seed has no files)
        model = {"given": json.loads(_canonical(model))}
    else:
        model = model_identity(model, weights=weights)
    return CacheKey({"format": FORMAT, "version": VERSION, "model": model,
                     "data": data_identity(data), "tokenizer": tokenizer_identity(tokenizer),
                     "tokens": None if tokens is None else tokens_identity(tokens),
                     "seq_length": seq_length, "settings": settings})


def _differences(a, b, at: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{at}.{k}" if at else str(k))
        return out
    return [] if a == b else [at or "(the whole key)"]


# ---- the store ----

def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _indices(indices, what: str = "indices") -> torch.Tensor:
    t = torch.as_tensor(indices)
    if t.dim() != 1 or (t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)):
        raise ReferenceCacheError(f"{what} must be a 1-D sequence of integer sample indices, got "
                                  f"{tuple(t.shape)} {t.dtype}")
    t = t.to(torch.int64).cpu()
    if t.numel() and int(t.min()) < 0:
        raise ReferenceCacheError(f"{what} ({int(t.min())}) must be >= 0")
    return t


class ReferenceCache:
    """Per-sample reference (chosen, rejected) sequence log-probs in ``directory`` under ``key``
    (module docstring). Opening a folder that holds another key raises ReferenceCacheKeyError;
    an empty or missing folder becomes a new cache for ``key``. ``rtol``: how far two writers' values
    of one sample may differ (relative). ``create=False``: touch nothing now (a process that only
    reads the cache another process opened: the key is checked at the first read)."""

    def __init__(self, directory, key: CacheKey, *, shard_size: int = DEFAULT_SHARD_SIZE, rtol: float = DEFAULT_RTOL,
                 create: bool = True):
        if not isinstance(key, CacheKey):
            raise ReferenceCacheError(f"key must be a CacheKey (reference_cache_key(...)), got {type(key).__name__}")
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ReferenceCacheError(f"shard_size ({shard_size!r}) must be a positive integer")
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < 1:
            raise ReferenceCacheError(f"rtol ({rtol!r}) must be a number in [0, 1)")
        self.dir, self.key, self._shard_size, self.rtol = Path(directory), key, shard_size, float(rtol)
        self._writer, self._parts_written = uuid.uuid4().hex, 0
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._done: dict | None = None  # key.json once complete: it never changes again
        if not create:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self._meta()
        if meta is None:  # a new cache: created under the lock, or a second writer's "new" could overwrite
            with self._lock():  # the first one's completion
                meta = self._meta()
                if meta is None:
                    _atomic_write(self.dir / KEY_FILE, self._meta_bytes({"complete": False}))
        if meta is not None:
            self._check_key(meta)

    @contextlib.contextmanager
    def _lock(self):
        """The folder's writer lock (module docstring): held while key.json is created or a merge runs."""
        try:
            with FileLock(str(self.dir / LOCK_FILE), timeout=LOCK_TIMEOUT_S):
                yield
        except Timeout:
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r}: {LOCK_FILE} was held for more than "
                                      f"{LOCK_TIMEOUT_S:.0f} s by another writer (a hung run?); retry when it ends, "
                                      "or point dpo.cache_dir elsewhere") from None

    # ---- key.json ----
    def _meta_bytes(self, extra: dict) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "digest": self.key.digest, "key": self.key.fields,
                           **extra}, indent=1, sort_keys=True).encode()

    def _meta(self) -> dict | None:
        path = self.dir / KEY_FILE
        if not path.exists():
            return None
        try:
            meta = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {KEY_FILE} is not readable JSON "
                                             f"({e}); delete the folder to recompute the cache") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("digest"), str):
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {KEY_FILE} is not a reference "
                                             "cache's key; delete the folder to recompute the cache")
        return meta

    def _check_key(self, meta: dict) -> None:
        if meta["digest"] == self.key.digest:
            return
        diff = _differences(meta.get("key"), self.key.fields) or ["(the recorded digest)"]
        shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise ReferenceCacheKeyError(f"reference cache {str(self.dir)!r} was made for another model, data, tokenizer "
                                     f"or settings (differs in: {shown}); point the cache elsewhere or delete it "
                                     "to recompute")

    def _live_meta(self) -> dict:
        if self._done is not None:
            return self._done
        meta = self._meta()
        if meta is None:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {KEY_FILE} is missing (never "
                                             "created here, or deleted)")
        self._check_key(meta)
        if meta.get("complete"):
            self._done = meta
        return meta

    @property
    def complete(self) -> bool:
        """True once ``finalize`` has run for this key, by any writer (re-read from disk until then)."""
        return bool(self._live_meta().get("complete"))

    @property
    def num_samples(self) -> int | None:
        meta = self._live_meta()
        return meta.get("num_samples") if meta.get("complete") else None

    # ---- writing ----
    def put(self, indices, chosen: torch.Tensor, rejected: torch.Tensor) -> bool:
        """Store the reference log-probs of samples ``indices`` (the dataset's own indices): one
        part file, written atomically. Writers never share a file, so any number may run at once.
        False (nothing kept) when the cache is complete: another writer finished it, values included."""
        idx = _indices(indices)
        values = []
        for name, t in (("chosen", chosen), ("rejected", rejected)):
            t = torch.as_tensor(t)
            if t.shape != idx.shape or not t.is_floating_point():
                raise ReferenceCacheError(f"{name} must be a floating-point tensor of shape {tuple(idx.shape)} "
                                          f"(one value per index), got {tuple(t.shape)} {t.dtype}")
            t = t.detach().to("cpu", torch.float64).contiguous()
            if not bool(torch.isfinite(t).all()):
                raise ReferenceCacheError(f"{name} holds a non-finite log-prob (sample "
                                          f"{int(idx[~torch.isfinite(t)][0])}); nothing was stored")
            values.append(t)
        if idx.unique().numel() != idx.numel():
            raise ReferenceCacheError("indices must not repeat within one put")
        if not idx.numel() or self.complete:
            return False
        # the write time first: name order is write order, so "the first part kept" is the earliest written
        path = self.dir / f"part-{time.time_ns():020d}-{self._writer}-{self._parts_written:06d}.safetensors"
        self._parts_written += 1
        _atomic_write(path, st_save({"index": idx.contiguous(), "chosen": values[0], "rejected": values[1]},
                                    metadata={"digest": self.key.digest}))
        if self.complete:  # another writer's merge ended while this part was written: nobody will read it
            path.unlink(missing_ok=True)
            return False
        return True

    def _parse(self, path: Path, data: bytes, names: dict[str, torch.dtype], length: int | None = None):
        try:
            tensors = st_load(data)
            header_len = int.from_bytes(data[:8], "little")  # the header st_load has just parsed: JSON
            metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        except (SafetensorError, ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {path.name} is not a valid "
                                             f"safetensors file ({e}); delete the folder to recompute") from None
        if metadata.get("digest") != self.key.digest:
            raise ReferenceCacheKeyError(f"reference cache {str(self.dir)!r}: {path.name} was written for another key")
        n = None
        for name, dtype in names.items():
            t = tensors.get(name)
            if t is None or t.dtype != dtype or t.dim() != 1 or (n is not None and t.shape[0] != n):
                raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {path.name} lacks a 1-D {dtype} "
                                                 f"tensor {name!r} of the same length as the others")
            n = t.shape[0]
        if length is not None and n != length:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {path.name} holds {n} samples, "
                                             f"not {length}")
        return tensors

    def _part_files(self) -> list[Path]:
        return sorted(self.dir.glob("part-*.safetensors"))

    def _read_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The parts' (index, chosen, rejected) concatenated in name order. A part that vanished since
        the listing (another run's merge completed the cache) is skipped."""
        idx, ch, rj = [], [], []
        part_names = {"index": torch.int64, "chosen": torch.float64, "rejected": torch.float64}
        for p in self._part_files():
            try:
                data = p.read_bytes()
            except FileNotFoundError:
                continue
            t = self._parse(p, data, part_names)
            idx.append(t["index"])
            ch.append(t["chosen"])
            rj.append(t["rejected"])
        if not idx:
            empty = torch.zeros(0, dtype=torch.float64)
            return torch.zeros(0, dtype=torch.int64), empty, empty
        return torch.cat(idx), torch.cat(ch), torch.cat(rj)

    def missing(self, num_samples: int) -> torch.Tensor:
        """The sample indices in [0, num_samples) no part file holds yet (all of them for a new cache;
        none once complete)."""
        if self.complete:
            return torch.zeros(0, dtype=torch.int64)
        have = torch.zeros(num_samples, dtype=torch.bool)
        idx = self._read_parts()[0]
        have[idx[idx < num_samples]] = True
        return (~have).nonzero().flatten()

    def finalize(self, num_samples: int) -> bool:
        """Merge every part into the shards and mark the cache complete (one process of a run, once its
        writers are done; several runs may call it at once: one merges, under the folder's lock). True
        when this call completed the cache, False when another writer had (a success: same key, same
        values). Every sample in [0, num_samples) must be present; a sample written more than once
        must have the same values (to ``rtol``; the earliest written part's value is kept)."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ReferenceCacheError(f"num_samples ({num_samples!r}) must be a positive integer")
        with self._lock():
            meta = self._live_meta()
            if meta.get("complete"):
                if meta.get("num_samples") != num_samples:
                    raise ReferenceCacheError(f"reference cache {str(self.dir)!r} holds {meta.get('num_samples')} "
                                              f"samples, but num_samples is {num_samples}: the same key must mean "
                                              "the same dataset")
                for p in self._part_files():  # late parts of writers that finished after the merge
                    p.unlink(missing_ok=True)
                return False
            self._merge(num_samples)
            return True

    def _merge(self, num_samples: int) -> None:
        idx, ch, rj = self._read_parts()
        if idx.numel() and int(idx.max()) >= num_samples:
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r}: sample {int(idx.max())} was stored, but the "
                                      f"dataset has {num_samples} samples")
        m = idx.numel()
        # each sample's first occurrence in part-file order (m: never stored)
        first = torch.full((num_samples,), m, dtype=torch.int64).scatter_reduce(0, idx, torch.arange(m), "amin")
        absent = (first == m).nonzero().flatten()
        kept = first.clamp(max=max(m - 1, 0))
        chosen, rejected = ch[kept] if m else ch, rj[kept] if m else rj
        for name, kept_vals, vals in (("chosen", chosen, ch), ("rejected", rejected, rj)):
            same = torch.isclose(vals, kept_vals[idx], rtol=self.rtol, atol=0.0)
            if not bool(same.all()):
                i = int((~same).nonzero()[0])
                raise ReferenceCacheError(
                    f"reference cache {str(self.dir)!r}: sample {int(idx[i])} was stored twice with different {name} "
                    f"log-probs ({float(kept_vals[idx[i]]):.9g} and {float(vals[i]):.9g}, beyond rtol {self.rtol:g}): "
                    "two writers of one key computed different references, so the key misses an input they differ in; "
                    "delete the folder to recompute")
        if absent.numel():
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r}: {absent.numel()} of {num_samples} samples "
                                      f"were never stored (the first: {absent[:5].tolist()})")
        shards = {}
        for k, lo in enumerate(range(0, num_samples, self._shard_size)):
            hi = min(lo + self._shard_size, num_samples)
            data = st_save({"chosen": chosen[lo:hi].contiguous(), "rejected": rejected[lo:hi].contiguous()},
                           metadata={"digest": self.key.digest, "first": str(lo)})
            name = f"shard-{k:06d}.safetensors"
            _atomic_write(self.dir / name, data)
            shards[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(self.dir / KEY_FILE, self._meta_bytes({"complete": True, "num_samples": num_samples,
                                                             "shard_size": self._shard_size, "shards": shards}))
        # every part, also one a late writer renamed in during the merge: a put that lands after this
        # listing sees the cache complete and removes its own part
        for p in self._part_files():
            p.unlink(missing_ok=True)

    # ---- reading ----
    def _shard(self, k: int, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if k in self._shards:
            return self._shards[k]
        name = f"shard-{k:06d}.safetensors"
        rec = meta["shards"].get(name)
        path = self.dir / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {name} is not readable ({e}); "
                                             "delete the folder to recompute") from None
        if rec is None or len(data) != rec.get("bytes") or hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {name} differs from the bytes "
                                             f"recorded in {KEY_FILE} (damaged or edited); delete the folder to "
                                             "recompute")
        size, n = meta["shard_size"], meta["num_samples"]
        t = self._parse(path, data, {"chosen": torch.float64, "rejected": torch.float64},
                        length=min(size, n - k * size))
        self._shards[k] = (t["chosen"], t["rejected"])
        return self._shards[k]

    def get(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference (chosen, rejected) log-probs of samples ``indices``: two float64 (len,) CPU
        tensors. The cache must be complete."""
        meta = self._live_meta()
        if not meta.get("complete"):
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r} is not complete: run the reference pass "
                                      "(put every sample, then finalize) first")
        try:
            size, n, _ = int(meta["shard_size"]), int(meta["num_samples"]), dict(meta["shards"])
        except (KeyError, TypeError, ValueError):
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {KEY_FILE} lacks the shard "
                                             "record of a complete cache") from None
        idx = _indices(indices)
        if idx.numel() and int(idx.max()) >= n:
            raise ReferenceCacheError(f"sample index {int(idx.max())} is out of the cache's range [0, {n})")
        chosen = torch.empty(idx.numel(), dtype=torch.float64)
        rejected = torch.empty_like(chosen)
        shard = idx // size
        for k in shard.unique().tolist():
            sel = shard == k
            c, r = self._shard(k, meta)
            chosen[sel], rejected[sel] = c[idx[sel] - k * size], r[idx[sel] - k * size]
        return chosen, rejected


__all__ = ["CacheKey", "ReferenceCache", "ReferenceCacheCorruptError", "ReferenceCacheError",
           "ReferenceCacheKeyError", "data_identity", "model_identity", "reference_cache_key", "tokenizer_identity",
           "tokens_identity", "weight_file_identity"]
