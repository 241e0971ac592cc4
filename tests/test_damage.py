"""Saves never build on an object known to be damaged, and `cas repair` quarantines it.

A flipped payload byte keeps a file's size, so presence checks pass. Once verify or a failed
load has found it, the next save writes the object again (and its commit puts the fresh copy
in the damaged one's place), delta saves code nothing against it, and `cas repair` moves it to
quarantine/. Real stores, real files, real CLI processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lmdb
import pytest
import torch

import cas
from cas.index import WHERE_PACK
from helpers import assert_same

CAS = [sys.executable, "-m", "cas.cli"]


def _cas(*args, store):
    return subprocess.run(CAS + ["--store", str(store)] + [str(a) for a in args], capture_output=True,
                          text=True, timeout=120)


def _flip(path: str, offset: int | None = None) -> None:
    """Flip one byte of a file in place (the middle of its payload by default): its size stays."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        where = len(data) // 2 if offset is None else offset
        data[where] ^= 0x01
        f.seek(0)
        f.write(data)


def _chunk(store, step: int, path: str, i: int = 0) -> bytes:
    return next(t for t in store.tensors(step) if t["path"] == path)["chunks"][i]


def _damaged(store) -> dict[bytes, dict]:
    with store.index.read() as txn:
        return dict(store.index.iter_damaged(txn))


def _chain(store, key: bytes) -> list[bytes]:
    return store.objects.chain(key)


@pytest.fixture
def state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(16, 1024, generator=g)}  # 4 + 1 files


def test_a_save_after_verify_writes_a_damaged_chunk_again_and_heals_the_store(store, state):
    store.save(state, step=1)
    key = _chunk(store, 1, "w")
    _flip(store.objects.files.path(key))
    report = store.verify()
    assert report.damaged_steps == [1]
    ck = store.save(state, step=2)  # the same chunks: before the fix it reused the damaged one
    assert_same(store.load(2), state)
    assert ck.new_bytes > store.objects.record(key).stored_size  # written again (before: the nodes only)
    assert_same(store.load(1), state)  # the fresh copy took the damaged one's place
    assert report.recorded == [key.hex()]
    assert store.verify().ok and _damaged(store) == {}


def test_a_failed_load_records_the_damaged_chunk(store, state):
    store.save(state, step=1)
    key = _chunk(store, 1, "w", 2)
    _flip(store.objects.files.path(key))
    with pytest.raises(cas.CorruptionError, match=key.hex()):
        store.load(1)
    store.save(state, step=2)
    assert_same(store.load(2), state)
    assert_same(store.load(1), state)
    assert _damaged(store) == {}


def test_a_failed_restore_records_the_damaged_chunk(store):
    model = torch.nn.Linear(1024, 64)
    store.save({"model": model}, step=1)
    key = _chunk(store, 1, "model.weight")
    _flip(store.objects.files.path(key))
    with pytest.raises(cas.CorruptionError):
        store.restore({"model": torch.nn.Linear(1024, 64)})
    store.save({"model": model}, step=2)
    fresh = torch.nn.Linear(1024, 64)
    store.restore({"model": fresh}, step=1)
    assert_same(fresh.state_dict(), model.state_dict())


def test_the_damage_record_names_the_damaged_object_and_who_found_it(store, state):
    store.save(state, step=1)
    key = _chunk(store, 1, "w", 2)
    _flip(store.objects.files.path(key))
    with pytest.raises(cas.CorruptionError):
        store.load(1)
    info = _damaged(store)[key]
    assert info["by"] == "load of step 1" and "hash" in info["reason"] and info["found"] > 0
    store.verify()
    assert _damaged(store)[key]["by"] == "verify"


def test_a_damaged_manifest_node_in_a_pack_is_written_again(store, state):
    store.save(state, step=1)
    node_key = store.reader(1).top()["w"].key  # the tensor node of "w", a small object in a pack
    rec = store.objects.record(node_key)
    assert rec.where == WHERE_PACK
    _flip(store.objects.packs.path(rec.pack), rec.offset + rec.stored_size - 2)
    assert not store.verify().ok
    store.save(state, step=2)  # the same tensor node: written again into this save's pack
    assert_same(store.load(2), state)
    assert store.objects.record(node_key).pack != rec.pack
    assert_same(store.load(1), state)
    assert store.verify().ok


