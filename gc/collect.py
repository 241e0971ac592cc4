"""Forget, then mark and sweep.

1. Forget: the checkpoints retention removes leave the registry in one LMDB transaction.
2. Mark: walk every live root (committed checkpoints) through manifest nodes to chunk keys,
   visiting a shared subtree once. Objects held by in-flight writers (their leases' holds)
   are live too.
3. Sweep, in batches, each in one write transaction that first re-checks the commit
   generation (a checkpoint committed since the mark is marked before anything is deleted)
   and the holds (a writer that claimed an object since the mark keeps it), then deletes the
   index records and unlinks the files of the batch while holding LMDB's writer lock, so no
   writer can claim one of them half-way. A crash inside a batch leaves index records whose
   files are gone: writers check a file exists before reusing it, and the next gc drops them.
See docs/architecture.md, "Garbage collection and concurrent saves".
"""

from __future__ import annotations

import errno
import time
import weakref
from dataclasses import dataclass, field

from cas import faults
from cas.errors import CasError, CorruptionError
from cas.index import WHERE_PACK
from cas.packs import PACK_ENTRY_HEADER, PACK_HEADER, PACK_TARGET
from cas.progress import ProgressCallback
from cas.store.cache import stored_anywhere
from cas.store.registry import Checkpoint

from .bucket import REWRITE_BELOW, most_dead_first, sweep_bucket
from .marking import Marker, RegistryMoved, bases_of, marked_now
from .retention import Retention, keep_unmirrored
from .writers import clean_tmp, reap_dead_leases, why_wait

SWEEP_BATCH = 512
MARK_ATTEMPTS = 5  # marks restarted because another process removed checkpoints meanwhile


@dataclass
class GcReport:
    removed: list[Checkpoint] = field(default_factory=list)
    kept: list[tuple[Checkpoint, list[str]]] = field(default_factory=list)
    freed_bytes: int = 0
    objects_swept: int = 0
    live_objects: int = 0
    dry_run: bool = False
    leases_reaped: int = 0
    reclaimed_bytes: int = 0  # disk space given back: object files and packs removed, less repacked bytes
    packs_removed: int = 0
    packs_rewritten: int = 0
    deferred: str | None = None  # why the sweep deleted nothing this time, if it had to wait
    objects_held: int = 0  # unreachable objects a writer in progress held (a later gc sweeps them)
    packs_held: int = 0  # packs left uncompacted for a writer in progress (a later gc compacts them)
    held_for_mirror: list[int] = field(default_factory=list)  # kept only because not yet mirrored
    objects_missing: int = 0  # objects committed checkpoints need that the store holds nowhere
    unrecorded_packs: list[str] = field(default_factory=list)  # kept: entries checkpoints need, no record names
    mark_seconds: float = 0.0
    sweep_seconds: float = 0.0

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run,
                "removed": [ck.to_json() for ck in self.removed],
                "kept": [dict(ck.to_json(), rules=rules) for ck, rules in self.kept],
                "freed_bytes": self.freed_bytes, "objects_swept": self.objects_swept,
                "reclaimed_bytes": self.reclaimed_bytes, "packs_removed": self.packs_removed,
                "packs_rewritten": self.packs_rewritten,
                "live_objects": self.live_objects, "leases_reaped": self.leases_reaped, "deferred": self.deferred,
                "objects_held": self.objects_held, "packs_held": self.packs_held,
                "held_for_mirror": self.held_for_mirror, "objects_missing": self.objects_missing,
                "unrecorded_packs": self.unrecorded_packs,
                "mark_seconds": round(self.mark_seconds, 4), "sweep_seconds": round(self.sweep_seconds, 4)}


class _Retry(Exception):
    """The registry changed under a sweep batch: mark the new roots, then try the batch again."""


class _IndexSuspect(Exception):
    """What gc would mark from disagrees with the store's own truth: the registry with the
    record log, or a live object has no index record (so its delta base could not be followed).
    The index is a cache, possibly damaged: rebuild it from the store and mark again."""


