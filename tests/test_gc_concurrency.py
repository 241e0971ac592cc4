"""gc against real concurrent writers and crashes: a save never loses an object to a sweep."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from test_gc import assert_exactly_reachable
from workers import state_of

import cas

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")


def spawn(*args, faults: str = "") -> subprocess.Popen:
    env = dict(os.environ, CAS_FAULTS=faults)
    return subprocess.Popen([sys.executable, WORKERS, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_reached(flag: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(flag + ".reached"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "child never reached its fault point"
        time.sleep(0.01)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


def open_store(path):
    return cas.open(path, chunk_size=64 << 10, pack_max=4096)


def assert_loads(store, step: int, seeds: list[int]) -> None:
    loaded = store.load(step)
    expected = state_of(seeds)
    assert list(loaded) == list(expected)
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), (step, k)


def test_save_that_holds_old_objects_survives_a_sweep(tmp_path):
    """A save claims objects of step 1 and pauses; step 1 is deleted and swept meanwhile."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    with open_store(path) as store:
        store.save(state_of([1, 2]), step=1)
    child = spawn("save", path, 2, "1+3", faults=f"save.chunks_written=pause:{flag}")
    wait_reached(flag, child)
    with open_store(path) as store:
        store.delete(1)
        report = store.gc()
        assert report.objects_swept > 0  # tensor 2's objects went; tensor 1's are held
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert_loads(store, 2, [1, 3])
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


def test_commit_between_mark_and_sweep_is_marked_before_deleting(tmp_path):
    """gc marks with no roots, pauses; a save commits a checkpoint reusing the 'dead' objects."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    with open_store(path) as store:
        store.save(state_of([1, 2]), step=1)
        store.delete(1)
    child = spawn("gc", path, faults=f"gc.marked=pause:{flag}")
    wait_reached(flag, child)
    with open_store(path) as store:
        ck = store.save(state_of([1, 5]), step=2)
        assert ck.new_bytes < 0.6 * ck.logical_bytes  # tensor 1 was reused, not rewritten
    open(flag, "w").close()
    swept = int(finish(child).split()[0])
    assert swept > 0
    with open_store(path) as store:
        assert_loads(store, 2, [1, 5])
        assert store.verify().ok
        assert_exactly_reachable(store)


def test_gc_killed_mid_sweep_then_rerun(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:
        for step in range(1, 6):
            store.save(state_of([0, step]), step=step)
    child = spawn("gc", path, 2, faults="gc.sweep_batch=kill")
    child.communicate(timeout=120)
    assert child.returncode == -9
    with open_store(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [4, 5]  # the forget committed
        assert_loads(store, 4, [0, 4])
        assert_loads(store, 5, [0, 5])
        assert store.verify().ok
        store.save(state_of([0, 3]), step=6)  # its objects' files were unlinked: rewritten, not reused
        assert_loads(store, 6, [0, 3])
        store.gc()
        assert_exactly_reachable(store)


def test_a_second_process_saves_while_gc_runs_repeatedly(tmp_path):
    """Free-running race: one process saves 30 steps reusing earlier tensors, this one runs gc
    with keep_last=3 as fast as it can. Every checkpoint left loads bit for bit."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([0, 10, 100]), step=0)
    child = spawn("save_loop", path, 1, 30)
    runs = 0
    with open_store(path) as store:
        while child.poll() is None:
            store.gc(keep_last=3)
            runs += 1
    finish(child)
    assert runs > 0
    with open_store(path) as store:
        for ck in store.checkpoints():
            assert_loads(store, ck.step, [ck.step % 5, ck.step % 7 + 10, ck.step])
        assert 30 in [ck.step for ck in store.checkpoints()]
        store.gc(keep_last=3)
        assert store.verify().ok
        assert_exactly_reachable(store)


def test_gc_reaps_the_lease_of_a_killed_save(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save(state_of([1]), step=1)
    child = spawn("save", path, 2, "2+3", faults="save.nodes_written=kill")
    child.communicate(timeout=120)
    assert child.returncode == -9
    with open_store(path) as store:
        with store.index.read() as txn:
            assert len(store.index.leases(txn)) == 1
        assert [ck.step for ck in store.checkpoints()] == [1]
        report = store.gc()
        assert report.leases_reaped == 1  # its staged files were never published: tmp is cleaned below
        assert_exactly_reachable(store)
        assert not os.listdir(store.layout.tmp)
