"""Content-addressed objects over the index and a backend, and the write session protocol.

A writer works inside a WriteSession, which holds a lease in the index:
  1. claim(keys): one write transaction records a hold on each key and says which keys are
     already durably stored (index record present, and for file objects the file is there with
     its recorded size). Held keys are never swept by gc, so a claimed object stays put.
  2. write(key, raw): encode and store the absent ones, in worker threads. Small encoded
     objects are kept for the next transaction (they live inside LMDB); large ones become files.
  3. commit(finish): fsync the directories, then one write transaction indexes every object
     written, runs `finish` (the caller's registry change, e.g. a checkpoint), and ends the
     lease. Before it, nothing the session wrote is referenced; after it, all of it is durable.
The index, not the presence of a file, decides dedup: a file left by a crash is rewritten.
"""

from __future__ import annotations

import secrets
import threading
from typing import Callable, TypeVar

import numpy as np

from . import faults
from .codecs import CodecPolicy, decode_into, parse_header
from .errors import MissingObjectError, StoreClosedError
from .index import LEASE_ID_SIZE, WHERE_FILE, WHERE_INLINE, Index, ObjectRecord
from .objects import ObjectBackend

T = TypeVar("T")
DEFAULT_INLINE_MAX = 64 << 10  # encoded objects up to this size live in LMDB, not in files


class ObjectStore:
    def __init__(self, index: Index, files: ObjectBackend, codec: CodecPolicy,
                 inline_max: int = DEFAULT_INLINE_MAX) -> None:
        self.index = index
        self.files = files
        self.codec = codec
        self.inline_max = inline_max

    def fetch(self, key: bytes) -> bytes:
        """The encoded bytes of an object, wherever it lives; MissingObjectError if nowhere."""
        with self.index.read() as txn:
            data = self.index.inline_get(txn, key)
        return data if data is not None else self.files.get(key)

    def get(self, key: bytes, out: np.ndarray | None = None) -> np.ndarray:
        """Decoded, hash-checked raw bytes of an object (into `out` when given)."""
        return decode_into(self.fetch(key), key, out)

    def codec_of(self, key: bytes) -> str:
        return parse_header(self.fetch(key), key=key).codec_name

    def session(self, purpose: str) -> "WriteSession":
        return WriteSession(self, purpose)


class WriteSession:
    """One writer's lease: claims, writes and a single commit. Use as a context manager; leaving
    the block without commit() ends the lease and leaves what was written to gc."""

    def __init__(self, store: ObjectStore, purpose: str) -> None:
        self.store = store
        self.index = store.index
        self.lease = secrets.token_bytes(LEASE_ID_SIZE)
        self.new_bytes = 0
        self._claimed: set[bytes] = set()
        self._pending_inline: dict[bytes, tuple[bytes, int]] = {}
        self._written: dict[bytes, ObjectRecord] = {}
        self._lock = threading.Lock()
        self._open = True
        with self.index.write() as txn:
            self.index.new_lease(txn, self.lease, purpose)

    def __enter__(self) -> "WriteSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._open:
            self.abort()

    def claim(self, keys: list[bytes]) -> list[bool]:
        """Hold `keys` for this session; True for each key that is already stored (or claimed
        earlier in this session), False for each the caller must write."""
        self._check_open()
        records: list = []
        with self.index.write() as txn:
            self._flush_inline(txn)
            for key in keys:
                if key in self._claimed:
                    records.append(True)
                    continue
                self._claimed.add(key)
                self.index.hold(txn, self.lease, key)
                records.append(self.index.record(txn, key))
        # Held keys cannot be swept from here on, so the file checks may run outside the txn.
        return [rec is True or self._is_stored(key, rec) for key, rec in zip(keys, records)]

    def _is_stored(self, key: bytes, rec: ObjectRecord | None) -> bool:
        if rec is None:
            return False
        return rec.where == WHERE_INLINE or self.store.files.has(key) == rec.stored_size

    def write(self, key: bytes, raw, element_size: int = 1) -> int:
        """Encode and store one object (thread-safe); returns its encoded size."""
        parts = self.store.codec.encode(raw, element_size)
        size = sum(memoryview(p).nbytes for p in parts)
        raw_size = memoryview(raw).nbytes
        if size <= self.store.inline_max:
            blob = b"".join(bytes(p) for p in parts)
            with self._lock:
                self._pending_inline[key] = (blob, raw_size)
        else:
            self.store.files.put(key, parts)
            with self._lock:
                self._written[key] = ObjectRecord(WHERE_FILE, size, raw_size)
        return size

    def adopt(self, key: bytes) -> int:
        """Index at commit a file object that another process wrote (a DCP rank, which cannot
        touch LMDB): its header must parse and give its raw size. Returns its stored size."""
        data_size = self.store.files.has(key)
        if data_size is None:
            raise MissingObjectError("an object a distributed writer reported is not in the store", key=key.hex())
        head = parse_header(self.store.files.head(key, 64), key=key)
        with self._lock:
            if key not in self._written:
                self._written[key] = ObjectRecord(WHERE_FILE, data_size, head.raw_size)
        return data_size

    def commit(self, finish: Callable[[object], T]) -> T:
        """Make every written object durable, then in one transaction index them, run
        `finish(txn)` and end the lease. If `finish` raises, nothing of it is committed."""
        self._check_open()
        self.store.files.sync()
        faults.point("commit.synced")
        with self.index.write() as txn:
            self._flush_inline(txn)
            for key, rec in self._written.items():
                if self.index.record(txn, key) is None:
                    self.new_bytes += rec.stored_size
                txn.put(key, rec.pack(), db=self.index.db("objects"))
            result = finish(txn)
            self.index.end_lease(txn, self.lease)
            self.index.bump_generation(txn)
        self._open = False
        return result

    def abort(self) -> None:
        """End the lease without committing; written objects become garbage for gc."""
        if not self._open:
            return
        self._open = False
        try:
            with self.index.write() as txn:
                self.index.end_lease(txn, self.lease)
        except Exception:  # the lease of a dead writer is reclaimed by gc anyway
            pass

    def _flush_inline(self, txn) -> None:
        with self._lock:
            pending, self._pending_inline = self._pending_inline, {}
        objects, inline = self.index.db("objects"), self.index.db("inline")
        for key, (blob, raw_size) in pending.items():
            if self.index.record(txn, key) is None:
                self.new_bytes += len(blob)
            txn.put(key, blob, db=inline)
            txn.put(key, ObjectRecord(WHERE_INLINE, len(blob), raw_size).pack(), db=objects)

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosedError("this write session has already been committed or aborted")