def collect(store, retention: Retention | None, *, dry_run: bool = False,
            progress: ProgressCallback | None = None, sweep_objects: bool = True,
            space_budget: bool = True, wait: float | None = None) -> GcReport:
    """Apply `retention` (None, or a policy with no rule: remove nothing, only sweep garbage),
    then sweep (unless `sweep_objects` is False: retention after a save into a bucket, where a
    sweep waits for other hosts' saves). A policy refused for these checkpoints
    (RetentionRefusedError) removes and sweeps nothing. `space_budget` False: a folder's large
    packs are rewritten only under half live (the retention on a save's path leaves the rest
    of compact_packs's rule to the background). `wait`: how long a bucket's sweep waits for
    other hosts' saves before it leaves its packs for a later gc (default: a lease's ttl)."""
    report = GcReport(dry_run=dry_run)
    if retention is not None and not retention.has_rules:
        retention = None
    mirrored_only = getattr(store, "mirror", None) is not None  # a store opened with mirror=

    def choose(cks: list) -> list[int]:
        decisions = retention.decide(cks) if retention is not None else {ck.step: ["kept"] for ck in cks}
        if mirrored_only:
            report.held_for_mirror = keep_unmirrored(cks, decisions)
        report.kept = [(ck, decisions[ck.step]) for ck in cks if decisions[ck.step]]
        report.removed = [ck for ck in cks if not decisions[ck.step]]
        return [ck.step for ck in report.removed]

    if dry_run or retention is None:
        choose(store.checkpoints())
    else:  # decided on the registry inside the transaction that removes: no stale decision
        store.delete_chosen(choose)
    faults.point("gc.forgotten")
    if not sweep_objects:
        report.deferred = ("in a bucket the objects are swept after the save's recode, in the background "
                           "(store.gc() sweeps at once)")
        return report
    removed_keys = {ck.key for ck in report.removed} if dry_run else set()
    sweep(store, report, dry_run=dry_run, ignore_roots=removed_keys, progress=progress, space_budget=space_budget,
          wait=wait)
    return report


def sweep(store, report: GcReport, *, dry_run: bool, ignore_roots: set[bytes] = frozenset(),
          progress: ProgressCallback | None = None, space_budget: bool = True, wait: float | None = None) -> None:
    """Mark from the committed roots (less `ignore_roots`, for a dry run) and delete the rest.
    When another process removes checkpoints while this one marks them, the mark starts over
    from the registry (a few times at most); a sweep batch under way starts over the same way."""
    if not dry_run:
        report.leases_reaped = reap_dead_leases(store)
    rebuilt = False
    for attempt in range(MARK_ATTEMPTS):
        try:
            if not store.location.local:  # no LMDB writer lock is shared across hosts: the log orders
                return sweep_bucket(store, report, Marker, dry_run=dry_run, ignore_roots=ignore_roots,
                                    progress=progress, wait=wait)
            return _sweep_once(store, report, dry_run=dry_run, ignore_roots=ignore_roots, progress=progress,
                               rebuilt=rebuilt, space_budget=space_budget)
        except _IndexSuspect as suspect:
            if rebuilt:
                raise CasError(f"gc stopped before deleting anything: {suspect} even after the index was rebuilt "
                               "from the store; run `cas verify`") from None
            _rebuild_index(store, str(suspect))
            rebuilt = True
        except RegistryMoved:
            if attempt == MARK_ATTEMPTS - 1:
                raise CasError(f"gc gave up: checkpoints were removed by another process during each of its "
                               f"{MARK_ATTEMPTS} marks; run it again") from None


