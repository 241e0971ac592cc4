"""Filesystems and processes at their edges (issue 21): no hard links, a full disk under a pack
rewrite, two gcs compacting at once, a stale LMDB reader, a read-only mount beside a writer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from test_gc import assert_exactly_reachable
from test_gc_concurrency import finish, spawn, wait_reached
from workers import state_of, tensor

import cas
from cas.errors import UnsupportedFilesystemError
from cas.fsutil import rename_noreplace
from cas.localfs import LocalBackend
from cas.objectfiles import FileObjects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mounted(cmd: list[str], mount) -> bool:
    """Run a mount command; False (the test skips) where this sandbox cannot mount."""
    return subprocess.run(cmd + [str(mount)], capture_output=True).returncode == 0


def unmount(mount) -> None:
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def run_child(code: str, faults: str = "") -> subprocess.Popen:
    """A real process running `code` (the tests folder importable), with fault points."""
    env = dict(os.environ, CAS_FAULTS=faults, PYTHONPATH=os.path.join(ROOT, "tests"))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# --- item 6: publishing an object file never replaces one ---------------------------------------

@pytest.fixture
def exfat(tmp_path):
    """A real exFAT filesystem through FUSE on a loop device: no hard links, no RENAME_NOREPLACE."""
    if not all(shutil.which(t) for t in ("mkfs.exfat", "mount.exfat-fuse", "losetup")):
        pytest.skip("exfatprogs, exfat-fuse or losetup missing (apt-get install exfatprogs exfat-fuse)")
    image, mount = tmp_path / "exfat.img", tmp_path / "exfat"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    mount.mkdir()
    if subprocess.run(["mkfs.exfat", str(image)], capture_output=True).returncode:
        pytest.skip("mkfs.exfat failed")
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode:
        pytest.skip("no loop device here")
    device = loop.stdout.strip()
    try:
        if not mounted(["mount.exfat-fuse", device], mount):
            pytest.skip("cannot mount FUSE exFAT here")
        try:
            yield mount
        finally:
            unmount(mount)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def test_a_filesystem_without_hard_links_or_noreplace_renames_refuses_object_files(exfat):
    """On FUSE exFAT the check-then-rename fallback let a killed writer replace another
    writer's committed file. Publishing must be one step or not at all: the save is refused
    by name, nothing is committed and no file is left under objects/."""
    probe = exfat / "probe"
    probe.write_bytes(b"x")
    with pytest.raises(OSError):
        os.link(probe, exfat / "probe2")  # the premise: no hard links here
    path = exfat / "s"
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        with pytest.raises(UnsupportedFilesystemError, match="neither rename without replacing"):
            store.save(state_of([1]), step=1)
        assert store.checkpoints() == []
    assert list(FileObjects(LocalBackend(str(path))).iterate()) == []
    assert os.listdir(path / "tmp") == []


def test_rename_noreplace_never_replaces_on_a_real_filesystem(tmp_path):
    """renameat2(RENAME_NOREPLACE) is what every object file is published with where the
    kernel has it: an existing name is refused and keeps its bytes."""
    first, second, final = tmp_path / "a", tmp_path / "b", tmp_path / "final"
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    rename_noreplace(str(first), str(final))
    with pytest.raises(FileExistsError):
        rename_noreplace(str(second), str(final))
    assert final.read_bytes() == b"first" and second.read_bytes() == b"second"
    files = FileObjects(LocalBackend(str(tmp_path), str(tmp_path)))
    key = bytes(range(32))
    assert files.place_new(files.stage(key, [b"one"]))
    other = files.stage(key, [b"two"])
    assert not files.place_new(other) and files.get(key) == b"one"


def test_a_writer_paused_before_naming_its_files_never_replaces_a_committed_one(tmp_path):
    """Writer A (uncompressed files) pauses just before naming its files; writer B commits the
    same chunks (compressed); A goes on and is killed before its commit. B's checkpoint loads."""
    path, flag = tmp_path / "s", str(tmp_path / "go")
    cas.open(path, chunk_size=64 << 10).close()
    a = run_child(f"""
        import cas
        from workers import state_of
        with cas.open({str(path)!r}, compress=False, pack_max=4096) as store:
            store.save(state_of([1, 2]), step=1)
    """, faults=f"objects.placing=pause:{flag},commit.synced=kill")
    wait_reached(flag, a)
    with cas.open(path, pack_max=4096) as store:
        store.save(state_of([1, 2]), step=2)
    open(flag, "w").close()
    a.communicate(timeout=120)
    assert a.returncode == -9
    with cas.open(path) as store:
        loaded = store.load(2)
        assert all(torch.equal(loaded[k], v) for k, v in state_of([1, 2]).items())
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


