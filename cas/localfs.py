"""The local-filesystem backend: blobs as files under the store's folder (cas.backend's contract).

Create-only writes go to a temporary file, are fsynced, and take their name by a rename that
never replaces a file (fsutil.name_new: renameat2 RENAME_NOREPLACE, else a hard link) (two writers racing on one name: one wins);
the directory is fsynced before put_if_absent returns. Leases are files holding an exclusive
`flock` for as long as their holder lives: the kernel drops the lock when the holder dies,
however it dies, and in whatever PID namespace it ran, so a lease is judged dead only when its
lock can be taken (never from a process id or a clock).
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Iterable

from .backend import Capabilities
from .errors import CasError, MissingObjectError
from .fsutil import fsync_dir, lock_held, name_new, unlink_quietly, write_tmp

MAX_BLOB = 1 << 30  # log entries and leases are small; a larger file is not one of ours


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


class LocalBackend:
    """Blobs as files under `root`; temporary files in `tmp_dir`."""

    def __init__(self, root: str, tmp_dir: str) -> None:
        self.root = root
        self.tmp_dir = tmp_dir
        self.capabilities = Capabilities(locks=True, local_path=root)
        self._made: set[str] = set()

    def _path(self, name: str) -> str:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise CasError(f"not a blob name: {name!r}")
        return os.path.join(self.root, *parts)

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise MissingObjectError(f"{name} is missing from the store at {self.root}") from None
        except OSError as exc:  # a folder or a symlink in its place
            raise MissingObjectError(f"{name} in the store at {self.root} cannot be read: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            end = size if length is None else min(size, start + length)
            if end - start > MAX_BLOB:
                raise MissingObjectError(f"{name} is {size} bytes: not a blob this store wrote")
            return os.pread(fd, max(end - start, 0), start)
        finally:
            os.close(fd)

    def stat(self, name: str) -> int | None:
        try:
            return os.stat(self._path(name), follow_symlinks=False).st_size
        except FileNotFoundError:
            return None

    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        path = self._path(name)
        self._ensure_dir(os.path.dirname(path))
        tmp = write_tmp(path, parts, tmp_dir=self.tmp_dir, fsync=True)
        try:
            created = name_new(tmp, path)
        finally:
            unlink_quietly(tmp)
        if created:
            fsync_dir(os.path.dirname(path))
        return created

    def list(self, prefix: str) -> list[str]:
        """Names under `prefix` ('log/' lists that folder; a partial last part filters it)."""
        folder, _, start = prefix.rpartition("/")
        directory = self._path(folder) if folder else self.root
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(f"{folder}/{n}" if folder else n for n in names
                      if n.startswith(start) and not n.startswith("."))

    def delete(self, name: str) -> bool:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return False
        return True

    def lease(self, name: str, info: bytes) -> FileLease:
        """Take lease `name`: its file is written and locked under a temporary name, then linked
        into place, so no one ever sees the lease without its lock."""
        path = self._path(name)
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

    def lease_alive(self, name: str) -> bool | None:
        return lock_held(self._path(name))

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._made:
            made = not os.path.isdir(directory)
            os.makedirs(directory, exist_ok=True)
            if made:
                fsync_dir(os.path.dirname(directory))
            self._made.add(directory)
