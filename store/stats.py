"""What a store holds, counted from its index: bytes against full copies, and codec usage."""

from __future__ import annotations

from dataclasses import dataclass

from cas.codecs import parse_header
from cas.errors import CorruptionError
from cas.index import WHERE_PACK, Index
from cas.objectstore import ObjectStore

from .registry import Registry


@dataclass(frozen=True)
class StoreStats:
    logical_bytes: int  # tensor bytes over all committed checkpoints (what full copies would hold)
    stored_bytes: int  # encoded bytes of every object in the store
    num_objects: int
    num_checkpoints: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def store_stats(index: Index, registry: Registry) -> StoreStats:
    with index.read() as txn:
        stored = num = 0
        for _, rec in index.iter_records(txn):
            stored += rec.stored_size
            num += 1
        cks = registry.all(txn)
    return StoreStats(sum(c.logical_bytes for c in cks), stored, num, len(cks))


def codec_usage(index: Index, objects: ObjectStore) -> dict[str, dict]:
    """Per codec (as named in object headers): objects, stored and raw bytes, deepest chain."""
    usage: dict[str, dict] = {}
    with index.read() as txn:
        records = list(index.iter_records(txn))
    for key, rec in records:
        try:
            if rec.where == WHERE_PACK:
                head = objects.packs.read(rec.pack, rec.offset, min(rec.stored_size, 64), key)
            else:
                head = objects.files.head(key, 64)
            name = parse_header(head, key=key).codec_name
        except CorruptionError:
            name = "unreadable"
        u = usage.setdefault(name, {"objects": 0, "stored_bytes": 0, "raw_bytes": 0, "max_depth": 0})
        u["objects"] += 1
        u["stored_bytes"] += rec.stored_size
        u["raw_bytes"] += rec.raw_size
        u["max_depth"] = max(u["max_depth"], rec.depth)
    return usage