# --- item 13: pack rewrites planned against the free space --------------------------------------

def test_pack_rewrites_that_cannot_fit_wait_and_the_ones_that_fit_are_done(tmp_path):
    """A real 8 MiB tmpfs filled to 500 KiB free: a pack whose live 1 MiB cannot be copied
    used to fail every gc with ENOSPC. Now the small rewrite that fits is done, the big one is
    deferred by name, and once space is back the next gc does it."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if not mounted(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs"], mount):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = mount / "s"
        with cas.open(path, chunk_size=64 << 10, pack_max=1 << 20) as store:
            store.save({"a": tensor(1, rows=512), "b": tensor(2, rows=256)}, step=1)  # one 3 MiB pack
            store.save({"b": tensor(2, rows=256)}, step=2)
            store.save({"c": tensor(3, rows=32), "d": tensor(4, rows=32)}, step=3)  # a 256 KiB pack
            store.save({"d": tensor(4, rows=32)}, step=4)
            store.delete([1, 3])
            st = os.statvfs(mount)
            with open(mount / "filler", "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - (500 << 10)))
            report = store.gc()
            assert report.packs_rewritten == 1 and "pack rewrite" in report.deferred
            for step, name, t in ((2, "b", tensor(2, rows=256)), (4, "d", tensor(4, rows=32))):
                assert torch.equal(store.load(step)[name], t)
            os.unlink(mount / "filler")
            report = store.gc()
            assert report.packs_rewritten == 1 and report.deferred is None
            assert store.verify().ok
            assert_exactly_reachable(store)
    finally:
        unmount(mount)


# --- item 14: two gcs compacting one pack -------------------------------------------------------

def test_two_gcs_rewriting_the_same_pack_at_once_both_finish(tmp_path):
    """gc A plans to rewrite a pack and pauses; gc B plans the same rewrite, reads the records
    and pauses; A moves the entries and removes the old pack; B goes on. B used to fail with a
    false MissingObjectError ("pack ... holding the object is missing")."""
    path, go_a, go_b = tmp_path / "s", str(tmp_path / "a"), str(tmp_path / "b")
    with cas.open(path, chunk_size=64 << 10, pack_max=1 << 20) as store:
        store.save(state_of([1, 2]), step=1)
        store.save(state_of([2, 3]), step=2)
        store.delete([1])
    a = spawn("gc", path, faults=f"gc.repack=pause:{go_a}")
    wait_reached(go_a, a)
    b = spawn("gc", path, faults=f"gc.repack_reading=pause:{go_b}")
    wait_reached(go_b, b)
    open(go_a, "w").close()
    finish(a)
    open(go_b, "w").close()
    finish(b)
    with cas.open(path) as store:
        loaded = store.load(2)
        assert all(torch.equal(loaded[k], v) for k, v in state_of([2, 3]).items())
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


# --- item 12: LMDB reader slots ----------------------------------------------------------------

def test_a_reader_killed_inside_a_read_transaction_no_longer_pins_the_index(tmp_path):
    """A reader SIGKILLed inside a read transaction (a `cas du` killed half way) left its slot:
    LMDB kept every page its snapshot could see, and data.mdb grew with every commit of the
    long-lived writer. gc (and every writable open) now frees dead readers' slots."""
    path = tmp_path / "s"
    data = path / "index" / "data.mdb"
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        store.save(state_of([1]), step=0)
        reader = run_child(f"""
            import os, signal, cas
            store = cas.open({str(path)!r}, readonly=True)
            with store.index.read() as txn:
                os.kill(os.getpid(), signal.SIGKILL)
        """)
        reader.communicate(timeout=120)
        assert reader.returncode == -9 and f" {reader.pid} " in store.index.env.readers()
        sizes = []
        for step in range(1, 25):
            store.save(state_of([step + 1]), step=step)
            store.gc(keep_last=1)
            sizes.append(os.path.getsize(data))
        assert f" {reader.pid} " not in store.index.env.readers()
        assert sizes[-1] <= sizes[4], sizes  # pages freed by gc are reused, not appended
        assert torch.equal(store.load(24)["t25"], tensor(25))


