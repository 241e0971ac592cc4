"""The backend contract: what every place a store can live (a folder, a bucket) must do.

A backend is a flat space of immutable blobs under '/'-separated names (`log/000…01`,
`leases/…`), in the spirit of zarr-python's abc.Store and restic's backend.Backend. It knows
nothing of encodings, checkpoints or the index. Every operation the store's truth depends on is
one of these:

  get(name, start, length)   ranged read; MissingObjectError when absent
  stat(name)                 size in bytes, or None
  put_if_absent(name, parts) create-only write, durable when it returns: False (and nothing
                             changed) when the name exists. Two writers racing on one name:
                             exactly one gets True. This is the commit primitive.
  list(prefix)               names under a prefix, sorted
  delete(name)               remove; absent is fine
  lease(name, info)          a lease that lasts while its holder lives, and is seen to end
                             when the holder dies, however it dies (lease_alive)

Capabilities say what a backend offers beyond that, so callers choose a protocol instead of
probing: `locks` (lease liveness is proven by the holder's lock, not guessed from a clock),
`local_path` (a folder on this host: LMDB caches and object files may live in it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol


@dataclass(frozen=True)
class Capabilities:
    locks: bool  # lease_alive() is a fact (an OS lock held by a live holder), never a guess
    local_path: str | None  # the folder, when the backend is one on this host


class Lease(Protocol):
    name: str

    def release(self) -> None:
        """End the lease (idempotent)."""


class Backend(Protocol):
    capabilities: Capabilities

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes [start, start+length) of the blob (to its end when length is None)."""

    def stat(self, name: str) -> int | None:
        """The blob's size, or None when there is none."""

    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        """Create the blob from the concatenated parts, durably; False if the name exists."""

    def list(self, prefix: str) -> list[str]:
        """Every name starting with `prefix`, sorted; names the backend did not write are
        skipped."""

    def delete(self, name: str) -> bool:
        """Remove the blob; True when there was one."""

    def lease(self, name: str, info: bytes) -> Lease:
        """Take the lease `name` (a blob holding `info`) for as long as this process holds it."""

    def lease_alive(self, name: str) -> bool | None:
        """True while the lease's holder lives, False once it is provably gone (a dead holder's
        lease may then be reaped), None when there is no such lease."""
