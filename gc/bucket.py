"""The sweep of a store in a bucket, safe against saves running on other hosts, with no lock a
save waits on (docs/architecture.md, "Stores in a bucket", has the protocol and its proof).

In a bucket every object is in a pack, and hosts share nothing but the bucket: no LMDB writer
lock orders a sweep against a claim. The record log does instead, since every entry is created
create-only in one sequence. One gc epoch at a time holds the bucket's gc lock (GC_LOCK, a
lease saves never take) from its mark to its delete entry: two at once each trusted a copy the
other deleted (stop 35). One gc epoch:
1. mark from a cache proven current; doom every pack with no live entry, and every pack whose
   live entries are under REWRITE_BELOW of its bytes after copying those into new packs;
2. append an *intent* entry naming the doomed packs and the new ones: a host that folds it
   indexes the copies and stops relying on the doomed packs (its writers store their own
   copies), and every writer folds the log before it claims anything;
3. wait until every writer lease listed after the intent has ended or expired;
4. mark again from the log (the waited-for saves' commits) and keep any doomed pack that the
   caught-up index still reads a live object from (a save that reused it before it folded the
   intent; a recode's copy adopted over this gc's own);
5. append a *delete* entry naming the rest and ending every other epoch left pending, then
   delete them. A writer that appends after it and relied on one of them (only one paused past
   its lease's expiry) finds it when it folds the entry and fails, nothing committed
   (cas.objectstore WriteSession.check_nothing_lost). A gc that finds its lock lost or its
   epoch ended by another (it was paused past its lease) appends no delete.
A crash leaves an intent without its delete (its packs stay doomed: writers store copies, and
the next gc's delete entry ends the epoch, even when it dooms nothing) or a delete whose packs
are not all gone (no record names them any more: the next gc finds them dead and deletes them).
"""

from __future__ import annotations

import os
import secrets
import time

from cas import faults
from cas.errors import CasError, CorruptionError, MissingObjectError
from cas.fsutil import host_tag
from cas.index import WHERE_PACK
from cas.objectstore import LEASE_PREFIX
from cas.pools import Pool
from cas.store.records import gc_step
from cas.store import snapshots

REWRITE_BELOW = 0.5  # a pack whose live bytes are under this share of it is rewritten
# ... and, as restic's prune (its --max-unused default), packs are rewritten most-dead first
# until the dead bytes left in the bucket are at most this share of the live ones: a recode
# supersedes a save's whole chunks in place, leaving its segments anywhere from all dead to
# mostly live, and the half-live rule alone kept 1.07x the bytes of a store without deltas.
MAX_UNUSED = 0.05
GC_LOCK = "locks/gc"  # the lease a bucket's gc epoch holds: one epoch at a time
MAX_ROUNDS = 50  # delete entries retried after other hosts committed meanwhile (each round marks only their commits)
POLL_SECONDS = 0.25
READ_THREADS = 16


class _Moved(Exception):
    """Another host committed while this gc appended its delete entry: mark again."""


def sweep_bucket(store, report, marker_type, *, dry_run: bool, ignore_roots: set[bytes], progress,
                 wait: float | None = None) -> None:
    """One gc epoch over a bucket store (see the module docstring). `wait`: how long to wait for
    other hosts' saves (default: their lease ttl and a margin); past it the epoch stays pending
    and `report.deferred` says so."""
    if dry_run:
        return _epoch(store, report, marker_type, dry_run=True, ignore_roots=ignore_roots, progress=progress,
                      wait=wait, lock=None)
    lock = _one_gc_at_a_time(store.backend, wait)
    if lock is None:
        report.deferred = ("another host's gc is running (only one at a time: two epochs at once deleted each "
                           "other's survivors); the next gc does this one's work")
        return None
    try:
        return _epoch(store, report, marker_type, dry_run=False, ignore_roots=ignore_roots, progress=progress,
                      wait=wait, lock=lock)
    finally:
        lock.release()