def _sweep_once(store, report: GcReport, *, dry_run: bool, ignore_roots: set[bytes],
                progress: ProgressCallback | None, rebuilt: bool = False, space_budget: bool = True) -> None:
    t0 = time.perf_counter()
    store.ensure_cache()  # mark from a registry proven to match the store's record log (it may reopen the index)
    index, files = store.index, store.objects.files
    with index.read() as txn:
        generation = index.generation(txn)
        registered = store.registry.all(txn)
        head, _ = store.registry.head(txn)
        held = _held_with_bases(index, txn)
        records = dict(index.iter_records(txn))
    _check_registry(store, {ck.key for ck in registered}, head)
    roots = [ck.key for ck in registered if ck.key not in ignore_roots]
    marker = Marker(store, generation)
    marker.mark(roots, progress)
    if marker.unindexed and not rebuilt and _index_lost_them(store, marker.unindexed):
        raise _IndexSuspect(f"{len(marker.unindexed)} objects the checkpoints need have no index record "
                            f"(first {next(iter(marker.unindexed)).hex()})")
    report.objects_missing = len(marker.unindexed)  # (in no pack and no file: `cas verify` names them)
    on_disk = set(files.iterate())
    report.mark_seconds = time.perf_counter() - t0
    report.live_objects = len(marker.live)
    faults.point("gc.marked")

    t0 = time.perf_counter()
    candidates = [k for k in records if k not in marker.live and k not in held]
    report.objects_held = sum(1 for k in records if k not in marker.live and k in held)
    orphans = [k for k in on_disk - records.keys() if k not in marker.live and k not in held]
    if dry_run:
        report.freed_bytes = sum(records[k].stored_size for k in candidates) + sum(files.has(k) or 0 for k in orphans)
        report.objects_swept = len(candidates) + len(orphans)
        report.sweep_seconds = time.perf_counter() - t0
        return
    # Deltas before their bases (deeper first): a sweep batch that stops half way (a crash, an
    # error) leaves records whose files are gone, which writers see as not stored; it must
    # never leave a delta file whose base file is gone, which a writer would reuse or code against.
    candidates.sort(key=lambda k: records[k].depth, reverse=True)
    todo = orphans + candidates
    done = 0
    while done < len(todo):
        batch = todo[done:done + SWEEP_BATCH]
        try:
            with index.write() as txn:
                now = index.generation(txn)
                if now != generation:
                    new_roots = [ck.key for ck in store.registry.all(txn) if ck.key not in marker.roots]
                    raise _Retry(now, new_roots)
                if store.cache_is_stale(txn):  # another cache committed: mark again from the store
                    raise RegistryMoved()
                report.deferred = why_wait(store, txn)
                if report.deferred:
                    break
                held = _held_with_bases(index, txn)
                for key in batch:
                    if key in marker.live:
                        continue
                    if key in held:
                        report.objects_held += 1
                        continue
                    report.freed_bytes += _delete(store, txn, key, report, key in on_disk)
                    report.objects_swept += 1
                faults.point("gc.sweep_batch")
        except RegistryMoved:
            store.ensure_cache()
            raise
        except _Retry as retry:
            generation, new_roots = retry.args
            marker.generation = generation
            marker.mark(new_roots, progress)
            marker.follow_current_bases()
            continue
        done += len(batch)
        if progress:
            progress("sweep", done, len(todo))
    if report.deferred is None:
        _remove_superseded_files(store, report, on_disk & records.keys())
        report.packs_held = len(compact_packs(store, report, budget=space_budget, marked=(marker.live, head)))
    files.sync()
    with index.read() as txn:
        waiting = why_wait(store, txn)
    if not waiting:  # a DCP save's ranks leave replacement files in tmp/ for its commit
        clean_tmp(store)
    report.sweep_seconds = time.perf_counter() - t0


def _index_lost_them(store, unindexed: dict[bytes, tuple | None]) -> bool:
    """Whether live objects without a record may be index damage (so gc rebuilds the index
    before it deletes anything) rather than objects lost from the store (which a rebuild finds
    missing again, at every gc): true when the store holds any of them, or when a delta's record
    names as its base a key the delta's own header does not (a damaged record)."""
    for key, named_by in unindexed.items():
        if named_by is not None:
            delta, rec = named_by
            try:
                if store.objects.header_at(delta, rec).base != key:
                    return True
            except CasError:
                return True
    return stored_anywhere(store, unindexed)


