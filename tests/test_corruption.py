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
