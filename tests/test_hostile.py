"""Hostile and damaged input: random bytes and mutations of valid objects and manifests, damaged
manifest nodes and index, odd names and symlinks. Each gets one of our errors, in bounded time and
memory, changes nothing, and never yields wrong data."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas
from cas.store.registry import _pack as registry_pack
from cas.store.registry import step_key
from cas.codecs import CodecPolicy, decode_into
from cas.errors import CasError, CorruptionError
from cas.hashing import hash_bytes
from cas.index import WHERE_PACK
from cas.store.tree import parse_node
from cas.store.values import pack, unpack

RAW = np.random.default_rng(0).standard_normal(5000).astype(np.float32).view(np.uint8)
KEY = hash_bytes(RAW)
ENCODED = b"".join(bytes(p) for p in CodecPolicy().encode(RAW, 4).parts)
NODE = pack({"k": "tensor", "lib": "torch", "dtype": "float32", "shape": [5000], "chunk": 1 << 20, "chunks": [KEY]})


def mutate(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        if out:
            out[pos % len(out)] = value
    return bytes(out)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2000) | st.builds(mutate, st.just(ENCODED), st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8))
       | st.builds(lambda n: ENCODED[:n], st.integers(0, len(ENCODED) - 1)))
def test_decoder_raises_our_errors_or_returns_the_exact_bytes(data):
    try:
        out = decode_into(data, KEY)
    except CasError:
        return
    assert out.tobytes() == RAW.tobytes()  # only a mutation that left the content intact decodes


@settings(max_examples=300, deadline=2000)
@given(data=st.binary(max_size=500) | st.builds(mutate, st.just(NODE), st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6)))
def test_manifest_reader_raises_our_errors_on_anything_malformed(data):
    try:
        node = parse_node(data, hash_bytes(data))
    except CasError:
        return
    assert node["k"] in ("tensor", "value", "commit")


@pytest.mark.parametrize("bomb", [
    b"\xdd\xff\xff\xff\xff",  # array of 4 billion items, no bytes behind
    b"\xdf\xff\xff\xff\xff",  # map of 4 billion entries
    b"\xc6\xff\xff\xff\xff",  # 4 GiB binary
    b"\x91" * 100_000 + b"\xc0",  # nesting 100k deep
    msgpack.packb(msgpack.ExtType(2, msgpack.packb(msgpack.ExtType(2, b"\x91" * 5000)))),
    msgpack.packb(msgpack.ExtType(3, b"\x01" * 100_000)),  # an absurd big integer
    msgpack.packb(msgpack.ExtType(99, b"")),  # unknown extension
    msgpack.packb(msgpack.ExtType(1, b"short")),  # a reference of the wrong length
    msgpack.packb(msgpack.ExtType(7, msgpack.packb([[1, 2]]))),  # a set holding a list (unhashable)
    msgpack.packb(msgpack.ExtType(8, msgpack.packb({"a": 1}))),  # a frozenset that is no array
    msgpack.packb(msgpack.ExtType(9, msgpack.packb([[1, 2, 3]]))),  # a Counter whose pair is no pair
    msgpack.packb(msgpack.ExtType(9, msgpack.packb([[[1], 2]]))),  # a Counter keyed by a list
    msgpack.packb(msgpack.ExtType(6, b"os.system")),  # a torch dtype name that is none
    msgpack.packb(msgpack.ExtType(6, b"\xff\xfe")),  # not UTF-8
])
def test_msgpack_bombs_are_refused(bomb):
    with pytest.raises(CorruptionError):
        unpack(bomb)


@pytest.mark.parametrize("header", [
    b"caso\x01\x02" + (2**62).to_bytes(8, "little") + b"\x02\x01\x01\x04",  # absurd raw size
    b"caso\x01\x09" + (10).to_bytes(8, "little"),  # too many stages
    b"caso\x01\x01" + (10).to_bytes(8, "little") + b"\x07\x00",  # unknown codec stage
    b"caso\x02\x01" + (12).to_bytes(8, "little") + b"\x04\x03",  # delta of 3-byte elements
    b"caso\x02\x01" + (10).to_bytes(8, "little") + b"\x04\x04",  # 10 bytes are not 4-byte elements
    b"caso\x02\x02" + (8).to_bytes(8, "little") + b"\x02\x01\x04\x04",  # delta not the first stage
    b"caso\x01\x01" + (8).to_bytes(8, "little") + b"\x04\x04",  # sub in a format 1 object
    b"caso\x63\x00" + (10).to_bytes(8, "little"),  # a newer object format
    b"nope" * 10,
])
def test_absurd_object_headers_are_refused(header):
    with pytest.raises(CasError):
        decode_into(header + b"\x00" * 32, KEY)


def test_an_object_format_byte_flipped_to_zero_is_damage_that_verify_names(store):
    """No cas wrote object format 0: one bit flipped (1 -> 0) was a FormatVersionError ("upgrade
    cas"), so `cas verify` stopped at it and repair could not quarantine it. It is damage."""
    with pytest.raises(CorruptionError):
        decode_into(b"caso\x00\x00" + (10).to_bytes(8, "little") + b"\x00" * 32, KEY)
    _saved(store)
    key = store.tensors(1)[0]["chunks"][0]
    rec = store.objects.record(key)
    path, at = (store.objects.packs.path(rec.pack), rec.offset) if rec.where == WHERE_PACK \
        else (store.objects.files.path(key), 0)
    data = bytearray(open(path, "rb").read())
    assert data[at + 4] == 1
    data[at + 4] = 0
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(data)
    report = store.verify()
    assert report.damaged_steps == [1] and report.whole_steps == [2]


def _crafted_checkpoint(path, step: int, tensor_node: dict, chunk: bytes) -> None:
    """A checkpoint whose one tensor node is `tensor_node` (its chunks: `chunk`'s key), written
    as a hostile writer with access to the folder would: objects with valid names and headers,
    a log entry chained to the last."""
    import glob
    import time

    from cas.store.values import Ref

    def put(raw: bytes) -> bytes:
        key = hash_bytes(raw)
        os.makedirs(os.path.join(path, "objects", key.hex()[:2]), exist_ok=True)
        with open(os.path.join(path, "objects", key.hex()[:2], key.hex()), "wb") as f:
            f.write(b"caso\x01\x00" + len(raw).to_bytes(8, "little") + raw)
        return key

    c = put(chunk)
    node = put(pack(dict(tensor_node, chunks=[c] * len(tensor_node["chunks"]))))
    tree = put(pack({"k": "value", "v": {"x": Ref(node)}}))
    commit = put(pack({"k": "commit", "format": 1, "step": step, "created": time.time(), "milestone": False,
                       "metrics": {}, "meta": {}, "tree": Ref(tree), "logical_bytes": 16}))
    last = sorted(glob.glob(os.path.join(path, "log", "*")))[-1]
    seq = int(os.path.basename(last), 16) + 1
    add = {"op": "add", "step": step, "id": commit, "created": time.time(), "milestone": False, "pinned": False,
           "metrics": {}, "meta": {}, "logical_bytes": 16, "new_bytes": 0, "packs": [], "provenance": {}}
    body = {"format": 1, "seq": seq, "prev": hash_bytes(open(last, "rb").read()), "why": "save",
            "time": time.time(), "host": "h", "pid": 1, "user": "u", "changes": [add]}
    with open(os.path.join(path, "log", f"{seq:016x}"), "wb") as f:
        f.write(b"cas-log\n" + msgpack.packb(body, use_bin_type=True))


def test_tensor_nodes_that_do_not_fit_their_chunks_are_damage_before_any_allocation(tmp_path):
    """Nodes with valid hashes whose sizes do not fit: one 16-byte chunk for a 4 TiB tensor in
    chunks of 2**62 bytes (torch tried to allocate 4 TiB), a dimension of 2**63 (torch's
    TypeError escaped restore's fallback), chunks of 16 bytes where the node places 3 (verify
    said ok, every load failed). Each is a CorruptionError, and verify names it."""
    path = tmp_path / "s"
    with cas.open(path, chunk_size=65536) as store:
        store.save({"x": torch.zeros(4)}, step=1)
    base = {"k": "tensor", "lib": "torch", "dtype": "float32", "chunk": 65536}
    _crafted_checkpoint(path, 2, dict(base, shape=[2**40], chunk=2**62, chunks=[0]), bytes(16))
    _crafted_checkpoint(path, 3, dict(base, shape=[0, 2**63], chunks=[]), bytes(16))
    _crafted_checkpoint(path, 4, dict(base, shape=[4], chunk=3, chunks=[0] * 6), bytes(16))
    with cas.open(path) as store:
        for step in (2, 3, 4):
            with pytest.raises(CorruptionError):
                store.load(step)
        assert store.verify().damaged_steps == [2, 3, 4]
        restored = store.restore({"x": torch.ones(4)}, fallback=True)
        assert restored.checkpoint.step == 1 and torch.equal(restored["x"], torch.zeros(4))


def _saved(store):
    g = torch.Generator().manual_seed(0)
    store.save({"big": torch.randn(64, 1024, generator=g), "small": torch.arange(10)}, step=1)
    store.save({"other": torch.randn(64, 1024, generator=g)}, step=2)


def test_damaged_manifest_node_is_named_and_other_checkpoints_load(store):
    _saved(store)
    root = store.get(1).key  # step 1's commit node lives in a pack
    rec = store.objects.record(root)
    assert rec.where == WHERE_PACK
    path = store.objects.packs.path(rec.pack)
    data = bytearray(open(path, "rb").read())
    data[rec.offset + rec.stored_size // 2] ^= 0xFF
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptionError) as info:
        store.load(1)
    assert root.hex() in str(info.value) and "step 1" in str(info.value)
    report = store.verify()
    assert report.damaged_steps == [1] and report.whole_steps == [2]
    assert torch.is_tensor(store.load(2)["other"])


def test_object_names_that_are_not_hex_are_ignored(store):
    _saved(store)
    junk = os.path.join(store.layout.objects, "zz")
    os.makedirs(junk)
    open(os.path.join(junk, "z" * 64), "w").close()
    open(os.path.join(store.layout.objects, "README"), "w").close()
    assert all(len(k) == 32 for k in store.objects.files.iterate())
    assert store.verify().ok
    report = store.gc()
    assert os.path.exists(os.path.join(junk, "z" * 64))  # not ours: never deleted
    assert report.objects_swept == 0


def test_symlink_out_of_the_store_is_not_followed(store, tmp_path):
    _saved(store)
    key = store.tensors(1)[0]["chunks"][0]
    path = store.objects.files.path(key)
    outside = tmp_path / "outside"
    os.replace(path, outside)  # the real bytes now sit outside, behind a link
    os.symlink(outside, path)
    with pytest.raises(cas.MissingObjectError, match="cannot be read"):
        store.load(1)
    assert not store.verify(1).ok


def test_damaged_index_is_refused_then_repaired(store_path):
    with cas.open(store_path, chunk_size=64 << 10, pack_max=4096) as store:
        _saved(store)
        expected = store.load(1)
    with open(os.path.join(store_path, "index", "data.mdb"), "r+b") as f:
        f.write(b"\x00" * 8192)  # both meta pages gone
    with cas.open(store_path) as store:  # a cache that does not open is moved aside and rebuilt
        assert store.cache_report.moved_aside and [ck.step for ck in store.checkpoints()] == [1, 2]
    from cas.store.repair import repair
    report = repair(store_path)
    assert report.checkpoints == [1, 2]
    with cas.open(store_path) as store:
        assert store.verify().ok
        assert torch.equal(store.load(1)["big"], expected["big"])


def test_lmdb_record_damage_is_reported_by_name(store):
    _saved(store)
    key = store.tensors(1)[0]["chunks"][0]
    with store.index.write() as txn:
        txn.put(key, b"\x07garbage", db=store.index.db("objects"))
    with pytest.raises(CasError, match="cas repair"):
        store.load(1)


@pytest.mark.parametrize("field,value", [("stored_size", 2**40), ("offset", 2**63 + 5)])
def test_a_pack_record_reaching_past_its_pack_is_named(store, field, value):
    """A damaged record could ask for a terabyte (MemoryError) or an offset os.pread refuses
    (OverflowError): it is refused against the pack's size instead."""
    store.save({"small": torch.arange(100)}, step=1)
    key = store.tensors(1)[0]["chunks"][0]
    rec = store.objects.record(key)
    assert rec.where == WHERE_PACK
    with store.index.write() as txn:
        store.index.put_record(txn, key, dataclasses.replace(rec, **{field: value}))
    with pytest.raises(CorruptionError, match=key.hex()):
        store.load(1)
    assert not store.verify().ok


@pytest.mark.parametrize("names", ["a value node", "another step's commit"])
def test_a_registry_record_must_name_its_own_steps_commit(store, names):
    """A damaged or crafted registry id naming some other node must not load what it names
    (another step's commit loaded that step's state, silently; a value node raised KeyError)."""
    _saved(store)
    ck = store.get(2)
    if names == "a value node":
        other = parse_node(store.objects.get(ck.key).tobytes(), ck.key)["tree"].key.hex()
    else:
        other = store.get(1).id
    with store.index.write() as txn:
        # a damaged or crafted cache row (the record log is not touched, so the cache stays "current")
        txn.put(step_key(2), registry_pack(dataclasses.replace(ck, id=other)), db=store.registry.db)
    with pytest.raises(CorruptionError, match="registry names"):
        store.load(2)
    assert store.verify().damaged_steps == [2]


def test_a_cycle_of_bases_in_the_index_makes_the_next_save_write_whole(tmp_path):
    """The latest chunks' records form a cycle at the chain bound: the save looking up their
    chains' roots writes those chunks whole (verify reports the damage) instead of failing."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    with cas.open(tmp_path / "s", chunk_size=64 << 10, pack_max=4096, delta="forward", max_chain=1) as store:
        store.save({"w": w}, step=1)
        store.save({"w": w + 1e-4}, step=2)
        for key in store.tensors(2)[0]["chunks"]:
            base = store.objects.record(key).base
            with store.index.write() as txn:
                store.index.put_record(txn, base, dataclasses.replace(store.objects.record(base), base=key, depth=2))
        store.save({"w": w + 2e-4}, step=3)
        assert torch.equal(store.load(3)["w"], w + 2e-4)


def test_a_log_entry_missing_a_field_names_the_field():
    """A damaged entry without one of its fields said only "is damaged: 'seq'" (a KeyError's str)."""
    from cas.store.records import ENTRY_MAGIC, decode_entry

    with pytest.raises(CorruptionError, match="has no field 'prev'"):
        decode_entry(1, ENTRY_MAGIC + msgpack.packb({"format": 1, "seq": 1}))