# Per open store: (seq, digest, {step: commit key}) of the record log as folded so far, so that
# each gc reads only the entries since the last (0.1 ms an entry here).
_LOG_FOLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_registry(store, registered: set[bytes], head: int) -> None:
    """The checkpoints the registry holds must be those the record log (the truth) holds as of
    the entry it was folded to: a damaged index that lost a registry row would otherwise have
    gc delete that checkpoint's objects. The log is append-only and each entry names the digest
    of the one before, so the fold goes on from where the last gc of this open store left it."""
    if store.registry.log is None or not head:
        return
    seq, digest, live = _LOG_FOLDS.get(store, (0, None, {}))
    if seq > head:  # (a fold past this registry's head: start again)
        seq, digest, live = 0, None, {}
    try:
        seq, digest, live = _fold_live(store, seq, digest, dict(live), head)
    except CorruptionError:
        if not seq:
            raise
        seq, digest, live = _fold_live(store, 0, None, {}, head)  # the log is not the one folded before
    _LOG_FOLDS[store] = (seq, digest, live)
    truth = set(live.values())
    if truth != registered:
        raise _IndexSuspect(f"the index's registry holds {len(registered)} checkpoints, the record log "
                            f"{len(truth)} ({len(truth - registered)} missing from the registry)")


def _fold_live(store, seq: int, digest: bytes | None, live: dict[int, bytes],
               head: int) -> tuple[int, bytes | None, dict[int, bytes]]:
    """`live` (step -> commit key, as of log entry `seq` with `digest`) carried on to entry `head`."""
    for entry in store.records.entries(after=seq, prev=digest):
        if entry.seq > head:
            break
        for change in entry.changes:
            if change["op"] == "add":
                live[change["step"]] = bytes(change["id"])
            elif change["op"] == "remove":
                live.pop(change["step"], None)
        seq, digest = entry.seq, entry.digest
    return seq, digest, live


def _rebuild_index(store, reason: str) -> None:
    """Move the index aside and build a new one from the store (store.replace_damaged_index);
    not while a save of this store is open in this process: gc then stops, deleting nothing."""
    if store.replace_damaged_index(f"gc found the index inconsistent with the store ({reason})") is None:
        raise CasError(f"gc stopped before deleting anything: {reason}, so the index may be damaged; run "
                       "`cas repair` (it rebuilds it from the store), then gc again")


def _remove_superseded_files(store, report: GcReport, keys) -> None:
    """Remove object files whose records place the object in a pack: a recode moved it there
    (store/recode.py) and was stopped before it removed the file. Decided inside a write
    transaction, so no writer is mid-way through settling one of them."""
    index, files = store.index, store.objects.files
    with index.write() as txn:
        if why_wait(store, txn):
            return
        held = index.held_keys(txn)
        for key in keys:
            rec = index.record(txn, key)
            if rec is not None and rec.where == WHERE_PACK and key not in held:
                report.reclaimed_bytes += files.has(key) or 0
                files.delete(key)


def _held_with_bases(index, txn) -> set[bytes]:
    """Objects writers hold, and the bases of those that are deltas: a writer may code a new
    chunk against a held delta, and its commit must find the whole chain there."""
    held = index.held_keys(txn)
    return held | bases_of(index, txn, held)


def _delete(store, txn, key: bytes, report: GcReport, has_file: bool) -> int:
    """Drop one object's record, and its file, inside the sweep's write transaction. An object
    in a pack loses only its record here (compact_packs gives the space back), and the whole
    copy a recode superseded and was stopped before it removed (`has_file`: the sweep listed one):
    left, no record would name it, and only the next gc would take it as an orphan."""
    index, files = store.index, store.objects.files
    rec = index.record(txn, key)
    if rec is not None:
        txn.delete(key, db=index.db("objects"))
        if rec.where == WHERE_PACK and not has_file:
            return rec.stored_size
    size = files.has(key) or 0
    files.delete(key)
    report.reclaimed_bytes += size
    return rec.stored_size if rec is not None and size else size


