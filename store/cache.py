"""The LMDB index is a cache of the store: proven current on every open, rebuilt when it is not.

The store's truth is its objects (packs and object files, self-describing) and its record log
(store/records.py). The cache holds, in LMDB meta, the store id and the (seq, blake3) of the last
log entry it folded in. It is current when the store id matches, that entry still exists with
that digest, and the next one does not: one small read and one stat. Otherwise (missing,
damaged, emptied, another store's, an older copy put back, a crash between a log entry and its
cache update, another cache committing) it is rebuilt in one LMDB write transaction: every object
is found again from the packs and object files, and the registry is the fold of the whole log.
Leases and holds of live writers sharing the environment are kept. A read-only open rebuilds
into a private temporary cache and changes nothing in the store.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from cas import faults
from cas.codecs import decode_into, parse_header
from cas.crypt import namer_of
from cas.errors import CasError, CorruptionError, MissingObjectError
from cas.hashing import hash_bytes
from cas.index import WHERE_FILE, WHERE_PACK, Index, ObjectRecord
from cas.pools import Pool

from . import layout as L
from . import snapshots
from .copies import adopt_recodes, chain_holds, choose_copies, is_linear_copy, set_depths
from .registry import ORDER_TABLE, TABLE, TABLES, Checkpoint, add_change
from .tree import parse_node


SCAN_THREADS = 16  # ranged reads of pack footers in flight while a cache is rebuilt


@dataclass
class RebuildReport:
    objects: int = 0
    packs: int = 0
    checkpoints: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # damaged files and entries, by name
    moved_aside: str | None = None  # where a damaged index was put
    reason: str | None = None  # why the cache was rebuilt
    snapshot: int | None = None  # the log position of the snapshot it started from, if any
    log_healed: list[int] = field(default_factory=list)  # record log entries repair wrote back as written
    config_healed: bool = False  # repair wrote the config back as written
    log_mended: list[int] = field(default_factory=list)  # entries read as written, left as they are (a bucket's)
    salvaged: list[str] = field(default_factory=list)  # a read-only open folded around these (damaged entries)
    seconds: float = 0.0


def open_index(folder: str, *, readonly: bool, report: RebuildReport) -> tuple[Index, str | None]:
    """The store's LMDB environment in `folder`; a missing one is made, a damaged one moved
    aside (never deleted) and a fresh one made, or, where the cache may not be written
    (`readonly`: a read-only open of a local store), a private one in a temporary folder (its
    path returned)."""
    if os.path.isdir(folder) or readonly:
        try:
            return Index(folder, readonly=readonly, extra_tables=(TABLE,), optional_tables=(ORDER_TABLE,)), None
        except (CasError, OSError) as exc:
            report.skipped.append(f"index: {exc}")
            report.reason = "the index cannot be opened"
    if readonly:
        return private_index()
    if os.path.lexists(folder):
        report.moved_aside = move_aside(folder)
    os.makedirs(folder, exist_ok=True)
    return Index(folder, create=True, extra_tables=TABLES), None


def move_aside(folder: str) -> str:
    """Rename a damaged index to `<folder>.damaged-<time>-<pid>[-n]` (never deleted: it may be
    all there is to learn from); the name it got. Two in one second get two names."""
    base = f"{folder}.damaged-{int(time.time())}-{os.getpid()}"
    for n in range(1000):
        aside = base if n == 0 else f"{base}-{n}"
        if not os.path.lexists(aside):
            os.rename(folder, aside)
            return aside
    raise CasError(f"cannot move the damaged index {folder} aside: {base} and 999 more names are taken")


def private_index() -> tuple[Index, str]:
    folder = tempfile.mkdtemp(prefix="cas-cache-")
    return Index(folder, create=True, extra_tables=TABLES), folder


def drop_private(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def why_stale(store, txn) -> str | None:
    """None when the cache provably matches the store, else what is wrong with it."""
    index, registry = store.index, store.registry
    store_id = txn.get(b"store_id", db=index.db("meta"))
    if store_id is None:
        return "the index was never built for this store (new, emptied or replaced)"
    if bytes(store_id).decode() != store.config.store_id:
        return "the index belongs to another store"
    seq, digest = registry.head(txn)
    if seq:
        try:
            data = store.records.raw(seq)
        except CasError:
            return f"the index has record log entry {seq}, which the store does not (an index of a later state?)"
        if hash_bytes(data) != digest and store.records.mend(seq, data, digest) is None:
            return f"record log entry {seq} is not the one the index folded in"
    if store.records.exists(seq + 1):
        return f"{BEHIND}{seq} that the index lacks"
    return None


BEHIND = "the store has record log entries after "  # why_stale's reason for a cache that is only behind


def only_behind(reason: str | None) -> bool:
    """Whether why_stale's `reason` says the cache is the store's, as it stood some entries ago
    (a commit in flight looks so: its entry is in the log before its index transaction ends)."""
    return reason is not None and reason.startswith(BEHIND)


def rebuild(store, txn, report: RebuildReport | None = None, *, check: bool = False) -> RebuildReport:
    """Refill the cache from the store in the caller's write transaction: object records from
    the packs and object files (check=True also decodes every full object in a pack, to skip
    damaged copies), the registry from the record log. Live writers' leases and holds stay."""
    report = report or RebuildReport()
    t0 = time.perf_counter()
    index = store.index
    # The log first: every entry's objects were durable before the entry was created, so a scan
    # made after reading the entries finds all of them (scanning first missed the objects of an
    # entry another cache committed meanwhile, and the cache called itself current without them).
    salvage = _salvaging(store)
    damaged: list[CorruptionError] | None = [] if salvage else None
    try:
        entries = list(store.records.entries(around=damaged))
    except CorruptionError as exc:
        if not store.location.local:
            raise
        raise CorruptionError(f"{exc.detail}; a read-only open (cas.open(path, readonly=True); `cas ls`, `cas export`, "
                              "`cas push` to a new store) reads the checkpoints the rest of the log proves",
                              key=exc.key) from None
    try:
        old = dict(index.iter_records(txn))
    except CasError:  # a damaged record: choose among the copies on disk alone
        old = {}
    copies: dict[bytes, list[ObjectRecord]] = {}
    report.packs = _scan_packs(store.objects.packs, copies, report, check=check)
    _scan_files(store.objects.files, copies, report)
    _forget_deleted_packs(copies, entries)
    records = choose_copies(copies, old, extrapolates=lambda key, rec: is_linear_copy(store.objects, key, rec))
    adopt_recodes(records, copies, entries)
    set_depths(records)
    txn.drop(index.db("objects"), delete=False)
    for key, rec in records.items():
        index.put_record(txn, key, rec)
    store.registry.clear(txn)
    index.clear_pack_states(txn)  # refolded from the log's gc steps
    faults.point("cache.rebuilding")  # a kill here aborts the transaction: the cache stays as it was
    skipped = [] if damaged else None
    seq, digest = store.registry.fold(txn, entries, skipped=skipped)
    if damaged:
        report.salvaged = [str(exc) for exc in damaged] + skipped
        report.skipped += report.salvaged
    store.registry.set_head(txn, seq, digest)
    txn.put(b"store_id", store.config.store_id.encode(), db=index.db("meta"))
    index.bump_generation(txn)
    report.objects = len(records)
    report.checkpoints = [ck.step for ck in store.registry.all(txn)]
    report.seconds = time.perf_counter() - t0
    return report


