"""A checkpoint whose files are truncated, bit-flipped, missing, edited or crafted is refused naming the
file, and a resume falls back to the checkpoint before it with a warning: never wrong weights, never
code run. A save that cannot be written removes its unfinished folder and says how much space it
needed."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from test_train import small
from tpkernels.train import checkpoint
from tpkernels.train.checkpoint_files import CheckpointError
from tpkernels.train.trainer import Trainer

STEPS = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder with step_00000002 and step_00000004, the losses of an uninterrupted run)."""
    folder = tmp_path_factory.mktemp("ck")
    Trainer(small(steps=STEPS, stop_at_step=4, save_every=2, save_dir=str(folder))).train()
    full = [h["loss"] for h in Trainer(small(steps=STEPS)).train()]
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002", "step_00000004"]
    return folder, full


def _distcp(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


def _flip(step: Path) -> str:
    f = _distcp(step)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    return rf"{f.name} does not match its SHA-256 digest"


def _truncate(step: Path) -> str:
    f = _distcp(step)
    f.write_bytes(f.read_bytes()[:100])
    return rf"{f.name} holds 100 bytes, \d+ were written \(truncated\?\)"


def _remove_shard(step: Path) -> str:
    f = _distcp(step)
    f.unlink()
    return rf"{f.name} is missing"


def _edit_step(step: Path) -> str:
    meta = json.loads((step / "meta.json").read_text())
    meta["step"] = 3
    (step / "meta.json").write_text(json.dumps(meta))
    return r"meta.json was changed after it was written"


def _edit_step_and_seal(step: Path) -> str:
    from tpkernels.train.checkpoint_files import seal

    meta = json.loads((step / "meta.json").read_text())
    meta["step"] = 3
    (step / "meta.json").write_text(json.dumps(seal(meta)))
    return r"meta.json says step 3, the folder is step 4"


def _meta_not_json(step: Path) -> str:
    (step / "meta.json").write_text('{"step": 4, ')
    return r"meta.json is unreadable: JSONDecodeError"


def _meta_not_utf8(step: Path) -> str:
    (step / "meta.json").write_bytes(b"\xff\xfe\x00")
    return r"meta.json is unreadable: UnicodeDecodeError"


def _dcp_metadata_flipped(step: Path) -> str:
    f = step / ".metadata"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    f.write_bytes(bytes(raw))
    return r"\.metadata does not match its SHA-256 digest"


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran_code_marker",))


def _crafted_metadata(step: Path) -> str:
    """A .metadata that runs a shell command when unpickled, digests recomputed so only the allow-list
    stands between it and the shell."""
    from tpkernels.train.checkpoint_files import digest_files, seal

    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = digest_files(step)
    (step / "meta.json").write_text(json.dumps(seal(meta)))
    return r"refers to (posix|os)\.system, which a checkpoint's metadata never holds"


DAMAGE = {"bit flip in a weight file": _flip, "truncated weight file": _truncate, "missing shard": _remove_shard,
          "step edited in meta.json": _edit_step, "step edited and resealed": _edit_step_and_seal,
          "meta.json not JSON": _meta_not_json, "meta.json not text": _meta_not_utf8,
          "bit flip in .metadata": _dcp_metadata_flipped, "crafted .metadata": _crafted_metadata}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_resume_falls_back(saved, tmp_path, case, monkeypatch):
    folder, full = saved
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    monkeypatch.chdir(tmp_path)
    says = DAMAGE[case](ck / "step_00000004")
    with pytest.raises(CheckpointError, match=says):
        checkpoint.export_hf(ck / "step_00000004", tmp_path / "hf")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        history = Trainer(small(steps=STEPS, save_dir=str(ck))).train()
    assert [h["step"] for h in history] == [2, 3, 4, 5]
    assert [h["loss"] for h in history] == full[2:], "the fallback must resume exactly from step 2"
    assert any("step_00000004" in str(w.message) and "trying the checkpoint before it" in str(w.message)
               for w in seen), [str(w.message) for w in seen]
    assert not (tmp_path / "ran_code_marker").exists()


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(saved, tmp_path):
    folder, _ = saved
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    _flip(ck / "step_00000004")
    _truncate(ck / "step_00000002")
    with pytest.warns(UserWarning, match="trying the checkpoint before it"):
        with pytest.raises(CheckpointError, match=r"no checkpoint under .* can be loaded: .*step_00000004.*SHA-256.*"
                                                  r"step_00000002.*truncated"):
            Trainer(small(steps=STEPS, save_dir=str(ck)))


def test_a_checkpoint_missing_its_metadata_is_skipped_as_incomplete(saved, tmp_path):
    folder, full = saved
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    (ck / "step_00000004" / "meta.json").unlink()
    with pytest.warns(UserWarning, match=r"ignoring incomplete checkpoint .*step_00000004"):
        history = Trainer(small(steps=STEPS, save_dir=str(ck))).train()
    assert [h["loss"] for h in history] == full[2:]


def test_a_save_that_runs_out_of_space_cleans_up_and_says_how_much(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full_disk)
    trainer = Trainer(small(steps=2, save_dir=str(tmp_path / "ck")))
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"could not write checkpoint step_00000002 under .* "
                                                             r"\(this rank's share: [\d.]+ MiB; [\d.]+ MiB free there\)"
                                                             r".*No space left on device"):
        trainer.train()
    assert list((tmp_path / "ck").iterdir()) == [], "the unfinished .tmp folder must be removed"


def _resume_worker(rank, world, folder, damage):
    if rank == 0 and damage:
        _flip(Path(folder) / "step_00000004")
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = Trainer(small(steps=STEPS, tp=2, save_dir=folder))
    return t.step_index, [str(w.message) for w in seen if "trying the checkpoint before it" in str(w.message)]


def test_every_rank_refuses_the_same_damaged_checkpoint(rank_pool, saved, tmp_path):
    """Two ranks verify a share of the files each; both fall back, though only one read the bad file."""
    folder, _ = saved
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    got = rank_pool(2).run(_resume_worker, str(ck), True, timeout=120)
    assert [g[0] for g in got] == [2, 2]
    assert len(got[0][1]) == 1 and got[1][1] == [], "rank 0 warns once"
