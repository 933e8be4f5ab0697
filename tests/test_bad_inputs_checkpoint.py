"""A checkpoint whose files are truncated, bit-flipped, missing, edited or crafted is refused naming the
file, and a resume falls back to the checkpoint before it with a warning: never wrong weights, never
code run. A save that cannot be written removes its unfinished folder and says how much space it
needed."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
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


def _reseal(step: Path, md) -> None:
    """Write DCP metadata ``md`` as DCP does (a pickle) and recompute the digests and the seal, as anyone
    can: only the checks of what .metadata may declare stand between it and the load."""
    from tpkernels.train.checkpoint_files import digest_files, seal

    (step / ".metadata").write_bytes(pickle.dumps(md))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = digest_files(step)
    (step / "meta.json").write_text(json.dumps(seal(meta)))


def _bytes_entry(step: Path) -> str:
    """optim::step declared as bytes, stored in a .distcp file as a torch.save pickle that runs a shell
    command: DCP's default planner would torch.load(weights_only=False) it."""
    import io

    from torch.distributed.checkpoint import metadata as M
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from tpkernels.train.checkpoint_files import read_dcp_metadata

    md = read_dcp_metadata(step)
    buf = io.BytesIO()
    torch.save(_RunsCode(), buf)
    (step / "__9_0.distcp").write_bytes(buf.getvalue())
    md.state_dict_metadata["optim::step"] = M.BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "optim::step"}
    md.storage_data[M.MetadataIndex("optim::step")] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    _reseal(step, md)
    return r"\.metadata declares entry 'optim::step' stored as BytesStorageMetadata; the package writes tensors only"


def _path_out(where):
    """Every entry's storage moved to a copy of the weights outside the folder, at ``where(step)``."""
    def damage(step: Path) -> str:
        from tpkernels.train.checkpoint_files import read_dcp_metadata

        md = read_dcp_metadata(step)
        target = where(step)
        outside = step / target if not Path(target).is_absolute() else Path(target)
        shutil.copy(_distcp(step), outside)
        md.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()}
        _reseal(step, md)
        return rf"\.metadata declares entry '.*' stored in '{re.escape(target)}', which is not a plain file name inside"
    return damage


def _digest_of_a_file_outside(step: Path) -> str:
    from tpkernels.train.checkpoint_files import seal, sha256_of

    meta = json.loads((step / "meta.json").read_text())
    meta["files"]["../../outside"] = {"bytes": 3, "sha256": sha256_of(step / "meta.json")}
    (step / "meta.json").write_text(json.dumps(seal(meta)))
    return r"meta.json records '\.\./\.\./outside', which is not a plain file name"


DAMAGE = {"bit flip in a weight file": _flip, "truncated weight file": _truncate, "missing shard": _remove_shard,
          "step edited in meta.json": _edit_step, "step edited and resealed": _edit_step_and_seal,
          "meta.json not JSON": _meta_not_json, "meta.json not text": _meta_not_utf8,
          "bit flip in .metadata": _dcp_metadata_flipped, "crafted .metadata": _crafted_metadata,
          "bytes entry holding a pickle": _bytes_entry,
          "storage path ../": _path_out(lambda step: "../outside.distcp"),
          "storage path absolute": _path_out(lambda step: str(step.parent.parent / "elsewhere.distcp")),
          "digest of a file outside": _digest_of_a_file_outside}


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


@pytest.mark.parametrize("layers_left", ["reader and planner", "planner"])
def test_a_bytes_entry_is_refused_by_the_reader_and_the_planner_too(saved, tmp_path, monkeypatch, layers_left):
    """Each guard alone keeps the pickle shut: with the metadata check off, the reader refuses the bytes
    item; with the reader's refusal off too, the load planner does (it never calls torch.load)."""
    from tpkernels.train import checkpoint_files

    folder, _ = saved
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    monkeypatch.chdir(tmp_path)
    _bytes_entry(ck / "step_00000004")
    monkeypatch.setattr(checkpoint_files, "check_dcp_metadata", lambda path, md: None)
    if layers_left == "planner":
        from torch.distributed.checkpoint import FileSystemReader

        monkeypatch.setattr(checkpoint_files.SafeReader, "read_data", FileSystemReader.read_data)
    with pytest.raises(CheckpointError, match=r"entry 'optim::step' is stored as bytes, which DCP would unpickle"):
        checkpoint.export_hf(ck / "step_00000004", tmp_path / "hf")
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