def test_quick_verify_finds_a_damaged_header_and_says_it_cannot_see_payloads(store, state):
    store.save(state, step=1)
    payload, header = _chunk(store, 1, "w", 0), _chunk(store, 1, "w", 1)
    _flip(store.objects.files.path(payload))
    _flip(store.objects.files.path(header), 0)  # the object magic
    report = store.verify(quick=True)
    assert [p.key for p in report.problems] == [header.hex()]  # the payload damage is not visible
    out = _cas("verify", "--quick", store=store.path)
    assert out.returncode == 1 and "payload" in out.stdout, out.stdout
    store.save(state, step=2)
    with pytest.raises(cas.CorruptionError, match=payload.hex()):  # never recorded: still reused
        store.load(2)
    store.save(state, step=3)
    assert_same(store.load(3), state)  # the failed load recorded it; step 3 wrote it again
    assert_same(store.load(2), state)  # step 2 wrote the header-damaged one again


@pytest.mark.parametrize("offset", [0, 4, 14], ids=["magic", "format", "stage"])
def test_a_save_does_not_reuse_a_file_whose_header_is_damaged(store, state, offset):
    store.save(state, step=1)
    key = _chunk(store, 1, "w", 3)
    _flip(store.objects.files.path(key), offset)  # found by no verify, no load: the reuse check reads it
    store.save(state, step=2)
    assert_same(store.load(2), state)
    assert_same(store.load(1), state)


def test_delta_saves_code_nothing_against_a_damaged_base_kept_in_memory(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, pack_max=4096, delta="forward") as store:
        store.save({"w": w}, step=1)
        base = _chunk(store, 1, "w")
        _flip(store.objects.files.path(base))
        assert not store.verify().ok
        w2 = w + 1e-4
        store.save({"w": w2}, step=2)  # step 1's bytes are in memory: before the fix, coded against them
        assert all(base not in _chain(store, k) for t in store.tensors(2) for k in t["chunks"])
        assert_same(store.load(2), {"w": w2})


def test_delta_saves_code_nothing_against_a_delta_whose_base_is_damaged(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, pack_max=4096, delta="forward") as store:
        store.save({"w": w}, step=1)
        store.save({"w": w + 1e-4}, step=2)
        base, delta = _chunk(store, 1, "w"), _chunk(store, 2, "w")
        assert store.objects.record(delta).base == base
        _flip(store.objects.files.path(base))
        with pytest.raises(cas.CorruptionError):
            store.load(2)
        w3 = w + 2e-4
        store.save({"w": w3}, step=3)  # the in-memory base is step 2's delta, whose chain is rotten
        assert_same(store.load(3), {"w": w3})
        assert all(base not in _chain(store, k) for t in store.tensors(3) for k in t["chunks"])
        assert set(_damaged(store)) == {base}  # the damaged level, not the delta above it


def test_a_reused_delta_whose_base_is_damaged_is_written_again(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    path = tmp_path / "s"
    with cas.open(path, chunk_size=256 << 10, pack_max=4096, delta="forward") as store:
        store.save({"w": w}, step=1)
        store.save({"w": w + 1e-4}, step=2)
        base = _chunk(store, 1, "w")
    with cas.open(path, delta="forward") as store:  # a restarted run: nothing in memory
        _flip(store.objects.files.path(base))
        assert store.verify().damaged_steps == [1, 2]
        store.delete(1)
        store.save({"w": w + 1e-4}, step=3)  # step 2's chunks again: their chains reach the damage
        assert_same(store.load(3), {"w": w + 1e-4})
        assert_same(store.load(2), {"w": w + 1e-4})  # the fresh copies took the deltas' place


def test_cas_repair_quarantines_damaged_objects_and_gc_keeps_them(tmp_path, state):
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10, pack_max=16 << 10) as store:
        store.save(state, step=1)
        key = _chunk(store, 1, "w", 1)
        file = store.objects.files.path(key)
    _flip(file)
    damaged_bytes = open(file, "rb").read()
    out = _cas("verify", store=path)
    assert out.returncode == 1 and "repair" in out.stdout, out.stdout
    out = _cas("repair", store=path)
    assert out.returncode == 0, out.stderr
    assert "quarantined" in out.stdout and key.hex() in out.stdout
    moved = os.path.join(path, "quarantine", key.hex())
    assert not os.path.exists(file) and open(moved, "rb").read() == damaged_bytes
    assert _cas("gc", "--keep-all", store=path).returncode == 0
    assert os.path.exists(moved)  # gc never sweeps quarantine/
    with cas.open(path) as store:
        assert store.objects.record(key) is None
        assert store.verify().damaged_steps == [1]  # the step still lacks that chunk...
        store.save(state, step=2)  # ...until a save holds it again
        assert_same(store.load(1), state)
        assert store.verify().ok and _damaged(store) == {}
    assert _cas("repair", store=path).returncode == 0
    assert os.path.exists(moved)