def test_a_reader_on_a_read_only_mount_reads_one_consistent_index_while_a_writer_commits(tmp_path):
    """Through a read-only bind mount the lock file cannot be written; the index was opened
    without locks, so writers reused the pages a reader was reading (false MissingObjectError,
    "index record damaged"). The reader now reads a private copy of one committed transaction:
    a read transaction sees the same records before and after the writer's commits."""
    path, view, flag = tmp_path / "s", tmp_path / "ro", str(tmp_path / "go")
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(4):
            store.save(state_of([step, step + 10]), step=step)
    view.mkdir()
    if not mounted(["mount", "--bind", "-o", "ro", str(path)], view):
        pytest.skip("cannot make a read-only bind mount here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True)
        if os.access(view, os.W_OK):
            pytest.skip("the bind mount did not become read-only")
        reader = run_child(f"""
            import os, time, cas
            store = cas.open({str(view)!r}, create=False)
            with store.index.read() as txn:
                first = list(store.index.iter_records(txn))
                open({flag!r} + ".reached", "w").close()
                while not os.path.exists({flag!r}):
                    time.sleep(0.01)
                print(first == list(store.index.iter_records(txn)), len(first))
            print(sorted(store.load(3)) == ["t13", "t3"])
        """)
        wait_reached(flag, reader)
        with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
            for step in range(4, 10):
                store.save(state_of([step, step + 20]), step=step)
                store.delete([step - 4]) if step < 7 else None
                store.gc()
        open(flag, "w").close()
        same, loaded = finish(reader).split("\n")[:2]
        assert same.split()[0] == "True" and loaded == "True"
    finally:
        unmount(view)


def test_a_lease_file_is_taken_over_only_once_its_holder_is_gone(tmp_path):
    """The folder backend's take_over_lease: None while a live process holds the lease file's
    lock, the lock once that process is killed (the kernel let go of it)."""
    root = tmp_path / "store"
    (root / "tmp").mkdir(parents=True)
    code = ("import sys, time\nfrom cas.localfs import LocalBackend\n"
            "lease = LocalBackend(sys.argv[1]).lease('locks/gc', b'holder')\nprint('held', flush=True)\ntime.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        backend = LocalBackend(str(root))
        assert backend.lease_alive("locks/gc") is True and backend.take_over_lease("locks/gc", b"me") is None
    finally:
        holder.kill()
        holder.wait()
    assert backend.lease_alive("locks/gc") is False
    taken = backend.take_over_lease("locks/gc", b"me")
    assert taken is not None and backend.lease_alive("locks/gc") is True
    assert backend.take_over_lease("locks/gc", b"again") is None
    taken.release()
    assert backend.lease_alive("locks/gc") is None


def test_a_write_of_many_parts_is_cut_into_bounded_calls_and_lands_whole(tmp_path, monkeypatch):
    """pwrite_parts writes at most WRITE_BATCH bytes per call (other writers of the file wait on
    its inode lock while one call copies) yet puts every byte of every part at its place: parts
    cut across calls, more parts than one call takes, empty parts."""
    import numpy as np

    from cas.fsutil import WRITE_BATCH, pwrite_parts

    calls = []
    real = os.pwritev

    def pwritev(fd, buffers, offset):  # the real system call, its sizes noted
        calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset)
    monkeypatch.setattr(os, "pwritev", pwritev)
    rng = np.random.default_rng(7)
    sizes = [3, 0, WRITE_BATCH + 5, 1, *rng.integers(0, 5000, 700).tolist(), 2 * WRITE_BATCH, 17]
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert pwrite_parts(fd, parts, 11) == sum(sizes)
    finally:
        os.close(fd)
    assert path.read_bytes()[11:] == b"".join(p.tobytes() for p in parts)
    assert max(calls) <= WRITE_BATCH and len(calls) >= sum(sizes) // WRITE_BATCH
