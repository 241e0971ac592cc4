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

from . import layout as L
from .cache import RebuildReport, rebuild

RepairReport = RebuildReport


def repair(path: str, key=None) -> RebuildReport:
    """Rebuild the cache of the store at `path`, decoding every full object in a pack to skip
    damaged copies (a plain open only reads headers)."""
    from .store import CheckpointStore  # the store opens its cache, upgrading a format-1 store

    layout = L.Layout(os.path.abspath(path))
    L.read_config(layout)  # only a store is repaired: never create one here
    with CheckpointStore(path, create=False, key=key) as store:
        report = store.cache_report
        with store.index.write() as txn:
            rebuild(store, txn, report, check=True)
        report.log_healed = store.records.heal()  # the entries the rebuild read as written, written back
        report.config_healed = L.heal_config(layout, store.config)
    return report
