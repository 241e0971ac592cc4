"""The local-filesystem backend: blobs as files under the store's folder (cas.backend's contract).

This is the one module that turns blob names into paths, renames, links and lists tmp/ (with
fsutil, its helper library). Create-only writes go to a temporary file in tmp/, and take their
name by a rename that never replaces a file (fsutil.name_new: renameat2 RENAME_NOREPLACE, else
a hard link), so of two writers racing on one name exactly one wins. put_if_absent fsyncs the
directory before it returns; publish and delete leave it to sync(), which fsyncs each touched
directory once (a save publishes hundreds of object files and syncs once before its commit).
Leases are files holding an exclusive `flock` for as long as their holder lives: the kernel
drops the lock when the holder dies, however it dies, and in whatever PID namespace it ran, so
a lease is judged dead only when its lock can be taken (never from a process id or a clock).
Temporary files name their writer's owner file (fsutil.tmp_name), whose lock clean_tmp judges
the same way.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import threading
from typing import Iterable, Iterator

from .backend import MAX_BLOB, Buffer, Capabilities, Staged
from .errors import BlobAbsentError, CasError, MissingObjectError
from .fsutil import (OWNER_PREFIX, fsync_dir, fsync_file, host_tag, lock_held, name_new, open_regular, open_tmp,
                     owner_alive, owner_file, pid_alive, publish, pwrite_parts, read_head, start_writeback, tmp_owner, unlink_quietly, write_tmp)

TMP_FOLDER = "tmp"
# Reads into a caller's buffer of at least this many bytes map the file instead: the decoder (or
# the cipher) then reads the page cache itself, which saves the copy a pread makes (on this VM
# that copy runs at ~4 GB/s, a fifth of a load's CPU).
MAP_FROM = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_CAN_MAP = hasattr(mmap, "MAP_SHARED") and hasattr(mmap, "PROT_READ")  # POSIX mmap signature
# fsutil.tmp_name's tail after `.<stem>`: host, pid, thread, owner token and random digits
_TMP_TAIL = re.compile(r"\.[A-Za-z0-9-]+\.[0-9]+\.[0-9]+\.[0-9a-f]+\.tmp")


class FileLease:
    """A held lease: its file and the open descriptor whose flock proves the holder alive."""

    def __init__(self, name: str, path: str, fd: int) -> None:
        self.name, self._path, self._fd = name, path, fd
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            unlink_quietly(self._path)  # gone first: nobody can take a lock on a file being ended
            os.close(self._fd)
            self._fd = None


class StagedStream:
    """A temporary file written piece by piece, at offsets, by several threads at once (a pack
    streamed while a save encodes), named only when it is done (LocalBackend.stream)."""

    def __init__(self, backend: "LocalBackend", token: str, fd: int) -> None:
        self.backend, self.token, self._fd = backend, token, fd

    def write_at(self, offset: int, parts: list) -> int:
        return pwrite_parts(self._fd, parts, offset)

    def writeback(self, offset: int, nbytes: int) -> None:
        """Start writing a range to disk now (the fsync at close waits for less)."""
        start_writeback(self._fd, offset, nbytes)

    def close(self, name: str, *, fsync: bool = True) -> Staged:
        """Stop writing (fsynced when asked); the file is then a staged blob for `name`, to
        publish, replace or discard like any stage()'s."""
        try:
            if fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None
        return Staged(name, self.token)

    def discard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        unlink_quietly(os.path.join(self.backend.tmp_dir, self.token))


