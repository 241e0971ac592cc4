"""The checkpoint registry: step -> record, an LMDB table in the store's index.

Keys are the step as 8 big-endian bytes with the sign bit flipped, so a cursor walks steps in
ascending order. Values are msgpack maps (docs/format.md, "Registry"). A checkpoint exists
exactly when its record does: adding the record is the commit.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

import msgpack

from cas.errors import CasError, CheckpointExistsError, CheckpointNotFoundError, CorruptionError

TABLE = "checkpoints"
RECORD_FORMAT = 1
_BIAS = 1 << 63


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
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.id)

    def to_json(self) -> dict:
        return {"step": self.step, "id": self.id, "created": self.created.isoformat(),
                "milestone": self.milestone, "pinned": self.pinned, "metrics": self.metrics, "meta": self.meta,
                "logical_bytes": self.logical_bytes, "new_bytes": self.new_bytes}


def _pack(ck: Checkpoint) -> bytes:
    return msgpack.packb({"format": RECORD_FORMAT, "id": ck.key, "created": ck.created.timestamp(),
                          "milestone": ck.milestone, "pinned": ck.pinned, "metrics": ck.metrics,
                          "meta": ck.meta, "logical_bytes": ck.logical_bytes, "new_bytes": ck.new_bytes,
                          **ck.extra}, use_bin_type=True)


def _unpack(step: int, data: bytes) -> Checkpoint:
    try:
        rec = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return Checkpoint(
            step=step, id=bytes(rec["id"]).hex(),
            created=_dt.datetime.fromtimestamp(rec["created"], _dt.timezone.utc),
            milestone=bool(rec["milestone"]), pinned=bool(rec.get("pinned", False)),
            metrics=dict(rec["metrics"]), meta=dict(rec["meta"]),
            logical_bytes=int(rec["logical_bytes"]), new_bytes=int(rec["new_bytes"]),
            extra={k: v for k, v in rec.items() if k not in _KNOWN})
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CorruptionError(f"registry record of step {step} is damaged: {exc}") from None


_KNOWN = {"format", "id", "created", "milestone", "pinned", "metrics", "meta", "logical_bytes", "new_bytes"}


def exists_error(step: int) -> CheckpointExistsError:
    return CheckpointExistsError(f"a checkpoint with step {step} already exists; steps are never "
                                 "overwritten (delete it first, or save under another step)")


class Registry:
    def __init__(self, index, store_root: str) -> None:
        self.index = index
        self.store_root = store_root
        self.db = index.db(TABLE)

    def add(self, txn, ck: Checkpoint) -> None:
        if not txn.put(step_key(ck.step), _pack(ck), db=self.db, overwrite=False):
            raise exists_error(ck.step)

    def update(self, txn, ck: Checkpoint) -> None:
        txn.put(step_key(ck.step), _pack(ck), db=self.db)

    def get(self, txn, step: int) -> Checkpoint | None:
        data = txn.get(step_key(step), db=self.db)
        return _unpack(step, data) if data is not None else None

    def require(self, txn, step: int) -> Checkpoint:
        ck = self.get(txn, step)
        if ck is None:
            raise CheckpointNotFoundError(f"no checkpoint with step {step} in the store at {self.store_root}")
        return ck

    def remove(self, txn, step: int) -> bool:
        return txn.delete(step_key(step), db=self.db)

    def all(self, txn) -> list[Checkpoint]:
        return [_unpack(key_step(bytes(k)), v) for k, v in txn.cursor(db=self.db)]

    def latest(self, txn) -> Checkpoint | None:
        cur = txn.cursor(db=self.db)
        if not cur.last():
            return None
        return _unpack(key_step(bytes(cur.key())), cur.value())

    def previous(self, txn, step: int) -> Checkpoint | None:
        cur = txn.cursor(db=self.db)
        if not cur.set_range(step_key(step)):
            if not cur.last():
                return None
        elif not cur.prev():
            return None
        if key_step(bytes(cur.key())) >= step:
            return None
        return _unpack(key_step(bytes(cur.key())), cur.value())