def test_adapters_resume_only_as_they_were_trained(tmp_path):
    """A LoRA checkpoint resumed with another rank loaded its adapters and AdamW moments truncated (or failed
    on a missing rectangle), with another alpha it changed the model without a word, into a full fine-tune
    it dropped them: every change of the adapters' shape or meaning is refused naming the setting, the
    checkpoint's value and this run's. The same values (an explicit alpha equal to the default) resume."""
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.lora import apply_lora
    from tpkernels.train.checkpoint_files import seal

    two = {"model.layers": 2}
    lora, full = {**two, "model.finetune": "lora", "model.lora_rank": 4}, tmp_path / "full"
    Trainer(small(steps=4, stop_at_step=2, save_dir=str(tmp_path / "lora"), **lora)).train()
    Trainer(small(steps=4, stop_at_step=2, save_dir=str(full), **two)).train()
    for change, says in (({"model.lora_rank": 2}, r"model.lora_rank \(4 in the checkpoint, 2 here\)"),
                         ({"model.lora_rank": 8}, r"model.lora_rank \(4 in the checkpoint, 8 here\)"),
                         ({"model.lora_alpha": 4.0}, r"model.lora_alpha \(8.0 in the checkpoint, 4.0 here\)"),
                         ({"model.finetune": "full"}, r"saved with model.finetune lora \(LoRA adapters\); this run has "
                                                      r"model.finetune full \(no adapters\)")):
        with pytest.raises(ValueError, match=says):
            Trainer(small(steps=4, save_dir=str(tmp_path / "lora"), **{**lora, **change}))
    with pytest.raises(ValueError, match=r"saved with model.finetune full \(no adapters\); this run has model.finetune "
                                         r"lora \(LoRA adapters\)"):
        Trainer(small(steps=4, save_dir=str(full), **lora))
    path = checkpoint.latest(tmp_path / "lora")
    other = ParallelTransformer(small(**two).model_config(), None)
    apply_lora(other, 4, targets=("qkv", "out"))
    with pytest.raises(ValueError, match=r"the adapted layers \(\['qkv', 'out', 'gate_up', 'up', 'down'\] in the "
                                         r"checkpoint, \['qkv', 'out'\] here\)"):
        checkpoint.load(path, other)
    other = ParallelTransformer(small(**two).model_config(), None)
    apply_lora(other, 4)
    other.lora_spec = dataclasses.replace(other.lora_spec, scaling="alpha/sqrt(rank)")  # rsLoRA's rule
    with pytest.raises(ValueError, match=r"the LoRA scaling \('alpha/rank' in the checkpoint, 'alpha/sqrt\(rank\)' "
                                         r"here"):
        checkpoint.load(path, other)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(seal({**meta, "adapters": {"rank": "4"}})))  # crafted, resealed
    with pytest.raises(CheckpointError, match=r"meta.json: 'adapters' \(\{'rank': '4'\}\) must be null or a mapping"):
        checkpoint.load(path, other)
    # a checkpoint written before the adapters were recorded: its config says what they are
    (path / "meta.json").write_text(json.dumps(seal({k: v for k, v in meta.items() if k != "adapters"})))
    with pytest.raises(ValueError, match=r"model.lora_rank \(4 in the checkpoint, 2 here\)"):
        Trainer(small(steps=4, save_dir=str(tmp_path / "lora"), **{**lora, "model.lora_rank": 2}))
    same = Trainer(small(steps=4, save_dir=str(tmp_path / "lora"), **{**lora, "model.lora_alpha": 8.0}))
    assert same.resumed_from == path and [h["step"] for h in same.train()] == [2, 3]
