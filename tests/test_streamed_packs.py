"""Streamed packs, the default on a local store (pack_max=None): every object of a save goes
into a few large packs written while the save encodes, one fsync each, instead of a file per
chunk. The invariants stay those of object files: a kill between a pack's write and the commit
leaves every committed checkpoint whole and nothing of the save visible; a damaged entry in a
big pack is named (tensor, key) by loads and verify and quarantined by repair; gc gives back the
space of partly dead big packs once enough of them is dead; repair rebuilds the index from the
packs alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from helpers import tmp_files
from test_gc import assert_exactly_reachable
from workers import state_of

import cas
from cas.errors import CorruptionError
from cas.index import WHERE_PACK
from cas.store.quarantine import quarantine_damaged

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")
SEEDS = {1: [1, 2], 2: [1, 3], 3: [1, 4, 5]}


def open_store(path, **kw):
    return cas.open(path, chunk_size=64 << 10, **kw)


def records(store) -> dict:
    with store.index.read() as txn:
        return dict(store.index.iter_records(txn))


def chunk_keys(store, step: int, path: str) -> list[bytes]:
    return [t["chunks"] for t in store.tensors(step) if t["path"] == path][0]


def test_a_save_writes_packs_only_and_reads_back_bit_for_bit(tmp_path):
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1000).bfloat16(), "i": torch.arange(70_000), "n": 3}
    with open_store(tmp_path / "s") as store:
        store.objects.stream_target = 1 << 20  # several packs for this 2.6 MiB state
        store.save(state, step=1)
        assert list(store.objects.files.iterate()) == []  # no object file at all
        packs = list(store.objects.packs.iterate())
        assert 2 <= len(packs) <= 4
        assert all(rec.where == WHERE_PACK for rec in records(store).values())
        loaded = store.load(1)
        for k in ("w", "b", "i"):
            assert torch.equal(loaded[k], state[k])
        assert loaded["n"] == 3
        assert store.verify().ok
        assert tmp_files(store) == []
    with open_store(tmp_path / "s") as store:  # another process's view: the index says the same
        assert torch.equal(store.load(1)["w"], state["w"])


def test_a_pack_is_named_by_its_footer_and_lists_its_entries(tmp_path):
    from cas.hashing import hash_bytes
    from cas.packs import _TRAILER

    with open_store(tmp_path / "s") as store:
        store.save({"w": torch.randn(256, 1024)}, step=1)
        (pack,) = store.objects.packs.iterate()
        data = open(store.backend.path(store.objects.packs.name(pack)), "rb").read()
        length, _ = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
        assert hash_bytes(data[len(data) - _TRAILER.size - length:]) == pack
        listed = store.objects.packs.listed(pack, len(data))
        recs = records(store)
        assert {e.key for e in listed} == set(recs)
        assert all(recs[e.key].offset == e.offset and recs[e.key].stored_size == e.length for e in listed)


@pytest.mark.parametrize("point", ["session.pack_written", "commit.synced", "commit.in_txn"])
def test_a_save_killed_between_pack_writes_and_commit(tmp_path, point):
    path = tmp_path / "s"
    with open_store(path) as store:
        for step in (1, 2):
            store.save(state_of(SEEDS[step]), step=step)
    env = dict(os.environ, CAS_FAULTS=f"{point}=kill")
    out = subprocess.run([sys.executable, WORKERS, "save_streamed", str(path), "3", "1+4+5"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    with open_store(path) as store:
        steps = {ck.step for ck in store.checkpoints()}
        assert steps == ({1, 2, 3} if point == "commit.in_txn" else {1, 2})
        for step in steps:
            loaded = store.load(step)
            for k, t in state_of(SEEDS[step]).items():
                assert torch.equal(loaded[k], t)
        assert store.verify().ok
        if 3 not in steps:
            store.save(state_of(SEEDS[3]), step=3)  # saved again: the dead writer's packs are not trusted
        store.gc()
        assert_exactly_reachable(store)
        assert tmp_files(store) == []  # the dead writer's unfinished pack is gone too
        for step in (1, 2, 3):
            for k, t in state_of(SEEDS[step]).items():
                assert torch.equal(store.load(step)[k], t)


def _flip_entry(store, key: bytes, at: int = 100) -> None:
    rec = records(store)[key]
    path = store.backend.path(store.objects.packs.name(rec.pack))
    with open(path, "r+b") as f:
        f.seek(rec.offset + at)
        byte = f.read(1)
        f.seek(rec.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_entry_in_a_big_pack_is_named_quarantined_and_healed(tmp_path):
    path = tmp_path / "s"
    state = {"a": torch.randn(256, 1024), "b": torch.randn(256, 1024)}
    with open_store(path) as store:
        store.save(state, step=1)
        victim = chunk_keys(store, 1, "b")[3]
        _flip_entry(store, victim)
        with pytest.raises(CorruptionError) as err:
            store.load(1)
        assert err.value.key == victim.hex() and err.value.path == "b" and err.value.step == 1
        assert torch.equal(store.load(1, keys=["a"])["a"], state["a"])  # the rest of the pack reads fine
        report = store.verify()
        assert [(p.key, p.path) for p in report.problems] == [(victim.hex(), "b")]
    moved = quarantine_damaged(str(path)).moved
    assert [m.key for m in moved] == [victim.hex()] and moved[0].moved_to.endswith(victim.hex())
    with open_store(path) as store:
        assert victim not in records(store)  # the live pack stays; only the entry's record went
        store.save(state, step=2)  # the object written again heals step 1 too
        for step in (1, 2):
            loaded = store.load(step)
            assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
        assert store.verify().ok


def _pack_sizes(store) -> dict:
    return {p: store.objects.packs.size(p) for p in store.objects.packs.iterate()}


def test_gc_rewrites_a_big_pack_once_most_of_it_is_dead(tmp_path):
    """Two big packs (past PACK_TARGET) of step 1, each partly dead once step 1 goes: the one
    holding a little live data is rewritten (under half live); the one still mostly live is
    rewritten too, by the whole store's rule (its 4 MiB dead are over MAX_UNUSED of the live
    bytes; rewriting it copies 20 MiB to free 4)."""
    from cas.packs import PACK_TARGET

    shared, mostly_live = torch.randn(1 << 20), torch.randn(5 << 20)  # 4 and 20 MiB
    with open_store(tmp_path / "s", compress=False, workers=1) as store:  # one writer: entries in state order
        store.objects.stream_target = 24 << 20
        first = {"shared": shared, "big": torch.randn(5 << 20), "mostly": mostly_live, "gone": torch.randn(1 << 20)}
        store.save(first, step=1)
        big = {p: size for p, size in _pack_sizes(store).items() if size > PACK_TARGET}
        assert len(big) == 2  # [shared, big] and [mostly, gone]; the nodes in a small third
        first_pack = records(store)[chunk_keys(store, 1, "big")[0]].pack
        second_pack = records(store)[chunk_keys(store, 1, "mostly")[0]].pack
        assert set(big) == {first_pack, second_pack}
        store.save({"shared": shared}, step=2)  # step 2 reuses only "shared" (in the first big pack)
        store.save({"mostly": mostly_live}, step=3)  # step 3 the second's "mostly"
        before = sum(_pack_sizes(store).values())
        report = store.gc(keep_last=2)
        assert [ck.step for ck in store.checkpoints()] == [2, 3]
        assert report.packs_rewritten >= 2  # both big packs (and step 1's small pack of nodes)
        assert report.reclaimed_bytes >= 24 << 20  # "big" and "gone" given back
        after = _pack_sizes(store)
        assert sum(after.values()) <= before - (24 << 20)
        assert first_pack not in after and second_pack not in after
        assert torch.equal(store.load(2)["shared"], shared) and torch.equal(store.load(3)["mostly"], mostly_live)
        assert store.verify().ok


def test_repair_rebuilds_the_index_from_big_packs(tmp_path):
    path = tmp_path / "s"
    state = {f"t{i}": torch.randn(128, 1024) for i in range(4)}
    with open_store(path) as store:
        store.objects.stream_target = 1 << 20
        store.save(state, step=1)
        store.save({"t0": state["t0"], "x": torch.randn(64, 1024)}, step=2)
        before = records(store)
    shutil.rmtree(path / "index")
    from cas.store.repair import repair
    repair(str(path))
    with open_store(path) as store:
        assert records(store) == before
        for k, t in state.items():
            assert torch.equal(store.load(1)[k], t)
        assert store.verify().ok


def test_an_aborted_save_leaves_no_temporary_pack(tmp_path):
    class Boom(Exception):
        pass

    class Exploding:
        def state_dict(self):
            raise Boom()

        def load_state_dict(self, sd):
            pass

    with open_store(tmp_path / "s") as store:
        store.save({"w": torch.randn(256, 1024)}, step=1)
        with pytest.raises(Boom):
            store.save({"w": torch.randn(256, 1024), "m": Exploding()}, step=2)
        session = store.objects.session("test")
        session.write(b"\1" * 32, torch.randn(64 << 10).numpy().view("u1"), 4)  # a pack opened, never finished
        session.abort()
        assert tmp_files(store) == []
        assert [ck.step for ck in store.checkpoints()] == [1]


def test_a_damaged_pack_entry_never_lands_in_a_restore_target(tmp_path):
    with open_store(tmp_path / "s", compress=False) as store:
        model = torch.nn.Linear(256, 256)
        store.save({"model": model}, step=1)
        key = chunk_keys(store, 1, "model.weight")[2]
        _flip_entry(store, key, at=200)
        target = torch.nn.Linear(256, 256)
        before = target.weight.detach().clone()
        with pytest.raises(CorruptionError, match=key.hex()):
            store.restore({"model": target})
        chunk = (64 << 10) // 4
        rows = slice(2 * chunk // 256, 3 * chunk // 256)  # the damaged chunk's rows are as they were
        assert torch.equal(target.weight.detach()[rows], before[rows])


def test_a_reused_pack_entry_with_a_damaged_header_is_written_again(tmp_path):
    """The reuse check reads each reused entry's header, as it reads a reused file's: a save
    over a zeroed magic writes the chunk again, which heals the older checkpoint too."""
    state = {"w": torch.randn(256, 1024)}
    with open_store(tmp_path / "s") as store:
        store.save(state, step=1)
        key = chunk_keys(store, 1, "w")[1]
        old = records(store)[key]
        _flip_entry(store, key, at=0)
        store.save(state, step=2)
        assert records(store)[key].pack != old.pack  # a fresh copy, in step 2's pack
        for step in (1, 2):
            assert torch.equal(store.load(step)["w"], state["w"])
        assert store.verify().ok