def _salvaging(store) -> bool:
    """Whether a rebuild may fold around damaged log entries: only into the private cache of
    a read-only open, which nothing writes through and which is dropped at its close (a cache
    folded so is not the store's truth: gc or a writer relying on it could lose a checkpoint
    that a damaged entry added or pinned)."""
    return getattr(store, "_private_cache", None) is not None


def stored_anywhere(store, keys) -> bool:
    """Whether the store holds any of `keys` in a pack or an object file, found as a rebuild
    finds them, or has a pack it cannot read (which might): gc asks this of the live objects
    the index has no record of, to tell index damage (rebuild it) from objects lost with their
    files (a rebuild would find them missing again, every gc)."""
    wanted = set(keys)
    if any(store.objects.files.has(key) is not None for key in wanted):
        return True
    copies: dict[bytes, list[ObjectRecord]] = {}
    report = RebuildReport()
    _scan_packs(store.objects.packs, copies, report, check=False)
    return bool(report.skipped) or not wanted.isdisjoint(copies)


def intact_copy(store, key: bytes) -> bool:
    """Whether the store holds a copy of `key` that reads back whole: an object file or a pack
    entry (found as a rebuild finds them) that decodes to its key, or a delta whose header
    parses (its payload needs its base). A load asks this of an object the shared index has no
    record of before it rebuilds the index: a damaged copy a repair quarantined stays in its
    pack while the pack holds live objects, and must not be indexed again."""
    namer = namer_of(store.objects.packs.backend)
    blobs = []
    if store.objects.files.has(key) is not None:
        blobs.append(lambda: store.objects.files.get(key))
    copies: dict[bytes, list[ObjectRecord]] = {}
    _scan_packs(store.objects.packs, copies, RebuildReport(), check=False)
    for rec in copies.get(key, []):
        blobs.append(lambda rec=rec: store.objects.packs.read(rec.pack, rec.offset, rec.stored_size, key))
    for read in blobs:
        try:
            blob = read()
            if parse_header(blob, key=key).base is not None or decode_into(blob, key, namer=namer) is not None:
                return True
        except (CorruptionError, OSError):
            continue
    return False


