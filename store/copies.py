"""One record per object among the copies a store holds of it: what a cache rebuild (and, for
a bucket's recode entries, a catch-up) indexes. Several copies of one object lie on disk or in
a bucket after a crashed gc rewrite, a writer that lost a commit, a recode or a promotion whose
superseded copies are not compacted yet; each decodes to the same bytes, but a chain must
reach a full object, never loop, and a `linear` delta needs its base's own base as coded."""

from __future__ import annotations

import dataclasses

from cas.errors import CasError
from cas.index import WHERE_PACK, ObjectRecord
from cas.objectstore import MAX_CHAIN_DECODE


def choose_copies(copies: dict[bytes, list[ObjectRecord]], old: dict[bytes, ObjectRecord],
                  extrapolates=None) -> dict[bytes, ObjectRecord]:
    """One record per object among its copies on disk (a pack entry a crashed gc did not yet
    rewrite, a file, another writer's pack entry that lost the commit): the old index's record
    when it still describes one of them and its chain holds; else a full object; else a delta
    whose chain reaches a full object on disk. (A dead delta entry whose base is gone once beat
    the live full copy, and a checkpoint that loaded before the repair did not after it.) But a
    `linear` delta (`extrapolates(key, record)` says so, reading its header) predicts from its
    base's own base, so a base chosen whole under one takes its delta copy instead."""
    anchored = {key for key, recs in copies.items() if any(r.base is None for r in recs)}
    grown = True
    while grown:  # a delta is anchored once its base is; chains are short
        grown = False
        for key, recs in copies.items():
            if key not in anchored and any(r.base in anchored for r in recs):
                anchored.add(key)
                grown = True

    def rank(rec: ObjectRecord) -> int:
        return 0 if rec.base is None else 1 if rec.base in anchored else 2

    out = {}
    for key, recs in copies.items():
        prev = old.get(key)
        same = [r for r in recs if prev is not None and r.same_copy(prev) and rank(r) < 2]
        out[key] = same[0] if same else min(recs, key=rank)
    if extrapolates is not None:
        keep_extrapolated_bases(copies, out, extrapolates)
    changed = True
    while changed:  # records that do not reach a full object (a cycle) take a copy whose base does
        changed = False
        for key in out:
            if not reaches_full(out, key):
                good = [r for r in copies[key] if r.base is None or reaches_full(out, r.base)]
                if good and good[0] != out[key]:
                    out[key] = min(good, key=rank)
                    changed = True
    return out


def keep_extrapolated_bases(copies: dict[bytes, list[ObjectRecord]], out: dict[bytes, ObjectRecord],
                             extrapolates) -> None:
    """Give each base chosen whole its delta copy where a `linear` delta stands on it (the
    relinks of store/recode.py: coded against the base's delta copy, whose own base they read).
    Headers are read only where a base has both kinds of copy on disk (a duplicate a second
    writer left, or the copies a recode's promotion superseded, until gc compacts them). Until
    nothing changes: a base given its delta copy may be a `linear` delta itself, whose own base
    then needs the same (a promotion leaves whole and delta copies on two levels)."""
    changed = True
    while changed:
        changed = False
        for key, rec in list(out.items()):
            rec = out[key]
            base = rec.base
            if base is None or base not in out or out[base].base is not None:
                continue
            deltas = [r for r in copies.get(base, []) if r.base is not None and reaches_full(out, r.base)
                      and base not in chain_keys(out, r.base)]
            if deltas and extrapolates(key, rec):
                out[base] = deltas[0]
                changed = True


def chain_keys(records: dict[bytes, ObjectRecord], key: bytes) -> set[bytes]:
    keys: set[bytes] = set()
    while key is not None and key not in keys and len(keys) <= MAX_CHAIN_DECODE:
        keys.add(key)
        rec = records.get(key)
        key = rec.base if rec is not None else None
    return keys


def is_linear_copy(objects, key: bytes, rec: ObjectRecord) -> bool:
    """Whether the copy `rec` of object `key` is a `linear` delta (read from its header; an
    unreadable one is not: the load reports it)."""
    try:
        return objects.header_at(key, rec).needs_below
    except CasError:
        return False


def chain_holds(record_of, key: bytes, base: bytes | None) -> bool:
    """Whether `key` coded as a delta of `base` (None: whole) decodes from the records
    `record_of` gives: its base's chain reaches a full object within the decode bound and
    never passes through `key` itself (that would close a loop)."""
    for _ in range(MAX_CHAIN_DECODE):
        if base is None:
            return True
        if base == key:
            return False
        rec = record_of(base)
        if rec is None:
            return False
        base = rec.base
    return False


def adopt_recodes(records: dict[bytes, ObjectRecord], copies: dict[bytes, list[ObjectRecord]], entries) -> None:
    """What a bucket's recodes moved, chosen as catch_up chooses it: in log order, each copy in
    a pack a `recoded` entry names replaces the one chosen, where its chain holds. (Every host
    then reads the older checkpoints through the same deltas, and its gc takes back the whole
    copies they superseded rather than the deltas.)"""
    named = [pack for entry in entries for pack in entry.recoded]
    if not named:
        return
    wanted = set(named)
    in_pack: dict[bytes, list] = {}
    for key, recs in copies.items():
        for rec in recs:
            if rec.where == WHERE_PACK and rec.pack in wanted:
                in_pack.setdefault(rec.pack, []).append((key, rec))
    for pack in named:
        for key, rec in in_pack.get(pack, ()):
            if chain_holds(records.get, key, rec.base):
                records[key] = dataclasses.replace(rec, depth=0)


def reaches_full(records: dict[bytes, ObjectRecord], key: bytes) -> bool:
    for _ in range(MAX_CHAIN_DECODE + 1):
        rec = records.get(key)
        if rec is None:
            return False
        if rec.base is None:
            return True
        key = rec.base
    return False


def set_depths(records: dict[bytes, ObjectRecord]) -> None:
    """A delta's depth is its base's + 1, as the writer recorded it; a base that is missing
    counts as a full object (loading the delta then reports the missing base by name)."""
    def depth(key: bytes, seen: int = 0) -> int:
        rec = records.get(key)
        if rec is None or rec.base is None or seen > MAX_CHAIN_DECODE:
            return 0
        if rec.depth == 0:
            records[key] = rec = dataclasses.replace(rec, depth=min(depth(rec.base, seen + 1) + 1, 255))
        return rec.depth
    for key in list(records):
        depth(key)
