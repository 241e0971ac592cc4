"""gc against real concurrent writers and crashes: a save never loses an object to a sweep."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import assert_same, tmp_files, wait_for
from test_gc import assert_exactly_reachable
from workers import nudged, state_of, tensor, trajectory

import cas
from cas import faults

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
        assert not tmp_files(store)


def test_a_sweep_stopped_in_any_batch_leaves_no_delta_file_without_its_base(tmp_path, monkeypatch):
    """A sweep batch that stops half way (a crash, an error) has unlinked some files whose
    records stay. Deltas go before their bases, so no delta file outlives its base file: a
    save would otherwise reuse it, or code against it, and commit an unrestorable checkpoint."""
    collect = importlib.import_module("cas.gc.collect")  # cas.gc re-exports a function named collect
    monkeypatch.setattr(collect, "SWEEP_BATCH", 1)
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(256, 256, generator=g)]
    for _ in range(2):
        states.append(states[-1] + 1e-4 * torch.randn(256, 256, generator=g))
    k = 0
    while True:
        k += 1
        path = tmp_path / f"s{k}"
        with cas.open(path, chunk_size=64 << 10, pack_max=0, delta="forward", max_chain=2) as store:
            store.save({"w": states[0]}, step=1)
            store.save({"w": states[1]}, step=2)
            store.delete([1, 2])
            faults.configure(f"gc.sweep_batch=raise@{k}")
            try:
                store.gc()
                break  # k is past the last batch
            except faults.InjectedFault:
                pass
            finally:
                faults.configure("")
            with store.index.read() as txn:
                records = dict(store.index.iter_records(txn))
            for key, rec in records.items():
                if rec.base is not None and store.objects.files.has(key) is not None:
                    assert store.objects.files.has(rec.base) is not None, f"batch {k}: a delta outlived its base"
            store.save({"w": states[1]}, step=3)  # reuses what is left (or rewrites it)
            store.save({"w": states[2]}, step=4)  # codes against it
            assert torch.equal(store.load(3)["w"], states[1]) and torch.equal(store.load(4)["w"], states[2])
    assert k > 8  # every batch of the sweep was stopped once


@pytest.mark.parametrize("killed", [False, True])
def test_two_writers_of_the_same_new_object_never_mix_one_file_and_the_other_record(tmp_path, killed):
    """Both writers claim the same absent chunks; the parent codes them as deltas of its last
    save, the child writes them whole. A commit used to rename its files over the other's
    (committed or not) and overwrite the other's records: steps whose record and file came from
    different writers no longer decoded, and a writer killed in between broke the other's
    committed checkpoint. Names are settled inside the commit transaction now."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    store = cas.open(path, chunk_size=64 << 10, pack_max=4096, delta="forward")
    try:
        store.save({"t": tensor(7)}, step=1)
        faults_spec = f"save.nodes_written=pause:{flag},commit.synced=kill" if killed else f"commit.synced=pause:{flag}"
        child = spawn("save_nudged", path, 10, 7, faults=faults_spec)
        wait_reached(flag, child)
        store.save({"t": nudged(7)}, step=2)
        assert any(store.objects.record(k).base is not None for k in store.tensors(2)[0]["chunks"])
        open(flag, "w").close()
        child.communicate(timeout=120)
        assert child.returncode == (-9 if killed else 0)
        for ck in store.checkpoints():
            assert torch.equal(store.load(ck.step)["t"], tensor(7) if ck.step == 1 else nudged(7)), ck.step
        assert [ck.step for ck in store.checkpoints()] == ([1, 2] if killed else [1, 2, 10])
        assert store.verify().ok
    finally:
        store.close()


