"""Rebuild the index and the checkpoint registry from the objects on disk (`cas repair`).

Object files and pack files are self-describing and commit nodes carry everything a registry
record needs, so losing or damaging the LMDB index never loses a checkpoint. A damaged index
folder is moved aside, never deleted. Run it while no other process writes to the store.
What a rebuilt registry cannot know: `new_bytes` (set to 0) and pins and milestone changes
made after a save, unless the old registry could still be read; checkpoints deleted but not
yet collected come back (delete them again, then gc).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import time
from dataclasses import dataclass, field

from cas.codecs import decode_into, parse_header
from cas.errors import CasError, CorruptionError
from cas.index import WHERE_FILE, WHERE_PACK, Index, ObjectRecord
from cas.objectstore import MAX_CHAIN_DECODE
from cas.objects import FileObjects
from cas.packs import PackFiles

from . import layout as L
from .registry import TABLE as REGISTRY_TABLE
from .registry import Checkpoint, Registry
from .tree import parse_node


@dataclass
class RepairReport:
    objects: int = 0
    packs: int = 0
    checkpoints: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # damaged files and entries, by name
    moved_aside: str | None = None  # where a damaged index was put


def _open_or_replace_index(layout: L.Layout, report: RepairReport) -> tuple[Index, dict[int, Checkpoint], dict]:
    """The existing index when it opens (its registry flags and, where they still read, its
    object records are kept in view), else a fresh one."""
    try:
        index = Index(layout.index, extra_tables=(REGISTRY_TABLE,))
        with index.read() as txn:
            old = {ck.step: ck for ck in Registry(index, layout.root).all(txn)}
            try:
                old_records = dict(index.iter_records(txn))
            except CasError:  # a damaged record: choose among the copies on disk alone
                old_records = {}
        return index, old, old_records
    except (CasError, OSError) as exc:
        if "index" in locals():
            index.close()
        report.skipped.append(f"index: {exc}")
    if os.path.exists(layout.index):
        report.moved_aside = f"{layout.index}.damaged-{int(time.time())}"
        os.rename(layout.index, report.moved_aside)
    os.makedirs(layout.index)
    return Index(layout.index, create=True, extra_tables=(REGISTRY_TABLE,)), {}, {}


def _scan_packs(packs: PackFiles, copies: dict, commits: list, report: RepairReport) -> None:
    for pack in packs.iterate():
        report.packs += 1
        try:
            for key, offset, length in packs.entries(pack):
                blob = packs.read(pack, offset, length, key)
                try:
                    head = parse_header(blob, key=key)
                    # every pack entry is small: check it whole, except deltas (their base may
                    # be anywhere; verify checks them once the index is back)
                    raw = None if head.base else decode_into(blob, key)
                except CorruptionError as exc:
                    report.skipped.append(f"pack {pack.hex()} entry {key.hex()}: {exc.detail}")
                    continue
                copies.setdefault(key, []).append(ObjectRecord(WHERE_PACK, length, head.raw_size, pack, offset,
                                                               base=head.base))
                if raw is not None:
                    _note_commit(key, raw, commits)
        except (CorruptionError, OSError) as exc:
            report.skipped.append(f"pack {pack.hex()}: {exc}")


def _note_commit(key: bytes, raw, commits: list) -> None:
    """Commit nodes are small, so they always live in packs; any entry may be tried."""
    try:
        node = parse_node(raw.tobytes(), key)
    except CorruptionError:
        return
    if node["k"] == "commit":
        commits.append((key, node))


def _scan_files(files: FileObjects, copies: dict, report: RepairReport) -> None:
    for key in files.iterate():
        try:
            head = parse_header(files.head(key, 64), key=key)
            copies.setdefault(key, []).append(ObjectRecord(WHERE_FILE, files.has(key) or 0, head.raw_size,
                                                           base=head.base))
        except (CorruptionError, OSError) as exc:
            report.skipped.append(f"object {key.hex()}: {exc}")


def _choose(copies: dict[bytes, list[ObjectRecord]], old: dict[bytes, ObjectRecord]) -> dict[bytes, ObjectRecord]:
    """One record per object among its copies on disk (a pack entry a crashed gc did not yet
    rewrite, a file, another writer's pack entry that lost the commit): the old index's record
    when it still describes one of them and its chain holds; else a full object; else a delta
    whose chain reaches a full object on disk. (A dead delta entry whose base is gone once beat
    the live full copy, and a checkpoint that loaded before the repair did not after it.)"""
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
        same = [r for r in recs if prev is not None and _same_copy(r, prev) and rank(r) < 2]
        out[key] = same[0] if same else min(recs, key=rank)
    changed = True
    while changed:  # records that do not reach a full object (a cycle) take a copy whose base does
        changed = False
        for key in out:
            if not _reaches_full(out, key):
                good = [r for r in copies[key] if r.base is None or _reaches_full(out, r.base)]
                if good and good[0] != out[key]:
                    out[key] = min(good, key=rank)
                    changed = True
    return out


def _reaches_full(records: dict[bytes, ObjectRecord], key: bytes) -> bool:
    for _ in range(MAX_CHAIN_DECODE + 1):
        rec = records.get(key)
        if rec is None:
            return False
        if rec.base is None:
            return True
        key = rec.base
    return False


def _same_copy(rec: ObjectRecord, prev: ObjectRecord) -> bool:
    return (rec.where == prev.where and rec.base == prev.base and rec.stored_size == prev.stored_size
            and (rec.where == WHERE_FILE or (rec.pack == prev.pack and rec.offset == prev.offset)))


def _set_depths(records: dict[bytes, ObjectRecord]) -> None:
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


def _checkpoints(commits: list, old: dict[int, Checkpoint]) -> list[Checkpoint]:
    newest: dict[int, tuple[bytes, dict]] = {}
    for key, node in commits:
        if node["step"] not in newest or node["created"] > newest[node["step"]][1]["created"]:
            newest[node["step"]] = (key, node)
    out = []
    for step, (key, node) in sorted(newest.items()):
        prev = old.get(step)
        same = prev is not None and prev.id == key.hex()
        out.append(Checkpoint(step=step, id=key.hex(),
                              created=_dt.datetime.fromtimestamp(node["created"], _dt.timezone.utc),
                              milestone=prev.milestone if same else bool(node.get("milestone")),
                              metrics=dict(node.get("metrics") or {}), meta=dict(node.get("meta") or {}),
                              logical_bytes=int(node.get("logical_bytes", 0)),
                              new_bytes=prev.new_bytes if same else 0, pinned=prev.pinned if same else False))
    return out


def repair(path: str) -> RepairReport:
    layout = L.Layout(os.path.abspath(path))
    L.read_config(layout)  # only a store is repaired
    report = RepairReport()
    index, old, old_records = _open_or_replace_index(layout, report)
    try:
        copies: dict[bytes, list[ObjectRecord]] = {}
        commits: list = []
        _scan_packs(PackFiles(layout.packs, layout.tmp), copies, commits, report)
        _scan_files(FileObjects(layout.objects, layout.tmp), copies, report)
        records = _choose(copies, old_records)
        _set_depths(records)
        cks = _checkpoints(commits, old)
        registry = Registry(index, layout.root)
        with index.write() as txn:
            for name in ("objects", "leases", "holds", REGISTRY_TABLE):
                txn.drop(index.db(name), delete=False)
            for key, rec in records.items():
                index.put_record(txn, key, rec)
            for ck in cks:
                registry.add(txn, ck)
            index.bump_generation(txn)
        report.objects = len(records)
        report.checkpoints = [ck.step for ck in cks]
    finally:
        index.close()
    return report
