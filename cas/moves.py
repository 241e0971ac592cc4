"""Moves: writes that store an object the index already holds again, encoded otherwise.

gc's repacking copies live objects as they are (write_encoded); a recode makes a full object a
delta of the newer chunk that replaced it (write_recoded); a relink codes a delta again as a
`linear` one against the same base (write_relinked); a promotion makes a delta whole again
(write_whole_again), codes the deltas that stood on it against its base instead
(write_rebased) and a `linear` delta standing on one of those as `sub` (write_unlinked). Each
goes into a pack, so the copy it replaces stays readable until the commit, and each stands
only if, inside the commit's transaction, the index still holds what it was coded from
(another writer may have moved the same object meanwhile): the rules are here, the commit that
applies them is WriteSession's.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from .chains import MAX_CHAIN_DECODE
from .errors import CasError
from .index import Index, ObjectRecord

if TYPE_CHECKING:
    from .objectstore import ObjectStore


class Moves:
    """WriteSession's moving writes (a mixin: it shares the session's lock, its records and its
    placement of pack entries)."""

    index: Index
    _lock: threading.Lock
    _moves: set[bytes]
    _recoded: set[bytes]
    _relinked: dict[bytes, bytes]
    _wholes: set[bytes]
    _unlinked: set[bytes]
    _rebased: dict[bytes, bytes]
    _sources: dict[bytes, ObjectRecord]
    _written: dict[bytes, ObjectRecord]
    store: "ObjectStore"

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
        its new record replaces the index's at the commit only if the index's still places the
        copy `rec` describes, the one read (else another writer moved or re-encoded it meanwhile:
        a recode, relink or promotion; that copy stays, and this entry is garbage). pack_only: into a pack whatever its size (a recode's whole copy coded
        again: the file it had stays readable until the commit, then goes)."""
        with self._lock:
            self._moves.add(key)
            self._sources[key] = rec
        if pack_only:
            self._place_in_pack(key, blob, rec.raw_size, rec.base, rec.depth)
        else:
            self._place(key, [blob], memoryview(blob).nbytes, rec.raw_size, rec.base, rec.depth)

    def write_whole_again(self, key: bytes, blob: bytes, raw_size: int) -> None:
        """Store a delta again whole (store/recode.py's promotion: content of an older checkpoint
        that came back in the newest, which must decode without a chain), always into a pack.
        Its record replaces the index's at the commit only if, inside that transaction, no
        `linear` delta is left standing on it (one reads its base's base, which a whole object
        no longer names): see _settle_promotions."""
        with self._lock:
            self._moves.add(key)
            self._wholes.add(key)
        self._place_in_pack(key, blob, raw_size, None, 0)

    def write_unlinked(self, key: bytes, blob: bytes, raw_size: int, base: bytes) -> None:
        """Store a `linear` delta again as a `sub` delta of the same `base`, which no longer
        reads the base's own base (so that base may become whole), always into a pack. No edge
        changes; its record replaces the index's at the commit only if the index's is still a
        delta of `base`."""
        with self._lock:
            self._moves.add(key)
            self._unlinked.add(key)
        self._place_in_pack(key, blob, raw_size, base, 0)

    def write_rebased(self, key: bytes, blob: bytes, raw_size: int, base: bytes, old_base: bytes) -> None:
        """Store a delta of `old_base` again as a delta of `base` (old_base's own base: a
        promotion splices old_base out of the chains that ran through it), always into a pack.
        Its record replaces the index's at the commit only if the index's is still a delta of
        `old_base`, `base`'s chain does not run through it, and no `linear` delta stands on it
        (one reads its base's base, which changes)."""
        with self._lock:
            self._moves.add(key)
            self._rebased[key] = old_base
        self._place_in_pack(key, blob, raw_size, base, 0)

    def _settle_promotions(self, txn, chosen: dict[bytes, ObjectRecord]) -> list[tuple[bytes, ObjectRecord]]:
        """The records a promotion's commit indexes (inside its transaction, after the session's
        other writes, `chosen`). An unlinked delta stands while its index record is a delta of
        the same base. A rebased one, while its record is a delta of the base it was coded away
        from and its new base's chain (as this commit leaves it) does not reach it. Neither a
        rebased object nor one made whole may leave a `linear` delta standing on it (read from
        its header; an unreadable one counts as linear): judged until nothing changes, as one
        refused move can refuse the one below it. Every delta whose chain the moves change gets
        its new depth."""
        children = self.index.delta_children(txn)
        records: dict[bytes, ObjectRecord | None] = {}

        def indexed(key: bytes) -> ObjectRecord | None:
            if key not in records:
                records[key] = self.index.record(txn, key)
            return records[key]

        def kept(keys, base_was) -> dict[bytes, ObjectRecord]:
            out = {}
            for key in keys:
                rec, current = self._written[key], indexed(key)
                if current is not None and current.raw_size == rec.raw_size and base_was(key, current.base):
                    out[key] = rec
            return out

        unlinked = kept(self._unlinked, lambda key, base: base == self._written[key].base)
        rebased = kept(self._rebased, lambda key, base: base == self._rebased[key])
        wholes = kept(self._wholes, lambda key, base: True)
        linear: dict[bytes, bool] = {}

        def stays_linear(child: bytes) -> bool:
            if child not in linear:
                rec = indexed(child)
                try:
                    linear[child] = rec is not None and self.store.header_at(child, rec).needs_below
                except CasError:
                    linear[child] = True
            return linear[child]

        def leaves_linear(key: bytes) -> bool:
            return any(c not in unlinked and c not in rebased and c not in wholes and stays_linear(c)
                       for c in children.get(key, ()))

        def left(key: bytes) -> ObjectRecord | None:
            return unlinked.get(key) or rebased.get(key) or wholes.get(key) or chosen.get(key) or indexed(key)

        def loops(key: bytes) -> bool:
            base, steps = rebased[key].base, 0
            while base is not None and steps <= MAX_CHAIN_DECODE:
                if base == key:
                    return True
                rec, steps = left(base), steps + 1
                base = rec.base if rec is not None else None
            return base is not None

        refused = True
        while refused:
            refused = False
            for moves, judge in ((rebased, lambda k: leaves_linear(k) or loops(k)), (wholes, leaves_linear)):
                for key in [k for k in moves if judge(k)]:
                    del moves[key]
                    refused = True
        moved = {**unlinked, **rebased, **wholes}
        depths: dict[bytes, int] = {}

        def depth_of(key: bytes) -> int:
            if key not in depths:
                depths[key] = 255  # until known: a hostile cycle of bases ends here
                rec = left(key)
                depths[key] = 0 if rec is None or rec.base is None else min(depth_of(rec.base) + 1, 255)
            return depths[key]

        out = [(key, dataclasses.replace(rec, depth=depth_of(key))) for key, rec in moved.items()]
        below = [c for key in moved for c in children.get(key, ()) if c not in moved]
        seen = set(moved)
        while below:  # the deltas above the moved ones, level by level
            key = below.pop()
            if key in seen:
                continue
            seen.add(key)
            rec = indexed(key)
            if rec is not None and rec.base is not None and rec.depth != depth_of(key):
                out.append((key, dataclasses.replace(rec, depth=depth_of(key))))
            below.extend(children.get(key, ()))
        return out

    def _place_in_pack(self, key: bytes, blob: bytes, raw_size: int, base: bytes | None, depth: int) -> None:
        """Store a moved object in a pack whatever its size: the copy it replaces (a file, or
        another pack's entry) stays readable until the commit has moved its record."""
        size = memoryview(blob).nbytes
        self._pack_entry(key, [blob], size, raw_size, base, depth)
