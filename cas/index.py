"""The LMDB environment: object index, inline objects, write leases and their holds.

One LMDB write transaction is atomic and durable (synced at commit), and readers never block
writers; every state change of the store is one such transaction. Upper layers (the
checkpoint registry) open their own named databases in the same environment so that their
change commits in the same transaction as the objects it references.

The index is a cache of what is on disk: object files and pack files are self-describing, and
`cas repair` rebuilds it from them (store/repair.py).

Tables (see docs/format.md, "Index"):
  objects  key -> ObjectRecord        every object that is durably stored, and where
  leases   lease id -> msgpack        writers in progress (pid, host, start time)
  holds    lease id + key -> b""      objects an in-progress writer references
  meta     name -> value              counters (the commit generation)
  damaged  key -> msgpack             objects found damaged (reason, found, by): saves do not reuse them
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import lmdb
import msgpack

from .errors import CasError, ReadOnlyStoreError
from .hashing import KEY_SIZE

WHERE_FILE = 0  # objects/ab/<key>
WHERE_PACK = 2  # an entry of a pack file
FLAG_BASE = 1  # the object is a delta against a base object (an edge gc must follow)
_RECORD = struct.Struct("<BBQQ")  # where, flags, stored (encoded) size, raw size
_PACK_LOC = struct.Struct("<32sQ")  # pack key, offset of the encoded object in it
LEASE_ID_SIZE = 16
_TABLES = ("objects", "leases", "holds", "meta")
# Tables added after stores were first written: a read-only open of an older store goes without.
_LATER_TABLES = ("damaged",)
DEFAULT_MAP_SIZE = 1 << 40  # address space only: the file grows as data is written


@dataclass(frozen=True)
class ObjectRecord:
    where: int
    stored_size: int
    raw_size: int
    pack: bytes | None = None  # for WHERE_PACK: the pack's key ...
    offset: int = 0  # ... and where the encoded object starts in it
    base: bytes | None = None  # for a delta: the object it is coded against ...
    depth: int = 0  # ... and how many deltas deep it sits (a full object is 0)

    def pack_bytes(self) -> bytes:
        out = _RECORD.pack(self.where, FLAG_BASE if self.base else 0, self.stored_size, self.raw_size)
        if self.where == WHERE_PACK:
            out += _PACK_LOC.pack(self.pack, self.offset)
        return out + (self.base + bytes([self.depth]) if self.base else b"")

    @classmethod
    def unpack(cls, data: bytes) -> "ObjectRecord":
        try:
            where, flags, stored, raw = _RECORD.unpack_from(data, 0)
            pos, pack, offset, base = _RECORD.size, None, 0, None
            if where == WHERE_PACK:
                pack, offset = _PACK_LOC.unpack_from(data, pos)
                pos += _PACK_LOC.size
            elif where != WHERE_FILE:
                raise ValueError(f"unknown location {where}")
            depth = 0
            if flags & FLAG_BASE:
                base = bytes(data[pos:pos + KEY_SIZE])
                depth = data[pos + KEY_SIZE] if len(data) > pos + KEY_SIZE else -1
                pos += KEY_SIZE + 1
            if pos != len(data) or (base is not None and (len(base) != KEY_SIZE or depth < 1)):
                raise ValueError("wrong length")
        except (struct.error, ValueError, IndexError) as exc:
            raise CasError(f"an index record is damaged ({exc}); run `cas repair` to rebuild the index") from None
        return cls(where, stored, raw, pack, offset, base, depth)


_envs: dict[str, list] = {}  # real path -> [environment, opened read-only, users, {table name: handle}]
_envs_lock = threading.Lock()


def _shared_env(path: str, *, readonly: bool, create: bool, map_size: int) -> tuple[lmdb.Environment, dict]:
    """One LMDB environment per store and process, shared by every Store opened on it (LMDB
    forbids opening an environment twice in a process, and its transactions are thread-safe),
    with its table handles: opening a table again would start a transaction, which waits for
    LMDB's writer lock while holding the GIL, so a store opened while another thread of the
    process is in a write transaction (a DCP async save committing) deadlocked."""
    real = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(real)
        if entry is not None:
            if entry[1] and not readonly:
                raise CasError(f"the store index at {path} is already open read-only in this process; "
                               "close that store before opening it for writing")
            entry[2] += 1
            return entry[0], entry[3]
        try:
            env = lmdb.open(path, subdir=True, create=create, readonly=readonly,
                            lock=not readonly or os.access(path, os.W_OK),
                            map_size=map_size, max_dbs=16, max_readers=512,
                            readahead=False, sync=True, metasync=True)
        except lmdb.Error as exc:
            raise CasError(f"cannot open the store index at {path}: {exc}; `cas repair` rebuilds it "
                           "from the objects on disk") from None
        _envs[real] = [env, readonly, 1, {}]
        return env, _envs[real][3]


def _release_env(path: str) -> None:
    real = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(real)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del _envs[real]
            entry[0].close()


class Index:
    """The store's LMDB environment and its tables."""

    def __init__(self, path: str, *, readonly: bool = False, create: bool = False,
                 map_size: int = DEFAULT_MAP_SIZE, extra_tables: tuple = ()) -> None:
        self.path = path
        self.readonly = readonly
        self.env, handles = _shared_env(path, readonly=readonly, create=create, map_size=map_size)
        self.tables = {}
        for name in _TABLES + _LATER_TABLES + tuple(extra_tables):
            try:
                with _envs_lock:
                    if name not in handles:  # the environment's first Index opens each table once
                        handles[name] = self.env.open_db(name.encode(), create=not readonly)
                    self.tables[name] = handles[name]
            except lmdb.NotFoundError:
                if not (readonly and name in _LATER_TABLES):
                    raise
            except lmdb.Error as exc:
                _release_env(path)
                raise CasError(f"the store index at {path} cannot open table {name!r} ({exc}): it is damaged "
                               "or was written by another program; `cas repair` rebuilds it") from None

    def close(self) -> None:
        _release_env(self.path)

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

    def put_record(self, txn, key: bytes, rec: ObjectRecord) -> None:
        txn.put(key, rec.pack_bytes(), db=self.tables["objects"])

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

    # --- damage found (a cache of findings: if lost, the next verify finds them again) -----
    def any_damaged(self, txn) -> bool:
        """Whether any object is recorded as damaged (the common answer, no, costs one lookup)."""
        db = self.tables.get("damaged")
        return db is not None and txn.stat(db)["entries"] > 0

    def damaged(self, txn, key: bytes) -> dict | None:
        """The damage record of an object: {"reason", "found" (UNIX time), "by"}, or None."""
        db = self.tables.get("damaged")
        raw = txn.get(key, db=db) if db is not None else None
        return msgpack.unpackb(raw) if raw is not None else None

    def iter_damaged(self, txn) -> Iterator[tuple[bytes, dict]]:
        db = self.tables.get("damaged")
        for key, raw in txn.cursor(db=db) if db is not None else ():
            yield bytes(key), msgpack.unpackb(raw)

    def mark_damaged(self, txn, key: bytes, reason: str, by: str) -> None:
        self.put_damaged(txn, key, {"reason": reason, "found": time.time(), "by": by})

    def put_damaged(self, txn, key: bytes, info: dict) -> None:
        txn.put(key, msgpack.packb(info), db=self.tables["damaged"])

    def clear_damaged(self, txn, key: bytes) -> None:
        txn.delete(key, db=self.tables["damaged"])

    # --- counters ------------------------------------------------------------------------
    def generation(self, txn) -> int:
        raw = txn.get(b"generation", db=self.tables["meta"])
        return int.from_bytes(raw, "big") if raw else 0

    def bump_generation(self, txn) -> int:
        gen = self.generation(txn) + 1
        txn.put(b"generation", gen.to_bytes(8, "big"), db=self.tables["meta"])
        return gen
