"""`cas repair`: rebuild the index (a cache) from the store's own objects and record log.

Object files and pack files are self-describing, and every checkpoint and every later change
to its flags is an entry of the record log (store/records.py), so a lost or damaged LMDB index
loses no checkpoint, pin or milestone. A damaged index folder is moved aside, never deleted.
The rebuild is one LMDB write transaction: a repair killed at any point leaves the cache as it
was (or, when it had to be replaced, a new one that the next open rebuilds again), never a
cache that claims to be current and is empty. Writers may run meanwhile: their leases and
holds are kept.
"""

from __future__ import annotations

import os

from cas.errors import CasError
from cas.index import found_damage, unreadable

from . import layout as L
from .cache import RebuildReport, move_aside, rebuild

RepairReport = RebuildReport


def repair(path: str, key=None) -> RebuildReport:
    """Rebuild the cache of the store at `path` (a folder, or a bucket URL: this host's cache of
    it), decoding every full object in a pack to skip damaged copies (a plain open only reads
    headers), and write back the log entries and config it read as written. An index that
    cannot be read through (tried in a child process first: some damage kills the reader), or
    that LMDB finds damaged while it is rebuilt, is moved aside and a new one built: writing
    into a damaged LMDB file is not safe."""
    from .location import locate

    where = locate(path)
    config = where.read_config()  # only a store is repaired: never create one here
    folder = where.index_dir(config)
    damage = unreadable(folder) if os.path.isdir(folder) else None
    moved = move_aside(folder) if damage else None
    try:
        report = _rebuild(path, where, key)
    except CasError as exc:
        if moved is not None or not found_damage(exc):
            raise
        damage, moved = str(exc), move_aside(folder)
        report = _rebuild(path, where, key)
    if moved is not None:
        report.moved_aside, report.reason = moved, f"the index was damaged ({damage})"
    return report


def _rebuild(path: str, where, key) -> RebuildReport:
    from .store import CheckpointStore  # the store opens its cache, upgrading a format-1 store

    with CheckpointStore(path, create=False, key=key) as store:
        report = store.cache_report
        with store.index.write() as txn:
            rebuild(store, txn, report, check=True)
        if where.local:  # the entries and config read as written, written back (a bucket's blobs never are)
            report.log_healed = store.records.heal()
            report.config_healed = L.heal_config(L.Layout(os.path.abspath(where.name)), store.config)
        else:
            report.log_mended = store.records.still_damaged()
    return report