def compact_packs(store, report: GcReport, only=None, budget: bool = True,
                  marked: tuple[set[bytes], int] | None = None) -> set[bytes]:
    """Remove packs no record points to, then rewrite packs that hold dead entries so that only
    live objects stay on disk. A pack with an entry held by a writer in progress is left alone:
    it may be that writer's own pack, not yet committed. Rewrites are planned against the free
    space: the pack freeing the most that fits goes next, and one that fits nowhere waits for a
    later gc (named in report.deferred) rather than failing this one and every one after it.
    A large pack (a save's streamed chunks, past PACK_TARGET) is rewritten once its live
    entries hold under REWRITE_BELOW of its bytes, as in a bucket: rewriting 200 MiB to free a
    few would cost more than the space is worth, and its dead entries go when it is emptier.
    A whole gc (`only` None, `budget`) then also rewrites large packs most dead first until the store's
    dead bytes are at most MAX_UNUSED of its live ones, as in a bucket (a recode leaves the
    packs of the save before anywhere from all dead to mostly live; the half rule alone left a
    store with deltas about a tenth larger on disk than its live bytes).
    `only`: these packs alone (those a recode left dead entries in), where they still exist.
    An entry no record places in its pack is dead only if no checkpoint needs it or a record
    places it elsewhere: records can be lost (an index deleted under a writer, two processes
    writing it through different lock files), and a pack whose entries a checkpoint needs and
    no record names elsewhere stays. `marked`: (the live objects, the record log entry the mark
    saw) of the sweep calling; outside one, a mark is made the first time a pack has entries no
    record names anywhere (swept, or lost), and such a pack is left alone once the log moved
    past that mark (a new checkpoint the mark did not see). After a recode, whose superseded
    entries have records elsewhere, none is needed.
    Returns the packs left alone for a writer in progress (or a gc to wait for), to try again."""
    packs, index = store.objects.packs, store.index
    live_now, head_seen = marked if marked is not None else (None, 0)  # (marked when first needed)
    index.reader_check()  # a dead reader's slot would keep every page this gc frees from reuse
    rewrite: dict[bytes, list[bytes]] = {}
    kept: dict[bytes, tuple[int, int]] = {}  # pack -> (live bytes, size): no rule rewrites it (yet)
    unlisted: dict[bytes, list[bytes]] = {}  # the live entries of the large packs in `kept` with dead ones
    busy: set[bytes] = set()
    for pack in list(packs.iterate()) if only is None else [p for p in only if packs.size(p) is not None]:
        try:
            entries = packs.keys(pack)  # its footer: one read of its tail
        except (CorruptionError, OSError):
            continue  # a damaged pack (or one another gc removed) is verify's business, never gc's
        with index.read() as txn:
            placed = sum(1 for k in entries if (rec := index.record(txn, k)) is not None and rec.pack == pack)
        if placed and placed == len(entries):
            size = packs.size(pack) or 0
            kept[pack] = (size, size)
            continue  # nothing dead in it: nothing to do, held or not
        if not packs.footer_trusted(pack):
            continue  # its list of entries is damaged: a live entry may look dead (verify's business)
        while True:
            with index.write() as txn:
                recs = {k: rec for k in entries if (rec := index.record(txn, k)) is not None and rec.pack == pack}
                live = list(recs)
                if live and len(live) == len(entries):
                    break
                if why_wait(store, txn) or not set(entries).isdisjoint(index.held_keys(txn)):
                    busy.add(pack)
                    break
                # entries no record names anywhere: swept by gc, or lost by the index (see above)
                unrecorded = [k for k in entries if k not in recs and index.record(txn, k) is None]
                if not unrecorded or live_now is not None:
                    if any(k in live_now for k in unrecorded):
                        report.unrecorded_packs.append(pack.hex())  # the index lost them: a gc rebuilds it
                    elif unrecorded and marked is None and store.records.exists(head_seen + 1):
                        busy.add(pack)  # a checkpoint committed since the mark may need its entries
                    else:
                        _compact_one(store, pack, recs, report, rewrite, kept, unlisted)
                    break
            live_now, head_seen = marked_now(store)  # (once, outside the transaction: it reads the store)
    if only is None and budget:
        for pack in most_dead_first(kept):
            rewrite[pack] = unlisted[pack]
    plans = {pack: _repack_sizes(store, pack, live) for pack, live in rewrite.items()}
    while plans:
        free = store.backend.free_bytes()
        free = float("inf") if free is None else free
        fitting = [p for p, (need, _) in plans.items() if need + _repack_margin(need) <= free]
        if not fitting:
            report.deferred = (f"{len(plans)} pack rewrite(s) need more free space than the "
                               f"{free} bytes left; a later gc retries them")
            return busy
        pack = max(fitting, key=lambda p: plans[p][1])
        del plans[pack]
        faults.point("gc.repack")
        _rewrite_pack(store, pack, rewrite[pack], report)
    return busy


