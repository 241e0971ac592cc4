"""The store's truth lives in its own objects and record log; the LMDB index is only a cache.

Every test here loses, damages or rolls back the cache (or kills a process half way through a
change) and checks that every committed checkpoint, with its flags exactly as last set, is
still there, loads bit for bit, and that gc frees nothing a checkpoint needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time

import pytest
import torch
from test_gc import assert_exactly_reachable
from test_gc_concurrency import WORKERS, assert_loads, finish, open_store, spawn, wait_reached
from workers import smooth, state_of

import cas
from cas.errors import CorruptionError

DATA = os.path.join(os.path.dirname(__file__), "data")


def flags(store) -> list[tuple]:
    return [(ck.step, ck.id, ck.milestone, ck.pinned) for ck in store.checkpoints()]


def build(path) -> list[tuple]:
    """Steps 1-4 sharing tensors; a milestone, a pin and an unset milestone after the saves; step 1
    deleted. Returns the flags as the store holds them."""
    with open_store(path) as store:
        for step in (1, 2, 3, 4):
            store.save(state_of([step, step + 10, 99]), step=step)
        store.set_milestone(2)
        store.pin(3)
        store.set_milestone(4)
        store.set_milestone(4, False)
        store.delete(1)
        return flags(store)


def drop_index_files(path) -> None:
    folder = os.path.join(path, "index")
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))


def cli(*args, path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(path), *args],
                          capture_output=True, text=True, timeout=120)


def tree_digest(path) -> dict[str, str]:
    """Every file's digest, but LMDB's lock.mdb: its reader table is shared with writers, so
    every reader writes its slot there (it holds no store content)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == "lock.mdb":
                continue
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_a_store_whose_index_files_were_deleted_keeps_every_checkpoint_and_flag(tmp_path):
    """The issue's repro: cp -a, rm index/*.mdb, open, save, gc --keep-all, repair."""
    src, copy = tmp_path / "src", tmp_path / "S"
    expected = build(src)
    shutil.copytree(src, copy)
    drop_index_files(copy)
    with open_store(copy) as store:
        assert store.cache_report.reason is not None  # it noticed, and rebuilt
        assert flags(store) == expected
        assert store.latest().step == 4
        store.save(state_of([90]), step=90)
    result = cli("gc", "--keep-all", path=copy)
    assert result.returncode == 0, result.stderr
    with open_store(copy) as store:
        assert [f[0] for f in flags(store)] == [2, 3, 4, 90]
        for step in (2, 3, 4):
            assert_loads(store, step, [step, step + 10, 99])
        assert_exactly_reachable(store)
    drop_index_files(copy)
    result = cli("repair", path=copy)
    assert result.returncode == 0, result.stderr
    with open_store(copy) as store:
        assert flags(store)[:3] == expected  # pins and milestones, with their later changes
        assert store.verify().ok


def test_an_older_copy_of_the_index_put_back_is_caught_up(tmp_path):
    path = tmp_path / "s"
    build(path)
    old_index = tmp_path / "old-index"
    shutil.copytree(path / "index", old_index)
    with open_store(path) as store:
        store.save(state_of([5, 15]), step=5)
        store.delete(2)
        store.unpin(3)
        store.gc(keep_last=2)  # sweeps step 2's objects, which the old copy still lists
        expected = flags(store)
    shutil.rmtree(path / "index")
    shutil.copytree(old_index, path / "index")
    with open_store(path) as store:
        assert "record log entries after" in store.cache_report.reason
        assert flags(store) == expected
        store.save(state_of([2, 12, 99]), step=6)  # objects the old copy thinks stored are written again
        assert_loads(store, 6, [2, 12, 99])
        store.gc()
        assert_exactly_reachable(store)
        assert_loads(store, 5, [5, 15])


