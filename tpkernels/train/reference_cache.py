"""The reference log-prob cache of DPO: each sample's reference (chosen, rejected) sequence
log-probs, computed once and kept on disk for the runs that follow.

    key = reference_cache_key(model="ckpt/", data=["pairs.jsonl"], tokenizer="ckpt/", seq_length=2048,
                              settings={"loss_on": "last", "overflow": "truncate", "dtype": "bfloat16"})
    cache = ReferenceCache("out/ref_cache", key)      # ReferenceCacheKeyError if the folder holds another key
    if not cache.complete:
        cache.put(indices, chosen, rejected)          # every writer: its own samples (any DP layout)
        ...                                           # after a barrier, one process:
        cache.finalize(num_samples)
    chosen, rejected = cache.get(indices)             # float64 (len(indices),) each

The key (``CacheKey``: a JSON dict and its SHA-256) names what the values depend on and nothing
else, so any layout (TP, PP, CP, DP, micro-batching) reads the same cache:
- the model: the SHA-256 of config.json and, per weight file (``*.safetensors``, ``*.bin``,
  ``*.pt``, ``*.pth`` and their index JSON), its size and modification time in nanoseconds
  (``weights="stat"``, the default: free, and any rewrite or copy of a file misses the cache) or
  its SHA-256 (``weights="content"``: survives copies, costs a read of the checkpoint);
- the data: the SHA-256 of every dataset file in the order given (a folder: its files, sorted by
  relative path), names relative to the path given (moving the data keeps the key);
- the tokenizer: the SHA-256 of its files (tokenizer.json, tokenizer_config.json, the vocabulary
  and merges, special_tokens_map.json, added_tokens.json, sentencepiece models, chat templates);
- ``seq_length`` and ``settings``: the data layer's mask and packing settings and anything else the
  values depend on (the reference's compute dtype, for one), any JSON object.

The store is sharded by the dataset's own sample index: shard k holds samples
[k·shard_size, (k+1)·shard_size). Writers add part files (``part-<time_ns>-<uuid>-<n>.safetensors``: index,
chosen, rejected), never touching another writer's; ``finalize`` merges them into the shards,
checks that every sample in [0, num_samples) is there, records each shard's size and SHA-256 in
``key.json`` and marks the cache complete. Parts left by an interrupted pass stay valid for the
same key (``missing`` lists what is still to compute). Everything is safetensors and JSON: nothing
is unpickled. A shard whose bytes differ from the record, or that does not parse, is a
``ReferenceCacheCorruptError``.
"""

from __future__ import annotations

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
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tpkernels.train.checkpoint_files import sha256_of

FORMAT = "tpkernels-reference-cache"
VERSION = 1
KEY_FILE = "key.json"
DEFAULT_SHARD_SIZE = 1 << 16  # samples per shard: 1 MiB of float64 pairs
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
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


def model_identity(model_dir, *, weights: str = "stat") -> dict:
    """config.json's SHA-256 and each weight file's size and mtime_ns (``"stat"``) or SHA-256 (``"content"``)."""
    if weights not in ("stat", "content"):
        raise ReferenceCacheError(f"weights ({weights!r}) must be 'stat' or 'content'")
    folder = _dir(model_dir, "model")
    config = folder / "config.json"
    if not config.is_file():
        raise ReferenceCacheError(f"model folder {str(folder)!r} has no config.json")
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(tuple(s + ".index.json" for s in WEIGHT_SUFFIXES))))
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ReferenceCacheError(f"model folder {str(folder)!r} has no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    out = {}
    for p in files:
        st = p.stat()
        out[p.name] = ({"bytes": st.st_size, "mtime_ns": st.st_mtime_ns} if weights == "stat"
                       else {"bytes": st.st_size, "sha256": sha256_of(p)})
    return {"config_sha256": sha256_of(config), "weights": weights, "files": out}


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


def reference_cache_key(*, model, data, tokenizer, seq_length: int, settings: dict | None = None,
                        weights: str = "stat") -> CacheKey:
    """The key of a reference cache (module docstring): model and tokenizer folders, dataset paths,
    ``seq_length`` and ``settings`` (a JSON object: the mask and packing settings and the like).
    ``model`` may also be a JSON dict that identifies it (a model initialised from a seed: the seed
    and its shape)."""
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
    an empty or missing folder becomes a new cache for ``key``."""

    def __init__(self, directory, key: CacheKey, *, shard_size: int = DEFAULT_SHARD_SIZE):
        if not isinstance(key, CacheKey):
            raise ReferenceCacheError(f"key must be a CacheKey (reference_cache_key(...)), got {type(key).__name__}")
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ReferenceCacheError(f"shard_size ({shard_size!r}) must be a positive integer")
        self.dir, self.key, self._shard_size = Path(directory), key, shard_size
        self._writer, self._parts_written = uuid.uuid4().hex, 0
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self._meta()
        if meta is None:
            _atomic_write(self.dir / KEY_FILE, self._meta_bytes({"complete": False}))
        else:
            self._check_key(meta)

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
        meta = self._meta()
        if meta is None:
            raise ReferenceCacheCorruptError(f"reference cache {str(self.dir)!r}: {KEY_FILE} has disappeared")
        self._check_key(meta)
        return meta

    @property
    def complete(self) -> bool:
        """True once ``finalize`` has run for this key (re-read from disk each time)."""
        return bool(self._live_meta().get("complete"))

    @property
    def num_samples(self) -> int | None:
        meta = self._live_meta()
        return meta.get("num_samples") if meta.get("complete") else None

    # ---- writing ----
    def put(self, indices, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """Store the reference log-probs of samples ``indices`` (the dataset's own indices): one
        part file, written atomically. Writers never share a file, so any number may run at once."""
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
        if not idx.numel():
            return
        if self.complete:
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r} is complete: it takes no more samples")
        # the write time first: name order is write order, so "the first part kept" is the earliest written
        name = f"part-{time.time_ns():020d}-{self._writer}-{self._parts_written:06d}.safetensors"
        self._parts_written += 1
        _atomic_write(self.dir / name, st_save({"index": idx.contiguous(), "chosen": values[0], "rejected": values[1]},
                                               metadata={"digest": self.key.digest}))

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
        idx, ch, rj = [], [], []
        part_names = {"index": torch.int64, "chosen": torch.float64, "rejected": torch.float64}
        for p in self._part_files():
            t = self._parse(p, p.read_bytes(), part_names)
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

    def finalize(self, num_samples: int) -> None:
        """Merge every part into the shards and mark the cache complete (one process, once all writers
        are done). Every sample in [0, num_samples) must be present; a sample written more than once
        must have the same values (to 1e-6 relative; the earliest written part's value is kept)."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ReferenceCacheError(f"num_samples ({num_samples!r}) must be a positive integer")
        if self.complete:
            raise ReferenceCacheError(f"reference cache {str(self.dir)!r} is complete already")
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
            same = torch.isclose(vals, kept_vals[idx], rtol=1e-6, atol=0.0)
            if not bool(same.all()):
                raise ReferenceCacheError(f"reference cache {str(self.dir)!r}: sample {int(idx[~same][0])} was "
                                          f"stored twice with different {name} log-probs")
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
        for p in self._part_files():
            p.unlink()

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
           "ReferenceCacheKeyError", "data_identity", "model_identity", "reference_cache_key", "tokenizer_identity"]
