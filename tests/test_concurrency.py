"""Real processes sharing one store: concurrent writers, a reader during commits, a read-only store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from test_gc import assert_exactly_reachable
from helpers import outcome_of, wait_for
from workers import state_of

import cas
from cas import faults

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")


def spawn(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKERS, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def test_two_processes_save_different_steps_at_the_same_time(tmp_path):
    path = tmp_path / "s"
    cas.open(path, chunk_size=64 << 10).close()
    a, b = spawn("save_loop", path, 0, 12), spawn("save_loop", path, 100, 12)  # overlapping tensors
    finish(a), finish(b)
    with cas.open(path) as store:
        steps = [ck.step for ck in store.checkpoints()]
        assert steps == list(range(12)) + list(range(100, 112))
        for step in steps:
            loaded = store.load(step)
            for k, t in state_of([step % 5, step % 7 + 10, step]).items():
                assert torch.equal(loaded[k], t)
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


def test_a_reader_loads_whole_checkpoints_while_a_writer_commits(tmp_path):
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        store.save(state_of([0, 10, 0]), step=0)
    reader = spawn("load_loop", path, 6)
    writer = spawn("save_loop", path, 1, 40)
    finish(writer)
    loads = int(finish(reader))
    assert loads > 5


def test_a_read_only_open_racing_a_commit_reads_and_writes_nothing(tmp_path):
    """A read-only open found the shared index current, then a writer appended its log entry
    (its index transaction still open), and the open's second look tried to bring the index up
    to date itself: ReadOnlyStoreError (a pull from a store being saved to failed so too). Now it
    gives the commit a moment, then reads from a private cache: it sees both checkpoints."""
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        store.save({"t1": torch.ones(4)}, step=1)
    reader_gate, writer_gate = tmp_path / "reader", tmp_path / "writer"
    faults.configure(f"store.cache_opened=pause:{reader_gate}@1")
    opened: list = []
    reader = threading.Thread(target=lambda: opened.append(outcome_of(lambda: cas.open(path, readonly=True))))
    writer = None
    try:
        reader.start()
        wait_for(f"{reader_gate}.reached")
        writer = spawn("save", path, 2, "7+8", env=dict(os.environ, CAS_FAULTS=f"registry.logged=pause:{writer_gate}"))
        wait_for(f"{writer_gate}.reached")
        reader_gate.touch()
        reader.join(timeout=60)
    finally:
        reader_gate.touch()
        writer_gate.touch()
        faults.configure("")
        if writer is not None:
            finish(writer)
    store = opened[0]
    assert not isinstance(store, Exception), store
    with store:
        assert [ck.step for ck in store.checkpoints()] == [1, 2]
        loaded = store.load(2)
    assert loaded.keys() == {"t7", "t8"} and all(torch.equal(loaded[k], v) for k, v in state_of([7, 8]).items())




def test_a_store_on_a_read_only_filesystem_is_opened_read_only_for_loading(tmp_path):
    """The store's files cannot be written (a read-only bind mount: even root gets EROFS); a
    process opens it read-only, loads every checkpoint, and writes are refused by name."""
    path, view = tmp_path / "s", tmp_path / "ro"
    with cas.open(path, chunk_size=64 << 10) as store:
        store.save(state_of([1, 2]), step=1)
    view.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(view)], capture_output=True).returncode:
        pytest.skip("cannot make a read-only bind mount here (needs root)")
    try:
        if os.access(view, os.W_OK):
            subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True)
        if os.access(view, os.W_OK):
            pytest.skip("the bind mount did not become read-only")
        out = finish(spawn("load_all", view))
        assert out.split() == ["1", "True"]
        with cas.open(view) as store:
            with pytest.raises(cas.ReadOnlyStoreError):
                store.save(state_of([3]), step=2)
            with pytest.raises(cas.ReadOnlyStoreError):
                store.delete(1)
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)


def test_opening_a_store_while_another_thread_is_in_a_write_transaction(tmp_path):
    """Each Index opened its tables again, which starts an LMDB transaction that waits for the
    writer lock while holding the GIL: opening a store while another thread of the process
    was committing (a DCP async save) deadlocked. Table handles are shared per environment."""
    code = textwrap.dedent(f"""
        import faulthandler, threading, time, cas
        faulthandler.dump_traceback_later(30, exit=True)
        store = cas.open({str(tmp_path / 's')!r})
        inside = threading.Event()
        def writer():
            with store.index.write():
                inside.set()
                time.sleep(0.5)
        thread = threading.Thread(target=writer)
        thread.start()
        inside.wait()
        cas.open({str(tmp_path / 's')!r}, create=False).close()
        thread.join()
        print("opened")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "opened", out.stderr[-1500:]



