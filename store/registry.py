"""The checkpoint registry: step -> record, the fold of the store's record log, cached in LMDB.

The truth is the record log (store/records.py): every change is one immutable entry, written
create-only inside the LMDB write transaction that applies it to the cache, after every object
it references is durable. The cache tables are rebuilt from the log whenever they do not
provably match it (store/cache.py), so losing, damaging or rolling back the LMDB file loses no
checkpoint and no flag.

Cache tables (docs/format.md, "Index"): `checkpoints` step -> record (the step as 8 big-endian
bytes with the sign bit flipped, so a cursor walks steps in ascending order); `order` commit
order (entry seq, step) -> b"", so the newest checkpoint is the most recently committed one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from dataclasses import dataclass, field
from typing import Callable

import msgpack

from cas import faults
from cas.errors import CasError, CheckpointExistsError, CheckpointNotFoundError, CorruptionError, StoreWriteError
from cas.hashing import hash_bytes

from .records import FLAGS, RecordLog

TABLE = "checkpoints"
ORDER_TABLE = "order"
ROWS, CHECK = b"registry_rows", b"registry_check"  # meta keys of the registry's check (registry_damage)
TABLES = (TABLE, ORDER_TABLE)
RECORD_FORMAT = 1
_BIAS = 1 << 63
APPEND_ATTEMPTS = 20  # entries other caches committed meanwhile, folded in before trying again (hosts saving many times a second)


def step_key(step: int) -> bytes:
    if type(step) is not int:
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not -_BIAS <= step < _BIAS:
        raise CasError(f"step {step} does not fit in 64 bits")
    return (step + _BIAS).to_bytes(8, "big")


def key_step(key: bytes) -> int:
    return int.from_bytes(key, "big") - _BIAS


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint as the registry records it."""

    step: int
    id: str  # hex of the commit node's key, the root of its Merkle tree
    created: _dt.datetime
    milestone: bool
    metrics: dict
    meta: dict
    logical_bytes: int  # tensor bytes it holds
    new_bytes: int  # bytes its save added on disk
    pinned: bool = False
    seq: int = 0  # the record log entry that committed it: commit order, never the wall clock
    mirrored: bool = False  # pushed to the mirror of the store it lives in (a `set` entry says so)
    provenance: dict = field(default_factory=dict, compare=False)  # what produced it (store/provenance.py)
    signature: dict | None = field(default=None, compare=False, repr=False)  # store/signing.py
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.id)

    def to_json(self) -> dict:
        return {"step": self.step, "id": self.id, "created": self.created.isoformat(),
                "milestone": self.milestone, "pinned": self.pinned, "metrics": self.metrics, "meta": self.meta,
                "logical_bytes": self.logical_bytes, "new_bytes": self.new_bytes, "seq": self.seq,
                "mirrored": self.mirrored, "provenance": self.provenance}


_KNOWN = {"format", "id", "created", "milestone", "pinned", "metrics", "meta", "logical_bytes", "new_bytes", "seq",
          "mirrored", "provenance", "signature"}


def _pack(ck: Checkpoint) -> bytes:
    return msgpack.packb({"format": RECORD_FORMAT, "id": ck.key, "created": ck.created.timestamp(),
                          "milestone": ck.milestone, "pinned": ck.pinned, "metrics": ck.metrics,
                          "meta": ck.meta, "logical_bytes": ck.logical_bytes, "new_bytes": ck.new_bytes,
                          "seq": ck.seq, "mirrored": ck.mirrored, "provenance": ck.provenance,
                          **({"signature": ck.signature} if ck.signature else {}), **ck.extra},
                         use_bin_type=True)


def _unpack(step: int, data: bytes) -> Checkpoint:
    try:
        rec = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return Checkpoint(
            step=step, id=bytes(rec["id"]).hex(),
            created=_dt.datetime.fromtimestamp(rec["created"], _dt.timezone.utc),
            milestone=bool(rec["milestone"]), pinned=bool(rec.get("pinned", False)),
            metrics=dict(rec["metrics"]), meta=dict(rec["meta"]),
            logical_bytes=int(rec["logical_bytes"]), new_bytes=int(rec["new_bytes"]), seq=int(rec.get("seq", 0)),
            mirrored=bool(rec.get("mirrored", False)), provenance=dict(rec.get("provenance") or {}),
            signature=rec.get("signature"), extra={k: v for k, v in rec.items() if k not in _KNOWN})
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CorruptionError(f"registry record of step {step} is damaged: {exc}") from None