def _forget_deleted_packs(copies: dict[bytes, list[ObjectRecord]], entries) -> None:
    """Drop the copies in packs a gc's delete entry names (a gc that died before it deleted
    them all): their objects are stored elsewhere or nowhere, and the next gc removes the rest."""
    gone = {p for e in entries if e.gc and e.gc["phase"] == "delete" for p in e.gc["packs"]}
    if not gone:
        return
    for key in list(copies):
        copies[key] = [r for r in copies[key] if r.where != WHERE_PACK or r.pack not in gone]
        if not copies[key]:
            del copies[key]


def ensure_current(store, report: RebuildReport) -> None:
    """Check the cache against the store; bring it up to date (once, whoever gets LMDB's writer
    lock first: the others find it current) when it does not match."""
    with store.index.read() as txn:
        reason = why_stale(store, txn)
    if reason is None:
        return
    with store.index.write() as txn:
        reason = why_stale(store, txn)
        if reason is not None:
            report.reason = report.reason or reason
            refresh(store, txn, report)


def refresh(store, txn, report: RebuildReport) -> None:
    """Bring a cache that is behind the store up to date: by folding only the entries it lacks
    where it can (catch_up), from a snapshot when it is empty, else by a full rebuild."""
    if catch_up(store, txn, report):
        return
    if snapshots.restore(store, txn, report) and catch_up(store, txn, report):
        return
    rebuild(store, txn, report)
    snapshots.offer(store, txn)


def catch_up(store, txn, report: RebuildReport) -> bool:
    """Fold the log entries after the cache's head into it, reading the footers of the packs
    they name; False (nothing done that a rebuild would not redo) where that cannot be proven
    enough: a store whose writers keep objects outside packs (a folder's object files, which
    no entry names), an entry that names no packs, a chain that does not continue from the
    cache's head, a pack that cannot be read and that no later entry deleted."""
    if store.location.local:
        return False
    registry, index = store.registry, store.index
    seq, digest = registry.head(txn)
    if not seq:
        return False
    t0 = time.perf_counter()
    try:
        entries = list(store.records.entries(after=seq, prev=digest))
    except CasError:
        return False
    named = [_packs_named(entry) for entry in entries]
    if any(packs is None for packs in named):
        return False
    wanted = sorted({p for packs in named for p in packs})
    listed = _read_footers(store.objects.packs, wanted)
    deleted = {p for e in entries if e.gc and e.gc["phase"] == "delete" for p in e.gc["packs"]}
    if any(isinstance(listed[p], Exception) and p not in deleted for p in wanted):
        return False
    try:
        for entry, packs in zip(entries, named):
            if entry.gc and entry.gc["phase"] == "intent":  # doomed first: the rewrites' copies then win
                index.doom_packs(txn, entry.gc["packs"], entry.gc["epoch"])
            for pack in packs:
                if not isinstance(listed[pack], Exception):
                    _index_pack(index, txn, pack, listed[pack], recoded=pack in entry.recoded)
            registry.fold(txn, [entry])
    except CorruptionError:
        return False  # an entry that does not apply: the rebuild reports it
    last = entries[-1] if entries else None
    if last is not None:
        registry.set_head(txn, last.seq, last.digest)
        index.bump_generation(txn)
    report.checkpoints = [ck.step for ck in registry.all(txn)]
    report.packs += len(wanted)
    report.seconds += time.perf_counter() - t0
    return True


def _packs_named(entry) -> list[bytes] | None:
    """The packs an entry's objects are in (its saves' and its gc rewrites'); None when an add
    names none (written by a cas that did not list them)."""
    packs = (list(entry.gc["new_packs"]) if entry.gc else []) + list(entry.recoded)
    for change in entry.changes:
        if change["op"] == "add":
            if not isinstance(change.get("packs"), list):
                return None
            packs.extend(bytes(p) for p in change["packs"])
    return packs


