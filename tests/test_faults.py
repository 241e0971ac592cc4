"""Crash at every phase: a real saving (or collecting) process is SIGKILLed at a named point or at
a random moment; a fresh process then finds every committed checkpoint whole, the interrupted
one fully there or absent, verify clean, and gc reclaiming what the crash left behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_gc import assert_exactly_reachable
from workers import state_of

import cas
from cas import faults

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")
SAVE_POINTS = ["save.planned", "save.hashed", "session.before_file_write", "session.file_written",
               "save.chunks_written", "save.nodes_written", "commit.synced", "commit.in_txn", "save.committed"]
ASYNC_POINTS = ["save.staged", "save.chunks_written", "commit.in_txn"]
GC_POINTS = ["gc.forgotten", "gc.marking", "gc.marked", "gc.sweep_batch", "gc.repack"]
SEEDS = {1: [1, 2], 2: [1, 3], 3: [1, 4, 5]}  # step -> the tensors it holds; tensor 1 is shared


def run_worker(*args, faults: str) -> int:
    env = dict(os.environ, CAS_FAULTS=faults)
    out = subprocess.run([sys.executable, WORKERS, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=120)
    return out.returncode


def open_store(path):
    return cas.open(path, chunk_size=64 << 10, pack_max=4096)


def check_store(path, committed: dict[int, list[int]], maybe: dict[int, list[int]]) -> None:
    """Every committed step loads bit for bit, each `maybe` step is whole or absent, verify is
    clean, and a gc leaves exactly the reachable objects."""
    with open_store(path) as store:
        steps = {ck.step for ck in store.checkpoints()}
        assert set(committed) <= steps <= set(committed) | set(maybe)
        for step in steps:
            seeds = committed.get(step) or maybe[step]
            loaded = store.load(step)
            for k, t in state_of(seeds).items():
                assert torch.equal(loaded[k], t), (step, k)
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


@pytest.fixture
def two_saved(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:
        for step in (1, 2):
            store.save(state_of(SEEDS[step]), step=step)
    return path


COMMITTED_AT = ("commit.in_txn", "save.committed")  # the record log entry exists: the save is committed


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_save_killed_at_each_phase(two_saved, point):
    assert run_worker("save", two_saved, 3, "1+4+5", faults=f"{point}=kill") == -signal.SIGKILL
    check_store(two_saved, {1: SEEDS[1], 2: SEEDS[2]}, {3: SEEDS[3]})
    with open_store(two_saved) as store:
        assert (3 in {ck.step for ck in store.checkpoints()}) == (point in COMMITTED_AT)
        if point not in COMMITTED_AT:
            store.save(state_of(SEEDS[3]), step=3)  # the store is usable: the step can be saved again
    check_store(two_saved, SEEDS, {})


@pytest.mark.parametrize("point", ASYNC_POINTS)
def test_async_save_killed_at_each_phase(two_saved, point):
    assert run_worker("save_async", two_saved, 3, "1+4+5", faults=f"{point}=kill") == -signal.SIGKILL
    check_store(two_saved, {1: SEEDS[1], 2: SEEDS[2], **({3: SEEDS[3]} if point in COMMITTED_AT else {})}, {})


@pytest.mark.parametrize("point", GC_POINTS)
def test_gc_killed_at_each_phase(tmp_path, point):
    path = tmp_path / "s"
    with open_store(path) as store:
        for step in (1, 2, 3):
            store.save(state_of(SEEDS[step]), step=step)
        store.save({"small": torch.arange(8)}, step=4)  # packs shared with kept checkpoints get rewritten
    assert run_worker("gc", path, 2, faults=f"{point}=kill@1") == -signal.SIGKILL
    with open_store(path) as store:
        kept = {ck.step for ck in store.checkpoints()}
    assert {3, 4} <= kept
    with open_store(path) as store:  # a second gc finishes the job
        store.gc(keep_last=2)
        assert [ck.step for ck in store.checkpoints()] == [3, 4]
    with open_store(path) as store:
        for k, t in state_of(SEEDS[3]).items():
            assert torch.equal(store.load(3)[k], t)
        assert torch.equal(store.load(4)["small"], torch.arange(8))
        assert store.verify().ok
        assert_exactly_reachable(store)


def test_random_kills_during_a_save_loop(tmp_path):
    """A process saves step after step; it is SIGKILLed at random moments, then restarted."""
    path = tmp_path / "s"
    rng = random.Random(1234)
    runs, first = 8, 0
    checked: set[int] = set()  # loaded bit for bit after an earlier kill; verify() checks their objects again
    for _ in range(runs):
        proc = subprocess.Popen([sys.executable, WORKERS, "save_loop", str(path), str(first), "1000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]  # however loaded the machine
        time.sleep(0.3 + rng.random() * 1.5)  # somewhere inside the saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with open_store(path) as store:
            steps = [ck.step for ck in store.checkpoints()]
            assert checked <= set(steps)
            _assert_saved_states(store, [step for step in steps if step not in checked])
            checked.update(steps)
            assert store.verify().ok  # every object of every checkpoint, old ones (recoded since) too
        first = (max(steps) + 1) if steps else first
    with open_store(path) as store:
        store.gc()
        assert_exactly_reachable(store)
        _assert_saved_states(store, steps)  # every committed checkpoint is whole, bit for bit
    assert first > 0


def _assert_saved_states(store, steps) -> None:
    for step in steps:
        loaded = store.load(step)
        for k, t in state_of([step % 5, step % 7 + 10, step]).items():
            assert torch.equal(loaded[k], t), (step, k)


def test_disk_full_injected(two_saved):
    assert run_worker("save", two_saved, 3, "1+4+5", faults="session.before_file_write=enospc@2") == 1
    with open_store(two_saved) as store:
        assert [ck.step for ck in store.checkpoints()] == [1, 2]
        faults.configure("session.before_file_write=enospc")
        try:
            with pytest.raises(cas.StoreWriteError, match="No space left on device"):
                store.save(state_of(SEEDS[3]), step=3)
        finally:
            faults.configure("")
        store.save(state_of(SEEDS[3]), step=3)  # space is back
    check_store(two_saved, SEEDS, {})


def test_disk_full_on_a_real_small_filesystem(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = mount / "s"
        with open_store(path) as store:
            store.save({"a": torch.randn(64, 1024)}, step=1)  # 256 KiB
            with pytest.raises(cas.StoreWriteError, match="No space left"):
                store.save({"big": torch.randn(1024, 1024)}, step=2)  # 4 MiB cannot fit
            assert [ck.step for ck in store.checkpoints()] == [1]
            store.gc()  # reclaims the partial save's files: space is back
            store.save({"b": torch.randn(64, 1024)}, step=2)
            assert store.verify().ok
            assert_exactly_reachable(store)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