def test_an_index_of_another_store_is_rebuilt(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    expected = build(a)
    with open_store(b) as store:
        store.save(state_of([7]), step=7)
    shutil.rmtree(a / "index")
    shutil.copytree(b / "index", a / "index")
    with open_store(a) as store:
        assert store.cache_report.reason == "the index belongs to another store"
        assert flags(store) == expected


def test_a_read_only_open_of_a_stale_store_changes_nothing(tmp_path):
    path = tmp_path / "s"
    expected = build(path)
    drop_index_files(path)
    before = tree_digest(path)
    with cas.open(path, readonly=True) as store:
        assert flags(store) == expected
        assert_loads(store, 3, [3, 13, 99])
        with pytest.raises(cas.ReadOnlyStoreError):
            store.gc()
    assert tree_digest(path) == before


@pytest.mark.parametrize("cut", ["to one page", "to half", "by its last page"])
def test_a_truncated_index_is_moved_aside_and_rebuilt(tmp_path, cut):
    """Cut to half or by a page, LMDB mapped the file and read past its end: SIGBUS killed the
    process at its first read. The data file is now checked against its newest meta page
    first, so read-only opens read a private cache and writable ones rebuild the index."""
    path = tmp_path / "s"
    expected = build(path)
    data = path / "index" / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate({"to one page": 4096, "to half": size // 2 // 4096 * 4096, "by its last page": size - 4096}[cut])
    # in a child first: without the check it dies of SIGBUS, which would take pytest's worker with it
    code = "import cas, sys; s = cas.open(sys.argv[1], readonly=True); print(s.verify().ok, len(s.checkpoints()))"
    read_only = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert (read_only.returncode, read_only.stdout.split()) == (0, ["True", str(len(expected))]), read_only.stderr[-2000:]
    with open_store(path) as store:
        assert flags(store) == expected
        assert store.cache_report.moved_aside is not None
        assert_loads(store, 4, [4, 14, 99])



def test_an_index_data_file_that_is_a_fifo_is_moved_aside_and_rebuilt(tmp_path):
    """Hostile or broken: reading its meta pages (the cut-short check) would wait forever."""
    path = tmp_path / "s"
    expected = build(path)
    data = path / "index" / "data.mdb"
    data.unlink()
    os.mkfifo(data)
    code = "import cas, sys; s = cas.open(sys.argv[1], readonly=True); print(len(s.checkpoints()))"
    read_only = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert (read_only.returncode, read_only.stdout.split()) == (0, [str(len(expected))]), read_only.stderr[-2000:]
    with open_store(path) as store:
        assert flags(store) == expected and store.cache_report.moved_aside is not None


@pytest.mark.parametrize("blob", ["config", "log entry"])
def test_a_config_or_log_entry_that_is_a_fifo_is_refused_not_waited_on(tmp_path, blob):
    """Reading a FIFO put in a file's place waits for a writer forever: an open (and `cas ls`)
    hung on a config or, with the index lost, a log entry that was one."""
    path = tmp_path / "s"
    build(path)
    target = path / "config" if blob == "config" else path / "log" / f"{2:016x}"
    target.unlink()
    os.mkfifo(target)
    if blob != "config":
        drop_index_files(path)
    result = cli("ls", path=path)  # (a hang is a TimeoutExpired)
    if blob == "config":
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    else:  # a read-only open reads around an entry it cannot read; a writable one refuses
        assert result.returncode == 0 and "log/0000000000000002" in result.stderr, result.stderr
        result = cli("pin", "3", path=path)
        assert result.returncode == 2 and "log/0000000000000002" in result.stderr, result.stderr


def test_a_format_1_store_is_upgraded_on_its_first_writable_open(tmp_path):
    """tests/data/store-v1.tar.gz was written by the format-1 cas: steps 1-4 delta-coded, step 1
    pinned, 2 made a milestone after its save, 3 made one and unmade, 4 deleted."""
    with tarfile.open(os.path.join(DATA, "store-v1.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / "store-v1"
    before = tree_digest(path)
    with cas.open(path, readonly=True) as store:  # read as format 1 wrote it, nothing changed
        assert [(ck.step, ck.milestone, ck.pinned) for ck in store.checkpoints()] == \
            [(1, False, True), (2, True, False), (3, False, False)]
    assert tree_digest(path) == before
    with cas.open(path) as store:
        assert store.config.format == 2
        assert [(ck.step, ck.milestone, ck.pinned) for ck in store.checkpoints()] == \
            [(1, False, True), (2, True, False), (3, False, False)]
        for step in (1, 2, 3):
            state = store.load(step)
            expected = torch.randint(0, 16, (32, 1024), generator=torch.Generator().manual_seed(0)).float()
            expected[:step] += 0.5
            assert torch.equal(state["w"], expected) and state["step"] == step
        assert store.verify().ok
    drop_index_files(path)
    with cas.open(path) as store:  # now the log holds the flags
        assert [(ck.step, ck.milestone, ck.pinned) for ck in store.checkpoints()] == \
            [(1, False, True), (2, True, False), (3, False, False)]


@pytest.mark.parametrize("point", ["registry.logged", "commit.in_txn"])
def test_a_save_killed_between_its_log_entry_and_the_cache_update_is_committed(tmp_path, point):
    """Once the log entry exists the checkpoint is committed, whatever the cache says."""
    path = tmp_path / "s"
    build(path)
    child = spawn("save", path, 8, "8+18", faults=f"{point}=kill")
    child.communicate(timeout=120)
    assert child.returncode == -9
    with open_store(path) as store:
        assert [f[0] for f in flags(store)] == [2, 3, 4, 8]
        assert_loads(store, 8, [8, 18])
        store.gc()
        assert_exactly_reachable(store)
        assert_loads(store, 8, [8, 18])


def test_a_flag_change_killed_after_its_log_entry_is_kept(tmp_path, point="registry.logged"):
    path = tmp_path / "s"
    expected = build(path)
    code = ("import cas; s = cas.open(%r, create=False); s.pin(2)" % str(path))
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CAS_FAULTS=f"{point}=kill"),
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    with open_store(path) as store:
        assert [(f[0], f[3]) for f in flags(store)] == [(2, True), (3, True), (4, False)]
        assert [f[1] for f in flags(store)] == [f[1] for f in expected]


@pytest.mark.parametrize("damage", ["registry row lost", "delta base overwritten", "delta record lost"])
def test_gc_over_a_damaged_index_deletes_nothing_a_checkpoint_needs(tmp_path, damage):
    """An index damaged where nothing at open notices (bytes of its file overwritten: an audit's
    random overwrites lost whole checkpoints to the next gc): a registry row gone made gc delete
    that checkpoint's objects; a delta's record gone, or naming another base, made it delete the
    real base. gc now checks the registry against the record log and that every live object
    has a record, and rebuilds the index from the store before it deletes anything."""
    from dataclasses import replace

    from cas.store.registry import step_key

    path = tmp_path / "s"
    states = {step: smooth(step) for step in range(4)}
    with cas.open(path, chunk_size=64 << 10) as store:
        for step, state in states.items():
            store.save(state, step=step)
        store.wait()
        delta = next(k for t in store.tensors(0) for k in t["chunks"] if store.objects.record(k).base)
        with store.index.write() as txn:
            if damage == "registry row lost":
                txn.delete(step_key(1), db=store.registry.db)
            elif damage == "delta base overwritten":
                store.index.put_record(txn, delta, replace(store.objects.record(delta), base=os.urandom(32)))
            else:
                txn.delete(delta, db=store.index.tables["objects"])
        store.gc()
        assert [ck.step for ck in store.checkpoints()] == [0, 1, 2, 3]
        for step, state in states.items():
            assert torch.equal(store.load(step)["w"], state["w"])
        assert store.verify().ok
    drop_index_files(path)
    with cas.open(path) as store:
        for step, state in states.items():
            assert torch.equal(store.load(step)["w"], state["w"])
        assert store.verify().ok


def test_gc_over_a_store_that_lost_an_object_does_not_rebuild_its_index_each_time(tmp_path):
    """An object lost with its file (no index damage): after the index was rebuilt it has no
    record, as index damage would leave. gc moved the index aside and rebuilt it at every run,
    leaving one more copy of it in the store each time; it now looks for the object in the
    store first, reports it missing, and rebuilds only where the store does hold it."""
    from cas.errors import MissingObjectError

    path = tmp_path / "s"
    states = {step: smooth(step) for step in range(4)}
    with cas.open(path, chunk_size=64 << 10, delta=False, pack_max=0) as store:
        for step, state in states.items():
            store.save(state, step=step)
        later = {k for step in (1, 2, 3) for t in store.tensors(step) for k in t["chunks"]}
        lost, kept = [k for t in store.tensors(0) for k in t["chunks"] if k not in later][:2]
        assert store.objects.files.has(lost) and store.objects.files.has(kept)
        store.objects.files.delete(lost)
    drop_index_files(path)

    def aside() -> list[str]:
        return [name for name in os.listdir(path) if ".damaged-" in name]

    with cas.open(path) as store:
        for _ in range(2):
            report = store.gc()
            assert report.objects_missing == 1 and not aside()
        for step in (1, 2, 3):
            assert torch.equal(store.load(step)["w"], states[step]["w"])
        with pytest.raises(MissingObjectError, match=lost.hex()):
            store.load(0)
        with store.index.write() as txn:  # index damage beside it: a record lost, its file there
            txn.delete(kept, db=store.index.tables["objects"])
        report = store.gc()
        assert len(aside()) == 1 and report.objects_missing == 1
        assert store.objects.record(kept) is not None
    assert "1 objects the checkpoints need are missing" in cli("gc", "--keep-all", path=path).stdout


def build_packed(path) -> list[tuple]:
    """Steps 1-3 in packs (the default pack_max), step 2 a milestone; the flags as held."""
    with cas.open(path, chunk_size=64 << 10) as store:
        for step in (1, 2, 3):
            store.save(state_of([step, step + 10, 99]), step=step)
        store.set_milestone(2)
        return flags(store)


LEAF, OVERFLOW, PAGE = 0x02, 0x04, 4096  # LMDB page flags, and its page size here


def kill_a_reader(path) -> None:
    """Point the first node of an index leaf page past the end of the file, trying the pages
    from the last until a `cas verify` dies of the signal (LMDB reads the node through its map)."""
    data = path / "index" / "data.mdb"
    pages = data.read_bytes()
    for page in reversed(range(2, len(pages) // PAGE)):
        flag, lower = struct.unpack_from("<HH", pages, page * PAGE + 10)
        if flag != LEAF or lower <= 16:
            continue
        with open(data, "r+b") as f:
            f.write(pages)
            f.seek(page * PAGE + 16)
            f.write(struct.pack("<H", 0xFFF8))  # the node's offset in its page
        if cli("verify", path=path).returncode < 0:
            return
    raise AssertionError("no leaf page whose damage kills a reader")


def page_of_wrong_type(path) -> None:
    """Mark every page holding an object's record as an overflow page: LMDB raises
    MDB_CORRUPTED ("Located page was wrong type") when it reaches one, reading or writing."""
    with cas.open(path) as store, store.index.read() as txn:
        keys = [key for key, _ in store.index.iter_records(txn)]
    key = keys[len(keys) // 2]
    data = path / "index" / "data.mdb"
    pages = data.read_bytes()
    found = [at for at in range(len(pages)) if pages.startswith(key, at) and struct.unpack_from("<H", pages, at - 2)[0] == 32]
    assert found
    with open(data, "r+b") as f:
        for at in found:  # the key of a node (its size field before it): the live page and its old copies
            f.seek(at // PAGE * PAGE + 10)
            f.write(struct.pack("<H", OVERFLOW))


@pytest.mark.parametrize("damage", [kill_a_reader, page_of_wrong_type], ids=["kills a reader", "page of wrong type"])
def test_repair_moves_aside_an_index_it_cannot_read_through_and_builds_a_new_one(tmp_path, damage):
    """`cas repair`, the way out that every error about a damaged index names, rebuilt the
    index in place: damage that made LMDB read past the end of its file killed repair too
    (SIGBUS), and a page of the wrong type failed its write ("writing to the index ... failed;
    `cas repair` rebuilds it"). Repair now reads the index through in a child process first,
    moves one it cannot read aside and builds a new one from the store."""
    path = tmp_path / "s"
    expected = build_packed(path)
    damage(path)
    done = cli("repair", path=path)
    assert done.returncode == 0 and "the damaged index was moved to" in done.stdout, done.stdout + done.stderr[-2000:]
    assert [name for name in os.listdir(path) if name.startswith("index.damaged-")]
    assert cli("verify", path=path).returncode == 0
    with cas.open(path) as store:
        assert flags(store) == expected
        assert_loads(store, 3, [3, 13, 99])


@pytest.mark.parametrize("first", ["load", "quick verify"])
@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "read-only"])
def test_a_load_that_finds_the_index_lost_records_rebuilds_it_from_the_store(tmp_path, readonly, first):
    """An index whose object records were lost (bytes of its file overwritten) still names the
    store's newest log entry, so it passed for current, and every load of a committed
    checkpoint raised MissingObjectError ("object file is missing") although its packs were
    whole. A load (or a verify) that finds an object the index does not know, but the store holds, now moves
    the shared index aside and rebuilds it (once per open; a read-only open builds a private
    cache and changes nothing), then reads on."""
    path = tmp_path / "s"
    expected = build_packed(path)
    with cas.open(path) as store, store.index.write() as txn:
        store.index.mark_damaged(txn, b"d" * 32, "found so by a load", "test")  # an object saves must not reuse
        txn.drop(store.index.db("objects"), delete=False)
    before = tree_digest(path)
    with cas.open(path, readonly=readonly) as store:
        with pytest.warns(UserWarning, match="had no record of object"):
            if first == "load":
                assert_loads(store, 3, [3, 13, 99])
            else:
                assert store.verify(quick=True).ok
        assert_loads(store, 1, [1, 11, 99])
        assert flags(store) == expected and store.verify().ok
        assert (store.cache_report.moved_aside is None) == readonly
    if readonly:
        assert tree_digest(path) == before
    else:
        with cas.open(path) as store, store.index.read() as txn:  # the new index is the shared one
            assert store.cache_report.reason is None and store.index.damaged(txn, b"d" * 32)


def test_indexes_moved_aside_in_the_same_second_get_two_names(tmp_path):
    """Two damaged indexes moved aside by one process in one second: the second rename hit the
    first's name (an OSError out of gc, "Directory not empty")."""
    from cas.store.cache import move_aside

    folder = tmp_path / "index"
    names = []
    for _ in range(2):
        folder.mkdir()
        (folder / "data.mdb").write_bytes(b"x")
        names.append(move_aside(str(folder)))
    assert len(set(names)) == 2 and all(os.path.isdir(n) for n in names) and not folder.exists()


def test_a_rebuild_killed_half_way_leaves_a_store_that_rebuilds_again(tmp_path):
    path = tmp_path / "s"
    expected = build(path)
    drop_index_files(path)
    child = spawn("open_only", path, faults="cache.rebuilding=kill")
    child.communicate(timeout=120)
    assert child.returncode == -9
    with cas.open(path, retention=cas.Retention(keep_last=1)) as store:  # retention must see everything
        assert flags(store) == expected
        store.save(state_of([9]), step=9)
        assert [f[0] for f in flags(store)] == [3, 9]  # 3 is pinned; 9 the newest
        assert_loads(store, 3, [3, 13, 99])


def test_a_killed_repair_loses_nothing(tmp_path):
    """Issue 21, item 7: a repair killed at any point, then a restart with retention."""
    path = tmp_path / "s"
    expected = build(path)
    for point in ("cache.rebuilding", "registry.logged"):
        child = spawn("repair", path, faults=f"{point}=kill")
        child.communicate(timeout=120)
        with cas.open(path, retention=cas.Retention(keep_last=3)) as store:
            assert flags(store) == expected
            assert_loads(store, 2, [2, 12, 99])


def test_two_processes_rebuilding_at_once_agree(tmp_path):
    path = tmp_path / "s"
    expected = build(path)
    drop_index_files(path)
    procs = [spawn("open_only", path) for _ in range(3)]
    outs = [finish(p).strip() for p in procs]
    assert outs == ["2,3,4"] * 3
    with open_store(path) as store:
        assert flags(store) == expected
        assert store.cache_report.reason is None
        assert store.verify().ok


def damage(entry, *positions_and_masks) -> bytes:
    """XOR the masks into the log entry file at the positions; returns its bytes as written."""
    data = entry.read_bytes()
    damaged = bytearray(data)
    for at, mask in positions_and_masks:
        damaged[at] ^= mask
    os.chmod(entry, 0o644)
    entry.write_bytes(bytes(damaged))
    return data


def damage_beyond_mending(entry) -> None:
    """Two bytes changed: no digest the store holds can prove the original (one bit or byte can)."""
    damage(entry, (-3, 0xFF), (-40, 0x0F))


@pytest.mark.parametrize("where", ["the newest entry, index kept", "the newest entry, index lost",
                                   "an older entry, index lost", "an older entry that still parses",
                                   "the next entry's prev"])
def test_a_log_entry_with_one_damaged_bit_or_byte_is_read_as_written_and_repair_writes_it_back(tmp_path, where):
    """One flipped bit in the newest record-log entry made every open refuse the store (the
    index's head digest no longer matched, and the rebuild refused the entry), and one in any
    entry did once the index was lost. The digests the store holds of each entry (the next
    entry's `prev`, the index's head, the digest the entry ends with) prove the original bytes,
    one bit or byte away."""
    import socket

    from cas.hashing import hash_bytes

    path = tmp_path / "s"
    expected = build(path)
    log = path / "log"
    names = sorted(os.listdir(log))
    newest, older, after_older = log / names[-1], log / names[2], log / names[3]
    if where.startswith("the newest entry"):  # proven by the index's head, or by its own digest
        entry, written = newest, damage(newest, (60, 0x04))
    elif where == "an older entry, index lost":
        entry, written = older, damage(older, (100, 0x5A))
    elif where == "an older entry that still parses":
        at = older.read_bytes().index(socket.gethostname().encode())
        entry, written = older, damage(older, (at, 0x01))  # another host name: it parses, its digest is other
    else:
        at = after_older.read_bytes().index(hash_bytes(older.read_bytes())) + 7
        entry, written = after_older, damage(after_older, (at, 0x80))
    if where != "the newest entry, index kept":
        drop_index_files(path)
    with open_store(path) as store:
        assert flags(store) == expected
        for step, *_ in expected:
            assert_loads(store, step, [step, step + 10, 99])
        report = store.verify()
        assert [p.message for p in report.problems if "record log entry" in p.message] == [
            f"record log entry log/{entry.name} is damaged (one bit or byte); it is read as written, which the digest "
            "the store holds of it proves; `cas repair` writes it back"]
    result = cli("verify", path=path)
    assert result.returncode == 1 and "cas repair` writes it back" in result.stdout, result.stdout + result.stderr
    result = cli("repair", path=path)
    assert result.returncode == 0 and f"record log entry {int(entry.name, 16)} had one damaged" in result.stdout
    assert entry.read_bytes() == written
    assert [n for n in os.listdir(path / "quarantine") if n.startswith(f"log-{entry.name}-")]
    drop_index_files(path)
    with open_store(path) as store:
        assert flags(store) == expected and store.verify().ok
        store.gc()
        assert flags(store) == expected


def test_a_damaged_log_entry_is_named_and_nothing_is_changed(tmp_path):
    path = tmp_path / "s"
    build(path)
    entry = path / "log" / f"{3:016x}"
    damage_beyond_mending(entry)
    drop_index_files(path)
    with pytest.raises(CorruptionError, match="log"):
        open_store(path)
    result = cli("pin", "3", path=path)
    assert result.returncode == 2 and "log" in result.stderr and "Traceback" not in result.stderr


def test_a_config_with_one_damaged_bit_or_byte_is_read_as_written_and_repair_writes_it_back(tmp_path):
    """Any damaged byte of the config (about 120 bytes) made every open refuse the store:
    `cas ls` said it was not a store, or a flipped format asked to upgrade cas. A config now
    ends with the blake3 of its other bytes, which proves the original one bit or byte away."""
    import msgpack

    path = tmp_path / "s"
    expected = build(path)
    config = path / "config"
    written = config.read_bytes()
    fields = msgpack.unpackb(written[len(b"cas-store\n"):])
    assert list(fields)[-1] == "digest"
    format_at = written.index(b"\xa6format") + 7
    for at, mask in [(0, 0x20), (format_at, 0x04), (len(written) // 2, 0xFF), (len(written) - 40, 0x01),
                     (len(written) - 1, 0x80)]:
        os.chmod(config, 0o644)
        config.write_bytes(bytes(b ^ mask if i == at else b for i, b in enumerate(written)))
        drop_index_files(path)
        with open_store(path) as store:
            assert flags(store) == expected
            assert_loads(store, 4, [4, 14, 99])
            assert [p.message for p in store.verify().problems] == [
                "the store's config is damaged (one bit or byte); it is read as written, which the digest it ends with "
                "proves; `cas repair` writes it back"], at
        result = cli("repair", path=path)
        assert result.returncode == 0 and "the config had one damaged bit or byte" in result.stdout, result.stdout
        assert config.read_bytes() == written
        assert cli("verify", path=path).returncode == 0
    os.chmod(config, 0o644)
    config.write_bytes(bytes(b ^ 0xFF if i in (20, 30) else b for i, b in enumerate(written)))
    with pytest.raises(cas.NotAStoreError, match="config"):
        open_store(path)


@pytest.mark.parametrize("seq", [6, 2])  # the pin of step 3; the save of step 2 (its milestone, entry 5, then fails)
def test_a_read_only_open_reads_around_a_log_entry_damaged_beyond_mending(tmp_path, seq):
    """One damaged entry locked every checkpoint once the index was lost. A writable open still
    refuses (gc on a registry folded around it could sweep what that entry added or pinned),
    and says how to get the rest out; a read-only open folds around it into its private cache,
    warns, and every checkpoint the rest of the log proves loads and can be pushed out."""
    path = tmp_path / "s"
    expected = build(path)  # entries: saves 1-4, milestone 2, pin 3, milestone 4 set and unset, delete 1
    name = f"log/{seq:016x}"
    damage_beyond_mending(path / name)
    if seq == 6:
        expected = [(step, id_, milestone, False) for step, id_, milestone, _ in expected]
    else:
        expected = [row for row in expected if row[0] != 2]
    drop_index_files(path)
    with pytest.raises(CorruptionError, match=f"{name}.*readonly=True"):
        open_store(path)  # (it made an empty index, a cache, before it read the log)
    before = tree_digest(path)
    with pytest.warns(UserWarning) as caught:
        store = cas.open(path, readonly=True)
    assert re.search(f"{name}.*folded the record log around it", str(caught[0].message))
    with store:
        assert flags(store) == expected
        for step, *_ in expected:
            assert_loads(store, step, [step, step + 10, 99])
        assert any("entry 5" in line and "does not apply" in line for line in store.cache_report.salvaged) == (seq == 2)
    assert tree_digest(path) == before
    result = cli("ls", path=path)
    assert result.returncode == 0 and result.stderr.startswith(f"cas: record log entry {name}"), result.stderr
    assert "Traceback" not in result.stderr and "UserWarning" not in result.stderr
    result = cli("push", str(tmp_path / "rescued"), path=path)
    assert result.returncode == 0, result.stdout + result.stderr
    with open_store(tmp_path / "rescued") as rescued:
        assert [ck.step for ck in rescued.checkpoints()] == [row[0] for row in expected]
        assert_loads(rescued, 3, [3, 13, 99])
    assert tree_digest(path) == before


def test_verify_reads_the_whole_record_log_and_checks_the_index_against_it(tmp_path):
    """`cas verify` said ok while a record log entry was damaged (only `cas log` and a rebuild
    saw it), and while the index served a checkpoint record or a commit order other than the
    log's (a row put back from an older copy of the index: a deleted checkpoint's contents, a
    pin undone, an older step as the newest)."""
    from dataclasses import replace

    from cas.store.registry import step_key

    path = tmp_path / "s"
    build(path)
    with open_store(path) as store:
        assert store.verify().ok
        with store.index.write() as txn:
            txn.put(step_key(3), store.registry._dump(replace(store.registry.get(txn, 3), pinned=False)),
                    db=store.registry.db)
        report = store.verify()
        assert report.damaged_steps == [3] and "pinned" in str(report.problems[0])
    drop_index_files(path)
    with open_store(path) as store:
        assert store.verify().ok
        with store.index.write() as txn:
            cursor = txn.cursor(db=store.registry.order)
            cursor.last()
            cursor.delete()
        assert store.latest().step == 3 and not store.verify().ok
    assert cli("verify", path=path).returncode == 0  # a new open finds the rows unproven and rebuilds them
    drop_index_files(path)
    open_store(path).close()  # rebuilt: current, and no open reads old entries again
    damage_beyond_mending(path / "log" / f"{2:016x}")
    result = cli("verify", path=path)
    assert result.returncode == 1 and "record log is damaged" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("key", [None, "k"])
def test_an_index_whose_checkpoint_records_are_not_its_folds_is_rebuilt_at_open(tmp_path, key):
    """An open proved the head the index folded to, not the rows: a checkpoint record put back
    from an older copy of the index (another checkpoint at that step, a pin undone: gc then
    removed the pinned step), a commit-order row edited (an older step served as the newest),
    or a flipped bit in a sealed record (every read of it failed) passed. The index keeps a
    check of its rows bound to its head; an open that finds them other rebuilds them."""
    import lmdb

    from cas.store.registry import step_key

    path = tmp_path / "s"
    with cas.open(path, key=key) as store:
        store.save(state_of([1]), step=1)
        store.pin(1)
        with store.index.read() as txn:
            pinned_row = bytes(txn.get(step_key(1), db=store.registry.db))
        store.unpin(1)
        store.save(state_of([2]), step=2)
        store.pin(2)
        expected = flags(store)
    for damage in ("an older row", "an order row gone", "a flipped bit"):
        env = lmdb.open(str(path / "index"), max_dbs=64)  # (closed before cas opens it: one per process)
        with env.begin(write=True) as txn:
            rows, order = env.open_db(b"checkpoints", txn=txn), env.open_db(b"order", txn=txn)
            if damage == "an older row":  # step 1 pinned again, step 2 not
                txn.put(step_key(1), pinned_row, db=rows)
            elif damage == "an order row gone":  # step 1 the newest
                cursor = txn.cursor(db=order)
                cursor.last()
                cursor.delete()
            else:
                row = bytearray(txn.get(step_key(2), db=rows))
                row[len(row) // 2] ^= 0x40
                txn.put(step_key(2), bytes(row), db=rows)
        env.close()
        with cas.open(path, key=key) as store:
            assert "not those it folded" in store.cache_report.reason, damage
            assert flags(store) == expected and store.latest().step == 2
            assert store.verify().ok


def test_a_log_entry_renamed_into_a_gap_is_refused(tmp_path):
    path = tmp_path / "s"
    build(path)
    last = max(os.listdir(path / "log"))
    os.rename(path / "log" / last, path / "log" / f"{int(last, 16) + 1:016x}")
    drop_index_files(path)
    with pytest.raises(CorruptionError, match="missing|renamed"):
        open_store(path)


def test_the_same_step_committed_through_two_caches_commits_once(tmp_path):
    """A process whose index was replaced under it (two caches of one store): the record log
    decides, and the loser gets CheckpointExistsError with nothing of it visible."""
    path = tmp_path / "s"
    build(path)
    flag = str(tmp_path / "flag")
    child = spawn("save", path, 20, "20+21", faults=f"save.nodes_written=pause:{flag}")
    wait_reached(flag, child)
    shutil.rmtree(path / "index")  # the child keeps its (now unlinked) environment
    with open_store(path) as store:
        store.save(state_of([30]), step=20)
    open(flag, "w").close()
    out, err = child.communicate(timeout=120)
    assert child.returncode != 0 and ("CheckpointExistsError" in err or "deleted or replaced" in err), err
    with open_store(path) as store:
        assert_loads(store, 20, [30])
        store.gc()
        assert_exactly_reachable(store)
        assert_loads(store, 20, [30])


def test_gc_waits_for_a_live_writer_it_cannot_account_for(tmp_path):
    """The index is deleted while a save that reuses old objects runs: a gc through the
    rebuilt index does not know its holds, so it must not sweep until that writer ends."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([1, 2]), step=1)
        store.save(state_of([3]), step=2)
        store.delete(1)  # step 1's objects are garbage ... until the paused save reuses them
    flag = str(tmp_path / "flag")
    child = spawn("save", path, 3, "1+2", faults=f"save.chunks_written=pause:{flag}")
    wait_reached(flag, child)
    drop_index_files(path)
    with open_store(path) as store:
        report = store.gc()
        assert report.deferred and "another index" in report.deferred
        assert report.objects_swept == 0
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [2, 3]
        assert_loads(store, 3, [1, 2])
        store.gc()
        assert_exactly_reachable(store)
        assert_loads(store, 3, [1, 2])


def unshare_available() -> bool:
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare")
def test_gc_in_another_pid_namespace_never_reaps_a_live_writer(tmp_path):
    """Issue 21, item 5: a gc sidecar with its own PID namespace sees no process with the
    writer's pid; the writer's lease and temporary files must survive it all the same."""
    if not unshare_available():
        pytest.skip("cannot make a PID namespace here")
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([1, 2]), step=1)
        store.save(state_of([3]), step=2)
        store.delete(1)
    flag = str(tmp_path / "flag")
    child = spawn("save", path, 3, "1+2+4", faults=f"save.chunks_written=pause:{flag}")
    wait_reached(flag, child)
    tmp_before = set(os.listdir(path / "tmp"))
    sidecar = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, WORKERS, "gc", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert sidecar.returncode == 0, sidecar.stderr
    assert tmp_before <= set(os.listdir(path / "tmp"))  # its staged files are still there
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert_loads(store, 3, [1, 2, 4])
        with store.index.read() as txn:
            assert store.index.leases(txn) == {}


def test_a_killed_coordinators_barrier_is_reaped_and_gc_says_what_it_deferred(tmp_path):
    """Issue 21, item 11: a live barrier defers the sweep and says so; a dead one is reaped."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([1]), step=1)
        store.save(state_of([2]), step=2)
        store.delete(1)
    holder = subprocess.Popen([sys.executable, WORKERS, "hold_lease", str(path), "barrier:dcp step 9"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = cli("gc", "--keep-all", path=path)
        assert result.returncode == 0 and "deferred" in result.stdout, result.stdout
    finally:
        holder.kill()
        holder.wait()
    with open_store(path) as store:
        report = store.gc()
        assert report.leases_reaped == 1 and report.deferred is None and report.objects_swept > 0
        assert_exactly_reachable(store)


def test_rollback_under_retention_keeps_the_new_line(tmp_path):
    """Issue 21, item 3: steps 100-400 with keep_last=3; restore step 200 and save 210, 220, 230.
    "Last" is commit order, so each save keeps itself and the new line grows; save() never
    returns a checkpoint that its own retention removed."""
    with cas.open(tmp_path / "s", chunk_size=64 << 10, retention=cas.Retention(keep_last=3)) as store:
        for step in (100, 200, 300, 400):
            store.save(state_of([step]), step=step)
        assert [ck.step for ck in store.checkpoints()] == [200, 300, 400]
        store.load(200)  # the rollback
        for step in (210, 220, 230):
            ck = store.save(state_of([step]), step=step)
            assert store.exists(ck.step) and store.latest().step == step
        assert [ck.step for ck in store.checkpoints()] == [210, 220, 230]
        assert_loads(store, 230, [230])
        assert_exactly_reachable(store)


def test_lightning_last_is_the_most_recent_save_whatever_the_clocks(tmp_path, monkeypatch):
    """Issue 21, item 10: two plugin instances whose clocks differ by 60 s both save last.ckpt;
    loading it returns the later save, not the one with the later wall-clock time."""
    pytest.importorskip("lightning")
    import time as _time

    from cas.store import lightning as lt
    from cas.store import store as store_module
    path = str(tmp_path / "s")
    first = lt.CasCheckpointIO(path)
    first.save_checkpoint({"w": torch.ones(3), "global_step": 1}, tmp_path / "ckpts" / "last.ckpt")
    first.teardown()
    real = _time.time
    monkeypatch.setattr(store_module.time, "time", lambda: real() - 60)  # this host's clock is behind
    second = lt.CasCheckpointIO(path)
    second.save_checkpoint({"w": torch.full((3,), 2.0), "global_step": 2}, tmp_path / "ckpts" / "last.ckpt")
    loaded = second.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    second.teardown()
    assert torch.equal(loaded["w"], torch.full((3,), 2.0))


def test_a_process_whose_index_was_deleted_under_it_goes_on_saving(tmp_path):
    """Its environment's files are gone; another process made a new index and committed. The
    next save here opens the index at the path again (its changes would otherwise reach nobody,
    and every commit race with the others), and every process sees every checkpoint."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([1]), step=1)
        drop_index_files(path)
        finish(spawn("save", path, 2, "2+20"))
        store.save(state_of([3]), step=3)
        assert [ck.step for ck in store.checkpoints()] == [1, 2, 3]
        finish(spawn("save", path, 4, "4+40"))
        assert store.exists(4)  # this process shares the index at the path again
        store.save(state_of([5]), step=5)
        assert [ck.step for ck in store.checkpoints()] == [1, 2, 3, 4, 5]
        assert_loads(store, 2, [2, 20])
        assert_loads(store, 4, [4, 40])
    assert finish(spawn("open_only", path)).strip() == "1,2,3,4,5"


SAVE_PHASES = ["save.planned", "save.chunks_written", "save.nodes_written", "commit.synced"]
GC_PHASES = ["gc.forgotten", "gc.marked", "gc.sweep_batch"]


def lose_cache(path, loss: str, old_copy) -> None:
    """Delete the index files, or put an older copy of the index in their place, while another
    process has them open. (Truncating a file another process has mapped kills it with SIGBUS:
    a truncated cache is tested at rest, above.)"""
    if loss == "deleted":
        drop_index_files(path)
    else:
        shutil.rmtree(path / "index")
        shutil.copytree(old_copy, path / "index")


@pytest.mark.parametrize("loss", ["deleted", "older copy"])
@pytest.mark.parametrize("point", SAVE_PHASES)
def test_the_cache_lost_at_any_phase_of_a_save_loses_nothing(tmp_path, point, loss):
    path, old, flag = tmp_path / "s", tmp_path / "old", str(tmp_path / "flag")
    expected = build(path)
    shutil.copytree(path / "index", old)
    with open_store(path) as store:
        store.save(state_of([7]), step=7)  # the older copy lacks this one
    child = spawn("save", path, 8, "8+18+99", faults=f"{point}=pause:{flag}")
    wait_reached(flag, child)
    lose_cache(path, loss, old)
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert flags(store)[:3] == expected and [f[0] for f in flags(store)][3:] == [7, 8]
        for step in (2, 3, 4):
            assert_loads(store, step, [step, step + 10, 99])
        assert_loads(store, 7, [7])
        assert_loads(store, 8, [8, 18, 99])
        store.gc()
        assert_exactly_reachable(store)
        assert_loads(store, 8, [8, 18, 99])


@pytest.mark.parametrize("loss", ["deleted", "older copy"])
@pytest.mark.parametrize("point", GC_PHASES)
def test_the_cache_lost_at_any_phase_of_a_gc_loses_nothing(tmp_path, point, loss):
    path, old, flag = tmp_path / "s", tmp_path / "old", str(tmp_path / "flag")
    build(path)
    shutil.copytree(path / "index", old)
    child = spawn("gc", path, 2, faults=f"{point}=pause:{flag}")  # keep_last 2: removes step 2
    wait_reached(flag, child)
    lose_cache(path, loss, old)
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert [(f[0], f[3]) for f in flags(store)] == [(3, True), (4, False)]
        for step in (3, 4):
            assert_loads(store, step, [step, step + 10, 99])
        store.gc()
        assert_exactly_reachable(store)
        assert store.verify().ok


def _delete_the_index_once_paused(path, gate) -> None:
    """Wait until a `pause:` fault point at `gate` is reached, then delete the store's index files
    under the paused process."""
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{gate}.reached"):
        assert time.monotonic() < deadline, "the fault point was never reached"
        time.sleep(0.02)
    for name in ("data.mdb", "lock.mdb"):
        os.unlink(path / "index" / name)


def test_a_recode_over_an_index_deleted_under_it_commits_nothing_and_loses_nothing(tmp_path):
    """Found by the soak with index deletions: a recode (reverse deltas) whose index files were
    deleted while it ran committed its moves into the orphaned index and removed the whole
    copies' files; the index at the path, rebuilt from the store, never learned of the
    recode's new pack, and the compaction after the next save deleted it as a pack no record
    points to: committed checkpoints lost their chunks. A commit on an orphaned index is now
    refused, and nothing is deleted on its records."""
    from cas import faults

    path, gate = tmp_path / "s", tmp_path / "gate"
    opts = dict(chunk_size=64 << 10, pack_max=16 << 10)  # chunks as object files, as in the soak
    w1 = torch.randn(64, 1024)
    w2 = w1 + 1e-4 * torch.randn_like(w1)
    w3 = w2 + 1e-4 * torch.randn_like(w1)
    faults.configure(f"recode.encoded=pause:{gate}@1")
    try:
        store = cas.open(path, delta=True, **opts)
        store.save({"w": w1}, step=1)
        store.save({"w": w2}, step=2)  # the recode of step 1 against it waits at the gate
        _delete_the_index_once_paused(path, gate)
        with cas.open(path, delta=True, **opts) as other:  # a new index at the path, rebuilt from the store
            other.save({"w": w3}, step=3)
        gate.touch()
        store.wait_recoding()
        store.close()
    finally:
        faults.configure("")
    with cas.open(path, delta=True, **opts) as other:
        other.gc()  # compacts what no record points to
        for step, w in ((1, w1), (2, w2), (3, w3)):
            assert torch.equal(other.load(step)["w"], w)
        assert other.verify().ok


def test_a_writer_whose_index_lock_file_is_replaced_reopens_the_index_before_it_commits(tmp_path):
    """The soak deletes index/data.mdb, then index/lock.mdb, under running writers. A process
    that opened the index between the two shares the new data file with every process that
    opens it after, but took LMDB's writer lock in the deleted lock file: its commits and
    theirs run at once, and one overwrites the other (stop 40: a committed save lost its
    records, then a compaction its pack); here LMDB aborted the process. A lock file replaced
    under a writer now counts as an index replaced: its commits are refused and it opens the
    index at the path again (LMDB will not open the same data file twice in a process, so that
    open moves the index aside and builds another from the store, which every other process
    then opens in turn), never writing beside the others under another lock."""
    import threading

    from cas import faults

    path, gate, ready, go = tmp_path / "s", tmp_path / "gate", tmp_path / "ready", tmp_path / "go"
    store = cas.open(path, chunk_size=64 << 10)
    store.save({"w": torch.randn(64, 256)}, step=1)
    os.unlink(path / "index" / "data.mdb")
    between = subprocess.Popen([sys.executable, "-c", (  # opens the index between the two deletions
        "import os, sys, time, torch, cas\n"
        "s = cas.open(sys.argv[1], chunk_size=64 << 10)\n"
        "open(sys.argv[2], 'w').close()\n"
        "while not os.path.exists(sys.argv[3]): time.sleep(0.02)\n"
        "s.save({'w': torch.randn(64, 256)}, step=3)\n"
        "s.close()\n"), str(path), str(ready), str(go)], stderr=subprocess.PIPE, text=True)
    outcome: list = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and between.poll() is None, between.stderr.read() if between.poll() else ""
            time.sleep(0.02)
        os.unlink(path / "index" / "lock.mdb")
        faults.configure(f"commit.in_txn=pause:{gate}@1")  # this process's next commit waits inside its transaction

        def save() -> None:
            try:
                outcome.append(store.save({"w": torch.randn(64, 256)}, step=2))
            except Exception as exc:  # noqa: BLE001 - the finding
                outcome.append(exc)
        saving = threading.Thread(target=save)
        saving.start()
        while not os.path.exists(f"{gate}.reached"):
            assert time.monotonic() < deadline and saving.is_alive()
            time.sleep(0.02)
        go.touch()  # the other commit, while this one is inside its transaction
        with contextlib.suppress(subprocess.TimeoutExpired):
            between.wait(timeout=8)  # (it waits for this one's writer lock now: it ends after the gate)
        gate.touch()
        saving.join(timeout=120)
        assert between.wait(timeout=120) == 0, between.stderr.read()
    finally:
        faults.configure("")
        if between.poll() is None:
            between.kill()
    assert not isinstance(outcome[0], Exception), outcome[0]
    store.close()
    with cas.open(path, chunk_size=64 << 10) as fresh:
        from test_gc import reachable
        need = reachable(fresh, [1, 2, 3])
        with fresh.index.read() as txn:
            unrecorded = [k.hex()[:16] for k in need if fresh.index.record(txn, k) is None]
        assert not unrecorded and [ck.step for ck in fresh.checkpoints()] == [1, 2, 3], unrecorded
        assert fresh.verify().ok


def test_an_open_store_sees_a_commit_whose_writer_died_before_its_index_transaction(tmp_path):
    """A writer killed between its record log entry (the commit) and its index transaction
    leaves the shared index a commit behind. A store opened before that saw only the index:
    exists() said False for a step that save() then refused as committed (the soak of stop 40,
    a writer resuming after its predecessor's kill). Reads of the registry now fold the log
    first when it is ahead (one stat)."""
    path = tmp_path / "s"
    store = cas.open(path)
    store.save({"w": torch.zeros(10)}, step=1)
    env = dict(os.environ, CAS_FAULTS="registry.logged=kill")
    killed = subprocess.run([sys.executable, "-c", (
        "import sys, torch, cas\n"
        "cas.open(sys.argv[1]).save({'w': torch.ones(10)}, step=2)\n"), str(path)],
        env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    try:
        assert store.exists(2)
        assert [ck.step for ck in store.checkpoints()] == [1, 2]
        assert torch.equal(store.load(2)["w"], torch.ones(10))
    finally:
        store.close()


@pytest.mark.parametrize("compaction", ["after_recode", "reclaim"])
def test_compaction_after_a_save_never_drops_a_pack_whose_records_the_index_lost(tmp_path, compaction):
    """Found by the 600 s soak (stop 40: a committed checkpoint lost its manifest node): the
    index lost the records of a committed save's pack (an LMDB commit lost when two processes
    wrote one index through different lock files, after its lock file was deleted under them),
    and a writer's compaction after its recode, which went by the records alone with no mark,
    removed that pack as one "no record points to". Compaction outside a sweep now marks
    first: a pack with an entry some checkpoint needs and no record names elsewhere stays."""
    from cas.gc import GcReport
    from cas.gc.collect import compact_packs
    from cas.index import WHERE_PACK

    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        store.save({"w": torch.randn(64, 256), "n": 1}, step=1)
        store.save({"w": torch.randn(64, 256), "n": 2}, step=2)
        store.wait()
        step2 = reachable_keys(store, 2) - reachable_keys(store, 1)
        with store.index.write() as txn:  # the records of step 2's objects are lost
            records = dict(store.index.iter_records(txn))
            packs = {rec.pack for rec in records.values() if rec.where == WHERE_PACK}
            lost = {records[k].pack for k in step2 if records[k].where == WHERE_PACK}
            assert lost
            for key in step2:
                txn.delete(key, db=store.index.db("objects"))
        if compaction == "after_recode":
            store.after_recode(packs)
        else:
            compact_packs(store, GcReport())
        assert all(store.objects.packs.size(p) is not None for p in lost)
    with cas.open(path, chunk_size=64 << 10) as store:
        assert store.load(2)["n"] == 2 and store.verify().ok


def reachable_keys(store, step: int) -> set[bytes]:
    from test_gc import reachable

    return reachable(store, [step])


def test_a_gc_whose_index_is_replaced_while_it_marks_opens_it_again_and_marks_anew(tmp_path):
    """Found by the 600 s soak (stops 39 and 40): a gc marking from an index that another process
    replaced under it (deleted, then rebuilt from the store) read roots and node records that
    were no longer the store's: a checkpoint another gc had removed and swept meanwhile. Its
    node was gone, the orphaned index's generation never moved, so gc stopped with "a manifest
    node is unreadable ... run cas verify" on a sound store. It now opens the index at the path
    again and marks anew."""
    import threading

    from cas import faults

    path, gate = tmp_path / "s", tmp_path / "gate"
    store = cas.open(path)
    for step in (1, 2):
        store.save({"w": torch.full((1000,), float(step))}, step=step)
    faults.configure(f"gc.marking=pause:{gate}@1")  # the first node it marks: step 2's commit
    outcome: list = []

    def collect() -> None:
        try:
            outcome.append(store.gc())
        except Exception as exc:  # noqa: BLE001 - what the gc raised is the finding
            outcome.append(exc)
    marking = threading.Thread(target=collect)
    try:
        marking.start()
        _delete_the_index_once_paused(path, gate)
        with cas.open(path) as other:  # a new index at the path, rebuilt from the store
            other.delete([1])
            other.gc()  # step 1's nodes go
        gate.touch()
        marking.join(timeout=120)
    finally:
        faults.configure("")
    assert not isinstance(outcome[0], Exception), outcome[0]
    store.close()
    with cas.open(path) as other:
        assert [ck.step for ck in other.checkpoints()] == [2]
        assert torch.equal(other.load(2)["w"], torch.full((1000,), 2.0)) and other.verify().ok


def test_a_save_whose_index_is_deleted_under_it_opens_the_index_again_and_commits(tmp_path):
    """A save's commit into an index deleted while it ran is refused (its records would reach
    nobody); the save opens the index at the path again and saves once more, so the caller
    sees a committed checkpoint, which every open of the store finds."""
    from cas import faults

    path, gate = tmp_path / "s", tmp_path / "gate"
    store = cas.open(path)
    store.save({"w": torch.zeros(1000)}, step=1)
    faults.configure(f"save.chunks_written=pause:{gate}@1")
    try:
        future = store.save_async({"w": torch.ones(1000)}, step=2)
        _delete_the_index_once_paused(path, gate)
        with cas.open(path) as other:  # a new index at the path
            assert [ck.step for ck in other.checkpoints()] == [1]
        gate.touch()
        assert future.result(timeout=120).step == 2
    finally:
        faults.configure("")
        store.close()
    with cas.open(path) as other:
        assert [ck.step for ck in other.checkpoints()] == [1, 2]
        assert torch.equal(other.load(2)["w"], torch.ones(1000)) and other.verify().ok