def _one_gc_at_a_time(backend, wait: float | None):
    """Take the bucket's gc lock (a lease, GC_LOCK), waiting as long as a gc waits for writers;
    None when another host's gc holds it all that time. Saves never take it: only gc epochs
    exclude each other (restic's prune takes an exclusive lock too). Two at once each trusted a
    copy the other was deleting (audit of stop 35: a committed checkpoint lost)."""
    deadline = time.monotonic() + (wait if wait is not None else getattr(backend, "lease_ttl", 60.0) + 5.0)
    info = f"{host_tag()} {os.getpid()}".encode()
    while True:
        try:
            return backend.lease(GC_LOCK, info)
        except CasError:
            taken = backend.take_over_lease(GC_LOCK, info)  # its holder stopped renewing it: gone
            if taken is not None:
                return taken
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_SECONDS)


def _epoch(store, report, marker_type, *, dry_run: bool, ignore_roots: set[bytes], progress,
           wait: float | None, lock) -> None:
    t0 = time.perf_counter()
    if not dry_run:
        report.leases_reaped += _reap_expired(store.backend)
    store.ensure_cache()
    index, packs = store.index, store.objects.packs
    with index.read() as txn:
        marker = marker_type(store, index.generation(txn))
        roots = [ck.key for ck in store.registry.all(txn) if ck.key not in ignore_roots]
    marker.mark(roots, progress)
    faults.point("gc.bucket_marked")  # another gc may log its intent here, before this one lists
    report.live_objects = len(marker.live)
    sizes = packs.sizes()
    doomed, moves = _plan(store, marker.live, sizes)
    report.mark_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    if dry_run:
        report.freed_bytes = sum(sizes[p] for p in doomed) - sum(rec.stored_size for recs in moves.values()
                                                                  for _, rec in recs)
        report.objects_swept = _dead_records(store, doomed, marker.live)
        return
    with index.read() as txn:
        left_pending = index.any_doomed(txn)  # epochs of earlier gcs, which this one's delete entry ends
    epoch = secrets.token_bytes(16)
    if doomed:
        _rewrite_and_intend(store, epoch, doomed, moves)
        faults.point("gc.intent_logged")
        report.deferred = _wait_for_writers(store, wait)
    if report.deferred is None and (doomed or left_pending):
        deleted = _delete_epoch(store, report, marker, epoch, doomed, progress, lock)
        report.packs_removed = len(deleted - set(moves))
        report.packs_rewritten = len(deleted & set(moves))
        report.reclaimed_bytes = sum(sizes[p] for p in deleted) - sum(
            rec.stored_size for p in deleted & set(moves) for _, rec in moves[p])
        report.freed_bytes = report.reclaimed_bytes
    if report.deferred is None:
        snapshots.prune(store)
        store.backend.clean_tmp()
    report.sweep_seconds = time.perf_counter() - t0


def _plan(store, live: set[bytes], sizes: dict[bytes, int]) -> tuple[set[bytes], dict[bytes, list]]:
    """(doomed packs, pack -> [(key, record)] of the live entries to copy out of it first). A
    pack an unfinished writer of this cache holds an entry of is left alone."""
    index = store.index
    by_pack: dict[bytes, list] = {}
    with index.read() as txn:
        held = index.held_keys(txn)
        for key, rec in index.iter_records(txn):
            if rec.where == WHERE_PACK:
                by_pack.setdefault(rec.pack, []).append((key, rec))
    doomed, moves = set(), {}
    kept: dict[bytes, tuple[int, int]] = {}  # pack -> (live bytes, size) of the packs left as they are
    kept_alive: dict[bytes, list] = {}  # their live entries
    for pack, size in sizes.items():
        recs = by_pack.get(pack, [])
        if any(key in held for key, _ in recs):
            continue
        alive = [(key, rec) for key, rec in recs if key in live]
        used = sum(PACK_ENTRY_OVERHEAD + rec.stored_size for _, rec in alive)
        if not alive:
            doomed.add(pack)
        elif used < REWRITE_BELOW * size:
            doomed.add(pack)
            moves[pack] = alive
        else:
            kept[pack], kept_alive[pack] = (used, size), alive
    for pack in most_dead_first(kept):
        doomed.add(pack)
        moves[pack] = kept_alive[pack]
    return doomed, moves


