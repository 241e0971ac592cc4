"""Large encoded objects, one blob each, named objects/ab/<64 hex digits> in the backend.

A thin layer over cas.backend: it names objects by key and says which errors mean what; how
bytes are staged, named without replacing, synced or listed is the backend's. It knows nothing
of encodings or of what references what: the index (cas.index) says which objects are durably
committed, and only it is trusted for dedup.
"""

from __future__ import annotations

from typing import Iterable

from . import faults
from .backend import Backend, Buffer, Staged
from .errors import BlobAbsentError, MissingObjectError
from .fanout import Fanout
from .hashing import to_hex

PREFIX = "objects"


class FileObjects(Fanout):
    """One blob per object, staged while a save encodes and named before its commit."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, PREFIX)

    def get(self, key: bytes, buffer: Buffer | None = None):
        """The stored bytes; with `buffer`, read into the reusable buffer it gives (no copy)."""
        return self._read(key, None, buffer)

    def head(self, key: bytes, nbytes: int) -> bytes:
        """The first `nbytes` stored bytes (an object's header), without reading the rest."""
        return self._read(key, nbytes, None)

    def _read(self, key: bytes, length: int | None, buffer: Buffer | None):
        try:
            return self.backend.get(self.name(key), 0, length, buffer=buffer)
        except BlobAbsentError:
            raise MissingObjectError("object file is missing", key=to_hex(key)) from None
        except MissingObjectError as exc:  # too large, a directory, a symlink (ELOOP), unreadable
            raise MissingObjectError(f"object file cannot be read: {exc.detail}", key=to_hex(key)) from None

    def put(self, key: bytes, parts: Iterable) -> None:
        """Store an object at once, over any file of it (tests and tools; saves stage)."""
        self.backend.replace(self.stage(key, parts, fsync=True))

    def stage(self, key: bytes, parts: Iterable, *, fsync: bool = False) -> Staged:
        """Write an object, not yet visible under its name. A writer stages its objects while it
        encodes and names them all before its commit: the fsyncs then come in one batch
        instead of stalling a worker thread after each object."""
        return self.backend.stage(self.name(key), parts, fsync=fsync)

    def staged(self, key: bytes, token: str) -> Staged:
        """The object another process of this store staged under `token` (a DCP rank's)."""
        return self.backend.staged(self.name(key), token)

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        """(size, first `nbytes` bytes) of a staged object; MissingObjectError when gone."""
        return self.backend.peek(staged, nbytes)

    @staticmethod
    def key_of(staged: Staged) -> bytes:
        return bytes.fromhex(staged.name.rpartition("/")[2])

    def place_new(self, staged: Staged, *, fsync: bool = False) -> bool:
        """Give a staged object its name (fsyncing it first when asked) unless a file holds
        that name already: False then, and the staged object is left as it is. An existing
        file may be indexed by another writer, and other checkpoints decode through it, so it
        never changes under them; the writer decides with the index (WriteSession.commit and
        adopt). sync() makes the new names durable."""
        faults.point("objects.placing")
        return self.backend.publish(staged, fsync=fsync)

    def replace(self, staged: Staged) -> None:
        """Put a staged object in place of the file under its name, durably: only inside the
        commit transaction that settles the name (WriteSession.commit)."""
        self.backend.replace(staged)

    def discard(self, staged: list[Staged]) -> None:
        for one in staged:
            self.backend.discard(one)

    def has(self, key: bytes) -> int | None:
        """Size in bytes of the stored object, or None when absent."""
        return self.size(key)

    def delete(self, key: bytes) -> None:
        """Remove the object (absent is fine); durable after sync()."""
        self.backend.delete(self.name(key))

    def sync(self) -> None:
        """Make every name given and removed so far durable."""
        self.backend.sync()
