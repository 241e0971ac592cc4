"""gc of a store in a bucket while other hosts save (gc/bucket.py), and how a host's cache keeps
up with the others (catch-up, snapshots), against the real SeaweedFS server. A host is a
process with its own cache folder; the interleavings are forced with fault points."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import cas
from cas.gc import Retention, collect
from cas.gc.bucket import GC_LOCK
from cas.store.records import RecordLog
from cas.store.snapshots import SNAPSHOT_EVERY, snapshot_name
from helpers import assert_same
from test_s3_store import host, state
from s3server import s3_bucket, s3_prefix, s3_server, s3_url  # noqa: F401 - fixtures

SAVER = """
import sys, torch, cas
url, cache, seed, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(seed)
state = {"model": {f"w{i}": torch.randn(64, 256, generator=g) for i in range(3)}, "step": seed, "note": f"state {seed}"}
with cas.open(url, cache_dir=cache, chunk_size=64 << 10) as store:
    try:
        store.save(state, step=step)
        print("committed", flush=True)
    except cas.CasError as exc:
        print("refused:", exc, flush=True)
"""
GC = """
import sys, cas
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    store.gc(keep_last=1)
"""


def spawn(script: str, *args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=dict(os.environ, **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: str, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the worker ended first: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def paused_reuser(a, url: str, tmp_path) -> tuple[subprocess.Popen, str]:
    """Checkpoints 1 and 2 on host A; host B saving checkpoint 1's state again as step 3, paused
    once it has claimed (reused, not written) the objects of checkpoint 1. Returns (B, its gate)."""
    a.save(state(1), step=1)
    a.save(state(2), step=2)
    gate = str(tmp_path / "gate")
    b = spawn(SAVER, url, tmp_path / "cache-b", 1, 3, env={"CAS_FAULTS": f"save.chunks_written=pause:{gate}"})
    wait_for(gate + ".reached", b)
    return b, gate


def pack_sizes(store) -> dict:
    return store.objects.packs.sizes()


def last_gc_phase(store) -> str | None:
    log = RecordLog(store.backend, store.path)
    entry = log.read(log.last_seq())
    return entry.gc["phase"] if entry.gc else None


def assert_every_pack_holds_something_live(url, tmp_path, name: str) -> None:
    """A fresh host's mark reaches an entry of every pack in the bucket: nothing is left over."""
    with host(url, tmp_path, name) as fresh:
        report = fresh.gc(dry_run=True)
        assert report.freed_bytes <= 0 and fresh.verify().ok, report.to_json()


def test_gc_deletes_what_no_checkpoint_needs_and_every_host_keeps_up(s3_url, tmp_path):
    with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "c") as c:
        for step in (1, 2, 3):
            a.save(state(step), step=step)
        c.ensure_cache()
        assert_same(c.load(1), state(1))  # c's cache now names the packs of checkpoint 1
        before = pack_sizes(a)
        report = a.gc(keep_last=1)
        after = pack_sizes(a)
        assert report.deferred is None and report.packs_removed > 0, report.to_json()
        assert sum(after.values()) < sum(before.values()) and set(after) < set(before)
        assert [ck.step for ck in a.checkpoints()] == [3]
        assert a.gc().packs_removed == 0  # nothing more to do
        # c folds the gc's entries before it saves: the objects of checkpoint 1 are gone, so it writes them
        c.save(state(1), step=4)
        assert_same(c.load(3), state(3))
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [3, 4] and fresh.verify().ok
        assert_same(fresh.load(4), state(1))
        assert_same(fresh.load(3), state(3))
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


def test_a_rewritten_pack_is_found_again_by_every_host(s3_url, tmp_path):
    """A pack mostly dead (a big tensor of a removed checkpoint beside a small live one) is
    rewritten: its live object is copied into a new pack, the old one deleted; a host whose
    cache still points into the old pack finds the copy, and so does a fresh host."""
    g = torch.Generator().manual_seed(5)
    small, big, other = (torch.randn(64, 256, generator=g), torch.randn(256, 1024, generator=g),
                         torch.randn(64, 256, generator=g))
    with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "c") as c:
        a.save({"small": small, "big": big}, step=1)
        a.save({"small": small, "other": other}, step=2)
        c.ensure_cache()
        assert torch.equal(c.load(2)["small"], small)  # c's cache places `small` in step 1's pack
        report = a.gc(keep_last=1)
        assert report.deferred is None and report.packs_rewritten == 1, report.to_json()
        loaded = c.load(2)  # the old pack is gone: c catches up and reads the copy
        assert torch.equal(loaded["small"], small) and torch.equal(loaded["other"], other)
        c.save({"small": small, "more": big}, step=3)  # dedups against the copy, writes `big` again
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [2, 3] and fresh.verify().ok
        assert torch.equal(fresh.load(3)["more"], big)
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