def add_change(ck: Checkpoint, packs=()) -> dict:
    """The log change that commits `ck` (`packs`: the pack files its save wrote). A copied
    checkpoint keeps its signature: it covers no field a copy changes (store/signing.py)."""
    change = {"op": "add", "step": ck.step, "id": ck.key, "created": ck.created.timestamp(),
              "milestone": ck.milestone, "pinned": ck.pinned, "metrics": ck.metrics, "meta": ck.meta,
              "logical_bytes": ck.logical_bytes, "new_bytes": ck.new_bytes, "packs": [bytes(p) for p in packs],
              "provenance": ck.provenance}
    if ck.signature:
        change["signature"] = ck.signature
    return change


def set_change(ck: Checkpoint, **flags: bool) -> dict:
    return {"op": "set", "step": ck.step, "id": ck.key, **flags}


def remove_change(ck: Checkpoint) -> dict:
    return {"op": "remove", "step": ck.step, "id": ck.key}


def _from_add(change: dict, seq: int) -> Checkpoint:
    try:
        return Checkpoint(step=change["step"], id=bytes(change["id"]).hex(),
                          created=_dt.datetime.fromtimestamp(float(change["created"]), _dt.timezone.utc),
                          milestone=bool(change["milestone"]), pinned=bool(change.get("pinned", False)),
                          metrics=dict(change["metrics"]), meta=dict(change["meta"]),
                          logical_bytes=int(change["logical_bytes"]), new_bytes=int(change["new_bytes"]), seq=seq,
                          provenance=dict(change.get("provenance") or {}), signature=change.get("signature"))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CorruptionError(f"record log entry {seq} holds a damaged checkpoint record: {exc}") from None


def applied(current: Checkpoint | None, change: dict, seq: int, where: str) -> Checkpoint | None:
    """The checkpoint at `change`'s step once log entry `seq` applied it to `current` (None:
    removed). A change that does not apply (an add where one exists, a set or remove of a
    checkpoint that is gone or another) raises."""
    op, step = change["op"], change["step"]
    if op == "add":
        if current is not None:
            raise exists_error(step)
        return _from_add(change, seq)
    if current is None or current.key != bytes(change["id"]):
        raise CheckpointNotFoundError(f"checkpoint {step} of the store at {where} was removed or replaced meanwhile")
    if op == "remove":
        return None
    return dataclasses.replace(current, **{f: change[f] for f in FLAGS if f in change})


def fold_records(entries, where: str, upto: int | None = None) -> dict[int, Checkpoint]:
    """step -> checkpoint as the record log's entries (up to seq `upto`) leave it: what the
    registry of a cache folded to that entry must hold. A damaged entry, one out of the chain,
    or one whose change does not apply, is a CorruptionError."""
    out: dict[int, Checkpoint] = {}
    for entry in entries:
        if upto is not None and entry.seq > upto:
            break
        for change in entry.changes:
            try:
                ck = applied(out.get(change["step"]), change, entry.seq, where)
            except (CheckpointExistsError, CheckpointNotFoundError) as exc:
                raise CorruptionError(f"record log entry {entry.seq} of the store at {where} does not apply: "
                                      f"{exc}") from None
            if ck is None:
                del out[change["step"]]
            else:
                out[change["step"]] = ck
    return out


def differences(cached: Checkpoint, truth: Checkpoint) -> list[str]:
    """The fields in which a cached checkpoint record differs from the record log's, compared as
    their msgpack bytes: a NaN metric (a diverged run's loss) is not == itself, but is the same
    value in both records."""
    mine, theirs = msgpack.unpackb(_pack(cached), raw=False), msgpack.unpackb(_pack(truth), raw=False)
    return sorted(f for f in mine.keys() | theirs.keys()
                  if msgpack.packb(mine.get(f)) != msgpack.packb(theirs.get(f)))


