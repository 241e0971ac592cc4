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

import errno
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import lmdb
import msgpack

from .errors import CasError, IndexDamagedError, IndexReplacedError, ReadOnlyStoreError, StoreWriteError
from .hashing import KEY_SIZE

WHERE_FILE = 0  # objects/ab/<key>
WHERE_PACK = 2  # an entry of a pack file
FLAG_BASE = 1  # the object is a delta against a base object (an edge gc must follow)
_RECORD = struct.Struct("<BBQQ")  # where, flags, stored (encoded) size, raw size
_PACK_LOC = struct.Struct("<32sQ")  # pack key, offset of the encoded object in it
LEASE_ID_SIZE = 16
_TABLES = ("objects", "leases", "holds", "meta")
# Tables added after stores were first written: a read-only open of an older store goes without.
_LATER_TABLES = ("damaged", "packstate")
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

    def same_copy(self, other: "ObjectRecord") -> bool:
        """Whether both place the same stored copy (the depth aside, which a recode below changes)."""
        return (self.where == other.where and self.base == other.base and self.stored_size == other.stored_size
                and (self.where == WHERE_FILE or (self.pack == other.pack and self.offset == other.offset)))

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
            raise IndexDamagedError(f"an index record is damaged ({exc}); run `cas repair` to rebuild the index") from None
        return cls(where, stored, raw, pack, offset, base, depth)


_envs: dict[str, list] = {}  # real path -> [environment, opened read-only, users, {table name: handle}, snapshot dir,
#                                          identity of its data.mdb]
_envs_lock = threading.Lock()
_META = struct.Struct("<Q8xI20xI92xQQ")  # an LMDB meta page: pgno, magic, page size, last page, txnid (64-bit layout)
_LMDB_MAGIC = 0xBEEFC0DE
SNAPSHOT_ATTEMPTS = 5


def _shared_env(path: str, *, readonly: bool, create: bool, map_size: int) -> tuple[lmdb.Environment, dict]:
    """One LMDB environment per store and process, shared by every Store opened on it (LMDB
    forbids opening an environment twice in a process, and its transactions are thread-safe),
    with its table handles: opening a table again would start a transaction, which waits for
    LMDB's writer lock while holding the GIL, so a store opened while another thread of the
    process is in a write transaction (a DCP async save committing) deadlocked. Each writable
    open clears the reader slots of dead processes (see reader_check)."""
    real = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(real)
        if entry is not None and entry[4] is None and entry[5] != file_identity(path):
            entry = None  # the index files were deleted or replaced under it: those are other files now
        if entry is not None:
            if entry[1] and not readonly:
                raise CasError(f"the store index at {path} is already open read-only in this process; "
                               "close that store before opening it for writing")
            entry[2] += 1
        else:
            env, snapshot = _open_env(path, readonly=readonly, create=create, map_size=map_size)
            entry = _envs[real] = [env, env.flags()["readonly"], 1, {}, snapshot, file_identity(path)]
    if not readonly:
        reader_check(entry[0])
    return entry


def file_identity(path: str) -> tuple | None:
    """(device, inode) of an environment's data file and of its lock file: changes when the
    index files are deleted and made again, or another copy is put in their place. The lock
    file counts too: a process that opened the index after its lock file was deleted (the data
    file kept, or made again in between) takes LMDB's writer lock in another file than those
    that opened it before, and two such writers commit over each other (the soak of stop 40
    lost a committed save's records so, and a compaction then its pack)."""
    try:
        data = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    try:
        lock = os.stat(os.path.join(path, "lock.mdb"))
    except OSError:
        return data.st_dev, data.st_ino, None
    return data.st_dev, data.st_ino, lock.st_dev, lock.st_ino


