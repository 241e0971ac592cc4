"""The record log: the store's own truth about which checkpoints exist and their flags.

Every change to the registry (a checkpoint committed, a milestone or pin set or unset, a
checkpoint removed or replaced) is one immutable entry `log/<seq as 16 hex digits>` written
create-only (cas.backend put_if_absent), the way git keeps refs and Delta Lake its commit log.
Entry `seq` is created only by the writer that wins the name, after every object it references
is durable; the registry is the fold of entries 1, 2, … in order, so it can always be derived
from the store alone, exactly as of the last committed change. Each entry names the blake3 of
the one before it, so a lost, reordered or foreign entry is detected instead of folded.
The LMDB registry is a cache of this fold (store/cache.py). Format: docs/format.md, "Record log".
"""

from __future__ import annotations

import os
import pwd
import socket
import time
from dataclasses import dataclass
from typing import Iterator

import msgpack

from cas.backend import Backend
from cas.bitrot import claims_a_digest, proves_itself, undo_one_error, undo_own_error, with_digest
from cas.errors import CasError, CorruptionError, MissingObjectError
from cas.hashing import KEY_SIZE, hash_bytes
from cas.pools import Pool

LOG_PREFIX = "log/"
ENTRY_MAGIC = b"cas-log\n"
ENTRY_FORMAT = 1
MAX_ENTRY = 64 << 20  # a migration entry lists every checkpoint of a store; far below this
OPS = ("add", "set", "remove")
READ_AHEAD = 256  # log entries read in parallel while a cache is rebuilt
READ_THREADS = 16
FLAGS = ("milestone", "pinned", "mirrored")  # mirrored: pushed to the store's mirror (older entries lack it)


def entry_name(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:016x}"


def name_seq(name: str) -> int | None:
    """The sequence number a log name holds, or None for a name that is not an entry's."""
    tail = name[len(LOG_PREFIX):]
    if not name.startswith(LOG_PREFIX) or len(tail) != 16:
        return None
    try:
        return int(tail, 16)
    except ValueError:
        return None


@dataclass(frozen=True)
class Entry:
    seq: int
    digest: bytes  # blake3 of the entry's bytes: the next entry's `prev`
    prev: bytes | None
    why: str  # what made the change: save, delete, gc, milestone, pin, replace, migrate, ...
    time: float
    host: str
    pid: int
    user: str
    changes: tuple  # the registry changes, applied in order, all or none
    gc: dict | None = None  # a gc step in a bucket store (docs/format.md, "gc entries"), else None
    recoded: tuple = ()  # a bucket recode's packs: copies of stored objects, coded anew (docs/format.md)


GC_PHASES = ("intent", "delete")


