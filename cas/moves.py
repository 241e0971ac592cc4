"""Moves: writes that store an object the index already holds again, encoded otherwise.

gc's repacking copies live objects as they are (write_encoded); a recode makes a full object a
delta of the newer chunk that replaced it (write_recoded); a relink codes a delta again as a
`linear` one against the same base (write_relinked). Each goes into a pack, so the copy it
replaces stays readable until the commit, and each stands only if, inside the commit's
transaction, the index still holds what it was coded from (another writer may have moved the
same object meanwhile): the rules are here, the commit that applies them is WriteSession's.
"""

from __future__ import annotations

import dataclasses
import threading

from .index import Index, ObjectRecord


class Moves:
    """WriteSession's moving writes (a mixin: it shares the session's lock, its records and its
    placement of pack entries)."""

    index: Index
    _lock: threading.Lock
    _moves: set[bytes]
    _recoded: set[bytes]
    _relinked: dict[bytes, bytes]
    _no_stream: bool

    def write_recoded(self, key: bytes, blob: bytes, raw_size: int, base: bytes, depth: int) -> None:
        """Store an object again as a delta of `base` (store/recode.py: an older checkpoint's
        chunk coded against the newer one that replaced it), always into a pack, so the file it
        had stays readable until the commit has moved its record. Its record replaces the
        index's at the commit only if, inside that transaction, the object is still a full
        object and `base` is indexed with no `key` on its chain (no other writer recoded either
        meanwhile: a chain never loops); else the index's stays and the entry is garbage."""
        with self._lock:
            self._moves.add(key)
            self._recoded.add(key)
        self._place_in_pack(key, blob, raw_size, base, depth)

    def write_relinked(self, key: bytes, blob: bytes, raw_size: int, base: bytes, below: bytes) -> None:
        """Store a delta again against the same `base`, now extrapolating from that base and
        `below` (a `linear` delta: store/recode.py codes an older chunk from the newer chunk
        above it and the one above that), always into a pack. Its record replaces the index's at
        the commit only if, inside that transaction, the object is still a delta of `base` and
        `base`'s record (this commit's, when it recodes `base` too) is a delta of exactly
        `below`, which decoding it takes as the base's base; else the index's stays and the
        entry is garbage. No reference edge changes, so no chain can loop."""
        with self._lock:
            self._moves.add(key)
            self._relinked[key] = below
        self._place_in_pack(key, blob, raw_size, base, 0)

    def _relink_stands(self, txn, key: bytes, current: ObjectRecord | None, rec: ObjectRecord,
                       chosen: dict[bytes, ObjectRecord]) -> ObjectRecord | None:
        """The record of a relinked object (write_relinked) if it stands, with its depth; None
        when it does not. `chosen`: the records this commit indexes for the other objects."""
        if current is None or current.base != rec.base or current.raw_size != rec.raw_size:
            return None
        base_rec = chosen.get(rec.base) or self.index.record(txn, rec.base)
        if base_rec is None or base_rec.base != self._relinked[key]:
            return None
        return dataclasses.replace(rec, depth=min(base_rec.depth + 1, 255))

    def _recode_stands(self, txn, key: bytes, current: ObjectRecord | None, rec: ObjectRecord,
                       chosen: dict[bytes, ObjectRecord], bases: set[bytes]) -> bool:
        """Whether a recoded object (write_recoded) takes its delta record: it is still a full
        object of that size, its base is a full object and it is the base of no delta, both as
        this commit leaves them (`chosen`: the records it indexes so far; `bases`: their delta
        bases). Judged against the index alone, two chunks that swapped places between two saves
        would each become the other's delta (a loop), and a chunk recoded onto one this commit
        also recodes would sit deeper than its record says."""
        if current is None or current.base is not None or current.raw_size != rec.raw_size or key in bases:
            return False
        base_rec = chosen.get(rec.base) or self.index.record(txn, rec.base)
        return rec.base != key and base_rec is not None and base_rec.base is None

    def write_encoded(self, key: bytes, blob: bytes, rec: ObjectRecord, *, pack_only: bool = False) -> None:
        """Store an already encoded object again (gc's repacking moves live objects this way):
        its new record replaces the index's at the commit, unless the index's names another
        base by then (a recode or relink re-encoded it meanwhile: that encoding stays, and this
        entry is garbage). pack_only: into a pack whatever its size (a recode's whole copy coded
        again: the file it had stays readable until the commit, then goes)."""
        with self._lock:
            self._moves.add(key)
        if pack_only:
            self._place_in_pack(key, blob, rec.raw_size, rec.base, rec.depth)
        else:
            self._place(key, [blob], memoryview(blob).nbytes, rec.raw_size, rec.base, rec.depth)

    def _place_in_pack(self, key: bytes, blob: bytes, raw_size: int, base: bytes | None, depth: int) -> None:
        """Store a moved object in a pack whatever its size: the copy it replaces (a file, or
        another pack's entry) stays readable until the commit has moved its record."""
        size = memoryview(blob).nbytes
        if self._no_stream or not self._stream_entry(key, [blob], size, raw_size, base, depth):
            self._add_small(key, blob, raw_size, base, depth)
