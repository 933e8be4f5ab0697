"""A checkpoint's files, checked before they are trusted: a SHA-256 digest per file, written at save
and verified before load; a sealed ``meta.json``; DCP's ``.metadata`` read without running code.

* Digests: DCP stores no checksum, and a flipped byte in a ``.distcp`` file loads as a wrong weight
  without a word. At save, once every rank has written, the ranks hash the folder's files between
  them (file ``i`` by rank ``i mod world``: shared storage, as multi-node runs need anyway) and
  rank 0 records ``{file: {bytes, sha256}}`` in ``meta.json``. Before a load the ranks verify the
  same way and agree on the verdict, so every rank refuses the same checkpoint with the same words.
* Seal: ``meta.json`` carries the SHA-256 of its own canonical JSON (without the seal), so a step
  edited by hand is refused; the step must also be the folder's (``step_NNNNNNNN``).
* ``.metadata``: ``torch.distributed.checkpoint`` pickles it and its reader unpickles it with
  ``pickle.load``: a crafted checkpoint would run code on ``resume`` and ``export-hf``.
  :class:`SafeReader` unpickles it with an allow-list: DCP's metadata dataclasses, ``torch.Size``,
  dtypes, layouts and memory formats, paths. Why our own list and not torch's ``weights_only``
  unpickler: that one reads ``torch.save`` archives, not a bare pickle stream; ``add_safe_globals``
  only extends it.
* What ``.metadata`` may declare (:func:`check_dcp_metadata`, before any data file is read): tensor
  entries only, each stored in a plain file name inside the folder. For a ``BytesStorageMetadata``
  entry DCP's load planner unpickles a ``.distcp`` file's bytes with ``weights_only=False`` (code
  runs), and a ``relative_path`` such as ``../x`` or ``/x`` is followed out
  of the folder (reading, and exporting, data that is not the checkpoint's). The package writes
  neither, so both are refused; :class:`SafeReader` and :class:`SafeLoadPlanner` also refuse a
  bytes item if one ever reaches them. Digests and the seal prove integrity, not origin: anyone
  can recompute them, so they do not make a checkpoint from elsewhere safe; these checks do.

Checkpoints written before the digests existed (no ``files`` in ``meta.json``) load as before, with
a warning that they cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tpkernels.parallel import control

# torch.distributed.checkpoint (with DTensor and sympy, about 0.7 s) is imported on the first read of a
# checkpoint, not with the trainer: most runs, and every rank a launch forks, never read one

META = "meta.json"
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (damaged, incomplete, edited or unsafe); names the file."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    return control.all_gather_objects(obj)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _data_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != META)


def digest_files(folder: str | Path) -> dict[str, dict]:
    """``{file: {"bytes", "sha256"}}`` of every file under ``folder`` but meta.json (collective: the
    ranks hash a share each)."""
    folder = Path(folder)
    rank, world = _world()
    names = _data_files(folder)
    mine = {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_of(folder / n)} for n in names[rank::world]}
    return {k: v for part in _gather(mine) for k, v in part.items()}


def seal(meta: dict) -> dict:
    """``meta`` with ``checksum``: the SHA-256 of the rest, in canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def check_seal(path: Path, meta: dict) -> None:
    """Refuse a meta.json edited after the save, or one whose step is not the folder's."""
    if "checksum" in meta and seal(meta)["checksum"] != meta["checksum"]:
        raise CheckpointError(f"checkpoint {path}: {META} was changed after it was written (its checksum does not "
                              "match its contents): refusing it")
    name = path.name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != meta.get("step"):
        raise CheckpointError(f"checkpoint {path}: {META} says step {meta.get('step')!r}, the folder is step "
                              f"{int(name[5:])}: refusing it")


def _problems(folder: Path, recorded: dict, names: list[str]) -> list[str]:
    out = []
    for n in names:
        f, want = folder / n, recorded[n]
        if not f.is_file():
            out.append(f"{f} is missing")
        elif f.stat().st_size != want["bytes"]:
            out.append(f"{f} holds {f.stat().st_size} bytes, {want['bytes']} were written (truncated?)")
        elif sha256_of(f) != want["sha256"]:
            out.append(f"{f} does not match its SHA-256 digest (damaged: its bytes changed after the save)")
    return out