def _open_env(path: str, *, readonly: bool, create: bool, map_size: int) -> tuple[lmdb.Environment, str | None]:
    """The environment at `path` with LMDB's locks, and None; or, where the lock file cannot
    be written (a read-only mount of a store that writers may change through another path), a
    private snapshot copy (see _snapshot) and the folder holding it. Never lock-free: a reader
    without a reader slot lets writers reuse the pages it is reading."""
    check_data_file(path)
    if readonly and not _lock_writable(path):
        return _snapshot(path, map_size)
    # A read-only open of an index this process could write opens it writable all the same (its
    # Index refuses writes, and opening writes nothing): LMDB allows one environment per path and
    # process, so a writable open later in the process shares this one. It found it "already
    # open read-only", took the index for damaged, moved it aside and built another, and the
    # reader read on in the old one, blind to every later commit (stop 30).
    readonly = readonly and not os.access(os.path.join(path, "data.mdb"), os.W_OK)
    try:
        env = lmdb.open(path, subdir=True, create=create, readonly=readonly, lock=True,
                        map_size=map_size, max_dbs=16, max_readers=512,
                        readahead=False, sync=True, metasync=True)
    except lmdb.Error as exc:
        raise CasError(f"cannot open the store index at {path}: {exc}; `cas repair` rebuilds it "
                       "from the objects on disk") from None
    return env, None


def _lock_writable(path: str) -> bool:
    """Whether this process can take a reader slot in the index's lock file."""
    lock = os.path.join(path, "lock.mdb")
    return os.access(lock if os.path.exists(lock) else path, os.W_OK)


def reader_check(env: lmdb.Environment) -> int:
    """Free the reader slots of processes that died inside a read transaction (a `cas du`
    killed half way): LMDB keeps every page such a slot's snapshot could see, so until they
    are freed every write transaction grows data.mdb. Returns the slots freed."""
    try:
        return env.reader_check()
    except lmdb.Error:
        return 0  # a snapshot opened read-only has no slots of others to free


def _meta_pages(data: str) -> tuple[list[tuple[int, int]], int]:
    """(transaction id, last page used) of an LMDB data file's two meta pages, and its page size."""
    with open(data, "rb") as f:
        first = f.read(_META.size)
        if len(first) < _META.size:
            raise CasError(f"{data} is cut short ({len(first)} bytes); `cas repair` rebuilds the index")
        pgno, magic, psize, last0, txnid0 = _META.unpack(first)
        f.seek(psize)
        second = f.read(_META.size)
    if magic != _LMDB_MAGIC or len(second) < _META.size:
        raise CasError(f"{data} is not an LMDB data file; `cas repair` rebuilds the index")
    _, _, _, last1, txnid1 = _META.unpack(second)
    return [(txnid0, last0), (txnid1, last1)], psize


def _meta_txnids(data: str) -> tuple[list[int], int]:
    """The transaction ids of an LMDB data file's two meta pages, and its page size."""
    metas, psize = _meta_pages(data)
    return [txnid for txnid, _ in metas], psize


def check_data_file(path: str) -> None:
    """Refuse an index whose data file is shorter than its newest transaction's pages (cut
    short by a crash of the filesystem, a full disk, a bad copy): LMDB maps the file and would
    read past its end, which kills the process with SIGBUS instead of raising."""
    data = os.path.join(path, "data.mdb")
    try:
        st = os.stat(data)
    except FileNotFoundError:
        return  # a new environment: LMDB makes it
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read below forever
        raise CasError(f"{data} is not a regular file; `cas repair` rebuilds the index")
    size = st.st_size
    metas, psize = _meta_pages(data)
    _, last = max(metas)
    if size < (last + 1) * psize:
        raise CasError(f"{data} is cut short ({size} bytes; its last transaction uses {(last + 1) * psize}); "
                       "`cas repair` rebuilds the index")


# Reads every table of an LMDB environment to its end, values included (run in a child process).
_READ_THROUGH = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], subdir=True, readonly=True, lock=True, max_dbs=64, readahead=False)
with env.begin() as txn:
    for name in [key for key, _ in txn.cursor()]:
        try:
            table = env.open_db(name, txn=txn, create=False)
        except lmdb.IncompatibleError:
            continue  # a key of the main table, not a table
        for key, value in txn.cursor(db=table):
            pass