def test_a_gc_whose_checkpoints_another_gc_removes_while_it_marks_starts_over(tmp_path):
    """A `cas gc` cron and a store with Retention: one forgets and sweeps checkpoints the other
    is marking. The marking gc used to stop on the vanished nodes with a false damage report."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    with open_store(path) as store:
        for step in (1, 2, 3):
            store.save(state_of([step, step + 10]), step=step)
    child = spawn("gc", path, faults=f"gc.marking=pause:{flag}@1")
    wait_reached(flag, child)
    with open_store(path) as store:
        store.gc(keep_last=1)
    open(flag, "w").close()
    finish(child)
    with open_store(path) as store:
        assert store.verify().ok and [ck.step for ck in store.checkpoints()] == [3]
        assert_exactly_reachable(store)


def test_a_retention_gc_that_fails_after_a_commit_warns_and_the_save_stands(tmp_path):
    with cas.open(tmp_path / "s", chunk_size=64 << 10, pack_max=4096, retention=cas.Retention(keep_last=5)) as store:
        store.save(state_of([1]), step=1)
        pack = store.objects.record(store.get(1).key).pack  # step 1's commit node: gone, so gc stops
    os.unlink(store.objects.packs.path(pack))
    # (opened again: an open store's gc remembers the nodes it read, and would not read it again)
    with cas.open(tmp_path / "s", chunk_size=64 << 10, pack_max=4096, retention=cas.Retention(keep_last=5)) as store:
        with pytest.warns(RuntimeWarning, match="step 2 is committed, but the retention gc after it failed"):
            ck = store.save(state_of([2]), step=2)
        assert ck.step == 2 and torch.equal(store.load(2)["t2"], state_of([2])["t2"])


def test_a_pack_entry_never_replaces_another_writers_committed_record(tmp_path):
    """A writer with objects in packs commits after another indexed the same chunk as a file
    delta and coded a `linear` delta over it: the committed record (its base, its depth, which
    the linear level above reads) stays; the late pack entry is dropped."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    with cas.open(path, chunk_size=256 << 10, delta="forward") as store:
        store.save({"w": trajectory(0)}, step=0)
        child = spawn("save_packed", path, 100, 1, faults=f"commit.synced=pause:{flag}")
        wait_reached(flag, child)  # it claimed trajectory(1)'s chunk (absent) and packed it whole
        store.save({"w": trajectory(1)}, step=1)
        store.save({"w": trajectory(2)}, step=2)
        assert store.objects.codec_of(store.tensors(2)[0]["chunks"][0]).startswith("linear")
        open(flag, "w").close()
        finish(child)
        for step in (0, 1, 2, 100):
            assert torch.equal(store.load(step)["w"], trajectory(min(step, 1) if step == 100 else step)), step
        assert store.verify().ok


def test_a_writer_whose_objects_another_committed_first_keeps_theirs_and_leaves_no_files(tmp_path):
    """This process codes the chunks as deltas and pauses before its commit; a child commits the
    same chunks whole. At its commit the names are taken and the child's records stay: this
    process's copies must not stay behind in tmp/ (gc spares a live process's files)."""
    import threading
    path, flag = tmp_path / "s", str(tmp_path / "go")
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta="forward") as store:
        store.save({"t": tensor(7)}, step=1)
        faults.configure(f"save.nodes_written=pause:{flag}")
        errors: list = []
        saver = threading.Thread(target=lambda: _record_error(errors, store.save, {"t": nudged(7)}, step=2))
        saver.start()
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag + ".reached"):
                assert saver.is_alive() and time.monotonic() < deadline
                time.sleep(0.01)
            finish(spawn("save_nudged", path, 10, 7))
        finally:
            faults.configure("")
            open(flag, "w").close()
            saver.join(60)
        assert not errors, errors
        assert all(store.objects.record(k).base is None for k in store.tensors(2)[0]["chunks"])  # the child's
        for ck in store.checkpoints():
            assert torch.equal(store.load(ck.step)["t"], tensor(7) if ck.step == 1 else nudged(7)), ck.step
        assert tmp_files(store) == []


