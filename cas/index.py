"""The LMDB environment: object index, inline objects, write leases and their holds.

One LMDB write transaction is atomic and durable (synced at commit), and readers never block
writers; every state change of the store is one such transaction. Upper layers (the
checkpoint registry) open their own named databases in the same environment so that their
change commits in the same transaction as the objects it references.

Tables (see docs/format.md, "Index"):
  objects  key -> ObjectRecord        every object that is durably stored, and where
  inline   key -> encoded object      small objects live here instead of in files
  leases   lease id -> msgpack        writers in progress (pid, host, start time)
  holds    lease id + key -> b""      objects an in-progress writer references
  meta     name -> value              counters (the commit generation)
"""

from __future__ import annotations

import os
import socket
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import lmdb
import msgpack

from .errors import CasError, ReadOnlyStoreError
from .hashing import KEY_SIZE

WHERE_FILE = 0
WHERE_INLINE = 1
_RECORD = struct.Struct("<BQQ")  # where, stored (encoded) size, raw size
LEASE_ID_SIZE = 16
_TABLES = ("objects", "inline", "leases", "holds", "meta")
DEFAULT_MAP_SIZE = 1 << 40  # address space only: the file grows as data is written


@dataclass(frozen=True)
class ObjectRecord:
    where: int
    stored_size: int
    raw_size: int

    def pack(self) -> bytes:
        return _RECORD.pack(self.where, self.stored_size, self.raw_size)

    @classmethod
    def unpack(cls, data: bytes) -> "ObjectRecord":
        if len(data) != _RECORD.size:
            raise CasError(f"index record has {len(data)} bytes, expected {_RECORD.size}: the index is damaged")
        return cls(*_RECORD.unpack(data))


class Index:
    """The store's LMDB environment and its tables."""

    def __init__(self, path: str, *, readonly: bool = False, create: bool = False,
                 map_size: int = DEFAULT_MAP_SIZE, extra_tables: tuple = ()) -> None:
        self.path = path
        self.readonly = readonly
        try:
            self.env = lmdb.open(path, subdir=True, create=create, readonly=readonly,
                                 lock=not readonly or os.access(path, os.W_OK),
                                 map_size=map_size, max_dbs=16, max_readers=512,
                                 readahead=False, sync=True, metasync=True)
        except lmdb.Error as exc:
            raise CasError(f"cannot open the store index at {path}: {exc}") from None
        self.tables = {}
        for name in _TABLES + tuple(extra_tables):
            try:
                self.tables[name] = self.env.open_db(name.encode(), create=not readonly)
            except lmdb.NotFoundError:
                raise CasError(f"the store index at {path} lacks table {name!r}: it is damaged "
                               "or was written by another program") from None

    def close(self) -> None:
        self.env.close()

    def db(self, name: str):
        return self.tables[name]

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        with self.env.begin(write=False, buffers=False) as txn:
            yield txn

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """One atomic, synced write transaction; aborted if the block raises."""
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {os.path.dirname(self.path)} is open read-only")
        with self.env.begin(write=True) as txn:
            yield txn

    # --- objects -------------------------------------------------------------------------
    def record(self, txn, key: bytes) -> ObjectRecord | None:
        raw = txn.get(key, db=self.tables["objects"])
        return ObjectRecord.unpack(raw) if raw is not None else None

    def iter_records(self, txn) -> Iterator[tuple[bytes, ObjectRecord]]:
        for key, raw in txn.cursor(db=self.tables["objects"]):
            yield bytes(key), ObjectRecord.unpack(raw)

    def inline_get(self, txn, key: bytes) -> bytes | None:
        return txn.get(key, db=self.tables["inline"])

    # --- leases and holds ----------------------------------------------------------------
    def new_lease(self, txn, lease: bytes, purpose: str) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "purpose": purpose}
        txn.put(lease, msgpack.packb(info), db=self.tables["leases"])

    def hold(self, txn, lease: bytes, key: bytes) -> None:
        txn.put(lease + key, b"", db=self.tables["holds"])

    def end_lease(self, txn, lease: bytes) -> None:
        holds = self.tables["holds"]
        cur = txn.cursor(db=holds)
        if cur.set_range(lease):
            while cur.key()[:LEASE_ID_SIZE] == lease:
                if not cur.delete():
                    break
        txn.delete(lease, db=self.tables["leases"])

    def leases(self, txn) -> dict[bytes, dict]:
        return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor(db=self.tables["leases"])}

    def held_keys(self, txn) -> set[bytes]:
        return {bytes(k[LEASE_ID_SIZE:LEASE_ID_SIZE + KEY_SIZE]) for k in txn.cursor(db=self.tables["holds"]).iternext(values=False)}

    # --- counters ------------------------------------------------------------------------
    def generation(self, txn) -> int:
        raw = txn.get(b"generation", db=self.tables["meta"])
        return int.from_bytes(raw, "big") if raw else 0

    def bump_generation(self, txn) -> int:
        gen = self.generation(txn) + 1
        txn.put(b"generation", gen.to_bytes(8, "big"), db=self.tables["meta"])
        return gen
