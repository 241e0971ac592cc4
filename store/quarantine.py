"""Quarantine: take the objects found damaged out of the live store (`cas repair` runs it).

verify and failed loads record damaged objects in the index's `damaged` table
(store/verify.py); saves already refuse to build on them. Quarantining moves such an object's
file into quarantine/ (never deleting it: someone recovering by hand may still want the bytes),
copies a pack entry's bytes there (the pack holds other live objects; gc drops the dead entry
when it rewrites the pack), and drops its index record, so that nothing finds it in the store
any more. Its damage record stays, marked with where it went: deltas whose chain reaches it
are still not reused or coded against, and a save that writes the object again clears it.
Nothing in quarantine/ is ever read, swept or rebuilt from (gc and repair only walk objects/
and packs/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cas.errors import BlobAbsentError, CorruptionError
from cas.index import WHERE_PACK, Index
from cas.localfs import LocalBackend
from cas.objectfiles import FileObjects
from cas.packs import PackFiles

from .location import Location
from . import layout as L

FOLDER = "quarantine"


@dataclass
class Quarantined:
    key: str  # hex
    reason: str
    moved_to: str | None  # None: nothing of it was left on disk (only its record went)


@dataclass
class QuarantineReport:
    moved: list[Quarantined] = field(default_factory=list)


def quarantine_damaged(path: str, key=None) -> QuarantineReport:
    """Move every object recorded as damaged, and not yet quarantined, out of objects/ and
    packs/ into quarantine/, and drop its index record. Each runs inside one write transaction,
    which a commit replacing the object with a fresh copy cannot interleave with (a commit
    decides and renames inside its own transaction, and clears the damage record there)."""
    layout = L.Layout(os.path.abspath(path))
    config = L.read_config(layout)
    report = QuarantineReport()
    where = Location("local", layout.root, LocalBackend(layout.root))
    where.unlock(config, key)  # an encrypted store's packs are read through its keys
    index = Index(layout.index)
    try:
        backend = where.backend
        files, packs = FileObjects(backend), PackFiles(backend)
        with index.write() as txn:
            for key, info in list(index.iter_damaged(txn)):
                if "quarantined" in info:
                    continue
                moved = _move_out(index, txn, files, packs, key)
                index.put_damaged(txn, key, dict(info, quarantined=moved or ""))
                report.moved.append(Quarantined(key.hex(), info.get("reason", ""), moved))
    finally:
        index.close()
    return report


def _move_out(index: Index, txn, files: FileObjects, packs: PackFiles, key: bytes) -> str | None:
    """Put what the store holds of one object into quarantine/ and drop its record; returns
    where it went (None when there was nothing to keep). A name taken by an earlier quarantine
    of that object is never replaced: <key>.1, .2, ... instead."""
    rec = index.record(txn, key)
    if rec is not None:
        txn.delete(key, db=index.db("objects"))
    blob = None
    if rec is not None and rec.where == WHERE_PACK:
        try:
            blob = packs.read(rec.pack, rec.offset, rec.stored_size, key)
        except CorruptionError:  # the pack is gone or shorter: nothing of the entry to keep
            return None
    backend, n = files.backend, 0
    while True:
        dest = f"{FOLDER}/{key.hex()}" + (f".{n}" if n else "")
        try:  # a pack entry's bytes are copied; a file (or what stands in its place) is moved
            if backend.put_if_absent(dest, [blob]) if blob is not None else backend.move(files.name(key), dest):
                return backend.where(dest)
        except BlobAbsentError:  # no file of it, indexed or not
            return None
        n += 1
