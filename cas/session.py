"""The write session protocol: one writer's lease, claims, writes and its single commit.

A writer works inside a WriteSession, which holds a lease in the index:
  1. claim(keys): one write transaction records a hold on each key and says which keys are
     already durably stored (index record present, and its file or pack there). Held keys are
     never swept by gc, so a claimed object stays put.
  2. write(key, raw): encode and store the absent ones, in worker threads. Each goes into a
     pack: on a local disk the pack streamed as the save runs (its small objects side by side,
     in runs), in a bucket one gathered in memory and written whole; with pack_max set, larger
     ones become files of their own.
  3. commit(finish): write the last pack, fsync the directories, then one write transaction
     indexes every object written, runs `finish` (the caller's registry change, e.g. a
     checkpoint) and ends the lease. Before it nothing the session wrote is referenced; after
     it, all of it is durable.
The index, not the presence of a file, decides dedup: a file left by a crash is rewritten.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np

from . import faults
from .chains import MAX_CHAIN_DECODE
from .codecs import parse_header
from .errors import CasError, CorruptionError, MissingObjectError, StoreClosedError, StoreWriteError
from .index import LEASE_ID_SIZE, WHERE_FILE, WHERE_PACK, ObjectRecord
from .moves import Moves
from .placing import Placing
from .backend import Staged
from .leases import begin_lease, lease_name
from .objectfiles import FileObjects
from .packs import PACK_HEADER, PackEntry

if TYPE_CHECKING:
    from .objectstore import ObjectStore

T = TypeVar("T")


class WriteSession(Placing, Moves):
    """One writer's lease: claims, writes and a single commit. Use as a context manager; leaving
    the block without commit() ends the lease and leaves what was written to gc."""

    def __init__(self, store: ObjectStore, purpose: str) -> None:
        self.store = store
        self.index = store.index
        self.lease = secrets.token_bytes(LEASE_ID_SIZE)
        self.new_bytes = 0
        self._held: set[bytes] = set()  # keys this session's lease holds against gc
        self._claimed: set[bytes] = set()  # keys not stored that a caller claimed, so writes
        self._written: dict[bytes, ObjectRecord] = {}
        self._records: dict[bytes, ObjectRecord] = {}  # what claim() found already stored
        self.reused: set[bytes] = set()  # the keys claim() or adopt() found stored before this session
        self._stale: set[bytes] = set()  # indexed, but the file or pack entry is gone: rewriting it is new bytes
        self._moves: set[bytes] = set()  # objects this session moves (gc's repacking): its record wins
        self._recoded: set[bytes] = set()  # moves that make a full object a delta (write_recoded)
        self._relinked: dict[bytes, bytes] = {}  # delta -> its base's base, re-coded against both (write_relinked)
        self.recoded: set[bytes] = set()  # of those, the ones the commit indexes (known inside it)
        self.relinked: set[bytes] = set()  # the relinked objects the commit indexes (known inside it)
        self._sources: dict[bytes, ObjectRecord] = {}  # the record each write_encoded copy was read as
        self._wholes: set[bytes] = set()  # deltas made whole again (write_whole_again)
        self._unlinked: set[bytes] = set()  # `linear` deltas coded again as `sub` (write_unlinked)
        self._rebased: dict[bytes, bytes] = {}  # delta -> the base it was coded away from (write_rebased)
        # adopted `linear` deltas -> the base's base they were coded with (decoding takes it from
        # the base's record, which another writer's promotion or recode may change before the commit)
        self._adopted_below: dict[bytes, bytes] = {}
        self._staged: list[Staged] = []  # object files written, named (fsync, no-replace) at commit
        self._put: dict[bytes, int] = {}  # depth of each object put_encoded (a pack flush moves records)
        self._start_placing()
        self._lock = threading.Lock()
        self._open = True
        # The lease file first (its lock is what proves this writer alive to gc, in any PID
        # namespace), then the index's lease that holds are recorded under; ended in reverse.
        store.own_lease_files.add(lease_name(self.lease))
        try:
            self._lease_file = begin_lease(store.backend, self.lease, purpose)
        except BaseException:
            store.own_lease_files.discard(lease_name(self.lease))
            raise
        try:
            faults.point("session.lease_file_taken")
            with self.index.write() as txn:
                self.index.new_lease(txn, self.lease, purpose, file=self._lease_file is not None)
        except BaseException:
            self._release_lease_file()
            raise

    def __enter__(self) -> "WriteSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._open:
            self.abort()

    def hold(self, keys) -> list[bool]:
        """Hold `keys` against gc for this session (a delta base or a chain root it may code
        against, an object it moves); True for each that is stored. Promises no write: a key
        held here and not stored is still the caller's to write if it claims it later. An
        object recorded as damaged, or a delta whose chain reaches one, is not stored: a save
        writes it again (and its commit puts the fresh copy in its place), and codes nothing
        against it."""
        self._check_open()
        new = [key for key in dict.fromkeys(keys) if key not in self._held]
        if new:
            with self.index.write() as txn:
                records = []
                for key in new:
                    self.index.hold(txn, self.lease, key)
                    records.append(self.index.record(txn, key))
                rotten = {key for key, rec in zip(new, records) if self._rotten(txn, key, rec)}
            # Held keys cannot be swept from here on, so the file checks may run outside the txn.
            found = {key: rec for key, rec in zip(new, records)
                     if key not in rotten and self._is_stored(key, rec) and self._header_sound(key, rec)}
            with self._lock:
                self._held.update(new)
                self._records.update(found)
                self._stale.update(k for k, rec in zip(new, records) if rec is not None and k not in found)
        with self._lock:
            return [key in self._records for key in keys]

    def claim(self, keys: list[bytes]) -> list[bool]:
        """Hold `keys` for this session; True for each key that is already stored (or claimed
        earlier in this session, by a caller who writes it), False for each the caller must
        write."""
        stored = self.hold(keys)
        out = []
        with self._lock:
            for key, ok in zip(keys, stored):
                out.append(ok or key in self._claimed)
                if ok:
                    self.reused.add(key)
                else:
                    self._claimed.add(key)
        return out

    def depth(self, key: bytes) -> int | None:
        """Delta depth of an object this session claimed or wrote; None when it is not stored."""
        with self._lock:
            rec = self._written.get(key) or self._records.get(key)
        return rec.depth if rec is not None else None

    def base_of(self, key: bytes) -> bytes | None:
        """The delta base of an object this session claimed or wrote (None: a full object or
        not stored)."""
        with self._lock:
            rec = self._written.get(key) or self._records.get(key)
        return rec.base if rec is not None else None

    def packs_written(self) -> list[bytes]:
        """The pack files this session wrote (the record log names them with the checkpoint)."""
        with self._lock:
            return sorted({rec.pack for rec in self._written.values() if rec.where == WHERE_PACK})

    def check_nothing_lost(self, txn) -> None:
        """Raise if a gc on another host deleted what this session relies on: a pack it wrote
        or an object it reused (run after this host's cache folded other hosts' entries, before
        the session's commit entry is tried again). Only a writer paused past its lease's expiry
        meets it; the save fails, nothing committed, and saving again writes what is missing."""
        gone = self.index.packs_gone(txn, self.packs_written())
        with self._lock:
            reused = list(self._records)
        lost = [key for key in reused if self.index.record(txn, key) is None]
        if gone or lost:
            what = f"pack {gone[0].hex()} it wrote" if gone else f"object {lost[0].hex()} it reused"
            raise StoreWriteError(f"a gc on another host deleted {what} while this save ran (its lease had "
                                  "expired); nothing was committed: save again")

    def delta_bases(self) -> dict[bytes, bytes]:
        """key -> base key of every delta this session wrote (also those still waiting for their
        pack)."""
        with self._lock:
            out = {key: rec.base for key, rec in self._written.items() if rec.base is not None}
            out.update((key, item[2]) for key, item in self._pending_small.items() if item[2] is not None)
            out.update((key, item[1]) for key, item in self._streamed.items() if item[1] is not None)
            out.update((item[0], item[4]) for item in self._run if item[4] is not None)
            return out

    def _rotten(self, txn, key: bytes, rec: ObjectRecord | None) -> bool:
        """Whether the object, or a base on its chain in the index, is recorded as damaged (by
        verify or a failed load): its stored copy cannot be decoded, so it is no base to build on.
        An object in a pack that a gc on another host is removing (doomed by its intent) is no
        better: the writer stores its own copy, which its commit indexes in its place."""
        damaged, doomed = self.index.any_damaged(txn), self.index.any_doomed(txn)
        if not damaged and not doomed:  # the common case, at the cost of two lookups
            return False
        for _ in range(MAX_CHAIN_DECODE + 1):
            if damaged and self.index.damaged(txn, key) is not None:
                return True
            if doomed and rec is not None and rec.where == WHERE_PACK and self.index.pack_doomed(txn, rec.pack):
                return True
            if rec is None or rec.base is None:
                return False
            key, rec = rec.base, self.index.record(txn, rec.base)
        return False

    def _header_sound(self, key: bytes, rec: ObjectRecord) -> bool:
        """_file_agrees, for reuse: one 64-byte read per reused file or local pack entry (25-40
        us here, within the noise of a save of 4 MiB chunks), which finds a zeroed or damaged
        header before a save builds on it; a damaged payload needs verify. A header naming an unknown format (a
        flipped format byte) is not sound either, rather than an error that stops every save."""
        try:
            return self._file_agrees(key, rec)
        except CasError:
            return False

    def _is_stored(self, key: bytes, rec: ObjectRecord | None) -> bool:
        if rec is None:
            return False
        if rec.where == WHERE_PACK:
            if self.store.trust_packs:
                return True
            size = self.store.packs.size(rec.pack)
            return size is not None and rec.offset + rec.stored_size <= size
        return self.store.files.has(key) == rec.stored_size

    def write(self, key: bytes, raw, element_size: int = 1,
              base: tuple[bytes, np.ndarray, int] | None = None) -> int:
        """Encode and store one object (thread-safe); returns its encoded size. `base` =
        (key, raw bytes, delta depth[, raw bytes of its own base, of which it is a delta]) of a
        stored object this one may be coded against."""
        below = base[3] if base is not None and len(base) > 3 else None
        enc = self.store.codec.encode(raw, element_size, base[:2] if base else None, below)
        raw_size = memoryview(raw).nbytes
        depth = base[2] + 1 if enc.base else 0
        self._place(key, enc.parts, enc.size, raw_size, enc.base, depth)
        return enc.size

    def _place(self, key: bytes, parts: list, size: int, raw_size: int, base: bytes | None, depth: int) -> None:
        """Store one encoded object: a file of its own when it is larger than pack_max (when
        set), else an entry of the pack being streamed (local stores), else gathered in memory
        for a pack written at once (a bucket's segments). `parts` are consumed before this
        returns (they may be a worker's reused buffers)."""
        pack_max = self.store.pack_max
        if pack_max is not None and size > pack_max:
            faults.point("session.before_file_write")
            staged = self.store.files.stage(key, parts)
            faults.point("session.file_written")
            with self._lock:
                self._staged.append(staged)
                self._written[key] = ObjectRecord(WHERE_FILE, size, raw_size, base=base, depth=depth)
        else:
            self._pack_entry(key, parts, size, raw_size, base, depth)

    def put_encoded(self, key: bytes, blob, *, raw_size: int, base: bytes | None) -> int:
        """Store an object encoded elsewhere (another store's copy: push, pull, mirror) as it is,
        so its key and blake3 check stay end to end; returns its size. The caller claimed `key`
        and decoded `blob` to it. Its header must give `raw_size` and `base`; a delta's base must
        be stored here or put earlier in this session (its depth follows that base's)."""
        head = parse_header(blob, key=key)
        if head.raw_size != raw_size or head.base != base:
            raise CorruptionError(f"object header gives {head.raw_size} raw bytes and base "
                                  f"{head.base.hex() if head.base else None}, its record {raw_size} and "
                                  f"{base.hex() if base else None}", key=key.hex())
        depth = 0
        if base is not None:
            with self._lock:
                rec = self._records.get(base)
                below = self._put.get(base, rec.depth if rec is not None else None)
            if below is None:
                raise MissingObjectError("the delta base of a copied object is neither stored here nor copied "
                                         "before it", key=base.hex())
            depth = below + 1
        with self._lock:
            self._put[key] = depth
        size = memoryview(blob).nbytes
        self._place(key, [blob], size, raw_size, base, depth)
        return size

    def adopt(self, key: bytes, replacement: Staged | None = None) -> int:
        """Index at commit a file object that another process wrote (a DCP rank, which cannot
        touch LMDB); returns its stored size. An object the index holds keeps its record and its
        file (other checkpoints decode through them: a save never changes either). `replacement`
        is a rank's fsynced temporary file of the same content, written because it could not
        tell whether the existing file is sound to reference: it is staged like this session's
        own files, so the commit transaction settles it (it takes that file's place only when
        the index does not hold the key with a matching file). The file indexed must have a
        header that parses and gives its raw size; a delta keeps its base edge (gc follows it),
        whose base must be indexed."""
        with self.index.read() as txn:
            held = self.index.record(txn, key)
        if held is not None and self._holds(key, held):
            if replacement is not None:
                self.store.files.discard([replacement])
            with self._lock:
                self.reused.add(key)
            return held.stored_size
        if replacement is not None:
            try:
                size, header = self.store.files.peek(replacement, 64)
            except MissingObjectError as exc:
                raise MissingObjectError(f"a distributed writer's replacement file cannot be read: {exc.detail}",
                                         key=key.hex()) from None
        else:
            size = self.store.files.has(key)
            if size is None:
                raise MissingObjectError("an object a distributed writer reported is not in the store",
                                         key=key.hex())
            header = self.store.files.head(key, 64)
        with self.index.read() as txn:
            rec = self._file_record(txn, key, header, size, "an object a distributed writer reported")
            below = self._below_now(txn, rec) if parse_header(header, key=key).needs_below else None
        if below is None and parse_header(header, key=key).needs_below:
            raise _linear_base_changed(key, rec.base)
        with self._lock:
            if key in self._written:
                if replacement is not None:
                    self.store.files.discard([replacement])
                return size
            self._written[key] = rec
            if below is not None:
                self._adopted_below[key] = below
            if replacement is not None:
                self._staged.append(replacement)
        return size

    def _below_now(self, txn, rec: ObjectRecord, chosen: dict | None = None) -> bytes | None:
        """The base's base an adopted `linear` delta decodes with, as the index (and this commit,
        `chosen`) has it; None for a base that is whole by now (another writer's save of its
        content promoted it), which leaves the delta undecodable."""
        base = (chosen or {}).get(rec.base) or self._written.get(rec.base) or self.index.record(txn, rec.base)
        return None if base is None else base.base

    def adopt_packed(self, pack: bytes, entries: list[PackEntry]) -> None:
        """Index at commit objects that another process wrote into `pack` (a DCP rank writing
        segments straight to a bucket), placed as it reports them: one stat for the pack, none
        per object (its footer lists the same entries; repair reads those). A key the index
        holds keeps its record, as in adopt(); a delta's base must be indexed or adopted first."""
        size = self.store.packs.size(pack)
        if size is None:
            raise MissingObjectError("a pack a distributed writer reported is not in the store", key=pack.hex())
        with self.index.read() as txn:
            held = {e.key: self.index.record(txn, e.key) for e in entries}
            held.update((e.base, self.index.record(txn, e.base)) for e in entries if e.base is not None)
        for e in entries:
            if e.offset < PACK_HEADER or e.length < 0 or e.offset + e.length > size:
                raise CorruptionError(f"a distributed writer places an object at {e.offset}..{e.offset + e.length} "
                                      f"of pack {pack.hex()}, which holds {size} bytes", key=e.key.hex())
            if held[e.key] is not None and self._holds(e.key, held[e.key]):
                continue
            with self._lock:
                base = None if e.base is None else self._written.get(e.base) or held[e.base]
                if e.base is not None and base is None:
                    raise MissingObjectError("the delta base of an object a distributed writer reported is not "
                                             "in the store", key=e.base.hex())
                self._written.setdefault(e.key, ObjectRecord(WHERE_PACK, e.length, e.raw_size, pack, e.offset,
                                                             e.base, base.depth + 1 if base else 0))

    def _settle(self, txn, key: bytes, rec: ObjectRecord, current: ObjectRecord | None, replacing: bool,
                chosen: dict[bytes, ObjectRecord], bases: set[bytes]) -> ObjectRecord | None:
        """The record to index for an object this session wrote (inside the commit transaction,
        `current` being the index's), or None to keep the index's as it is. An indexed object
        the store holds as its record says stays, file or pack entry: another writer's, which
        its checkpoints decode through (deltas above it read its base and depth), unless this
        session moves that very object (gc's repacking). Else this session's pack entry, or its
        file, already in place or (`replacing`) about to replace an unindexed or mismatched
        one. Else another writer's unindexed file of the same content replaced this session's
        (a commit that failed after settling): indexed as it is, from its header. An indexed
        object that is recorded as damaged (or stands on a damaged base) does not stay: this
        session's copy takes its place and the damage record goes (decided here, inside the
        transaction: another writer may have replaced it already)."""
        if key in self._recoded and not self._recode_stands(txn, key, current, rec, chosen, bases):
            return None
        if key in self._moves and key not in self._recoded and current is not None:
            source = self._sources.get(key)
            if current.base != rec.base or (source is not None and not current.same_copy(source)):
                return None  # another writer moved or re-encoded it since this copy was read: a
                # `linear` delta above may need its base as it is now, and a promotion its `sub` copy
            rec = dataclasses.replace(rec, depth=current.depth)  # a recode may have deepened its chain since
        rotten = key not in self._moves and self._rotten(txn, key, current)
        if (current is not None and current != rec and key not in self._moves and not rotten
                and self._holds(key, current)):
            return None
        if rotten:
            self.index.clear_damaged(txn, key)
        if rec.where == WHERE_PACK or replacing or self._holds(key, rec):
            return rec
        return self._file_record(txn, key, self.store.files.head(key, 64), self.store.files.has(key),
                                 "another writer's file of this object")

    def _file_record(self, txn, key: bytes, header: bytes, size: int, what: str) -> ObjectRecord:
        """The index record of a file object from its header: a delta keeps its base edge (gc
        follows it), and its base must be indexed (`what` names the file in that error)."""
        head = parse_header(header, key=key)
        if head.base is None:
            return ObjectRecord(WHERE_FILE, size, head.raw_size)
        base = self.index.record(txn, head.base)
        if base is None:
            raise MissingObjectError(f"the delta base of {what} is not in the store", key=head.base.hex())
        return ObjectRecord(WHERE_FILE, size, head.raw_size, base=head.base, depth=base.depth + 1)

    def _holds(self, key: bytes, rec: ObjectRecord) -> bool:
        """Whether the store holds the object as `rec` describes it (size, and base for a file)."""
        return self._is_stored(key, rec) and self._file_agrees(key, rec)

    def _file_agrees(self, key: bytes, rec: ObjectRecord) -> bool:
        """Whether an indexed object's header names the base its record does: a file's, or a
        local pack entry's (a bucket's segments are trusted, as in _is_stored)."""
        if rec.where == WHERE_PACK and self.store.trust_packs:
            return True
        try:
            return self.store.header_at(key, rec).base == rec.base
        except CorruptionError:
            return False

    def commit(self, finish: Callable[[object], T]) -> T:
        """Make every written object durable, then in one transaction index them, run
        `finish(txn)` and end the lease. If `finish` raises, nothing of it is committed.

        A file is never replaced outside that transaction: another writer may have written
        and indexed the same object meanwhile, encoded otherwise (a delta of another base), and
        its checkpoints decode through its file. So files take their names without replacing
        any (place_new), and each name is settled inside the transaction, which LMDB runs one
        at a time across processes (_settle)."""
        self._check_open()
        with self._lock:
            run = self._take_run()
        if run:
            self._stream_entries(run)
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            self._finish_stream(stream)
        self._flush_pack()
        taken = [staged for staged in self._staged if not self.store.files.place_new(staged, fsync=True)]
        self._staged = taken  # discarded by abort() if the commit fails
        self.store.files.sync()
        faults.point("commit.synced")
        replacements = {FileObjects.key_of(staged): staged for staged in taken}
        with self.index.write() as txn:
            self.index.refuse_if_orphaned("nothing of this change was committed")
            settled = []
            by_key: dict[bytes, ObjectRecord] = {}  # what this commit indexes, as it goes
            bases: set[bytes] = set()  # the delta bases of those
            for key, rec in self._written.items():
                if key in self._relinked or key in self._wholes or key in self._unlinked or key in self._rebased:
                    continue  # after the rest: its base may be recoded by this commit
                current = self.index.record(txn, key)
                chosen = self._settle(txn, key, rec, current, key in replacements, by_key, bases)
                if chosen is not None:
                    if key in self._stale or current is None:
                        self.new_bytes += chosen.stored_size
                    settled.append((key, chosen))
                    by_key[key] = chosen
                    if chosen.base is not None:
                        bases.add(chosen.base)
            if self._relinked:
                for key, rec in self._written.items():
                    if key in self._relinked:
                        chosen = self._relink_stands(txn, key, self.index.record(txn, key), rec, by_key)
                        if chosen is not None:
                            settled.append((key, chosen))
            if self._wholes or self._unlinked or self._rebased:
                settled += self._settle_promotions(txn, by_key)
            for key, below in self._adopted_below.items():  # their bases as this commit leaves them
                if key in by_key and self._below_now(txn, by_key[key], by_key) != below:
                    raise _linear_base_changed(key, by_key[key].base)
            self.recoded = {key for key, _ in settled if key in self._recoded}  # for `finish` to see
            self.relinked = {key for key, _ in settled if key in self._relinked}
            result = finish(txn)  # before any file changes: it may refuse the commit
            for key, chosen in settled:
                if key in replacements:
                    self.store.files.replace(replacements.pop(key))  # durable when it returns
                self.index.put_record(txn, key, chosen)
            self.index.end_lease(txn, self.lease)
            self.index.bump_generation(txn)
            faults.point("commit.in_txn")
        self._open = False
        self._release_lease_file()
        self.store.session_ended()
        self.store.files.discard(list(replacements.values()))  # the index's stayed
        self._staged = []
        return result

    def abort(self) -> None:
        """End the lease without committing; written objects become garbage for gc."""
        if not self._open:
            return
        self._open = False
        self.store.session_ended()
        self.store.files.discard(self._staged)
        for stream in list(self._streams):  # packs never finished: their temporary files go
            stream.discard()
        try:
            with self.index.write() as txn:
                self.index.end_lease(txn, self.lease)
        except Exception:  # the lease of a dead writer is reclaimed by gc anyway
            pass
        self._release_lease_file()

    def _release_lease_file(self) -> None:
        if self._lease_file is not None:
            self._lease_file.release()
        self.store.own_lease_files.discard(lease_name(self.lease))

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosedError("this write session has already been committed or aborted")


def _linear_base_changed(key: bytes, base: bytes) -> StoreWriteError:
    return StoreWriteError(f"chunk {key.hex()} of this save is a `linear` delta of {base.hex()}, whose own delta base "
                           "another writer changed since it was coded (a save of the same content made it whole): "
                           "it could not be decoded, so nothing of this save was committed; save again")