def verify(path: str | Path, meta: dict) -> None:
    """Check every file of checkpoint ``path`` against the digests in ``meta`` (collective when
    distributed: the ranks verify a share each and all raise the same :class:`CheckpointError`)."""
    path = Path(path)
    check_seal(path, meta)
    recorded = meta.get("files")
    rank, world = _world()
    if recorded is None:
        if rank == 0:
            warnings.warn(f"checkpoint {path} has no file digests (written by an older tpkernels): it cannot be "
                          "verified", stacklevel=3)
        return
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) and {"bytes", "sha256"} <= v.keys()
                                                 for v in recorded.values()):
        raise CheckpointError(f"checkpoint {path}: {META}'s 'files' must map file names to their bytes and sha256")
    outside = [f"{META} records {p}" for p in map(_not_plain, recorded) if p]
    if outside:  # never hash (read) a file out of the folder
        raise CheckpointError(f"checkpoint {path}: {outside[0]}: refusing it")
    names = sorted(recorded)
    bad = [p for part in _gather(_problems(path, recorded, names[rank::world])) for p in part]
    extra = sorted(set(_data_files(path)) - set(recorded)) if path.is_dir() else []
    if ".metadata" not in recorded:
        bad.append(f"{path / '.metadata'} is not among the recorded files")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(bad[:3])}{more}: refusing it")
    if extra and rank == 0:
        warnings.warn(f"checkpoint {path} holds files it did not write ({extra[:3]}); they are ignored", stacklevel=3)


# ---- DCP metadata without running code ----

def _dcp_metadata():
    from torch.distributed.checkpoint import metadata  # noqa: PLC0415

    return metadata


def _storage_info():
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415

    return _StorageInfo


def _allowed(module: str, name: str):
    """The object an allowed global names, or None."""
    dcp_metadata = _dcp_metadata()
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        if isinstance(obj, type) and obj.__module__ == module:  # its dataclasses and enums
            return obj
        return None
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return _storage_info()
    if module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        import pathlib  # noqa: PLC0415

        return getattr(pathlib, name)
    if module == "collections" and name == "OrderedDict":
        import collections  # noqa: PLC0415

        return collections.OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: str):
        super().__init__(f)
        self.where = where

    def find_class(self, module, name):
        obj = _allowed(module, name)
        if obj is None:
            raise CheckpointError(f"{self.where} refers to {module}.{name}, which a checkpoint's metadata never "
                                  "holds: refusing to load it (a crafted .metadata could run code)")
        return obj