def _read_footers(packs, names: list[bytes]) -> dict:
    """pack -> its footer entries, or the exception reading it raised (a HEAD and a ranged GET
    each, many at once)."""
    def one(pack: bytes):
        size = packs.size(pack)
        if size is None:
            return MissingObjectError("a pack named by the record log is not in the store", key=pack.hex())
        return _footer_or_error(packs, pack, size)
    if not names:
        return {}
    with Pool(max_workers=min(SCAN_THREADS, len(names)), thread_name_prefix="cas-scan") as pool:
        return dict(zip(names, pool.map(one, names)))


def _index_pack(index, txn, pack: bytes, listed, *, recoded: bool = False) -> None:
    """Index a pack's entries: a key with no record, or whose record is in a doomed pack, takes
    this copy; any other keeps the copy it has (its checkpoints decode through it). But a
    recode's pack (`recoded`) holds stored objects coded anew, which every host reads alike:
    its copies replace the ones indexed, where their chain reaches a full object here."""
    if listed is None:
        raise CorruptionError(f"pack {pack.hex()} has no footer")  # format 1: not in a bucket
    for e in listed:
        current = index.record(txn, e.key)
        if recoded:
            if not chain_holds(lambda k: index.record(txn, k), e.key, e.base):
                continue
        elif current is not None and not (current.where == WHERE_PACK and index.pack_doomed(txn, current.pack)):
            continue
        base = index.record(txn, e.base) if e.base is not None else None
        # a delta whose base is not indexed yet (later in this pack's listing, or in a pack the
        # same entry names: a gc rewrite copies a chain's objects in any order) is one deep at
        # least; a record with a base and depth 0 is no record at all (Index refuses it)
        depth = 0 if e.base is None else min(base.depth + 1, 255) if base is not None else 1
        index.put_record(txn, e.key, ObjectRecord(WHERE_PACK, e.length, e.raw_size, pack, e.offset, base=e.base,
                                                  depth=depth))


# --- finding objects again ----------------------------------------------------------------
def _scan_packs(packs, copies: dict, report, *, check: bool, commits: list | None = None) -> int:
    """Record every entry of every pack in `copies`. Packs with a footer are read from their
    tails only, many at once (a bucket answers each ranged read in milliseconds); check=True
    (repair) and format-1 packs read each entry and its header."""
    sizes = packs.sizes()
    footers = {}
    if not check and commits is None:
        with Pool(max_workers=SCAN_THREADS, thread_name_prefix="cas-scan") as pool:
            footers = dict(zip(sizes, pool.map(lambda item: _footer_or_error(packs, *item), sizes.items())))
    for pack in sizes:
        listed = footers.get(pack)
        if listed is not None and not isinstance(listed, Exception):
            for e in listed:
                copies.setdefault(e.key, []).append(ObjectRecord(WHERE_PACK, e.length, e.raw_size, pack, e.offset,
                                                                 base=e.base))
        else:  # no footer, or one that cannot be read or trusted: the pack's own entries, walked
            _scan_pack_entries(packs, pack, copies, report, check=check, commits=commits)
    return len(sizes)


def _footer_or_error(packs, pack: bytes, size: int):
    """A pack's footer; None or the error reading it to walk its entries instead: a format-1
    pack, a damaged footer (one whose entries do not lie end to end: a damaged offset put a
    checkpoint's commit node at the wrong place, and a rebuild lost it), or, on a local disk,
    one that neither names the pack nor agrees with its entries' headers (a damaged key). In a
    bucket a footer that fits is taken as read: checking its keys there costs a GET per entry,
    and each entry read is checked against its key anyway."""
    try:
        listed = packs.listed(pack, size, end_to_end=True)
    except (CorruptionError, OSError) as exc:
        return exc
    if listed is not None and packs.backend.capabilities.local_path is not None \
            and not packs.listing_agrees(pack, listed):
        return None
    return listed


HEAD_READ = 64  # bytes of an entry read for its header where its payload is not checked


def _scan_pack_entries(packs, pack: bytes, copies: dict, report, *, check: bool, commits: list | None) -> None:
    """Read and check each entry of a pack on its own (a ranged read: in an encrypted pack a
    damaged segment fails only the entries it covers, not the whole pack's read)."""
    try:
        entries = _entries_of(packs, pack)
    except (CorruptionError, OSError) as exc:
        report.skipped.append(f"pack {pack.hex()}: {exc}")
        return
    for key, offset, length in entries:
        try:
            whole = check or commits is not None
            blob = packs.read(pack, offset, length if whole else min(length, HEAD_READ), key)
            head = parse_header(blob, key=key)
            raw = decode_into(blob, key, namer=namer_of(packs.backend)) if whole and not head.base else None
        except CorruptionError as exc:
            report.skipped.append(f"pack {pack.hex()} entry {key.hex()}: {exc.detail}")
            continue
        except OSError as exc:
            report.skipped.append(f"pack {pack.hex()}: {exc}")
            return
        copies.setdefault(key, []).append(ObjectRecord(WHERE_PACK, length, head.raw_size, pack, offset,
                                                       base=head.base))
        if commits is not None and raw is not None:
            _note_commit(key, raw, commits)