def test_gc_while_another_host_saves_reusing_what_it_would_delete(s3_url, tmp_path):
    """B claims the objects of checkpoint 1 (reused, not written), then pauses; gc on A removes
    checkpoint 1, logs its intent and waits for B's lease; B commits; gc marks again, keeps the
    packs B's checkpoint needs and deletes the rest."""
    with host(s3_url, tmp_path, "a") as a:
        b, gate = paused_reuser(a, s3_url, tmp_path)
        reports: list = []
        gc = threading.Thread(target=lambda: reports.append(a.gc(keep_last=1)))
        gc.start()
        deadline = time.monotonic() + 60
        while last_gc_phase(a) != "intent":
            assert time.monotonic() < deadline and gc.is_alive(), "gc logged no intent"
            time.sleep(0.05)
        assert gc.is_alive()  # waiting for B's lease
        open(gate, "w").close()
        out, err = b.communicate(timeout=120)
        assert "committed" in out, err[-2000:]
        gc.join(timeout=120)
        assert reports and reports[0].deferred is None, reports
        assert [ck.step for ck in a.checkpoints()] == [2, 3]
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert fresh.verify().ok
        assert_same(fresh.load(3), state(1))
        assert_same(fresh.load(2), state(2))


def test_the_next_gc_ends_an_epoch_left_pending_whose_doomed_packs_a_save_made_live(s3_url, tmp_path):
    """A gc gives up waiting for B's save and leaves its epoch pending, the packs of checkpoint 1
    doomed; B's save, which had reused them before the intent, commits. The next gc finds those
    packs live and dooms nothing, yet ends the pending epoch: writers reuse the packs again
    instead of uploading copies of everything in them (before, such marks stayed for good)."""
    with host(s3_url, tmp_path, "a") as a:
        b, gate = paused_reuser(a, s3_url, tmp_path)
        pending = collect(a, Retention(keep_last=1), wait=0.5)
        assert pending.deferred is not None, pending.to_json()
        open(gate, "w").close()
        out, err = b.communicate(timeout=120)
        assert "committed" in out, err[-2000:]
        a.ensure_cache()
        with a.index.read() as txn:
            assert a.index.doomed_packs(txn)  # checkpoint 1's packs, live again through checkpoint 3
        report = a.gc()
        assert report.deferred is None and report.packs_removed == 0, report.to_json()
        with a.index.read() as txn:
            assert a.index.doomed_packs(txn) == []
        before = sum(pack_sizes(a).values())
        a.save(state(1), step=4)  # the same tensors as checkpoint 3: nothing to upload but its manifest
        assert sum(pack_sizes(a).values()) - before < 8 << 10
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [2, 3, 4] and fresh.verify().ok
        assert_same(fresh.load(4), state(1))
        assert_same(fresh.load(3), state(1))
        assert_same(fresh.load(2), state(2))


def test_a_save_that_starts_after_the_intent_writes_its_own_copies(s3_url, tmp_path):
    """gc on A logs its intent (dooming the packs of checkpoint 1) and pauses; B then saves the
    same state as checkpoint 1: it must not rely on the doomed packs, so it writes copies; gc
    goes on, deletes the doomed packs, and B's checkpoint loads."""
    from cas import faults

    with host(s3_url, tmp_path, "a") as a:
        a.save(state(1), step=1)
        a.save(state(2), step=2)
        a.wait()  # (the sweep after the saves done: the gate below is for the gc called here)
        gate = str(tmp_path / "gc-gate")
        faults.configure(f"gc.intent_logged=pause:{gate}")
        try:
            reports: list = []
            gc = threading.Thread(target=lambda: reports.append(a.gc(keep_last=1)))
            gc.start()
            deadline = time.monotonic() + 60
            while not os.path.exists(gate + ".reached"):
                assert time.monotonic() < deadline and gc.is_alive(), "gc never logged its intent"
                time.sleep(0.02)
            b = spawn(SAVER, s3_url, tmp_path / "cache-b", 1, 3)
            out, err = b.communicate(timeout=120)
            assert "committed" in out, err[-2000:]
        finally:
            open(gate, "w").close()
            faults.configure("")
        gc.join(timeout=120)
        assert reports and reports[0].deferred is None and reports[0].packs_removed > 0, reports
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [2, 3] and fresh.verify().ok
        assert_same(fresh.load(3), state(1))
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