def _record_error(errors: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test asserts there was none
        errors.append(exc)


def test_gc_removes_only_this_hosts_dead_writers_temporary_files_and_none_during_a_barrier(tmp_path):
    """A rank on another host of a shared filesystem (its pid means nothing here), or a DCP
    rank's replacement waiting for the coordinator's commit, keeps its temporary files."""
    from cas.fsutil import host_tag
    with open_store(tmp_path / "s") as store:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        ours = f".{'ab' * 32}.{host_tag()}.{dead}.1.00000000.tmp"
        theirs = f".{'cd' * 32}.other-host.{dead}.1.00000000.tmp"
        for name in (ours, theirs):
            open(os.path.join(store.layout.tmp, name), "wb").close()
        barrier = store.objects.session("barrier:dcp step 5")
        store.gc()
        assert tmp_files(store) == sorted([ours, theirs])
        barrier.abort()
        store.gc()
        assert tmp_files(store) == [theirs]


@pytest.mark.parametrize("pack_max", [4096, 65536])
def test_repair_indexes_the_live_copy_not_a_dead_delta_entry_a_killed_gc_left_in_a_pack(tmp_path, pack_max):
    """A delta Y in a pack, its base X a file; their checkpoint is deleted and a gc sweeps X and
    Y's record, then is killed before it rewrites the pack. Y is saved again whole. repair used
    to index the pack's dead delta entry for Y (base gone), and a checkpoint that loaded before
    the repair did not after it."""
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        store.save({"w": trajectory(0)}, step=1)
    with cas.open(path, delta="forward", pack_max=1 << 30) as store:
        store.save({"w": trajectory(1), "o": tensor(5, rows=4)}, step=2)  # deltas of step 1's chunks, packed
    with cas.open(path) as store:
        store.save({"o": tensor(5, rows=4)}, step=3)  # keeps step 2's pack partly live
        store.delete([1, 2])
    gc_run = spawn("gc", path, faults="gc.repack=kill@1")
    gc_run.communicate(timeout=120)
    assert gc_run.returncode == -9
    with cas.open(path, pack_max=pack_max) as store:
        store.save({"w": trajectory(1)}, step=4)
        assert store.verify().ok
    from cas.store.repair import repair
    repair(str(path))
    with cas.open(path) as store:
        assert torch.equal(store.load(4)["w"], trajectory(1)) and store.verify().ok


def test_retention_decides_on_the_registry_it_removes_from(tmp_path, monkeypatch):
    """gc decided on one read of the registry and removed in a later transaction: a checkpoint
    made a milestone in between was removed anyway, silently. The decision is taken inside the
    removing transaction now: a concurrent set_milestone either lands first (and is kept) or
    finds the checkpoint gone (and says so)."""
    import threading
    from cas.gc.retention import Retention
    decided, release, outcome = threading.Event(), threading.Event(), []
    real_decide = Retention.decide

    def slow_decide(self, cks, now=None):
        result = real_decide(self, cks, now)
        decided.set()
        release.wait(10)
        return result

    monkeypatch.setattr(Retention, "decide", slow_decide)
    with open_store(tmp_path / "s") as store:
        for step in (1, 2, 3):
            store.save(state_of([step]), step=step)

        def mark_milestone():
            decided.wait(10)
            try:
                store.set_milestone(2)
                outcome.append("set")
            except cas.CheckpointNotFoundError:
                outcome.append("gone")

        marker = threading.Thread(target=mark_milestone)
        marker.start()
        collector = threading.Thread(target=lambda: store.gc(keep_last=1, keep_milestones=True))
        collector.start()
        decided.wait(10)
        time.sleep(0.5)  # the marker is inside set_milestone now
        release.set()
        collector.join(30)
        marker.join(30)
        assert outcome == ["gone"] or (outcome == ["set"] and store.exists(2)), (outcome, store.exists(2))


@pytest.mark.parametrize("point,quick", [("verify.checkpoint", False), ("verify.tree_read", False),
                                         ("verify.tree_read", True)])
def test_a_verify_finds_no_damage_in_a_checkpoint_another_process_removes_while_it_runs(tmp_path, point, quick):
    """`cas verify` listed three checkpoints; while it paused at the second, another process
    removed that one and collected its objects. Before its tree was read (verify.checkpoint)
    the verify stopped with "no checkpoint with step 2" (exit 2); after (verify.tree_read) it
    reported the swept chunks missing, exit 1, and recorded them as damage. Now it checks the
    other two, names step 2 as removed meanwhile, and exits 0 with nothing recorded."""
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        for step in (1, 2, 3):
            store.save({"own": tensor(step), "shared": tensor(0)}, step=step)
    gate = tmp_path / "gate"
    env = dict(os.environ, CAS_FAULTS=f"{point}=pause:{gate}@2")
    verify = subprocess.Popen([sys.executable, "-m", "cas.cli", "--store", str(path), "verify", "--json",
                               *(["--quick"] if quick else [])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(f"{gate}.reached")
        with cas.open(path) as store:
            assert [ck.step for ck in store.delete([2])] == [2]
            assert store.gc().objects_swept > 0  # step 2's own chunks are gone from the disk
    finally:
        gate.touch()
    out, err = verify.communicate(timeout=120)
    assert verify.returncode == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] and report["problems"] == [] and report["recorded_damaged"] == []
    assert report["checked_checkpoints"] == [1, 3] and report["removed_checkpoints"] == [2]
    with cas.open(path) as store:
        with store.index.read() as txn:
            assert not store.index.any_damaged(txn)
        assert store.verify().ok
        assert_same(store.load(3), {"own": tensor(3), "shared": tensor(0)})


def test_a_verify_of_one_checkpoint_that_another_process_removes_meanwhile_says_it_is_gone(tmp_path):
    """`cas verify 2` read the tree of step 2, then another process removed it and swept its
    objects: the verify reported them missing (exit 1) and recorded them as damage. Now it says
    there is no such checkpoint (removed while verified), as for a step never there, and records
    nothing."""
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        for step in (1, 2):
            store.save({"own": tensor(step), "shared": tensor(0)}, step=step)
    gate = tmp_path / "gate"
    verify = subprocess.Popen([sys.executable, "-m", "cas.cli", "--store", str(path), "verify", "2"],
                              env=dict(os.environ, CAS_FAULTS=f"verify.tree_read=pause:{gate}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(f"{gate}.reached")
        with cas.open(path) as store:
            store.delete([2])
            assert store.gc().objects_swept > 0
    finally:
        gate.touch()
    out, err = verify.communicate(timeout=120)
    assert verify.returncode == 2 and "no checkpoint with step 2" in err and "PROBLEM" not in out, (out, err)
    with cas.open(path) as store:
        with store.index.read() as txn:
            assert not store.index.any_damaged(txn)
