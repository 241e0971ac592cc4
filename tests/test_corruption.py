"""A corrupted or missing object is reported by name and never returned as data."""

from __future__ import annotations

import os

import pytest
import torch

import cas


def _object_files(store) -> list[str]:
    root = store.layout.objects
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _chunk_file(store, step: int, path: str) -> str:
    t = next(t for t in store.tensors(step) if t["path"] == path)
    return store.objects.files.path(t["chunks"][0])


@pytest.fixture
def two_checkpoints(store):
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(64, 1024, generator=g)  # 256 KiB: four file objects
    store.save({"shared": shared, "mine": torch.randn(64, 1024, generator=g)}, step=1)
    store.save({"shared": shared, "mine": torch.randn(64, 1024, generator=g)}, step=2)
    return store


def test_flipped_byte_is_found_by_verify_and_load_raises(two_checkpoints):
    store = two_checkpoints
    path = _chunk_file(store, 2, "mine")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    key = os.path.basename(path)
    report = store.verify()
    assert not report.ok
    assert report.damaged_steps == [2]
    assert any(p.key == key and p.path == "mine" and p.step == 2 for p in report.problems)
    with pytest.raises(cas.CorruptionError) as info:
        store.load(2)
    assert key in str(info.value) and "'mine'" in str(info.value) and "step 2" in str(info.value)
    assert torch.is_tensor(store.load(1)["mine"])  # the other checkpoint is whole
    assert store.verify(1).ok


def test_missing_object_file_is_named(two_checkpoints):
    store = two_checkpoints
    path = _chunk_file(store, 1, "shared")
    os.unlink(path)
    with pytest.raises(cas.MissingObjectError, match=os.path.basename(path)):
        store.load(1)
    report = store.verify()
    assert report.damaged_steps == [1, 2]  # both share that tensor
    assert all("missing" in p.message for p in report.problems)


def test_truncated_object_file(two_checkpoints):
    store = two_checkpoints
    path = _chunk_file(store, 1, "mine")
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(cas.CorruptionError, match="truncated"):
        store.load(1)
    assert store.verify(2).ok


def test_a_save_rewrites_an_object_whose_file_vanished(two_checkpoints):
    store = two_checkpoints
    path = _chunk_file(store, 1, "shared")
    os.unlink(path)
    state = store.load(2, keys=["mine"])
    g = torch.Generator().manual_seed(1)
    state["shared"] = torch.randn(64, 1024, generator=g)  # the same bytes as the lost chunk's tensor
    store.save(state, step=3)
    assert os.path.exists(path)
    assert store.verify().ok  # steps 1 and 2 are whole again too


def _drifting_delta_store(path, steps: int = 3):
    """A delta store whose step k>0 chunks are deltas of step k-1's (64 KiB chunks, files)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    store = cas.open(path, chunk_size=64 << 10, pack_max=4096, delta="forward")
    for step in range(steps):
        store.save({"w": w}, step=step)
        w = w + 1e-4 * torch.randn(w.shape, generator=g)
    return store


def test_a_missing_delta_base_is_named_by_load_and_verify(tmp_path):
    """Once the checkpoint that held a base is gone, the base lives only below other deltas:
    the errors must name it, not only the delta on top."""
    with _drifting_delta_store(tmp_path / "s") as store:
        base = store.tensors(0)[0]["chunks"][0]
        store.delete(0)
        store.gc()
        os.unlink(store.objects.files.path(base))
        with pytest.raises(cas.CorruptionError, match=base.hex()):
            store.load(2)
        assert any(base.hex() in str(p) for p in store.verify().problems)


def test_new_bytes_counts_an_object_rewritten_because_its_file_vanished(store):
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    store.save({"w": w}, step=1)
    key = store.tensors(1)[0]["chunks"][0]
    size = store.objects.record(key).stored_size
    os.unlink(store.objects.files.path(key))
    ck = store.save({"w": w}, step=2)
    assert store.objects.files.has(key) == size and ck.new_bytes >= size


def test_repair_never_indexes_a_cycle_of_bases_when_a_chain_to_a_full_copy_exists():
    """A has delta copies against B and C, B against A and C, C is whole: whatever the old
    index said, the records chosen must reach C."""
    from cas.index import WHERE_FILE, ObjectRecord
    from cas.store.copies import choose_copies as _choose
    from cas.store.copies import reaches_full as _reaches_full
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    copies = {a: [ObjectRecord(WHERE_FILE, 10, 10, base=b), ObjectRecord(WHERE_FILE, 11, 10, base=c)],
              b: [ObjectRecord(WHERE_FILE, 12, 10, base=a), ObjectRecord(WHERE_FILE, 13, 10, base=c)],
              c: [ObjectRecord(WHERE_FILE, 14, 10)]}
    for old in ({}, {a: copies[a][0], b: copies[b][0]}):
        chosen = _choose(copies, old)
        assert all(_reaches_full(chosen, key) for key in copies)