def test_a_bucket_writer_relies_only_on_packs_it_created(s3_url, tmp_path):
    """A pack is named by its bytes: the same entries written again in the same order (two
    gcs copying a pack's live entries, found in stop 35 before gcs took turns) made a pack
    already there, whose fate was another writer's and another gc's. The second write gets a
    salt entry, and so a pack of its own."""
    from cas.packs import salt_entry

    with host(s3_url, tmp_path, "a") as a:
        packs = a.objects.packs
        entries = [salt_entry(a.objects.codec, a.objects.namer) for _ in range(3)]

        def salt():
            return salt_entry(a.objects.codec, a.objects.namer)
        first, placed = packs.write(entries, salt=salt)
        second, placed_again = packs.write(entries, salt=salt)
        assert first != second and {first, second} <= set(packs.sizes())
        assert placed_again[:3] == placed  # the same entries, at the same offsets, and a salt after them


def test_a_gc_racing_another_hosts_recode_and_its_sweep_loses_nothing(s3_url, tmp_path, monkeypatch):
    """Audit of stop 35. B's recode of step 1 has written its pack and waits before its log
    entry; A's gc, which does not know that pack, dooms it and copies chunk c (live, in a
    half-dead pack) whole into a pack of its own; B's recode commits, B's hosts read c through
    it, and B's sweep after the save dooms A's copy. Before, both epochs ran at once: B deleted
    A's copy, naming the recode's as the survivor, and A, trusting the copy it had made, deleted
    the recode's: c was gone on every host. Now one gc epoch runs at a time in a bucket, and a
    gc keeps any doomed pack the index, as the log stands, still reads a live object from."""
    from cas import faults

    monkeypatch.setenv("CAS_S3_LEASE_TTL", "20")
    g = torch.Generator().manual_seed(3)
    c = torch.randn(64, 256, generator=g)
    xs = {f"x{i}": torch.randn(64, 256, generator=g) for i in range(3)}
    c2 = c + 1e-3 * torch.randn(64, 256, generator=g)
    gate = str(tmp_path / "gate")
    with host(s3_url, tmp_path, "b") as b, host(s3_url, tmp_path, "a") as a:
        b.save({"c": c, **xs}, step=0)
        b.save({"c": c}, step=1)
        b.wait()
        b.delete(0)  # step 0's pack: c live, the rest dead
        faults.configure(f"recode.in_txn=pause:{gate}")
        try:
            b.save({"c": c2}, step=2)  # its recode of step 1 writes its pack and waits
            deadline = time.monotonic() + 60
            while not os.path.exists(gate + ".reached"):
                assert time.monotonic() < deadline, "the recode never paused"
                time.sleep(0.02)
            faults.configure("")
            reports: list = []
            gc = threading.Thread(target=lambda: reports.append(a.gc()))
            gc.start()
            while last_gc_phase(a) != "intent":
                assert time.monotonic() < deadline and gc.is_alive(), "A's gc never logged its intent"
                time.sleep(0.05)
        finally:
            open(gate, "w").close()
            faults.configure("")
        gc.join(timeout=120)
        b.wait()
        assert reports and reports[0].deferred is None, reports
        for store in (a, b):
            assert_same(store.load(1), {"c": c})
            assert_same(store.load(2), {"c": c2})
            assert store.verify().ok
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert_same(fresh.load(1), {"c": c})
        assert fresh.verify().ok