def exists_error(step: int) -> CheckpointExistsError:
    return CheckpointExistsError(f"a checkpoint with step {step} already exists; steps are never "
                                 "overwritten (delete it first, or save under another step)")


class _Taken(Exception):
    """Another cache created the log entry this one tried to."""


def apply_gc(index, txn, gc: dict | None) -> None:
    """What a gc step of the log means to this host's cache: an intent dooms its packs (writers
    stop relying on their objects) and indexes the packs its rewrites wrote; a delete ends the
    epochs it names (their packs no longer doomed) and drops the records of the packs it
    deleted (docs/architecture.md, "Stores in a bucket")."""
    if gc is None:
        return
    if gc["phase"] == "intent":
        index.doom_packs(txn, gc["packs"], gc["epoch"])
    else:
        for epoch in [gc["epoch"], *gc.get("settles", ())]:
            index.settle_epoch(txn, bytes(epoch), gc["packs"])


class Registry:
    """Reads come from the cache tables; every change is a log entry applied to them in the
    same LMDB write transaction. `rebuild(txn)` refolds the cache from the log: it runs when
    another cache (another host, a replaced LMDB file) committed the entry this one wanted."""

    def __init__(self, index, store_root: str, log: RecordLog | None,
                 rebuild: Callable[[object], None] | None = None, *, sealer=None) -> None:
        self.index = index
        # an encrypted store's keys (cas.crypt.StoreKeys): records are sealed in LMDB, which
        # lives in the store's folder and would otherwise hold their metrics and meta in plaintext
        self.sealer = sealer
        self.store_root = store_root
        self.log = log  # None: a format-1 store opened read-only, its LMDB registry read as it is
        self.rebuild = rebuild
        self.db = index.db(TABLE)
        self.order = index.tables.get(ORDER_TABLE)  # absent from a format-1 index opened read-only

    # --- reads ------------------------------------------------------------------------
    def _load(self, step: int, data) -> Checkpoint:
        if self.sealer is not None:
            data = self.sealer.unseal(data, step_key(step), f"the cached registry record of step {step}")
        return _unpack(step, data)

    def _dump(self, ck: Checkpoint) -> bytes:
        data = _pack(ck)
        return data if self.sealer is None else self.sealer.seal(data, step_key(ck.step))

    def get(self, txn, step: int) -> Checkpoint | None:
        data = txn.get(step_key(step), db=self.db)
        return self._load(step, data) if data is not None else None

    def require(self, txn, step: int) -> Checkpoint:
        ck = self.get(txn, step)
        if ck is None:
            raise CheckpointNotFoundError(f"no checkpoint with step {step} in the store at {self.store_root}")
        return ck

    def all(self, txn) -> list[Checkpoint]:
        return [self._load(key_step(bytes(k)), v) for k, v in txn.cursor(db=self.db)]

    def latest(self, txn) -> Checkpoint | None:
        """The most recently committed checkpoint (after a rollback, the new line's newest, not
        the highest step of the abandoned one)."""
        cur = txn.cursor(db=self.order) if self.order is not None else None
        if cur is None or not cur.last():
            cur = txn.cursor(db=self.db)  # a format-1 cache without commit order: by step
            return self._load(key_step(bytes(cur.key())), cur.value()) if cur.last() else None
        return self.get(txn, key_step(bytes(cur.key())[8:]))

    def previous(self, txn, step: int) -> Checkpoint | None:
        cur = txn.cursor(db=self.db)
        if not cur.set_range(step_key(step)):
            if not cur.last():
                return None
        elif not cur.prev():
            return None
        if key_step(bytes(cur.key())) >= step:
            return None
        return self._load(key_step(bytes(cur.key())), cur.value())

    # --- the cache's position in the log --------------------------------------------------
    def head(self, txn) -> tuple[int, bytes | None]:
        """(seq, digest) of the last log entry this cache holds."""
        meta = self.index.db("meta")
        seq = txn.get(b"log_seq", db=meta)
        return (int.from_bytes(seq, "big"), txn.get(b"log_hash", db=meta)) if seq else (0, None)

    def set_head(self, txn, seq: int, digest: bytes | None) -> None:
        meta = self.index.db("meta")
        txn.put(b"log_seq", seq.to_bytes(8, "big"), db=meta)
        if digest is None:
            txn.delete(b"log_hash", db=meta)
        else:
            txn.put(b"log_hash", digest, db=meta)
        txn.put(CHECK, self._check_of(seq, digest, self._rows_digest(txn)), db=meta)

    # --- the registry's check: its rows, bound to the log entry they were folded to ---------------
    # The open proves the cache's head current against the log; the rows themselves could still
    # be other than that head's fold (a row put back from an older copy of the file, an edit, a
    # flipped bit). So the cache keeps the XOR of a hash of every row (updated with each row
    # written) and, with the head, a hash of (head, that XOR); an open recomputes it from the rows
    # (registry_damage). Keyed with a subkey of the master key in an encrypted store, so that
    # without the key no edit of the file can be made to pass.
    def _row_hash(self, table: bytes, key: bytes, value) -> bytes:
        data = b"%s\0%s%s" % (table, len(key).to_bytes(2, "big"), key) + bytes(value)
        return self.sealer.registry_mac(data) if self.sealer is not None else hash_bytes(data)

    def _check_of(self, seq: int, digest: bytes | None, rows: bytes) -> bytes:
        data = b"cas registry check\0" + seq.to_bytes(8, "big") + (digest or b"") + rows
        return self.sealer.registry_mac(data) if self.sealer is not None else hash_bytes(data)

    def _rows_digest(self, txn) -> bytes:
        return bytes(txn.get(ROWS, db=self.index.db("meta")) or bytes(32))

    def _mix(self, txn, row_hash: bytes) -> None:
        now = int.from_bytes(self._rows_digest(txn), "big") ^ int.from_bytes(row_hash, "big")
        txn.put(ROWS, now.to_bytes(32, "big"), db=self.index.db("meta"))

    def _put(self, txn, db, table: bytes, key: bytes, value: bytes) -> None:
        old = txn.get(key, db=db)
        if old is not None:
            self._mix(txn, self._row_hash(table, key, old))
        txn.put(key, value, db=db)
        self._mix(txn, self._row_hash(table, key, value))

    def _delete(self, txn, db, table: bytes, key: bytes) -> None:
        old = txn.get(key, db=db)
        if old is not None:
            txn.delete(key, db=db)
            self._mix(txn, self._row_hash(table, key, old))

    def recompute_check(self, txn) -> None:
        """Set the rows' digest and the check from the tables as they are (a cache filled
        another way: from a snapshot, or written by a cas that kept no check)."""
        txn.put(ROWS, self._digest_of_tables(txn), db=self.index.db("meta"))
        self.set_head(txn, *self.head(txn))

    def _digest_of_tables(self, txn) -> bytes:
        acc = 0
        for table, db in ((b"checkpoints", self.db), (b"order", self.order)):
            if db is not None:
                for key, value in txn.cursor(db=db):
                    acc ^= int.from_bytes(self._row_hash(table, bytes(key), value), "big")
        return acc.to_bytes(32, "big")

    def registry_damage(self, txn) -> str | None:
        """None when the registry's rows are those its check was made over, with the head the
        cache holds; else what is wrong (the cache is then rebuilt from the record log)."""
        check = txn.get(CHECK, db=self.index.db("meta"))
        if check is None:
            return "the index keeps no check of its checkpoint records (written by an older cas)"
        seq, digest = self.head(txn)
        if bytes(check) != self._check_of(seq, digest, self._digest_of_tables(txn)):
            return ("the index's checkpoint records are not those it folded from the record log (damaged, "
                    "edited or put back from an older copy)")
        return None

    # --- changes ----------------------------------------------------------------------
    def commit(self, txn, why: str, changes: list[dict] | Callable[[object], list[dict]], *,
               gc: dict | None = None, check: Callable[[object], None] | None = None, recoded=()) -> int:
        """Append `changes` (and a gc step, `gc`, or a bucket recode's packs, `recoded`) to the log
        as one entry and apply them to the
        cache, all in the caller's write transaction; returns the entry's seq (0: nothing to
        commit). A change that does not apply (a step that exists, a checkpoint that is gone)
        raises and writes nothing. When another cache appended first, this one catches up with
        the log and, before trying the next entry, runs `check(txn)`, which raises if what the
        change relies on is gone (a gc on another host deleted it). `changes` may be a function
        of the transaction, planned again on the registry as it stands before each try: a
        decision about flags (a removal refused while pinned, retention's choice) must see a
        pin or milestone another host committed meanwhile (in a bucket, a gc removed a
        checkpoint another host had just pinned: audit of stop 33)."""
        if self.log is None:
            raise CasError(f"the store at {self.store_root} has format 1; open it writable once to upgrade it")
        for _ in range(APPEND_ATTEMPTS):
            seq, prev = self.head(txn)
            planned = changes(txn) if callable(changes) else changes
            if not planned and gc is None and not recoded:
                return 0
            faults.point("registry.planned")  # another host may append first: this try then fails, and plans again
            try:
                with self.index.nested(txn) as child:  # undone unless the entry is created
                    self.apply(child, seq + 1, planned)
                    entry = self.log.append(seq + 1, prev, why, planned, gc, recoded)
                    if entry is None:
                        raise _Taken()
                    faults.point("registry.logged")  # the entry is the truth from here; a kill leaves the cache behind
                    apply_gc(self.index, child, gc)
                    self.set_head(child, entry.seq, entry.digest)
                return entry.seq
            except _Taken:
                pass
            if self.index.orphaned():  # its changes reach nobody: refolding here would only race the others
                raise StoreWriteError(f"the index of the store at {self.store_root} was deleted or replaced while "
                                      "this process had it open, and another process committed since; nothing of "
                                      "this change was committed (the store's next save opens the index again)")
            self.rebuild(txn)  # folds in the other writers' entries
            if check is not None:
                check(txn)
        raise StoreWriteError(f"the record log of the store at {self.store_root} kept moving: {APPEND_ATTEMPTS} "
                              "other writers committed while this one tried; nothing was committed")

    def fold(self, txn, entries, *, skipped: list[str] | None = None) -> tuple[int, bytes | None]:
        """Apply log entries to the (emptied) cache tables; the last one's (seq, digest). With
        `skipped` (a read-only salvage around damaged entries), a change that does not apply
        is left out and said there instead of raising."""
        seq, digest = 0, None
        for entry in entries:
            batches = [[change] for change in entry.changes] if skipped is not None else [list(entry.changes)]
            for batch in batches:  # a salvage applies each change alone: one that fails leaves nothing
                try:
                    self.apply(txn, entry.seq, batch)
                except (CheckpointExistsError, CheckpointNotFoundError) as exc:
                    message = f"record log entry {entry.seq} of the store at {self.store_root} does not apply: {exc}"
                    if skipped is None:
                        raise CorruptionError(message) from None
                    skipped.append(message)
            apply_gc(self.index, txn, entry.gc)
            seq, digest = entry.seq, entry.digest
        return seq, digest

    def apply(self, txn, seq: int, changes: list[dict]) -> list[Checkpoint]:
        """Apply one entry's changes to the cache tables, in order."""
        out = []
        for change in changes:
            step = change["step"]
            current = self.get(txn, step)
            ck = applied(current, change, seq, self.store_root)
            if ck is None:
                self._delete(txn, self.db, b"checkpoints", step_key(step))
                self._delete(txn, self.order, b"order", current.seq.to_bytes(8, "big") + step_key(step))
                out.append(current)
                continue
            self._put(txn, self.db, b"checkpoints", step_key(step), self._dump(ck))
            if current is None:
                self._put(txn, self.order, b"order", seq.to_bytes(8, "big") + step_key(step), b"")
            out.append(ck)
        return out

    def order_keys(self, txn) -> list[tuple[int, int]]:
        """(entry seq, step) of every row of the commit-order table."""
        if self.order is None:
            return []
        return [(int.from_bytes(bytes(k)[:8], "big"), key_step(bytes(k)[8:])) for k, _ in txn.cursor(db=self.order)]

    def clear(self, txn) -> None:
        txn.drop(self.db, delete=False)
        txn.drop(self.order, delete=False)
        txn.put(ROWS, bytes(32), db=self.index.db("meta"))
