"""The DPO reference log-prob cache (tpkernels.train.reference_cache): a round trip through writers
that split the samples any way (two "DP layouts" read the same values), resumption from parts,
the key (model config/weights, data content, tokenizer, tokens, seq_length, settings; moving the
data keeps it; a weight file rewritten with its size and mtime kept misses), a folder made for
another key refused with the differing fields named, damaged files refused (a flipped byte, a
truncated shard, key.json not JSON), no pickle anywhere, and several writers at once: a writer that
finds the cache completed by another succeeds, and simultaneous merges both succeed with one result."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch

from tpkernels.train import reference_cache as rc
from tpkernels.train.reference_cache import (
    KEY_FILE,
    ReferenceCache,
    ReferenceCacheCorruptError,
    ReferenceCacheError,
    ReferenceCacheKeyError,
    reference_cache_key,
    weight_file_identity,
)


@pytest.fixture
def sources(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "tokenizer.json").write_text('{"model": "bpe"}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    folder = tmp_path / "saved"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "data-00000.arrow").write_bytes(b"arrow")
    (folder / "state.json").write_text("{}")
    return model, data, folder


def _key(sources, **over):
    model, data, folder = sources
    args = dict(model=model, data=[data, folder], tokenizer=model, seq_length=64,
                settings={"loss_on": "last", "overflow": "truncate"})
    args.update(over)
    return reference_cache_key(**args)


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(n, generator=g, dtype=torch.float64) * 100, -torch.rand(n, generator=g, dtype=torch.float64) * 90


def _fill(cache, chosen, rejected, writers):
    """Every writer puts its share (indices i ≡ w mod writers), a few samples per put."""
    n = chosen.numel()
    for w in range(writers):
        mine = torch.arange(w, n, writers)
        for part in mine.split(3):
            cache.put(part, chosen[part].float() if w == 1 else chosen[part], rejected[part])


def test_round_trip_is_layout_independent(tmp_path, sources):
    n = 23
    chosen, rejected = _values(n)
    chosen = chosen.float().double()  # what an fp32 log-prob stores: exactly
    key = _key(sources)
    a = ReferenceCache(tmp_path / "cache", key, shard_size=5)
    assert not a.complete
    assert torch.equal(a.missing(n), torch.arange(n))
    _fill(a, chosen, rejected, writers=3)
    assert a.missing(n).numel() == 0
    a.finalize(n)
    assert a.complete and a.num_samples == n
    assert not list((tmp_path / "cache").glob("part-*"))
    assert sorted(p.name for p in (tmp_path / "cache").glob("shard-*")) == [f"shard-{k:06d}.safetensors"
                                                                          for k in range(5)]
    # another run, another layout (a different split of the samples), reads its own samples
    b = ReferenceCache(tmp_path / "cache", _key(sources))
    for share in (torch.tensor([22, 0, 7, 5]), torch.arange(1, n, 2), []):
        c, r = b.get(share)
        assert c.dtype == torch.float64 and torch.equal(c, chosen[share]) and torch.equal(r, rejected[share])
    with pytest.raises(ReferenceCacheError, match=r"sample index 23 is out of the cache's range \[0, 23\)"):
        b.get([23])
    # a writer that finds the cache complete (another run finished it) succeeds and changes nothing
    assert b.put([0], chosen[:1] + 1, rejected[:1]) is False and b.finalize(n) is False
    assert torch.equal(b.get([0])[0], chosen[:1]) and not list((tmp_path / "cache").glob("part-*"))
    with pytest.raises(ReferenceCacheError, match=r"holds 23 samples, but num_samples is 24: the same key must"):
        b.finalize(n + 1)
    # nothing on disk is a pickle: safetensors and JSON only (and the writers' lock file, if it stays)
    for p in (tmp_path / "cache").iterdir():
        assert p.suffix in (".safetensors", ".json", ".lock"), p
        assert not p.read_bytes().startswith(b"\x80"), p


def test_interrupted_pass_resumes_and_incomplete_cache_is_refused(tmp_path, sources):
    n = 10
    chosen, rejected = _values(n, 1)
    cache = ReferenceCache(tmp_path / "c", _key(sources))
    cache.put(torch.arange(0, 6), chosen[:6], rejected[:6])
    with pytest.raises(ReferenceCacheError, match="is not complete: run the reference pass"):
        cache.get([0])
    with pytest.raises(ReferenceCacheError, match=r"4 of 10 samples were never stored \(the first: \[6, 7, 8, 9\]\)"):
        cache.finalize(n)
    resumed = ReferenceCache(tmp_path / "c", _key(sources))  # the next run, same key
    todo = resumed.missing(n)
    assert torch.equal(todo, torch.arange(6, 10))
    resumed.put(todo, chosen[todo], rejected[todo])
    resumed.put([2], chosen[2:3] * (1 + 1e-9), rejected[2:3])  # a repeat within tolerance: the first kept
    resumed.finalize(n)
    c, r = resumed.get(torch.arange(n))
    assert torch.equal(c, chosen) and torch.equal(r, rejected)


def test_repeated_sample_with_other_values_is_refused(tmp_path, sources):
    cache = ReferenceCache(tmp_path / "c", _key(sources))
    cache.put([0, 1], torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]))
    cache.put([1], torch.tensor([-2.5]), torch.tensor([-4.0]))
    with pytest.raises(ReferenceCacheError, match="sample 1 was stored twice with different chosen log-probs"):
        cache.finalize(2)


def test_key_covers_model_data_tokenizer_tokens_and_settings(tmp_path, sources):
    model, data, folder = sources
    base = _key(sources).digest
    assert _key(sources).digest == base
    # moving the data (same content, same names) keeps the key
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / data.name).write_bytes(data.read_bytes())
    assert _key(sources, data=[moved / data.name, folder]).digest == base
    assert _key(sources, data=[folder, data]).digest != base  # the order of blended sources matters
    assert _key(sources, seq_length=128).digest != base
    assert _key(sources, settings={"loss_on": "all", "overflow": "truncate"}).digest != base
    for path, text in ((folder / "train" / "data-00000.arrow", "arrow2"), (model / "tokenizer.json", "{}"),
                       (model / "tokenizer_config.json", '{"chat_template": "{{ messages[0] }}"}'),
                       (model / "config.json", '{"hidden_size": 16}')):
        old = path.read_bytes()
        path.write_text(text)
        assert _key(sources).digest != base, path
        path.write_bytes(old)
    # the packed tokens: the same tensors keep the key, one changed mask bit or a cast do not
    ids = torch.randint(0, 50, (3, 17))
    mask = torch.rand(3, 17) < 0.5
    tokens = _key(sources, tokens={"ids": ids, "mask": mask}).digest
    assert tokens != base and _key(sources, tokens={"mask": mask.clone(), "ids": ids.clone()}).digest == tokens
    flipped = mask.clone()
    flipped[2, 16] ^= True
    assert _key(sources, tokens={"ids": ids, "mask": flipped}).digest != tokens
    assert _key(sources, tokens={"ids": ids.int(), "mask": mask}).digest != tokens
    with pytest.raises(ReferenceCacheError, match="settings must be JSON"):
        _key(sources, settings={"dtype": torch.float32})
    with pytest.raises(ReferenceCacheError, match=r"tokens\['ids'\] must be a tensor, got list"):
        _key(sources, tokens={"ids": [1, 2]})
    with pytest.raises(ReferenceCacheError, match=r"weights \('stat'\) must be one of fingerprint, content"):
        _key(sources, weights="stat")
    with pytest.raises(ReferenceCacheError, match="has no weight file"):
        (model / "model.safetensors").unlink()
        _key(sources)


def _rewrite_keeping_size_and_mtime(path, at: int, value: int | None = None) -> None:
    """Byte ``at`` changed in place (to ``value``; default: flipped), the file's size and mtime as they
    were (cp -p, rsync -t, or a rewrite within one mtime tick leave a file so)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A if value is None else value]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_weights_rewritten_with_size_and_mtime_kept_miss(tmp_path, sources, monkeypatch, fresh_seed):
    """The base weights' identity: a weight file whose bytes changed while its size and mtime were
    kept misses the cache, small (hashed whole) or large (stat with ctime and inode, the safetensors
    header and sampled blocks); a copy of a small file keeps the key, content mode keeps it for any."""
    model, _, _ = sources
    weights = model / "model.safetensors"
    g = torch.Generator().manual_seed(fresh_seed)
    size = 5000 + int(torch.randint(0, 3000, (1,), generator=g))
    header = b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(torch.randint(0, 256, (size,),
                                                                                      generator=g).tolist()))
    base = _key(sources).digest
    _rewrite_keeping_size_and_mtime(weights, int(torch.randint(0, weights.stat().st_size, (1,), generator=g)))
    assert _key(sources).digest != base  # a small file: its SHA-256
    # a copy (new mtime, new inode) of a small file keeps the key: its content is the identity
    small = _key(sources).digest
    shutil.copyfile(weights, tmp_path / "copy")
    os.replace(tmp_path / "copy", weights)
    assert _key(sources).digest == small

    # a large file (the threshold lowered): identity from stat (ctime, inode) and sampled bytes
    monkeypatch.setattr(rc, "SMALL_FILE", 1024)
    monkeypatch.setattr(rc, "SAMPLE_BYTES", 16)
    large = weight_file_identity(weights)
    assert set(large) == {"bytes", "mtime_ns", "ctime_ns", "inode", "sampled_sha256"}
    content, before = _key(sources, weights="content").digest, _key(sources).digest
    n = weights.stat().st_size
    last = n - rc.SAMPLE_BYTES
    gap = last // (rc.SAMPLE_BLOCKS - 1) + rc.SAMPLE_BYTES  # the first byte after the second sampled block
    # a byte between the samples rewritten once the timestamp tick has passed: ctime sees it
    value, deadline = weights.read_bytes()[gap] ^ 0x5A, time.monotonic() + 5
    while weights.stat().st_ctime_ns == large["ctime_ns"]:
        assert time.monotonic() < deadline, "the file system's ctime never moved"
        time.sleep(0.01)
        _rewrite_keeping_size_and_mtime(weights, gap, value)
    assert weight_file_identity(weights)["sampled_sha256"] == large["sampled_sha256"]  # unsampled: ctime's work
    assert _key(sources).digest != before
    assert _key(sources, weights="content").digest != content
    # the sampled bytes alone (what sees a rewrite within one ctime tick): a byte of the header, of the
    # second, of a middle and of the last sampled block
    for at in (9, last // (rc.SAMPLE_BLOCKS - 1) + 3, 17 * last // (rc.SAMPLE_BLOCKS - 1) + 3, n - 1):
        was = weight_file_identity(weights)["sampled_sha256"]
        _rewrite_keeping_size_and_mtime(weights, at)
        assert weight_file_identity(weights)["sampled_sha256"] != was, at
    # content mode survives a copy of a large file too
    content = _key(sources, weights="content").digest
    shutil.copyfile(weights, tmp_path / "copy")
    os.replace(tmp_path / "copy", weights)
    assert _key(sources, weights="content").digest == content


def test_key_mismatch_is_a_named_error(tmp_path, sources):
    n = 4
    chosen, rejected = _values(n)
    cache = ReferenceCache(tmp_path / "c", _key(sources))
    cache.put(torch.arange(n), chosen, rejected)
    cache.finalize(n)
    with pytest.raises(ReferenceCacheKeyError, match=r"made for another model, data, tokenizer or settings "
                                                     r"\(differs in: seq_length, settings.loss_on\)"):
        ReferenceCache(tmp_path / "c", _key(sources, seq_length=32, settings={"loss_on": "all",
                                                                                "overflow": "truncate"}))
    assert issubclass(ReferenceCacheKeyError, ValueError)


def _complete(tmp_path, sources, n=12):
    chosen, rejected = _values(n)
    cache = ReferenceCache(tmp_path / "c", _key(sources), shard_size=8)
    cache.put(torch.arange(n), chosen, rejected)
    cache.finalize(n)
    return tmp_path / "c"


@pytest.mark.parametrize("damage, message", [
    (lambda d: _flip(d / "shard-000001.safetensors", -3), r"shard-000001.safetensors differs from the bytes recorded"),
    (lambda d: _truncate(d / "shard-000000.safetensors"), r"shard-000000.safetensors differs from the bytes recorded"),
    (lambda d: (d / "shard-000000.safetensors").unlink(), r"shard-000000.safetensors is not readable"),
    (lambda d: (d / KEY_FILE).write_text("{not json"), r"key.json is not readable JSON"),
    (lambda d: (d / KEY_FILE).write_text('{"format": "other"}'), r"key.json is not a reference cache's key"),
])
def test_damaged_files_are_named_errors(tmp_path, sources, damage, message):
    folder = _complete(tmp_path, sources)
    damage(folder)
    with pytest.raises(ReferenceCacheCorruptError, match=message):
        ReferenceCache(folder, _key(sources)).get(torch.arange(12))


def test_damaged_file_with_a_matching_record_is_still_refused(tmp_path, sources):
    """A shard replaced by garbage whose size and digest were also recorded (an edited cache): it
    must not parse as safetensors, and that is a named error, not a crash or a pickle load."""
    folder = _complete(tmp_path, sources)
    garbage = b"\xff" * 40
    (folder / "shard-000000.safetensors").write_bytes(garbage)
    meta = json.loads((folder / KEY_FILE).read_text())
    import hashlib
    meta["shards"]["shard-000000.safetensors"] = {"bytes": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()}
    (folder / KEY_FILE).write_text(json.dumps(meta))
    with pytest.raises(ReferenceCacheCorruptError, match=r"shard-000000.safetensors is not a valid safetensors file"):
        ReferenceCache(folder, _key(sources)).get([0])


def test_damaged_part_file_is_a_named_error(tmp_path, sources):
    cache = ReferenceCache(tmp_path / "c", _key(sources))
    cache.put([0, 1], torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]))
    (part,) = (tmp_path / "c").glob("part-*.safetensors")
    _truncate(part)
    with pytest.raises(ReferenceCacheCorruptError, match=r"part-.*\.safetensors is not a valid safetensors file"):
        cache.finalize(2)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.put([0, 1], torch.zeros(3), torch.zeros(2)), r"chosen must be a floating-point tensor of shape \(2,\)"),
    (lambda c: c.put([0, 0], torch.zeros(2), torch.zeros(2)), r"indices must not repeat within one put"),
    (lambda c: c.put([-1], torch.zeros(1), torch.zeros(1)), r"indices \(-1\) must be >= 0"),
    (lambda c: c.put([0.5], torch.zeros(1), torch.zeros(1)), r"indices must be a 1-D sequence of integer"),
    (lambda c: c.put([0], torch.tensor([float("nan")]), torch.zeros(1)), r"chosen holds a non-finite log-prob"),
    (lambda c: c.finalize(0), r"num_samples \(0\) must be a positive integer"),
])
def test_bad_calls_are_named_errors(tmp_path, sources, call, message):
    with pytest.raises(ReferenceCacheError, match=message):
        call(ReferenceCache(tmp_path / "c", _key(sources)))


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_writer_overtaken_by_another_succeeds(tmp_path, sources, monkeypatch):
    """Two runs of one key fill one folder: B decided what was missing, then A put everything and
    merged before B stored anything; a part of B's lands while A merges. B's puts and finalize succeed
    (nothing to add), no part file stays, and both read A's values."""
    n = 9
    chosen, rejected = _values(n, 2)
    a, b = ReferenceCache(tmp_path / "c", _key(sources)), ReferenceCache(tmp_path / "c", _key(sources))
    assert torch.equal(b.missing(n), torch.arange(n))  # B's decision: compute everything
    a.put(torch.arange(n), chosen, rejected)
    read = ReferenceCache._read_parts

    def b_writes_during_the_merge(self):
        out = read(self)
        assert b.put([3, 4], chosen[3:5], rejected[3:5]) is True  # lands after A listed the parts
        return out

    monkeypatch.setattr(ReferenceCache, "_read_parts", b_writes_during_the_merge)
    assert a.finalize(n) is True
    monkeypatch.setattr(ReferenceCache, "_read_parts", read)
    assert b.put(torch.arange(n), chosen, rejected) is False  # complete: B's values are not needed
    assert b.finalize(n) is False
    assert not list((tmp_path / "c").glob("part-*"))
    for cache in (a, b, ReferenceCache(tmp_path / "c", _key(sources))):  # a third run opens it complete
        c, r = cache.get(torch.arange(n))
        assert torch.equal(c, chosen) and torch.equal(r, rejected)