def test_a_writer_paused_past_its_lease_fails_and_commits_nothing(s3_url, tmp_path, monkeypatch):
    """B reuses the objects of checkpoint 1 and is stopped (SIGSTOP: its lease is not renewed);
    gc waits out the lease, deletes them, and B, resumed, finds that out before its commit."""
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")
    with host(s3_url, tmp_path, "a") as a:
        b, gate = paused_reuser(a, s3_url, tmp_path)
        os.kill(b.pid, signal.SIGSTOP)
        try:
            report = a.gc(keep_last=1)
            assert report.deferred is None and report.packs_removed > 0, report.to_json()
        finally:
            open(gate, "w").close()
            os.kill(b.pid, signal.SIGCONT)
        out, err = b.communicate(timeout=120)
        assert "refused:" in out and "gc on another host deleted" in out, (out, err[-2000:])
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [2] and fresh.verify().ok
    again = spawn(SAVER, s3_url, tmp_path / "cache-b", 1, 3)
    assert "committed" in again.communicate(timeout=120)[0]
    with host(s3_url, tmp_path, "fresh2") as fresh:
        assert_same(fresh.load(3), state(1))
        assert fresh.verify().ok


@pytest.mark.parametrize("phase", ["gc.intent_logged", "gc.delete_logged"])
def test_a_gc_killed_at_each_phase_loses_nothing_and_the_next_gc_finishes(s3_url, tmp_path, phase, monkeypatch):
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "3")  # (the next gc waits for the killed one's gc lock to lapse)
    with host(s3_url, tmp_path, "a") as a:
        for step in (1, 2, 3):
            a.save(state(step), step=step)
    proc = spawn(GC, s3_url, tmp_path / "cache-gc", env={"CAS_FAULTS": f"{phase}=kill"})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with host(s3_url, tmp_path, "b") as b:
        assert [ck.step for ck in b.checkpoints()] == [3] and b.verify().ok
        b.save(state(1), step=4)  # objects the killed gc doomed or deleted: written again
        assert_same(b.load(4), state(1))
        report = b.gc()
        assert report.deferred is None, report.to_json()
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [3, 4] and fresh.verify().ok
        assert_same(fresh.load(3), state(3))
        assert_same(fresh.load(4), state(1))
        with fresh.index.read() as txn:
            assert not fresh.index.any_doomed(txn)  # the next gc settled the killed one's epoch
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


def test_a_gc_paused_past_its_lock_finds_its_epoch_ended_and_deletes_nothing(s3_url, tmp_path, monkeypatch):
    """gc G logs its intent and is stopped past its gc lock's ttl; another gc takes the lock,
    deletes the same dead packs and ends G's epoch; a save then writes those objects again.
    Resumed, G appends no delete entry and nothing is lost."""
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")
    with host(s3_url, tmp_path, "a") as a:
        for step in (1, 2, 3):
            a.save(state(step), step=step)
        a.wait_recoding()  # (the sweeps after these saves end before G starts)
        gate = str(tmp_path / "gate")
        g = spawn(GC, s3_url, tmp_path / "cache-gc", env={"CAS_FAULTS": f"gc.intent_logged=pause:{gate}"})
        wait_for(gate + ".reached", g)
        os.kill(g.pid, signal.SIGSTOP)
        try:
            log = RecordLog(a.backend, a.path)
            intent = log.read(log.last_seq()).gc
            assert intent["phase"] == "intent"
            open(gate, "w").close()
            report = a.gc()  # waits out G's gc lock
            assert report.deferred is None and report.packs_removed > 0, report.to_json()
            a.save(state(1), step=4)
        finally:
            os.kill(g.pid, signal.SIGCONT)
        out, err = g.communicate(timeout=120)
        assert g.returncode == 0, err[-2000:]
    steps = [e.gc for e in log.entries() if e.gc]
    assert not [s for s in steps if s["epoch"] == intent["epoch"] and s["phase"] == "delete"]
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [3, 4] and fresh.verify().ok
        assert_same(fresh.load(3), state(3))
        assert_same(fresh.load(4), state(1))
        with fresh.index.read() as txn:
            assert not fresh.index.any_doomed(txn)
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


LOCK_HOLDER = """
import os, sys, time, cas
from cas.gc.bucket import GC_LOCK
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    lease = store.backend.lease(GC_LOCK, b"holder")
    print("held", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.02)
    lease.release()
    print("released", flush=True)
"""