def most_dead_first(kept: dict[bytes, tuple[int, int]]) -> list[bytes]:
    """The packs to rewrite, most dead first, until the dead bytes left are at most MAX_UNUSED
    of the live ones, from pack -> (live bytes, size) of the packs no other rule rewrites."""
    unused = sum(max(size - used, 0) for used, size in kept.values())
    budget = MAX_UNUSED * sum(used for used, _ in kept.values())
    chosen = []
    for pack, (used, size) in sorted(kept.items(), key=lambda item: item[1][0] / max(item[1][1], 1)):
        if unused <= budget or used >= size:
            break
        chosen.append(pack)
        unused -= size - used  # (its live entries are copied: the live bytes stay as they were)
    return chosen


PACK_ENTRY_OVERHEAD = 64  # bytes of framing and footer per entry, near enough for planning


def _dead_records(store, doomed: set[bytes], live: set[bytes]) -> int:
    with store.index.read() as txn:
        return sum(1 for key, rec in store.index.iter_records(txn)
                   if rec.where == WHERE_PACK and rec.pack in doomed and key not in live)


def _rewrite_and_intend(store, epoch: bytes, doomed: set[bytes], moves: dict) -> None:
    """Copy the live entries of the packs to rewrite into new packs, then commit the intent
    entry naming the doomed packs and the new ones, in one session."""
    with store.objects.session("gc rewrite") as session:
        session.hold([key for recs in moves.values() for key, _ in recs])
        for pack, recs in moves.items():
            for key, rec in recs:
                try:
                    blob = store.objects.packs.read(pack, rec.offset, rec.stored_size, key)
                except CorruptionError:
                    continue  # damaged: verify's business; the pack then keeps it (see _rescued)
                session.write_encoded(key, blob, rec)
        seq = session.commit(lambda txn: store.registry.commit(  # the session's new packs are written by now
            txn, "gc intent", [], gc=gc_step("intent", epoch, doomed, session.packs_written())))
    snapshots.take_if_due(store, seq)


def _reap_expired(backend) -> int:
    """Delete the lease objects whose holders stopped renewing them past their ttl (a killed
    writer's); returns how many."""
    expired = [name for name in backend.list(LEASE_PREFIX) if backend.lease_alive(name) is False]
    for name in expired:
        backend.delete(name)
    return len(expired)


def _wait_for_writers(store, wait: float | None) -> str | None:
    """Wait until every writer lease in the bucket has ended or expired (None), or say why not."""
    backend = store.backend
    deadline = time.monotonic() + (wait if wait is not None else getattr(backend, "lease_ttl", 60.0) + 5.0)
    pending = set(backend.list(LEASE_PREFIX))
    while True:
        for name in list(pending):
            alive = backend.lease_alive(name)
            if not alive:
                pending.discard(name)
                if alive is False:
                    backend.delete(name)  # expired: its writer is gone (or lost its lease)
        if not pending:
            return None
        if time.monotonic() >= deadline:
            return (f"{len(pending)} save(s) on other hosts still running; the packs this gc means to delete "
                    "stay until a later gc finds them done (their objects are safe either way)")
        time.sleep(POLL_SECONDS)