def test_a_writable_open_after_a_read_only_one_in_the_same_process_shares_its_index(tmp_path):
    """LMDB allows one environment per path and process. A read-only open made it read-only, so
    a writable open later in the process found it "already open read-only", took the index for
    damaged, moved it aside and built another; the reader read on in the old one and never saw
    a later commit (a pull from a store this process also saves to lost objects that way)."""
    path = tmp_path / "s"
    with cas.open(path) as store:
        store.save({"a": torch.ones(8)}, step=1)
    with cas.open(path, readonly=True) as reader, cas.open(path) as writer:
        assert writer.cache_report.moved_aside is None and writer.cache_report.reason is None
        writer.save({"a": torch.zeros(8)}, step=2)
        assert [ck.step for ck in reader.checkpoints()] == [1, 2]
        assert torch.equal(reader.load(2)["a"], torch.zeros(8))
        with pytest.raises(cas.ReadOnlyStoreError):
            reader.delete(1)
    assert not [name for name in os.listdir(path) if ".damaged-" in name]


def _gc_moves_a_live_object(path):
    """Removing step 1 leaves its pack with a dead entry (b) beside a live one (a): gc moves a."""
    with cas.open(path) as writer:
        writer.delete(1)
        assert writer.gc().packs_rewritten == 1


def _recode_moves_step_1(path):
    """A save close to step 2 makes step 2's chunks deltas of it, in new packs (reverse deltas)."""
    with cas.open(path, pack_max=4096) as writer:
        writer.save(_series(1e-4), step=3)


def _series(noise: float) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=g)
    return {"x": x + noise * torch.randn(1 << 18, generator=g)}


@pytest.mark.parametrize("move", [_gc_moves_a_live_object, _recode_moves_step_1], ids=["gc", "recode"])
@pytest.mark.parametrize("pack_max", [None, 4096], ids=["packed", "files"])
def test_a_reader_with_a_private_cache_follows_objects_a_writer_moved(tmp_path, move, pack_max):
    """A read-only open that found no shared index reads from a private cache, built once at
    open. A writer elsewhere then moved objects of checkpoints it kept (gc rewrote a pack with a
    dead entry; a recode made chunks deltas of a newer save): the reader's records still named
    the old places, so loading a checkpoint nobody removed raised MissingObjectError ("pack ...
    is missing", "object file is missing"): the pull audit of stop 29. The reader now brings its
    cache up to date from the record log and reads the objects where they went; its list of
    checkpoints follows the writer's too."""
    path = tmp_path / "s"
    a, b, c = (torch.full((64,), float(v)) for v in (1, 2, 3))
    states = {1: {"a": a, "b": b}, 2: {"a": a, "c": c, **_series(0)}}
    with cas.open(path, delta=True, pack_max=pack_max) as store:
        for step, state in states.items():
            store.save(state, step=step)
        index_dir = store.location.index_dir(store.config)
    shutil.rmtree(index_dir)
    with cas.open(path, readonly=True) as reader:
        assert reader.cache_report.reason is not None  # no shared index: a private cache
        move(path)
        with cas.open(path) as writer:
            steps = [ck.step for ck in writer.checkpoints()]
        assert [ck.step for ck in reader.checkpoints()] == steps  # the writer's removal or new save seen
        loaded = reader.load(2)
        assert loaded.keys() == states[2].keys() and all(torch.equal(loaded[k], v) for k, v in states[2].items())
        assert reader.verify().ok


OPENER = """
import sys, time, cas
start = float(sys.argv[2])
while time.time() < start:
    pass
with cas.open(sys.argv[1]) as store:
    print(store.created)
"""


def test_processes_opening_a_new_path_at_once_create_one_store_and_all_open_it(tmp_path):
    """Every rank of a job opens the same new path: one creates the store, the others wait for
    it. One that looked while the creator's temporary config file was in the folder took the
    folder for someone else's and raised NotAStoreError (seen as a failed HF DDP run)."""
    import time

    for round_ in range(4):
        path = tmp_path / f"s{round_}"
        start = time.time() + 1.5
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(path), str(start)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(6)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in outs if err]
        assert sorted(out.strip() for out, _ in outs) == ["False"] * 5 + ["True"]


def test_a_save_replacing_one_checkpoint_refuses_another_that_took_its_step(tmp_path):
    """save(replace=ck) replaces exactly `ck`: a checkpoint another writer put at the step since
    is refused with CheckpointExistsError, nothing committed (the Lightning plugin's two runs
    sharing a store: the later commit replaced the other run's checkpoint, stop 38)."""
    with cas.open(tmp_path / "s") as store:
        first = store.save({"w": torch.zeros(4)}, step=1)
        other = store.save({"w": torch.ones(4)}, step=1, replace=True)  # another writer's, meanwhile
        with pytest.raises(cas.CheckpointExistsError, match="saved again by another writer"):
            store.save({"w": torch.full((4,), 2.0)}, step=1, replace=first)
        assert store.get(1).id == other.id and torch.equal(store.load(1)["w"], torch.ones(4))
        assert store.save({"w": torch.full((4,), 3.0)}, step=1, replace=other).id != other.id
        store.delete(1)
        store.save({"w": torch.full((4,), 4.0)}, step=1, replace=other)  # gone meanwhile: saved anew
        assert torch.equal(store.load(1)["w"], torch.full((4,), 4.0)) and store.verify().ok