def test_a_dead_gc_lock_is_taken_over_by_one_host_and_its_old_holder_leaves_the_new_one(s3_url, tmp_path,
                                                                                        monkeypatch):
    """The gc lock's holder is stopped past its ttl. Two hosts judge it dead at once; only one
    takes it over (a compare-and-swap on the ETag judged dead: judging, deleting and creating it
    anew let the slower host delete the lock the faster one had just taken, an audit of stop 36).
    The old holder, resumed, releases: the new holder's lock stays."""
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "1")
    gate = str(tmp_path / "gate")
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, s3_url, str(tmp_path / "cache-h"), gate],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held", holder.stderr.read()[-2000:]
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "b") as b:
            assert a.backend.take_over_lease(GC_LOCK, b"a") is None  # alive: not taken
            deadline = time.monotonic() + 30
            while a.backend.lease_alive(GC_LOCK):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            judged_dead = b.backend._head(b.backend.key(GC_LOCK), "HEAD")  # b judges it dead first ...
            taken = a.backend.take_over_lease(GC_LOCK, b"a")  # ... a takes it over ...
            monkeypatch.setattr(b.backend, "_head", lambda key, what: judged_dead)
            assert taken is not None and b.backend.take_over_lease(GC_LOCK, b"b") is None  # ... b's swap fails
            monkeypatch.undo()
            open(gate, "w").close()
            os.kill(holder.pid, signal.SIGCONT)
            out, err = holder.communicate(timeout=60)
            assert "released" in out, err[-2000:]
            assert a.backend.lease_alive(GC_LOCK) is True and not taken.lost.is_set()
            taken.release()
            assert a.backend.lease_alive(GC_LOCK) is None
    finally:
        holder.kill()


@pytest.mark.parametrize("phase", ["session.pack_written", "commit.synced"])
def test_gc_reclaims_what_a_killed_saver_left(s3_url, tmp_path, monkeypatch, phase):
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")  # the killed saver's lease expires soon
    with host(s3_url, tmp_path, "a") as a:
        a.save(state(1), step=1)
        kept = pack_sizes(a)
        proc = spawn(SAVER, s3_url, tmp_path / "cache-killed", 2, 2, env={"CAS_FAULTS": f"{phase}=kill"})
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        assert set(pack_sizes(a)) > set(kept)  # the killed save left packs behind
        report = a.gc()
        assert report.deferred is None and report.packs_removed > 0, report.to_json()
        assert pack_sizes(a) == kept
        assert not a.backend.list("leases/")
        assert_same(a.load(1), state(1))


def test_a_host_behind_folds_only_the_new_entries(s3_url, tmp_path):
    # (delta=False: a's background recodes would add entries of their own while b is counted)
    with host(s3_url, tmp_path, "a", delta=False) as a, host(s3_url, tmp_path, "b") as b:
        for step in range(1, 6):
            a.save(state(step), step=step)
        b.ensure_cache()
        a.save(state(6), step=6)
        b.backend.requests.clear()
        b.ensure_cache()
        sent = dict(b.backend.requests)
        assert sum(sent.values()) <= 8 and sent.get("LIST", 0) <= 1, sent  # a rebuild lists and reads every pack
        assert b.exists(6)
        assert_same(b.load(6), state(6))


def test_a_fresh_host_starts_from_a_snapshot_and_ignores_a_bad_one(s3_url, tmp_path):
    small = lambda i: {"w": torch.full((8,), float(i)), "i": i}  # noqa: E731
    with host(s3_url, tmp_path, "a") as a:
        for step in range(1, SNAPSHOT_EVERY + 3):
            a.save(small(step), step=step)
        assert snapshot_name(SNAPSHOT_EVERY) in a.backend.list("snapshots/")
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert fresh.cache_report.snapshot == SNAPSHOT_EVERY
        assert [ck.step for ck in fresh.checkpoints()] == list(range(1, SNAPSHOT_EVERY + 3))
        assert_same(fresh.load(SNAPSHOT_EVERY + 2), small(SNAPSHOT_EVERY + 2))
        fresh.backend.put_if_absent(snapshot_name(SNAPSHOT_EVERY + 1), [b"cas-snap\n" + b"garbage"])
    with host(s3_url, tmp_path, "fresh2") as fresh:
        assert fresh.cache_report.snapshot == SNAPSHOT_EVERY  # the garbage one skipped
        assert [ck.step for ck in fresh.checkpoints()] == list(range(1, SNAPSHOT_EVERY + 3))
        assert fresh.verify().ok