def _delete_epoch(store, report, marker, epoch: bytes, doomed: set[bytes], progress, lock) -> set[bytes]:
    """Mark the commits made since the first mark, append the delete entry naming the doomed
    packs the index reads nothing live from and ending every other pending epoch, then delete
    them; returns those deleted (none when this gc lost its lock or its epoch meanwhile)."""
    listed = _footers(store.objects.packs, sorted(doomed))
    for _ in range(MAX_ROUNDS):
        store.ensure_cache()
        with store.index.read() as txn:
            generation = store.index.generation(txn)
            new_roots = [ck.key for ck in store.registry.all(txn) if ck.key not in marker.roots]
            pending = _pending_epochs(store.index, txn)
        settles, ended = sorted(pending - {epoch}), doomed and epoch not in pending
        if lock.lost.is_set() or ended:  # paused past its ttl: another gc may have run, or be running
            report.deferred = ("this gc lost its lock (it was paused past its lease)" if lock.lost.is_set() else
                               "another gc ended this gc's epoch (this one was paused past its lease)")
            return set()
        marker.generation = generation
        marker.mark(new_roots, progress)
        marker.follow_current_bases()  # a recode another host committed meanwhile: new base edges
        with store.index.read() as txn:
            kept = {p: _needed(store.index, txn, p, listed.get(p), marker.live) for p in doomed}
        deletable = {p for p, needed in kept.items() if needed is not True}
        survivors = set().union(*(kept[p] for p in deletable)) - deletable
        step = gc_step("delete", epoch, deletable, survivors, settles=settles)
        report.objects_swept = _dead_records(store, deletable, marker.live)

        def check(txn) -> None:
            raise _Moved()
        try:
            with store.index.write() as txn:
                seq = store.registry.commit(txn, "gc delete", [], gc=step, check=check)
        except _Moved:
            continue
        faults.point("gc.delete_logged")
        snapshots.take_if_due(store, seq)
        for pack in sorted(deletable):
            store.objects.packs.delete(pack)
        return deletable
    raise CasError(f"gc gave up: other hosts committed during each of its {MAX_ROUNDS} tries to end its epoch; "
                   "its packs stay doomed until the next gc")


def _footers(packs, names: list[bytes]) -> dict:
    def one(pack: bytes):
        size = packs.size(pack)
        if size is None:
            return MissingObjectError("gone", key=pack.hex())
        try:
            return packs.listed(pack, size)
        except (CorruptionError, OSError) as exc:
            return exc
    with Pool(max_workers=READ_THREADS, thread_name_prefix="cas-gc") as pool:
        return dict(zip(names, pool.map(one, names))) if names else {}


def _needed(index, txn, pack: bytes, listed, live: set[bytes]):
    """True when a doomed pack must stay: it holds a live object that the index, as the log
    stands now, finds nowhere else (a save reused it before its host folded the intent; a
    recode's copy adopted over this gc's own, which another gc then deleted), or
    its footer cannot be read (damage is verify's business). Else the set of other packs that
    hold its live objects (the delete entry names them, so a host whose cache finds an object
    in this pack learns where else it is), empty for a pack of dead objects or one already gone."""
    if isinstance(listed, MissingObjectError):
        return set()
    if listed is None or isinstance(listed, Exception):
        return True
    elsewhere = set()
    for e in listed:  # (a key this gc copied too: another host's epoch may have deleted the copy)
        if e.key not in live:
            continue
        rec = index.record(txn, e.key)
        if rec is None or rec.where != WHERE_PACK or rec.pack == pack:
            return True
        elsewhere.add(rec.pack)
    return elsewhere


def _pending_epochs(index, txn) -> set[bytes]:
    """The epochs whose packs are doomed: this gc's own once it logged its intent (until another
    gc's delete entry ends it), and those left pending (their gc crashed, gave up waiting, or
    lost its lock), which this one's delete entry ends all. It holds the gc lock, so none of their gcs is
    running unless paused past its lease, and such a gc appends no delete once it finds its
    epoch ended; its doomed packs that this epoch does not delete are live again (a save reused
    them before it folded the intent) or already gone, and stop being doomed, so writers reuse
    them again instead of uploading copies."""
    return {epoch for _, epoch in index.doomed_packs(txn)}