class LocalBackend:
    """Blobs as files under `root`; temporary files in `tmp_dir` (the store's tmp/)."""

    def __init__(self, root: str, tmp_dir: str | None = None) -> None:
        self.root = root
        self.tmp_dir = tmp_dir or os.path.join(root, TMP_FOLDER)
        self.capabilities = Capabilities(locks=True, local_path=root, batched_sync=True)
        self._made: set[str] = set()  # folders known to exist
        self._dirty: set[str] = set()  # folders whose entries changed since the last sync()
        self._lock = threading.Lock()

    def path(self, name: str) -> str:
        """The file blob `name` lives in (local backends only: tools and tests reach files so)."""
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise CasError(f"not a blob name: {name!r}")
        return os.path.join(self.root, *parts)

    def where(self, name: str) -> str:
        return self.path(name)

    # --- reads ------------------------------------------------------------------------------
    def get(self, name: str, start: int = 0, length: int | None = None, *, buffer: Buffer | None = None):
        try:  # a symlink must not lead out of the store
            fd = open_regular(self.path(name))
        except FileNotFoundError:
            raise BlobAbsentError(f"{name} is missing from the store at {self.root}") from None
        except OSError as exc:  # a folder or a symlink in its place, unreadable
            raise MissingObjectError(f"{name} in the store at {self.root} cannot be read: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            nbytes = max((size if length is None else min(size, start + length)) - start, 0)
            if nbytes > MAX_BLOB:
                raise MissingObjectError(f"{name} is {size} bytes, more than the {MAX_BLOB} a blob can be")
            if buffer is None:
                return os.pread(fd, nbytes, start) if nbytes else b""
            if nbytes >= MAP_FROM and _CAN_MAP:
                try:
                    return _mapped(fd, start, nbytes)
                except (OSError, ValueError):  # a filesystem that cannot map (some FUSE ones): read it
                    pass
            return _pread_into(fd, buffer(max(nbytes, 1)), nbytes, start)
        except OSError as exc:
            raise MissingObjectError(f"{name} in the store at {self.root} cannot be read: {exc}") from None
        finally:
            os.close(fd)

    def stat(self, name: str) -> int | None:
        try:
            return os.stat(self.path(name), follow_symlinks=False).st_size
        except FileNotFoundError:
            return None

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still write on the filesystem holding the store."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def list(self, prefix: str) -> list[str]:
        """Names under `prefix` at any depth ('log/' lists that folder; a partial last part
        filters it); dot-files (temporary and owner files) are not blobs."""
        folder, _, start = prefix.rpartition("/")
        directory = self.path(folder) if folder else self.root
        return sorted(_walk(directory, folder, start))

    def list_sizes(self, prefix: str) -> list[tuple[str, int]]:
        """(name, size) of each name under `prefix` (one stat each: a folder's listing has none)."""
        out = []
        for name in self.list(prefix):
            size = self.stat(name)
            if size is not None:  # removed between the listing and the stat
                out.append((name, size))
        return out

    # --- writes -----------------------------------------------------------------------------
    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        path = self.path(name)
        self._ensure_dir(os.path.dirname(path))
        tmp = write_tmp(path, parts, tmp_dir=self.tmp_dir, fsync=True)
        try:
            created = name_new(tmp, path)
        finally:
            unlink_quietly(tmp)
        if created:
            fsync_dir(os.path.dirname(path))
        return created

    def stage(self, name: str, parts: Iterable, *, fsync: bool = False) -> Staged:
        return Staged(name, os.path.basename(write_tmp(self.path(name), parts, tmp_dir=self.tmp_dir, fsync=fsync)))

    def stream(self, name_hint: str) -> StagedStream:
        """A temporary file to write at offsets while its name is not known yet (a pack named by
        what it holds once it is complete); `name_hint` is a blob name of its kind."""
        tmp, fd = open_tmp(self.path(name_hint), tmp_dir=self.tmp_dir)
        return StagedStream(self, os.path.basename(tmp), fd)

    def publish(self, staged: Staged, *, fsync: bool = False) -> bool:
        tmp, path = os.path.join(self.tmp_dir, staged.token), self.path(staged.name)
        if fsync:
            fsync_file(tmp)
        directory = os.path.dirname(path)
        made = directory not in self._made
        if made:
            os.makedirs(directory, exist_ok=True)
        if not name_new(tmp, path):
            return False
        with self._lock:
            self._made.add(directory)
            self._dirty.update((directory, os.path.dirname(directory)) if made else (directory,))
        return True

    def replace(self, staged: Staged) -> None:
        path = self.path(staged.name)
        self._ensure_dir(os.path.dirname(path))
        publish(os.path.join(self.tmp_dir, staged.token), path)
        fsync_dir(os.path.dirname(path))

    def discard(self, staged: Staged) -> None:
        unlink_quietly(os.path.join(self.tmp_dir, staged.token))

    def staged(self, name: str, token: str) -> Staged:
        """A Staged named by another process: only a plain name stage() gives for `name`."""
        stem = "." + name.rpartition("/")[2]
        if not (isinstance(token, str) and token.startswith(stem) and _TMP_TAIL.fullmatch(token, len(stem))):
            raise CasError(f"{token!r} is not a temporary file staged for {name}")
        return Staged(name, token)

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        tmp = os.path.join(self.tmp_dir, staged.token)
        try:
            return os.path.getsize(tmp), read_head(tmp, nbytes)
        except OSError as exc:
            raise MissingObjectError(f"the staged file for {staged.name} cannot be read: {exc}") from None

    def sync(self) -> None:
        # The lock is held through the fsyncs so that a concurrent sync() cannot return while
        # another thread is still flushing a directory that holds its blobs too.
        with self._lock:
            for directory in sorted(self._dirty, key=len, reverse=True):  # fan-outs before their parent
                fsync_dir(directory)
            self._dirty.clear()

    def delete(self, name: str) -> bool:
        path = self.path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        with self._lock:
            self._dirty.add(os.path.dirname(path))
        return True

    def move(self, name: str, new_name: str) -> bool:
        """BlobAbsentError when there is nothing under `name` (a folder standing there moves too)."""
        path, dest = self.path(name), self.path(new_name)
        if not os.path.lexists(path):
            raise BlobAbsentError(f"{name} is missing from the store at {self.root}")
        self._ensure_dir(os.path.dirname(dest))
        if not name_new(path, dest):
            return False
        fsync_dir(os.path.dirname(path))
        fsync_dir(os.path.dirname(dest))
        return True

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._made:
            made = not os.path.isdir(directory)
            os.makedirs(directory, exist_ok=True)
            if made:
                fsync_dir(os.path.dirname(directory))
            self._made.add(directory)

    # --- leases and temporary files ---------------------------------------------------------
    def lease(self, name: str, info: bytes) -> FileLease:
        """Take lease `name`: its file is written and locked under a temporary name, then linked
        into place, so no one ever sees the lease without its lock."""
        path = self.path(name)
        self._ensure_dir(os.path.dirname(path))
        tmp = write_tmp(path, [info], tmp_dir=self.tmp_dir, fsync=False)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not name_new(tmp, path):
                raise CasError(f"lease {name} exists already in the store at {self.root}")
        except BaseException:
            os.close(fd)
            raise
        finally:
            unlink_quietly(tmp)
        return FileLease(name, path, fd)

    def take_over_lease(self, name: str, info: bytes) -> FileLease | None:
        """The lease file's lock, taken where its holder is gone (the kernel let go of it), while
        the file is still the one at its name; its content stays the old holder's."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # reaped and made anew meanwhile
                raise BlockingIOError
        except OSError:
            os.close(fd)
            return None
        return FileLease(name, path, fd)

    def lease_alive(self, name: str) -> bool | None:
        return lock_held(self.path(name))

    def clean_tmp(self) -> int:
        """Remove temporary files whose writer is provably gone: its owner file's lock can be
        taken (a live writer in another PID namespace, or on another host sharing the
        filesystem, keeps its lock, so its files stay). Files of writers from before owner files
        are judged as that cas did: this host's, with their process id gone. Then the dead
        owners' files go too (after their files: a file left without its owner would never go)."""
        tmp = self.tmp_dir
        names = os.listdir(tmp) if os.path.isdir(tmp) else []
        dead_owners: set[str] = set()
        removed = 0
        for name in names:
            if _tmp_file_dead(tmp, name, dead_owners):
                unlink_quietly(os.path.join(tmp, name))
                removed += 1
        for name in names:
            if name.startswith(OWNER_PREFIX) and not name.endswith(".new"):
                parts = name[len(OWNER_PREFIX):].split(".")
                if len(parts) == 3 and parts[1].isdigit() and owner_alive(tmp, parts[0], int(parts[1]),
                                                                          parts[2]) is False:
                    dead_owners.add(os.path.join(tmp, name))
        for path in dead_owners:
            unlink_quietly(path)
        return removed


def _tmp_file_dead(tmp: str, name: str, dead_owners: set[str]) -> bool:
    """Whether temporary file `name`'s writer is provably gone (its owner file, when it names
    one, goes into `dead_owners`)."""
    owner = tmp_owner(name)
    if owner is None:
        return False
    host = host_tag()
    writer_host, pid, token = owner
    if token is None:
        return writer_host in (host, None) and not pid_alive(pid)
    alive = owner_alive(tmp, writer_host or host, pid, token)
    if alive is False:
        dead_owners.add(owner_file(tmp, writer_host or host, pid, token))
    return alive is False


def _walk(directory: str, folder: str, start: str) -> Iterator[str]:
    """Blob names under `directory` (named `folder`), entries of its own filtered by `start`."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.startswith(start):
            continue
        name = f"{folder}/{entry.name}" if folder else entry.name
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(entry.path, name, "")
        else:
            yield name


def _mapped(fd: int, start: int, nbytes: int) -> memoryview:
    """A read-only view of `nbytes` at `start` of the file, mapped and populated at once. The
    mapping lives as long as views of it do (published blobs are never rewritten in place: a
    replacement is a new file renamed over, a removal leaves the open inode readable)."""
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, nbytes + start - aligned, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ,
                       offset=aligned)
    return memoryview(mapped)[start - aligned:start - aligned + nbytes]


def _pread_into(fd: int, buf: memoryview, nbytes: int, offset: int) -> memoryview:
    """Read `nbytes` at `offset` into the start of `buf` (short reads resumed); the bytes read."""
    filled = 0
    while filled < nbytes:
        n = os.preadv(fd, [buf[filled:nbytes]], offset + filled)
        if not n:
            break
        filled += n
    return buf[:filled]