def racing_state(s: int, drift: bool) -> dict:
    """A racer's state `s`: drawn afresh (test_s3_store's state(s)), or (`drift`) one base moved a
    little, so that each save's recode codes the chunks it replaced as deltas of the new ones."""
    g = torch.Generator().manual_seed(100 + s if drift else s)
    ws = [torch.randn(64, 256, generator=g) for _ in range(3)]
    if drift:
        base = torch.Generator().manual_seed(7)
        ws = [torch.randn(64, 256, generator=base) + 1e-3 * w for w in ws]
    return {"model": {f"w{i}": w for i, w in enumerate(ws)}, "step": s, "note": f"state {s}"}


RACER = """
import sys, random, time, torch, cas
url, cache, first, count, seed, drift = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
rng = random.Random(seed)
""" + inspect.getsource(racing_state) + """
with cas.open(url, cache_dir=cache, chunk_size=64 << 10) as store:
    for i in range(count):
        s = rng.randrange(6)  # few states: saves keep reusing objects of checkpoints gc removed
        step = first + 2 * i
        try:
            store.save(racing_state(s, drift), step=step, meta={"seed": s})
            print("committed", step, flush=True)
        except cas.CasError as exc:
            print("refused", step, exc, flush=True)
"""
GC_LOOP = """
import os, sys, time, cas
# gc(keep_last=3) in a loop until the savers are done (the flag file exists), then once more: a
# loop of fixed length ran out before a loaded machine's savers had committed enough to remove
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    while True:
        final = os.path.exists(sys.argv[3])
        try:
            report = store.gc(keep_last=3)
        except cas.CasError as exc:  # giving up under contention is allowed (nothing committed); losing is not
            print("gave-up", exc, flush=True)
            continue
        print("gc", report.packs_removed, report.deferred, flush=True)
        if final:
            break
        time.sleep(0.1)
"""


@pytest.mark.parametrize("drift", [False, True])
def test_savers_on_two_hosts_racing_a_gc_lose_nothing(s3_url, tmp_path, monkeypatch, drift):
    """Free-running: two hosts save states drawn from a few (so they keep reusing objects the gc
    on a third host is deleting) while it loops gc(keep_last=3); with `drift` the states are
    close, so each host's recodes move what it saved before into deltas meanwhile. Afterwards
    every checkpoint loads bit for bit, and every committed step is either there or removed by
    a log entry."""
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "3")
    savers = [spawn(RACER, s3_url, tmp_path / f"cache-{n}", first, 12, seed, int(drift)) for n, first, seed in
              (("a", 0, 1), ("b", 1, 2))]
    done = tmp_path / "savers-done"
    gc = spawn(GC_LOOP, s3_url, tmp_path / "cache-gc", done)
    outs = [p.communicate(timeout=300) for p in savers]
    done.touch()
    gc_out, gc_err = gc.communicate(timeout=300)
    assert all(p.returncode == 0 for p in savers + [gc]), [o[1][-2000:] for o in outs] + [gc_err[-2000:]]
    committed = {int(line.split()[1]) for out, _ in outs for line in out.splitlines() if line.startswith("committed")}
    assert len(committed) >= 18, outs  # a refusal is allowed (a paused writer), a loss is not
    with host(s3_url, tmp_path, "fresh") as fresh:
        # packs were deleted: by the gc loop, or by the savers' sweeps after their recodes
        assert any(e.gc and e.gc["phase"] == "delete" and e.gc["packs"] for e in fresh.log()), gc_out
        assert fresh.verify().ok
        present = {ck.step: ck for ck in fresh.checkpoints()}
        removed = {c["step"] for e in fresh.log() for c in e.changes if c["op"] == "remove"}
        assert committed <= set(present) | removed
        for step, ck in present.items():
            assert_same(fresh.load(step), racing_state(ck.meta["seed"], drift))
        if drift:  # recodes raced the gc (what is left may hold no delta: gc kept the newest 3)
            assert any(e.recoded for e in fresh.log())
    assert_every_pack_holds_something_live(s3_url, tmp_path, "fresh2")