def _entries_of(packs, pack: bytes) -> list[tuple[bytes, int, int]]:
    """(key, offset, length) of a pack's entries: those its footer lists when the footer proves
    itself; else the places it lists, each with the key of the entry's own header in the pack (a
    key damaged in the footer must not rename an entry; an entry whose header cannot be read is
    left out), and those found by walking the pack from its start (up to the first entry a
    damage or a cut makes unreadable)."""
    size = packs.size(pack)
    try:
        listed = packs.listed(pack, size) if size is not None else None
    except CorruptionError:
        listed = None
    if listed is None:
        return list(packs.entries(pack))
    if packs.footer_trusted(pack):
        return [(e.key, e.offset, e.length) for e in listed]
    found = {}
    for e in listed:
        try:
            key, length = packs.entry_header(pack, e.offset)
        except (CorruptionError, OSError):
            continue
        if length == e.length:
            found[e.offset] = (key, e.offset, length)
    try:  # and the entries as the pack's own headers place them: a damaged offset hid one
        found.update((offset, (key, offset, length)) for key, offset, length in packs.entries(pack))
    except (CorruptionError, OSError):
        pass
    return [found[offset] for offset in sorted(found)]


def _note_commit(key: bytes, raw, commits: list) -> None:
    """Commit nodes are small, so they always live in packs; any entry may be tried."""
    try:
        node = parse_node(raw.tobytes(), key)
    except CorruptionError:
        return
    if node["k"] == "commit":
        commits.append((key, node))


def _scan_files(files, copies: dict, report) -> None:
    for key in files.iterate():
        try:
            head = parse_header(files.head(key, 64), key=key)
            copies.setdefault(key, []).append(ObjectRecord(WHERE_FILE, files.has(key) or 0, head.raw_size,
                                                           base=head.base))
        except (CorruptionError, OSError) as exc:
            report.skipped.append(f"object {key.hex()}: {exc}")


# --- format 1 -----------------------------------------------------------------------------
def migrate_v1(store, report: RebuildReport) -> None:
    """Upgrade a format-1 store (registry only in LMDB) on its first writable open: its
    checkpoints, with their flags as the LMDB registry holds them, become log entry 1, then
    the config says format 2 and the cache is rebuilt. A kill at any point is redone at the
    next open (entry 1 already written is reused, never written twice). A format-1 store whose
    LMDB file was lost gets its checkpoints from the commit nodes in its packs (flags set
    after a save are lost: format 1 kept them only in LMDB)."""
    if not store.records.exists(1):
        with store.index.read() as txn:
            cks = store.registry.all(txn) if report.reason is None else []
        if not cks:
            cks = _checkpoints_from_commits(store, report)
        changes = [add_change(ck) for ck in sorted(cks, key=lambda c: c.step)]
        store.records.append(1, None, "migrate", changes)
    L.write_config(store.layout, chunk_size=store.config.chunk_size, store_id=store.config.store_id,
                   created=store.config.created)
    store.config = L.read_config(store.layout)
    with store.index.write() as txn:
        rebuild(store, txn, report)
    report.reason = report.reason or "format 1 upgraded to format 2"


def _checkpoints_from_commits(store, report: RebuildReport) -> list[Checkpoint]:
    commits: list = []
    _scan_packs(store.objects.packs, {}, report, check=False, commits=commits)
    newest: dict[int, tuple[bytes, dict]] = {}
    for key, node in commits:
        if node["step"] not in newest or node["created"] > newest[node["step"]][1]["created"]:
            newest[node["step"]] = (key, node)
    return [Checkpoint(step=step, id=key.hex(), created=_dt.datetime.fromtimestamp(node["created"], _dt.timezone.utc),
                       milestone=bool(node.get("milestone")), metrics=dict(node.get("metrics") or {}),
                       meta=dict(node.get("meta") or {}), logical_bytes=int(node.get("logical_bytes", 0)),
                       new_bytes=0)
            for step, (key, node) in sorted(newest.items())]
