"""Where large encoded objects live: the backend interface and the local-files backend.

A backend stores opaque, immutable, content-named blobs. It knows nothing of encodings or of
what references what: the index (cas.index) says which objects are durably committed, and
only it is trusted for dedup. A second backend (object storage, say) is one new class with
these seven methods.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Iterable, Iterator, Protocol

from . import faults
from .errors import MissingObjectError
from .fanout import FanoutDir
from .fsutil import fsync_dir, fsync_file, name_new, publish, read_file, read_head, unlink_quietly, write_tmp
from .hashing import to_hex

MAX_OBJECT_FILE = (1 << 31) + 4096  # an encoded object never exceeds MAX_OBJECT_RAW plus its header


class ObjectBackend(Protocol):
    def get(self, key: bytes) -> bytes:
        """The stored bytes; MissingObjectError naming the key when absent."""

    def head(self, key: bytes, nbytes: int) -> bytes:
        """The first `nbytes` stored bytes (an object's header), without reading the rest."""

    def put(self, key: bytes, parts: Iterable) -> None:
        """Store the concatenation of `parts` under `key`, atomically. Durable once `sync()`
        returns."""

    def has(self, key: bytes) -> int | None:
        """Size in bytes of the stored object, or None when absent."""

    def delete(self, key: bytes) -> None:
        """Remove the object; absent is fine."""

    def iterate(self) -> Iterator[bytes]:
        """Every key stored (order unspecified); foreign names are skipped."""

    def sync(self) -> None:
        """Make every put so far durable (their directory entries included)."""


class FileObjects(FanoutDir):
    """One file per object under objects/ab/<64 hex digits>, written via tmp + fsync + rename."""

    def __init__(self, root: str, tmp_dir: str) -> None:
        super().__init__(root, tmp_dir)
        self._dirty: set[str] = set()
        self._made: set[str] = set()  # fan-out folders known to exist
        self._lock = threading.Lock()

    def get(self, key: bytes, buffer: Callable[[int], memoryview] | None = None):
        """The stored bytes; with `buffer`, read into the reusable buffer it gives (see read_file)."""
        path = self.path(key)
        try:
            return read_file(path, MAX_OBJECT_FILE, buffer)
        except FileNotFoundError:
            raise MissingObjectError("object file is missing", key=to_hex(key)) from None
        except (ValueError, OSError) as exc:  # too large, a directory, a symlink (ELOOP), unreadable
            raise MissingObjectError(f"object file cannot be read: {exc}", key=to_hex(key)) from None

    def head(self, key: bytes, nbytes: int) -> bytes:
        try:
            return read_head(self.path(key), nbytes)
        except FileNotFoundError:
            raise MissingObjectError("object file is missing", key=to_hex(key)) from None
        except OSError as exc:  # a directory, a symlink loop, unreadable: as get() reports them
            raise MissingObjectError(f"object file cannot be read: {exc}", key=to_hex(key)) from None

    def put(self, key: bytes, parts: Iterable) -> None:
        self.publish([self.stage(key, parts, fsync=True)], fsync=False)

    def stage(self, key: bytes, parts: Iterable, *, fsync: bool = False) -> tuple[str, bytes]:
        """Write an object to a temporary file, not yet visible under its name. A writer stages
        its objects while it encodes and publishes them all before its commit: the fsyncs then
        come in one batch instead of stalling a worker thread after each object."""
        return write_tmp(self.path(key), parts, tmp_dir=self.tmp_dir, fsync=fsync), key

    def publish(self, staged: list[tuple[str, bytes]], *, fsync: bool = True) -> None:
        """fsync each staged file (unless done already) and rename it into place; sync() then
        makes the renames durable. A file under its final name is always complete."""
        for tmp, key in staged:
            path = self.path(key)
            directory = os.path.dirname(path)
            if directory not in self._made:
                os.makedirs(directory, exist_ok=True)
                with self._lock:
                    self._made.add(directory)
                    self._dirty.add(self.root)
            publish(tmp, path, fsync=fsync)
            with self._lock:
                self._dirty.add(directory)

    def place_new(self, staged: tuple[str, bytes], *, fsync: bool = False) -> bool:
        """Give a staged file its object's name (fsyncing it first when asked) unless a file
        holds that name already: False then, and the staged file is left as it is. An existing
        file may be indexed by another writer, and other checkpoints decode through it, so it
        never changes under them; the writer decides with the index (WriteSession.commit and
        adopt). sync() makes the new names durable."""
        tmp, key = staged
        if fsync:
            fsync_file(tmp)
        path = self.path(key)
        directory = os.path.dirname(path)
        made = directory not in self._made
        if made:
            os.makedirs(directory, exist_ok=True)
        faults.point("objects.placing")
        if not name_new(tmp, path):
            return False
        with self._lock:
            self._made.add(directory)
            self._dirty.update((directory, self.root) if made else (directory,))
        return True

    @staticmethod
    def discard(staged: list[tuple[str, bytes]]) -> None:
        for tmp, _ in staged:
            unlink_quietly(tmp)

    def has(self, key: bytes) -> int | None:
        return self.size(key)

    def delete(self, key: bytes) -> None:
        if self.unlink(key):
            with self._lock:
                self._dirty.add(os.path.dirname(self.path(key)))

    def iterate(self) -> Iterator[bytes]:
        return self.names()

    def sync(self) -> None:
        # The lock is held through the fsyncs so that a concurrent sync() cannot return while
        # another thread is still flushing a directory that holds its objects too.
        with self._lock:
            for directory in sorted(self._dirty, key=len, reverse=True):  # fan-outs before root
                fsync_dir(directory)
            self._dirty.clear()
