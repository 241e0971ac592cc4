"""The backend contract: what every place a store can live (a folder, a bucket) must do.

A backend is a flat space of immutable blobs under '/'-separated names (`log/000…01`,
`leases/…`, `objects/ab/ab12…`, `packs/ab/ab12…`), in the spirit of zarr-python's abc.Store and
restic's backend.Backend. It knows nothing of encodings, checkpoints or the index. Every
operation the store's truth depends on is one of these:

  get(name, start, length, buffer)  ranged read (into a caller's reusable buffer when given:
                             the load path reads every object file so); BlobAbsentError when
                             absent, MissingObjectError when unreadable
  stat(name)                 size in bytes, or None
  put_if_absent(name, parts) create-only write, durable when it returns: False (and nothing
                             changed) when the name exists. Two writers racing on one name:
                             exactly one gets True. This is the commit primitive.
  stage(name, parts)         write bytes meant to become `name`, not yet visible under it: a
                             saver stages while it encodes and names them all before its commit
  publish(staged)            give staged bytes their name, create-only (False, the staged bytes
                             left for the caller, when the name exists); durable after sync()
  replace(staged)            give them their name even over an existing blob, durably: only the
                             commit transaction that settles a name does this (architecture.md,
                             invariant 2)
  discard(staged)            drop staged bytes
  staged(name, token)        the staged bytes another process of this store wrote (a DCP rank
                             reports `Staged.token`); CasError for a token it could not have given
  peek(staged, nbytes)       (size, first nbytes) of staged bytes
  sync()                     make every publish and delete so far durable (batched: a local
                             folder fsyncs each touched directory once)
  list(prefix)               names under a prefix, at any depth, sorted
  list_sizes(prefix)         the same with each blob's size (a bucket's listing carries them)
  delete(name)               remove; absent is fine; durable after sync()
  move(name, new_name)       give a blob another name, never over one (quarantine keeps a
                             damaged object's bytes this way), durably; False when taken
  free_bytes()               room left for writes (None: no limit to plan around); gc plans
                             pack rewrites against it
  where(name)                where a blob is, for messages (a file's path, a URL)
  clean_tmp()                drop staged bytes whose writer is provably gone
  lease(name, info)          a lease that lasts while its holder lives, and is seen to end
                             when the holder dies, however it dies (lease_alive)

Capabilities say what a backend offers beyond that, so callers choose a protocol instead of
probing: `locks` (lease liveness is proven by the holder's lock, not guessed from a clock),
`local_path` (a folder on this host: LMDB caches may live in it, and tests and tools may reach
a blob's file through `path(name)`), `batched_sync` (publishes and deletes are durable only
after sync(): an object store's are durable at once and its sync() does nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

MAX_BLOB = (1 << 31) + 4096  # an object file (MAX_OBJECT_RAW plus its header) or a pack, at most

Buffer = Callable[[int], memoryview]  # gives a writable buffer of at least n bytes (reused)


@dataclass(frozen=True)
class Capabilities:
    locks: bool  # lease_alive() is a fact (an OS lock held by a live holder), never a guess
    local_path: str | None  # the folder, when the backend is one on this host
    batched_sync: bool = True  # publish/delete are durable only once sync() returns


@dataclass(frozen=True)
class Staged:
    """Bytes written for `name` but not visible under it; `token` is the backend's handle on
    them (a local temporary file's name), which another process of the store may be given."""

    name: str
    token: str


class Lease(Protocol):
    name: str

    def release(self) -> None:
        """End the lease (idempotent)."""


class Backend(Protocol):
    capabilities: Capabilities

    def get(self, name: str, start: int = 0, length: int | None = None, *, buffer: Buffer | None = None):
        """Bytes [start, start+length) of the blob (to its end when length is None), as bytes,
        or with `buffer` as a memoryview into the buffer it gives (valid until it is reused)."""

    def stat(self, name: str) -> int | None:
        """The blob's size, or None when there is none."""

    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        """Create the blob from the concatenated parts, durably; False if the name exists."""

    def stage(self, name: str, parts: Iterable, *, fsync: bool = False) -> Staged:
        """Write the parts for `name` without making them visible (fsync: durable bytes now)."""

    def publish(self, staged: Staged, *, fsync: bool = False) -> bool:
        """Name staged bytes (making them durable first when asked), never over an existing
        blob: False then, and `staged` is left as it is. Durable once sync() returns."""

    def replace(self, staged: Staged) -> None:
        """Name staged bytes over whatever holds the name, durably (the commit's settling only)."""

    def discard(self, staged: Staged) -> None:
        """Drop staged bytes (absent is fine)."""

    def staged(self, name: str, token: str) -> Staged:
        """The Staged for bytes this store's backend staged for `name` under `token` (in another
        process); CasError when `token` is not one it gives for that name."""

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        """(size, first `nbytes` bytes) of staged bytes; MissingObjectError when gone."""

    def sync(self) -> None:
        """Make every publish and delete so far durable."""

    def list(self, prefix: str) -> list[str]:
        """Every name starting with `prefix`, at any depth, sorted; names the backend did not
        write (its own temporary files) are skipped."""

    def list_sizes(self, prefix: str) -> list[tuple[str, int]]:
        """(name, size) of every blob `list(prefix)` names, in the same order."""

    def delete(self, name: str) -> bool:
        """Remove the blob; True when there was one."""

    def move(self, name: str, new_name: str) -> bool:
        """Rename a blob, never over an existing one (False then), durably."""

    def free_bytes(self) -> int | None:
        """Bytes that may still be written, or None when the backend has no such limit."""

    def where(self, name: str) -> str:
        """The blob's location as a person would look for it (messages and reports only)."""

    def clean_tmp(self) -> int:
        """Remove staged bytes whose writer is provably gone; returns how many went."""

    def lease(self, name: str, info: bytes) -> Lease:
        """Take the lease `name` (a blob holding `info`) for as long as this process holds it."""

    def take_over_lease(self, name: str, info: bytes) -> Lease | None:
        """Take the lease `name` from a holder that is provably gone, atomically (of two takers
        one wins); None when the holder lives, there is no such lease, or another took it."""

    def lease_alive(self, name: str) -> bool | None:
        """True while the lease's holder lives, False once it is provably gone (a dead holder's
        lease may then be reaped), None when there is no such lease."""