def _user() -> str:
    """The account of the process's real uid: getpass.getuser() reads $LOGNAME and $USER first,
    so `LOGNAME=alice cas rm 1` run as root was logged as alice (audit of stop 36)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())


def gc_step(phase: str, epoch: bytes, packs, new_packs=(), settles=()) -> dict:
    """A gc entry's body: `packs` doomed (intent) or deleted (delete) in epoch `epoch`;
    `new_packs` the packs its rewrites wrote (they hold the live entries of doomed packs);
    `settles` (delete) earlier epochs it ends too (intents of gcs that did not finish)."""
    return {"phase": phase, "epoch": bytes(epoch), "packs": sorted(bytes(p) for p in packs),
            "new_packs": sorted(bytes(p) for p in new_packs), "settles": [bytes(e) for e in settles]}


def encode_entry(seq: int, prev: bytes | None, why: str, changes: list[dict], gc: dict | None = None,
                 recoded=()) -> bytes:
    body = {"format": ENTRY_FORMAT, "seq": seq, "prev": prev, "why": why, "time": time.time(),
            "host": socket.gethostname(), "pid": os.getpid(), "user": _user(), "changes": changes}
    if gc is not None:
        body["gc"] = gc
    if recoded:
        body["recoded"] = sorted(bytes(p) for p in recoded)
    return with_digest(ENTRY_MAGIC, body)


def decode_entry(seq: int, data: bytes) -> Entry:
    """Parse and check one entry; CorruptionError naming it for anything we did not write."""
    name = entry_name(seq)
    if not data.startswith(ENTRY_MAGIC):
        raise CorruptionError(f"record log entry {name} is not a cas log entry")
    try:
        body = msgpack.unpackb(data[len(ENTRY_MAGIC):], raw=False, strict_map_key=False)
        if claims_a_digest(body) and not proves_itself(data):
            raise CorruptionError(f"record log entry {name} is damaged: its bytes do not match the digest it ends with")
        if body["format"] != ENTRY_FORMAT:
            raise CasError(f"record log entry {name} has format {body['format']!r}; this cas reads "
                           f"{ENTRY_FORMAT} (upgrade cas)")
        prev = body["prev"]
        entry = Entry(seq=int(body["seq"]), digest=hash_bytes(data), prev=bytes(prev) if prev is not None else None,
                      why=str(body["why"]), time=float(body["time"]), host=str(body["host"]),
                      pid=int(body["pid"]), user=str(body["user"]), changes=tuple(body["changes"]),
                      gc=_checked_gc(body.get("gc")), recoded=tuple(_pack_names(body.get("recoded", []), "recoded")))
        for change in entry.changes:
            _check_change(change)
    except CasError:
        raise
    except KeyError as exc:  # (its str is only the key's repr)
        raise CorruptionError(f"record log entry {name} is damaged: it has no field {exc}") from None
    except (ValueError, TypeError, AttributeError, msgpack.UnpackException) as exc:
        raise CorruptionError(f"record log entry {name} is damaged: {exc}") from None
    if entry.seq != seq:
        raise CorruptionError(f"record log entry {name} says it is entry {entry.seq}: it was copied or renamed")
    return entry


def _checked_gc(gc) -> dict | None:
    if gc is None:
        return None
    if not isinstance(gc, dict) or gc.get("phase") not in GC_PHASES or not isinstance(gc.get("epoch"), bytes):
        raise ValueError(f"unknown gc step {gc!r:.80}")
    for field in ("packs", "new_packs"):
        _pack_names(gc.get(field), f"a gc step's {field}")
    if not isinstance(gc.get("settles", []), list) or not all(isinstance(e, bytes) for e in gc.get("settles", [])):
        raise ValueError("a gc step settles epochs named by bytes")
    return gc


def _pack_names(names, what: str) -> list:
    if not isinstance(names, list) or not all(isinstance(p, bytes) and len(p) == KEY_SIZE for p in names):
        raise ValueError(f"{what} are 32-byte pack names")
    return names


def _check_change(change: dict) -> None:
    if not isinstance(change, dict) or change.get("op") not in OPS:
        raise ValueError(f"unknown change {change!r:.80}")
    if type(change.get("step")) is not int or not isinstance(change.get("id"), bytes) or len(change["id"]) != KEY_SIZE:
        raise ValueError("a change needs an int step and a 32-byte checkpoint id")
    if change["op"] == "set" and not all(type(change.get(f, False)) is bool for f in FLAGS):
        raise ValueError("a set change holds booleans")


class RecordLog:
    """The log entries of one store, through its backend. An entry whose bytes were damaged
    after it was written (one bit or byte: cas/bitrot.py) is read as it was written when a
    digest recorded elsewhere proves the original (its successor's `prev`, the index's head):
    `mended` keeps those, `heal()` writes them back (`cas repair`)."""

    def __init__(self, backend: Backend, where: str) -> None:
        self.backend = backend
        self.where = where  # the store, for messages
        self.mended: dict[int, bytes] = {}  # seq -> its original bytes, proven by a digest held elsewhere

    def raw(self, seq: int) -> bytes:
        """Entry `seq`'s bytes (as written, where they were mended); CorruptionError if missing."""
        if seq in self.mended:
            return self.mended[seq]
        try:
            return bytes(self.backend.get(entry_name(seq)))
        except MissingObjectError:
            raise CorruptionError(f"record log entry {entry_name(seq)} of the store at {self.where} is "
                                  "missing") from None

    def read(self, seq: int) -> Entry:
        return decode_entry(seq, self.raw(seq))

    def mend(self, seq: int, data: bytes, digest: bytes | None) -> Entry | None:
        """Entry `seq` as written, when `data` (its bytes now) differs in one bit or byte from
        bytes that hash to `digest` (None: that end with the digest of their other bytes, as
        entries since stop 33 do) and those decode; None otherwise."""
        original = undo_one_error(data, digest) if digest is not None else undo_own_error(data, ENTRY_MAGIC)
        if original is None or original == data:
            return None
        try:
            entry = decode_entry(seq, original)
        except CorruptionError:
            return None
        self.mended[seq] = original
        return entry

    def still_damaged(self) -> list[int]:
        """The mended entries whose stored bytes are still the damaged ones (not yet healed):
        mended here, or, in an encrypted store, by the backend from their sealed bytes."""
        out = []
        for seq, original in sorted(self.mended.items()):
            try:
                if bytes(self.backend.get(entry_name(seq))) != original:
                    out.append(seq)
            except MissingObjectError:
                continue
        sealed = getattr(self.backend, "still_mended", None)
        if sealed is not None:
            out += [s for s in map(name_seq, list(self.backend.mended)) if s is not None and s not in out
                    and sealed(entry_name(s))]
        return sorted(out)

    def heal(self) -> list[int]:
        """Write the mended entries back as they were written, the damaged bytes first kept in
        quarantine/log-<seq>-<their hash> (an encrypted store's entry is sealed again)."""
        healed = []
        for seq in self.still_damaged():
            name = entry_name(seq)
            inner = getattr(self.backend, "inner", self.backend)
            damaged = bytes(inner.get(name))
            inner.put_if_absent(f"quarantine/log-{seq:016x}-{hash_bytes(damaged).hex()[:16]}", [damaged])
            self.backend.replace(self.backend.stage(name, [self.raw(seq)], fsync=True))
            getattr(self.backend, "mended", {}).pop(name, None)
            healed.append(seq)
        return healed

    def exists(self, seq: int) -> bool:
        return self.backend.stat(entry_name(seq)) is not None

    def last_seq(self) -> int:
        """The highest entry number present (0: an empty log)."""
        seqs = [s for s in map(name_seq, self.backend.list(LOG_PREFIX)) if s is not None]
        return max(seqs, default=0)

    def entries(self, after: int = 0, prev: bytes | None = None, *,
                around: list[CorruptionError] | None = None) -> Iterator[Entry]:
        """Entries after `after` in order, each checked to follow the one before (`prev`: the
        digest of entry `after`). An entry is given out once the next one confirms it, so that
        one whose bytes changed but still parse is mended (or reported) before anyone folds it.
        A gap, a broken chain, or an entry damaged beyond mending is a CorruptionError naming it;
        with `around` (a list), such an entry is skipped and its error appended there instead,
        and the entry after it is taken without a chain to check (a read-only salvage)."""
        last = self.last_seq()
        held: Entry | None = None  # follows `prev`'s entry; given out once its successor names its digest
        unknown = False  # the entry before was skipped: nothing to check `prev` against
        for seq, data in self._read_ahead(after + 1, last):
            entry = self._decoded(seq, data)
            if unknown and isinstance(entry, Entry):
                prev, unknown = entry.prev, False
            if isinstance(entry, Entry) and entry.prev not in (prev, None) and held is not None:
                # held's bytes parse but are not the ones its successor names: mend held
                fixed = self.mend(held.seq, self.raw(held.seq), entry.prev)
                if fixed is not None and fixed.prev == held.prev:
                    held, prev = fixed, fixed.digest
            if not (isinstance(entry, Entry) and entry.prev == prev):
                try:
                    entry = self._mended_or_raise(seq, data, entry, prev, last)
                except CorruptionError as exc:
                    if around is None:
                        raise
                    around.append(exc)
                    if held is not None and held.seq == seq - 1 and isinstance(entry, Entry):
                        around.append(CorruptionError(  # held or this entry changed: neither is proven
                            f"record log entry {entry_name(held.seq)} of the store at {self.where} may be the "
                            "damaged one (the next entry does not name its digest)"))
                    if held is not None:
                        yield held
                    held, unknown = None, True
                    continue
            if held is not None:
                yield held
            held, prev = entry, entry.digest
        if held is not None:
            yield held

    def _decoded(self, seq: int, data) -> Entry | CorruptionError:
        if isinstance(data, CorruptionError):
            return data
        try:
            return decode_entry(seq, data)
        except CorruptionError as exc:
            return exc

    def _mended_or_raise(self, seq: int, data, entry, prev: bytes | None, last: int) -> Entry:
        """Entry `seq` as written, from its damaged bytes and its successor's `prev`; else the
        error that names it (it does not parse, or does not follow the entry before it)."""
        successor = self._decoded(seq + 1, self._fetch(seq + 1)) if seq < last else None
        if not isinstance(data, CorruptionError):
            if isinstance(successor, Entry) and successor.prev is not None:
                fixed = self.mend(seq, data, successor.prev)
            else:  # the newest entry (or its successor damaged too): its own digest, where it has one
                fixed = self.mend(seq, data, None)
            if fixed is not None and fixed.prev == prev:
                return fixed
        if isinstance(entry, CorruptionError):
            raise entry
        raise CorruptionError(f"record log entry {entry_name(seq)} of the store at {self.where} does not "
                              "follow the entry before it (an entry was lost, replaced or reordered)")

    def _fetch(self, seq: int) -> bytes | CorruptionError:
        try:
            return self.raw(seq)
        except CorruptionError as exc:
            return exc

    def _read_ahead(self, first: int, last: int) -> Iterator[tuple[int, bytes | CorruptionError]]:
        """(seq, bytes or the error reading them) of entries first..last in order, read
        READ_AHEAD at a time in parallel: a bucket answers each GET in milliseconds, and a fresh
        host's cache is built from the whole log."""
        if last - first < 4:
            yield from ((seq, self._fetch(seq)) for seq in range(first, last + 1))
            return
        with Pool(max_workers=READ_THREADS, thread_name_prefix="cas-log") as pool:
            for start in range(first, last + 1, READ_AHEAD):
                seqs = range(start, min(start + READ_AHEAD, last + 1))
                yield from zip(seqs, pool.map(self._fetch, seqs))

    def append(self, seq: int, prev: bytes | None, why: str, changes: list[dict],
               gc: dict | None = None, recoded=()) -> Entry | None:
        """Create entry `seq`; None when another writer created it first (nothing written)."""
        data = encode_entry(seq, prev, why, changes, gc, recoded)
        if not self.backend.put_if_absent(entry_name(seq), [data]):
            return None
        return decode_entry(seq, data)