def test_a_host_open_before_another_pinned_keeps_the_pin_through_gc_and_delete(s3_url, tmp_path):
    """A host decided on its own cache as it stood: its gc removed checkpoints another host had
    pinned or made milestones since it opened the store, and its delete() removed a pinned one
    (audit of stop 33: data loss, every time); a gc whose checkpoint another host had removed
    failed on every call after. Each now catches up first and plans its change again on the
    registry as it stands at each try to append."""
    with host(s3_url, tmp_path, "a") as a:
        for step in range(6):
            a.save(state(step), step=step, meta={"seed": step})
    g = host(s3_url, tmp_path, "g")  # open, its cache as of step 5
    with host(s3_url, tmp_path, "b") as b:
        b.pin(0)
        b.set_milestone(1)
        b.pin(4)
    with pytest.raises(cas.CasError, match="pinned"):
        g.delete(4)
    report = g.gc(keep_last=2, keep_milestones=True)
    assert sorted(ck.step for ck in report.removed) == [2, 3]
    with host(s3_url, tmp_path, "b") as b:
        b.delete(5)  # g's next gc would have removed it itself: its stale plan failed, every call
    report = g.gc(keep_last=1, keep_milestones=True)
    assert [ck.step for ck in g.checkpoints()] == [0, 1, 4] and report.removed == []
    g.close()
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [(ck.step, ck.pinned, ck.milestone) for ck in fresh.checkpoints()] == \
            [(0, True, False), (1, False, True), (4, True, False)]
        for step in (0, 1, 4):
            assert_same(fresh.load(step), state(step))


GC_ONCE = """
import sys, cas
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    print("removed", [ck.step for ck in store.gc(keep_last=1).removed], flush=True)
"""


def test_a_pin_committed_between_a_gcs_decision_and_its_append_is_kept(s3_url, tmp_path):
    """The race the catch-up alone does not close: gc decides on a current cache, another host
    pins a checkpoint it chose, then gc appends. Its append of that entry number fails (the pin
    took it), it catches up, and plans again: the pinned checkpoint stays."""
    with host(s3_url, tmp_path, "a") as a:
        for step in range(4):
            a.save(state(step), step=step, meta={"seed": step})
    flag = str(tmp_path / "planned")
    gc = spawn(GC_ONCE, s3_url, tmp_path / "cache-gc", env={"CAS_FAULTS": f"registry.planned=pause:{flag}"})
    wait_for(flag + ".reached", gc)
    with host(s3_url, tmp_path, "b") as b:
        b.pin(1)
    open(flag, "w").close()
    out, err = gc.communicate(timeout=120)
    assert gc.returncode == 0, err
    assert "removed [0, 2]" in out, out
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [(ck.step, ck.pinned) for ck in fresh.checkpoints()] == [(1, True), (3, False)]
        assert_same(fresh.load(1), state(1))


def test_objects_saved_again_after_gc_deleted_their_pack_go_under_a_new_pack_name(s3_url, tmp_path):
    """Packs are named by their bytes, so saving again exactly the objects of a pack gc deleted
    made a pack of the deleted name; the log says that name is gone for good, so a rebuilt
    cache ignored it and the new checkpoint's objects were missing on every other host. The
    writer now salts such a pack to another name."""
    g = torch.Generator().manual_seed(5)
    st = {"w": torch.randn(256, 1024, generator=g)}  # 16 chunks of 64 KiB: several packs of data alone
    with host(s3_url, tmp_path, "a", delta=False, workers=1) as store:  # one writer: packs in chunk order
        store.objects.pack_target = 256 << 10
        store.save(st, step=1)
        first = set(store.objects.packs.sizes())
        store.save({"x": torch.zeros(4)}, step=2)
        store.delete(1)
        assert store.gc().deferred is None
        deleted = first - set(store.objects.packs.sizes())
        assert len(deleted) >= 3
        store.save(st, step=3)  # the same objects, in the same order
        assert not deleted & set(store.objects.packs.sizes())
        assert_same(store.load(3), st)
    with host(s3_url, tmp_path, "fresh") as fresh:  # its cache rebuilt from the bucket
        assert_same(fresh.load(3), st)
        assert fresh.verify().ok
