"""Snapshots of a bucket store's cache: what a host with an empty cache loads instead of reading
the whole record log and every pack footer (1,001 GETs for 500 checkpoints, 4-5 s).

A snapshot is the cache's tables as of one log entry, `snapshots/<seq as 16 hex digits>`,
created create-only by whichever host first commits or rebuilds past a multiple of
SNAPSHOT_EVERY entries. It is a cache too, never the truth: a host loads one only into an empty
cache, only when it names this store and the log's entry `seq` has the digest it holds, and then
folds the entries after it (store/cache.py catch_up); one that does not parse or check is
ignored, and the host rebuilds from the log and the packs. Format: docs/format.md, "Snapshots".
"""

from __future__ import annotations

import msgpack
import zstandard

from cas.errors import CasError
from cas.hashing import hash_bytes
from cas.index import ObjectRecord

from .records import entry_name

SNAPSHOT_PREFIX = "snapshots/"
SNAPSHOT_MAGIC = b"cas-snap\n"
SNAPSHOT_FORMAT = 1  # also the format of the rows it holds (ObjectRecord, registry records)
SNAPSHOT_EVERY = 64  # log entries between snapshots
KEEP = 2  # snapshots gc leaves (a host may be reading the one before the newest)
MAX_SNAPSHOT = 1 << 30
TABLES = ("objects", "packstate")  # index tables a snapshot holds, with the registry's two


def snapshot_name(seq: int) -> str:
    return f"{SNAPSHOT_PREFIX}{seq:016x}"


def snapshot_seqs(backend) -> list[int]:
    """The log positions of the snapshots in the store, ascending."""
    out = []
    for name in backend.list(SNAPSHOT_PREFIX):
        tail = name[len(SNAPSHOT_PREFIX):]
        if len(tail) == 16:
            try:
                out.append(int(tail, 16))
            except ValueError:
                continue
    return sorted(out)


def _tables(store) -> dict:
    registry, index = store.registry, store.index
    return {"checkpoints": registry.db, "order": registry.order,
            **{name: index.db(name) for name in TABLES}}


def encode(store, txn) -> tuple[int, bytes] | None:
    """(seq, bytes) of a snapshot of the cache as `txn` sees it; None for an empty log."""
    seq, digest = store.registry.head(txn)
    if not seq:
        return None
    body = {"format": SNAPSHOT_FORMAT, "store_id": store.config.store_id, "seq": seq, "digest": bytes(digest),
            "tables": {name: [[bytes(k), bytes(v)] for k, v in txn.cursor(db=db)]
                       for name, db in _tables(store).items()}}
    return seq, SNAPSHOT_MAGIC + zstandard.ZstdCompressor(level=3).compress(msgpack.packb(body, use_bin_type=True))


def take(store, txn) -> bool:
    """Write a snapshot of the cache at its head, unless one is there; best effort (a snapshot
    only saves another host time, so failing to write one fails nothing)."""
    made = encode(store, txn)
    if made is None:
        return False
    try:
        return store.records.backend.put_if_absent(snapshot_name(made[0]), [made[1]])
    except (CasError, OSError):
        return False


def due(seq: int) -> bool:
    return seq > 0 and seq % SNAPSHOT_EVERY == 0


def take_if_due(store, seq: int) -> None:
    """After this host's log entry `seq` is in its cache: snapshot the cache when the entry
    lands on a snapshot's sequence number, whatever made it (a save, a recode, a gc step)."""
    if not store.location.local and due(seq):
        with store.index.read() as txn:
            take(store, txn)


def offer(store, txn) -> None:
    """After a full rebuild of a bucket store's cache: snapshot it when the newest snapshot is
    SNAPSHOT_EVERY or more entries behind (so the next fresh host has less to read)."""
    if store.location.local:
        return
    seq, _ = store.registry.head(txn)
    try:
        newest = max(snapshot_seqs(store.records.backend), default=0)
    except (CasError, OSError):
        return
    if seq - newest >= SNAPSHOT_EVERY:
        take(store, txn)


def restore(store, txn, report) -> bool:
    """Fill an empty cache from the newest snapshot that checks (of the newest KEEP); False
    when there is none, the cache is not empty or the store is a folder."""
    if store.location.local or store.registry.head(txn)[0]:
        return False
    backend = store.records.backend
    try:
        seqs = snapshot_seqs(backend)
    except (CasError, OSError):
        return False
    for seq in reversed(seqs[-KEEP:]):
        try:
            body = _decode(backend.get(snapshot_name(seq)), seq)
            if body["store_id"] != store.config.store_id or hash_bytes(backend.get(entry_name(seq))) != body["digest"]:
                continue
            _load(store, txn, body)
            store.registry.all(txn)  # every registry record parses, or the snapshot is refused
        except (CasError, OSError, ValueError, TypeError, KeyError, zstandard.ZstdError, msgpack.UnpackException):
            continue  # not a snapshot this cas can trust: the next older one, or a rebuild
        report.reason = report.reason or "the cache was empty"
        report.snapshot = seq
        return True
    return False


def _decode(data: bytes, seq: int) -> dict:
    if not data.startswith(SNAPSHOT_MAGIC):
        raise ValueError("not a snapshot")
    raw = zstandard.ZstdDecompressor().decompress(data[len(SNAPSHOT_MAGIC):], max_output_size=MAX_SNAPSHOT)
    body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if body["format"] != SNAPSHOT_FORMAT or body["seq"] != seq or not isinstance(body["digest"], bytes):
        raise ValueError("a snapshot of another format or position")
    for rows in body["tables"].values():
        if not all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in rows):
            raise ValueError("a snapshot row that is not bytes")
    return body


def _load(store, txn, body: dict) -> None:
    tables = _tables(store)
    for name, db in tables.items():
        txn.drop(db, delete=False)
    for name, rows in body["tables"].items():
        db = tables.get(name)
        if db is None:
            raise ValueError(f"a snapshot table {name!r} this cas does not know")
        for key, value in rows:
            if name == "objects":
                ObjectRecord.unpack(value)  # each record parses
            txn.put(key, value, db=db)
    store.registry.set_head(txn, body["seq"], body["digest"])
    store.registry.recompute_check(txn)  # over the rows the snapshot put
    txn.put(b"store_id", store.config.store_id.encode(), db=store.index.db("meta"))
    store.index.bump_generation(txn)


def prune(store) -> int:
    """Delete all but the newest KEEP snapshots (gc); returns how many it deleted."""
    backend = store.records.backend
    old = snapshot_seqs(backend)[:-KEEP]
    for seq in old:
        backend.delete(snapshot_name(seq))
    return len(old)