def read_dcp_metadata(path: str | Path):
    """The ``.metadata`` of DCP checkpoint ``path``, unpickled with the allow-list."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh, str(f)).load()
    except CheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{f} is unreadable ({type(e).__name__}: {e}): refusing the checkpoint") from None
    if not isinstance(md, _dcp_metadata().Metadata):
        raise CheckpointError(f"{f} holds a {type(md).__name__}, not DCP metadata: refusing the checkpoint")
    check_dcp_metadata(path, md)
    return md


def _not_plain(name) -> str | None:
    if not isinstance(name, str) or not name:
        return f"{name!r}, which is not a file name"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or Path(name).is_absolute():
        return f"{name!r}, which is not a plain file name inside the folder (a path out of it would be followed)"
    return None


def file_name_problem(folder: Path, name) -> str | None:
    """Why ``name`` is not a plain file name of a file inside ``folder`` (None when it is one)."""
    problem = _not_plain(name)
    if problem:
        return problem
    f = folder / name
    if not f.is_file():
        return f"{name!r}, which is not a file in {folder}"
    if f.resolve().parent != folder.resolve():
        return f"{name!r}, a link out of {folder}"
    return None


def _entry_problem(key, entry) -> str | None:
    dcp_metadata = _dcp_metadata()
    if not isinstance(key, str):
        return f"a key {key!r} that is not a string"
    if type(entry) is not dcp_metadata.TensorStorageMetadata:
        return (f"entry {key!r} stored as {type(entry).__name__}; the package writes tensors only "
                "(TensorStorageMetadata), and DCP loads any other entry with torch.load(weights_only=False), "
                "which runs the code a pickle holds")
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if not (type(props) is dcp_metadata.TensorProperties and isinstance(props.dtype, torch.dtype)
            and type(size) is torch.Size and isinstance(chunks, list)
            and all(type(c) is dcp_metadata.ChunkStorageMetadata for c in chunks)):
        return f"entry {key!r} with malformed tensor metadata"
    return None


def _storage_problem(folder: Path, index, info, files: dict) -> str | None:
    """``files``: relative path -> (its problem, its size), filled as paths are met (one stat per file)."""
    fqn = getattr(index, "fqn", index)
    if type(index) is not _dcp_metadata().MetadataIndex or type(info) is not _storage_info():
        return f"storage record {index!r} of an unknown type ({type(info).__name__})"
    name = info.relative_path
    if not isinstance(name, str):
        return f"entry {fqn!r} stored in {name!r}, which is not a file name"
    if name not in files:
        problem = file_name_problem(folder, name)
        files[name] = (problem, 0 if problem else (folder / name).stat().st_size)
    problem, size = files[name]
    if problem:
        return f"entry {fqn!r} stored in {problem}"
    if info.transform_descriptors:
        return f"entry {fqn!r} stored with transforms {list(info.transform_descriptors)!r}, which the package never writes"
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length))
    if not ok or info.offset + info.length > size:
        return (f"entry {fqn!r} stored at bytes [{info.offset!r}, +{info.length!r}) of {info.relative_path!r}, "
                "outside that file")
    return None


def check_dcp_metadata(path: str | Path, md) -> None:
    """Refuse, before any data file is read, a ``.metadata`` that declares what the package never writes:
    an entry that is not a tensor (DCP would unpickle it, running code), or a storage path that is not a
    plain file name inside the checkpoint folder (DCP would follow it out). Raises CheckpointError naming
    the file and the entry."""
    folder = Path(path)
    f = folder / ".metadata"
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{f}: its entries or storage records are not mappings: refusing the checkpoint")
    problems = [p for p in (_entry_problem(k, e) for k, e in entries.items()) if p]
    files: dict = {}
    problems += [p for p in (_storage_problem(folder, i, s, files) for i, s in storage.items()) if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{f} declares {problems[0]}{more}: refusing the checkpoint (a checkpoint is data, "
                              "never code, and its files stay inside its folder)")


def _no_bytes(what: str, fqn) -> CheckpointError:
    return CheckpointError(f"{what}: entry {fqn!r} is stored as bytes, which DCP would unpickle (running code): "
                           "the package writes tensors only, refusing it")


def _reader_classes() -> tuple[type, type]:
    """SafeReader and SafeLoadPlanner, made on first use: their bases are DCP's."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint.planner import LoadItemType  # noqa: PLC0415

    class SafeReader(FileSystemReader):
        """DCP's file reader, its metadata read by :func:`read_dcp_metadata` (no code runs; checked by
        :func:`check_dcp_metadata`); a bytes item, should one reach it, is refused before it is read."""

        def read_metadata(self, *args, **kwargs):
            md = read_dcp_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = _dcp_metadata().StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise _no_bytes(str(Path(self.path) / ".metadata"), item.storage_index.fqn)
            return super().read_data(plan, planner)


    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner, except that it never unpickles: its ``load_bytes`` (the default one calls
        ``torch.load(weights_only=False)``) refuses."""

        def load_bytes(self, read_item, value):
            raise _no_bytes("checkpoint", read_item.dest_index.fqn)

    return SafeReader, SafeLoadPlanner


def __getattr__(name: str):
    if name in ("SafeReader", "SafeLoadPlanner"):
        reader, planner = _reader_classes()
        for cls in (reader, planner):
            cls.__qualname__ = cls.__name__
        globals().update(SafeReader=reader, SafeLoadPlanner=planner)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "SafeLoadPlanner", "SafeReader", "check_dcp_metadata", "check_seal", "digest_files",
           "file_name_problem", "read_dcp_metadata", "seal", "sha256_of", "verify"]