"""


def unreadable(path: str) -> str | None:
    """Why the index at `path` cannot be read through, or None (also when there is none).
    Every table is read to its end, every value copied, in a child process: damage that makes
    LMDB follow a node or page past the end of its file kills the reading process (SIGBUS), so
    only a child can find it and live. `cas repair` asks this before it writes into an index."""
    data = os.path.join(path, "data.mdb")
    if not os.path.exists(data):
        return None
    try:
        check_data_file(path)
    except CasError as exc:
        return str(exc)
    limit = 60 + os.path.getsize(data) / 20e6  # a cycle of damaged pages would never end
    try:
        done = subprocess.run([sys.executable, "-c", _READ_THROUGH, path], capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired:
        return f"reading {data} through did not end in {limit:.0f} s (its pages may form a cycle)"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"reading {data} through killed the reader ({name})"
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"reading {data} through failed: {last}"
    return None


def _snapshot(path: str, map_size: int) -> tuple[lmdb.Environment, str]:
    """A private copy of the index as of one committed transaction, opened with locks of its
    own: what a reader that cannot take a reader slot may safely read. Pages of transaction R
    are reused only by a writer two commits later (LMDB frees them at R+1 and a writer uses
    only pages freed before its predecessor), so a copy taken while the newest meta page moved
    at most from R to R+1 holds all of R; both meta pages of the copy are then set to R."""
    data = os.path.join(path, "data.mdb")
    folder = tempfile.mkdtemp(prefix="cas-index-snapshot-")
    try:
        for _ in range(SNAPSHOT_ATTEMPTS):
            before, psize = _meta_txnids(data)
            shutil.copyfile(data, os.path.join(folder, "data.mdb"))
            if max(_meta_txnids(data)[0]) <= max(before) + 1:
                _pin_meta(os.path.join(folder, "data.mdb"), before.index(max(before)), psize)
                env = lmdb.open(folder, subdir=True, readonly=True, lock=True, map_size=map_size,
                                max_dbs=16, max_readers=512, readahead=False)
                return env, folder
        raise CasError(f"the store index at {path} cannot be locked from here (its folder is read-only) and "
                       f"writers committed too fast to copy it {SNAPSHOT_ATTEMPTS} times; open the store "
                       "through a writable path")
    except (OSError, lmdb.Error) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise CasError(f"cannot open the store index at {path}: {exc}") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _pin_meta(data: str, slot: int, psize: int) -> None:
    """Overwrite the other meta page of a copied data file with meta page `slot`, so LMDB opens
    exactly that transaction (the other may be half copied)."""
    with open(data, "r+b") as f:
        f.seek(slot * psize)
        page = bytearray(f.read(psize))
        page[:8] = (1 - slot).to_bytes(8, "little")  # the page's own number
        f.seek((1 - slot) * psize)
        f.write(page)


def _release_env(path: str, entry: list) -> None:
    real = os.path.realpath(path)
    with _envs_lock:
        entry[2] -= 1
        if entry[2] == 0:
            if _envs.get(real) is entry:
                del _envs[real]
            entry[0].close()
            if entry[4] is not None:
                shutil.rmtree(entry[4], ignore_errors=True)


_LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError)  # what a damaged page raises


def found_damage(exc: BaseException) -> bool:
    """Whether `exc`, raised by an Index, is LMDB (or a record's parse) finding the index damaged,
    for a reader or a writer: a rebuild into a new index is then the way on."""
    return isinstance(exc, IndexDamagedError) or isinstance(exc.__cause__, _LMDB_DAMAGE)


_ROOM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def write_advice(exc: lmdb.Error) -> str:
    """What to do about a failed index write: room or permission for a full or read-only
    filesystem; for anything else (a damaged data file: LMDB found a bad page or transaction)
    a rebuild, which reads only the store's own objects and log."""
    rc = next((a for a in exc.args if isinstance(a, int)), None)
    if isinstance(exc, (lmdb.DiskError, lmdb.MapFullError, lmdb.ReadonlyError)) or rc in _ROOM_ERRNOS:
        return "Free space on its filesystem (or make it writable) and retry"
    return "The index may be damaged: `cas repair` rebuilds it from the store's objects and record log"


class Index:
    """The store's LMDB environment and its tables."""

    def __init__(self, path: str, *, readonly: bool = False, create: bool = False,
                 map_size: int = DEFAULT_MAP_SIZE, extra_tables: tuple = (), optional_tables: tuple = ()) -> None:
        """`optional_tables`: opened when present; a read-only open of an index written before
        they existed goes without them."""
        self.path = path
        self.readonly = readonly
        self._entry = _shared_env(path, readonly=readonly, create=create, map_size=map_size)
        self.env, handles = self._entry[0], self._entry[3]
        self.tables = {}
        optional = _LATER_TABLES + tuple(optional_tables)
        for name in _TABLES + tuple(extra_tables) + optional:
            try:
                with _envs_lock:
                    if name not in handles:  # the environment's first Index opens each table once
                        handles[name] = self.env.open_db(name.encode(), create=not readonly)
                    self.tables[name] = handles[name]
            except lmdb.NotFoundError:
                if name in optional and readonly:
                    continue
                _release_env(path, self._entry)
                raise CasError(f"the store index at {path} has no table {name!r}; `cas repair` rebuilds it") from None
            except lmdb.Error as exc:
                _release_env(path, self._entry)
                raise CasError(f"the store index at {path} cannot open table {name!r} ({exc}): it is damaged "
                               "or was written by another program; `cas repair` rebuilds it") from None

    def close(self) -> None:
        _release_env(self.path, self._entry)

    def orphaned(self) -> bool:
        """Whether the files at this index's path are no longer the ones this environment has
        open (deleted, or another copy put in their place, while this process ran): its changes
        then reach no other process, and the cache at the path is another one."""
        return self._entry[4] is None and self._entry[5] != file_identity(self.path)

    def refuse_if_orphaned(self, what: str) -> None:
        """IndexReplacedError when this environment is orphaned (see orphaned): records written
        here reach no one, and deletions decided on them can remove what the index at the path
        (rebuilt from the store) needs: a recode committed here, then compacted away elsewhere,
        lost committed checkpoints in the soak."""
        if self.orphaned():
            raise IndexReplacedError(f"the index of the store at {os.path.dirname(self.path)} was deleted or replaced "
                                     f"while this process had it open; {what} (the store's next operation opens "
                                     "the index again)")

    def reader_check(self) -> int:
        """Free dead processes' reader slots (see reader_check); gc calls it as it starts repacking."""
        return reader_check(self.env)

    def db(self, name: str):
        return self.tables[name]

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction. LMDB's own errors inside it (a page of a damaged file) become a
        IndexDamagedError (a CorruptionError) that says to rebuild the index (it is a cache)."""
        try:
            with self.env.begin(write=False, buffers=False) as txn:
                yield txn
        except _LMDB_DAMAGE as exc:
            raise IndexDamagedError(f"the index of the store at {os.path.dirname(self.path)} is damaged "
                                  f"({type(exc).__name__}: {exc}); `cas repair` rebuilds it from the store") from exc

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """One atomic, synced write transaction; aborted if the block raises. LMDB's own errors
        (a full disk or a read-only filesystem at commit) become StoreWriteError: LMDB aborted
        the whole transaction, so the caller learns that nothing of it was committed."""
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {os.path.dirname(self.path)} is open read-only")
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.Error as exc:
            raise StoreWriteError(f"writing to the index of the store at {os.path.dirname(self.path)} failed "
                                  f"({type(exc).__name__}: {exc}); nothing of that change was committed. "
                                  + write_advice(exc)) from exc

    @contextmanager
    def nested(self, txn) -> Iterator[lmdb.Transaction]:
        """A child of write transaction `txn`: what the block writes joins `txn` when it ends
        normally, and is undone (with nothing else of `txn`) when it raises."""
        with self.env.begin(write=True, parent=txn) as child:
            yield child

    # --- objects -------------------------------------------------------------------------
    def record(self, txn, key: bytes) -> ObjectRecord | None:
        raw = txn.get(key, db=self.tables["objects"])
        return ObjectRecord.unpack(raw) if raw is not None else None

    def iter_records(self, txn) -> Iterator[tuple[bytes, ObjectRecord]]:
        for key, raw in txn.cursor(db=self.tables["objects"]):
            yield bytes(key), ObjectRecord.unpack(raw)

    def delta_children(self, txn) -> dict[bytes, list[bytes]]:
        """base -> the keys of the deltas recorded against it: every delta edge reversed, from a
        full scan of the records (tens of ms per 100,000; only a recode that makes a delta
        whole again needs it, and only then)."""
        out: dict[bytes, list[bytes]] = {}
        for key, raw in txn.cursor(db=self.tables["objects"]):
            if len(raw) > 1 and raw[1] & FLAG_BASE:  # a delta's record ends with its base key and depth
                out.setdefault(bytes(raw[-KEY_SIZE - 1:-1]), []).append(bytes(key))
        return out

    def put_record(self, txn, key: bytes, rec: ObjectRecord) -> None:
        txn.put(key, rec.pack_bytes(), db=self.tables["objects"])

    # --- leases and holds ----------------------------------------------------------------
    def new_lease(self, txn, lease: bytes, purpose: str, *, file: bool = False) -> None:
        """`file`: the writer holds a lease file whose lock proves it alive (cas.localfs); gc
        judges a lease without one (a writer of an older cas) by its host and process id."""
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "purpose": purpose,
                "file": file}
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

    # --- packs a cross-host gc is removing (a bucket store; docs/architecture.md) ----------
    # b"d" + pack -> epoch: doomed by a gc intent (writers write their own copies of its
    # objects); b"g" + pack: deleted (a writer whose save reused it must not commit).
    def doom_packs(self, txn, packs, epoch: bytes) -> None:
        for pack in packs:
            txn.put(b"d" + pack, epoch, db=self.tables["packstate"])

    def pack_doomed(self, txn, pack: bytes | None) -> bool:
        db = self.tables.get("packstate")
        return pack is not None and db is not None and txn.get(b"d" + pack, db=db) is not None

    def any_doomed(self, txn) -> bool:
        db = self.tables.get("packstate")
        if db is None:
            return False
        cur = txn.cursor(db=db)
        return cur.set_range(b"d") and bytes(cur.key())[:1] == b"d"

    def doomed_packs(self, txn) -> list[tuple[bytes, bytes]]:
        """(pack, epoch) of every doomed pack."""
        db = self.tables.get("packstate")
        if db is None:
            return []
        return [(bytes(k)[1:], bytes(v)) for k, v in txn.cursor(db=db) if bytes(k)[:1] == b"d"]

    def packs_gone(self, txn, packs) -> list[bytes]:
        """Those of `packs` a gc deleted."""
        db = self.tables.get("packstate")
        return [p for p in packs if db is not None and txn.get(b"g" + p, db=db) is not None]

    def settle_epoch(self, txn, epoch: bytes, deleted) -> int:
        """A gc epoch ended: its packs are no longer doomed, `deleted` are gone, and the records
        that pointed into them are dropped (those objects are no longer stored). Returns the
        number of records dropped."""
        db = self.tables["packstate"]
        cur = txn.cursor(db=db)
        doomed = [bytes(k) for k, v in cur if bytes(k)[:1] == b"d" and bytes(v) == epoch]
        for key in doomed:
            txn.delete(key, db=db)
        deleted = set(deleted)
        for pack in deleted:
            txn.put(b"g" + pack, b"", db=db)
        dropped = [key for key, rec in self.iter_records(txn) if rec.where == WHERE_PACK and rec.pack in deleted]
        for key in dropped:
            txn.delete(key, db=self.tables["objects"])
        return len(dropped)

    def clear_pack_states(self, txn) -> None:
        txn.drop(self.tables["packstate"], delete=False)

    # --- counters ------------------------------------------------------------------------
    def generation(self, txn) -> int:
        raw = txn.get(b"generation", db=self.tables["meta"])
        return int.from_bytes(raw, "big") if raw else 0

    def bump_generation(self, txn) -> int:
        gen = self.generation(txn) + 1
        txn.put(b"generation", gen.to_bytes(8, "big"), db=self.tables["meta"])
        return gen