def test_repair_quarantines_a_damaged_pack_entry_as_a_copy(tmp_path, state):
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10, pack_max=16 << 10) as store:
        store.save(state, step=1)
        node_key = store.reader(1).top()["b"].key
        rec = store.objects.record(node_key)
        pack = store.objects.packs.path(rec.pack)
    _flip(pack, rec.offset + rec.stored_size - 2)
    assert _cas("verify", store=path).returncode == 1
    out = _cas("repair", store=path)
    assert out.returncode == 0 and node_key.hex() in out.stdout, out.stdout
    assert os.path.getsize(os.path.join(path, "quarantine", node_key.hex())) == rec.stored_size
    assert os.path.exists(pack)  # the pack holds other live objects
    with cas.open(path) as store:
        store.save(state, step=2)
        assert_same(store.load(1), state)


@pytest.mark.parametrize("pack_max", [None, 16 << 10])  # a streamed pack; packs written whole
def test_a_key_damaged_in_a_pack_footer_costs_gc_and_repair_nothing(tmp_path, pack_max):
    """One bit of an entry's key flipped in a pack's footer, every payload byte intact: gc
    rewrote the pack from the footer's list, took the renamed entry for dead and deleted the
    pack, and a checkpoint that loaded and verified before was lost for good. gc now acts only
    on a pack whose footer its name proves; repair takes each entry's key from the entry's own
    header in the pack."""
    import struct

    import msgpack

    path = tmp_path / "s"
    first = {"w": torch.arange(1000, dtype=torch.float32), "s": torch.tensor(3.5)}
    second = dict(first, w=first["w"] + 1)
    with cas.open(path, delta=False, pack_max=pack_max) as store:
        store.save(first, step=1)
        store.save(second, step=2)
        store.delete(1)  # dead entries: gc has a pack to rewrite
        packs = [store.objects.packs.path(p) for p in store.objects.packs.iterate()]
    for pack in packs:
        data = bytearray(open(pack, "rb").read())
        length = struct.unpack("<I", data[-12:-8])[0]
        start = len(data) - 12 - length
        key = bytes(msgpack.unpackb(bytes(data[start:-12]))[0][0])
        data[start + bytes(data[start:]).index(key) + 5] ^= 0x10
        open(pack, "wb").write(bytes(data))
    with cas.open(path) as store:
        assert_same(store.load(2), second)
        store.gc()
        assert_same(store.load(2), second)
    assert _cas("repair", store=path).returncode == 0
    with cas.open(path) as store:
        assert_same(store.load(2), second)


@pytest.mark.parametrize("pack_max", [None, 16 << 10])  # a streamed pack; packs written whole
def test_a_byte_damaged_in_a_pack_footer_or_trailer_loses_nothing_when_the_index_is_rebuilt(tmp_path, pack_max):
    """One byte of an entry's offset in a pack's footer: the rebuild after the index was lost
    placed that entry (a commit node) where it is not, and the checkpoint would not load;
    `cas repair` then quarantined the bytes at the wrong place and lost it. A byte of the
    trailer hid the whole pack. Every byte of the footer and trailer is damaged in turn here
    (a sample in the footer), the index dropped, and the checkpoint must load and verify."""
    import shutil
    import struct

    source = tmp_path / "source"
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(3000 * (i + 1)) for i in range(4)}
    with cas.open(source, delta=False, pack_max=pack_max) as store:
        store.save(state, step=1)
        packs = [os.path.relpath(store.objects.packs.path(p), source) for p in store.objects.packs.iterate()]
    pack = max(packs, key=lambda p: os.path.getsize(source / p))
    data = (source / pack).read_bytes()
    start = len(data) - 12 - struct.unpack("<I", data[-12:-8])[0]
    positions = list(range(start, len(data) - 12, 5)) + list(range(len(data) - 12, len(data)))
    for n, at in enumerate(positions):
        path = tmp_path / f"s{n}"
        shutil.copytree(source, path, ignore=shutil.ignore_patterns("index"))
        damaged = bytearray(data)
        damaged[at] ^= 0xFF
        os.chmod(path / pack, 0o644)
        (path / pack).write_bytes(bytes(damaged))
        with cas.open(path) as store:
            assert_same(store.load(1), state)
            assert store.verify().ok, at - len(data)
        if n % 8 == 0:
            shutil.rmtree(path / "index")
            assert _cas("repair", store=path).returncode == 0
            with cas.open(path) as store:
                store.gc()
                assert_same(store.load(1), state)
        shutil.rmtree(path)


def test_a_store_without_the_damaged_table_opens_read_only(tmp_path, state):
    path = tmp_path / "s"
    with cas.open(path) as store:
        store.save(state, step=1)
    env = lmdb.open(str(path / "index"), max_dbs=16)  # as a store written before the table existed
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"damaged", txn=txn), delete=True)
    env.close()
    with cas.open(path, readonly=True) as store:
        assert_same(store.load(1), state)
        assert store.verify().ok