def _compact_one(store, pack: bytes, recs: dict, report: GcReport, rewrite: dict, kept: dict, unlisted: dict) -> None:
    """What compact_packs does with a pack holding dead entries (`recs`: its live ones): delete
    it when none is live, plan its rewrite when small or mostly dead, else keep it for the
    space budget's rule."""
    packs = store.objects.packs
    size = packs.size(pack) or 0
    used = PACK_HEADER + sum(PACK_ENTRY_HEADER + rec.stored_size for rec in recs.values())
    live = list(recs)
    if not live:
        report.reclaimed_bytes += size
        packs.delete(pack)
        report.packs_removed += 1
    elif size <= PACK_TARGET or used < REWRITE_BELOW * size:
        rewrite[pack] = live
    else:
        kept[pack], unlisted[pack] = (used, size), live


def _repack_sizes(store, pack: bytes, live: list[bytes]) -> tuple[int, int]:
    """(bytes a rewrite writes, bytes it frees) for a pack and its live entries."""
    with store.index.read() as txn:
        recs = [rec for k in live if (rec := store.index.record(txn, k)) is not None and rec.pack == pack]
    need = PACK_HEADER + sum(PACK_ENTRY_HEADER + rec.stored_size for rec in recs)
    return need, (store.objects.packs.size(pack) or 0) - need


def _repack_margin(need: int) -> int:
    """Room kept free beyond a rewrite's new pack: the index grows by the moved records' pages."""
    return (256 << 10) + need // 16


def _rewrite_pack(store, pack: bytes, keys: list[bytes], report: GcReport) -> None:
    """Move a pack's live objects into a new pack (same keys, so no manifest changes), then
    remove the old pack once no record points to it. Another gc may compact the same pack at
    once: an entry it moved or swept meanwhile, or the pack it already removed, is skipped."""
    objects, index = store.objects, store.index
    with objects.session("gc repack") as session:
        session.hold(keys)
        with index.read() as txn:
            recs = {k: rec for k in keys if (rec := index.record(txn, k)) is not None and rec.pack == pack}
        faults.point("gc.repack_reading")
        try:
            moved = _move_entries(session, pack, recs)
            session.commit(lambda txn: None)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            report.deferred = f"a pack rewrite ran out of space ({exc}); a later gc retries it"
            return
    with index.write() as txn:
        if why_wait(store, txn) or any((rec := index.record(txn, k)) is not None and rec.pack == pack for k in keys):
            return
        size = objects.packs.size(pack)
        if size is None:
            return  # another gc removed it
        report.reclaimed_bytes += size - moved
        objects.packs.delete(pack)
        report.packs_rewritten += 1


def _move_entries(session, pack: bytes, recs: dict) -> int:
    """Write each entry of `pack` that `recs` places there into the session's new pack; returns
    the bytes moved. An entry that cannot be read is skipped: the pack is gone (another gc
    rewrote it and the records point to its copy) or damaged (verify's business)."""
    moved = 0
    for key, rec in recs.items():
        try:
            blob = session.store.packs.read(pack, rec.offset, rec.stored_size, key)
        except CorruptionError:
            continue
        session.write_encoded(key, blob, rec)
        moved += rec.stored_size
    return moved