def test_simultaneous_writers_all_succeed_with_one_result(tmp_path, sources):
    """Three writers (threads: each its own cache object, lock and files) open one new folder at the same
    moment, put overlapping shares (the values of fp32 runs at other layouts: equal to 1e-7) and merge at
    the same moment: every call succeeds, exactly one merges, all read the same values. Several rounds."""
    n, writers = 11, 3
    chosen, rejected = _values(n, 3)
    for round_ in range(4):
        folder, start, results = tmp_path / f"r{round_}", threading.Barrier(writers), {}

        def writer(w):
            try:
                start.wait()
                cache = ReferenceCache(folder, _key(sources))
                share = torch.arange(w, n + w * 3) % n  # overlapping shares, together every sample
                cache.put(share.unique(), chosen[share.unique()] * (1 + 1e-8 * w), rejected[share.unique()])
                start.wait()
                results[w] = (cache.finalize(n), *cache.get(torch.arange(n)))
            except Exception as e:  # noqa: BLE001  (reported by the test below)
                results[w] = e

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(not isinstance(r, Exception) for r in results.values()), results
        assert len(results) == writers and sorted(r[0] for r in results.values()) == [False] * (writers - 1) + [True]
        first = results[0]
        for merged, c, r in results.values():
            assert torch.equal(c, first[1]) and torch.equal(r, first[2])
        torch.testing.assert_close(first[1], chosen, rtol=1e-7, atol=0)
        assert not list(folder.glob("part-*"))
