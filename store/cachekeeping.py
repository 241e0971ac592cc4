"""How a Store keeps its index, a cache of the store, current: the shared LMDB cache of a
local store (its writers keep it so), a read-only open's private one, a bucket host's own;
catching up with the record log, following objects that moved, and seeing other writers'
commits. A mixin of CheckpointStore (store/store.py), which sets the attributes it uses."""

from __future__ import annotations

import time
import warnings

from cas.errors import CasError

from . import cache
from .registry import Registry


class CacheKeeping:
    # --- the index: a cache of the store -------------------------------------------------
    def _open_cache(self) -> None:
        """Open the LMDB cache; a read-only open whose cache does not match the store uses a
        private one instead (store/cache.py), so it changes nothing in the store."""
        self.cache_report = report = cache.RebuildReport()
        # a bucket store's cache is this host's own: written even when the store is opened read-only
        self.index, self._private_cache = cache.open_index(self.location.index_dir(self.config),
                                                            readonly=self.readonly and self.location.local,
                                                            report=report)
        legacy = self.config.format == 1 and self.readonly  # read as format 1 wrote it, no log
        self.registry = Registry(self.index, self.path, None if legacy else self.records, self._rebuild,
                                 sealer=self.location.keys)

    def _check_cache(self) -> None:
        """Make the cache provably current: upgrade a format-1 store, or rebuild a cache that
        does not match the store's objects and record log. A read-only open reads the shared
        cache as its writers keep it, or else a private one it rebuilds (it writes nothing)."""
        if self.registry.log is None:
            return
        if self.config.format == 1:
            cache.migrate_v1(self, self.cache_report)
            return
        if self.readonly and self.location.local and self._private_cache is None:
            reason = self._shared_cache_lag()
            if reason is None:
                with self.index.read() as txn:
                    reason = self.registry.registry_damage(txn)
            if reason is None:
                return  # current when looked at: its writers keep it so (a later look may find a newer commit)
            self._use_private_cache(reason)
        cache.ensure_current(self, self.cache_report)
        for problem in self.cache_report.salvaged:
            warnings.warn(f"cas: {problem}; this read-only open folded the record log around it: a checkpoint that "
                          "entry added, removed, pinned or marked may be missing or listed as before", stacklevel=4)
        with self.index.read() as txn:
            damage = self.registry.registry_damage(txn)
        if damage is not None:  # the head is current, the rows are not what it folded: rebuild them
            with self.index.write() as txn:
                damage = self.registry.registry_damage(txn)
                if damage is not None:
                    self.cache_report.reason = self.cache_report.reason or damage
                    cache.rebuild(self, txn, self.cache_report)

    def _shared_cache_lag(self, wait: float = 2.0) -> str | None:
        """Why the shared cache is behind the store, or None when it is current. A writer appends
        its log entry just before its index transaction commits, so a cache behind by a commit
        in flight is given `wait` seconds to catch up (a read-only open found it current, then
        failed to write it: the audit of stop 29); one still behind then (a writer killed in
        between, an index lost) is for a private cache to replace."""
        deadline = time.monotonic() + wait
        while True:
            with self.index.read() as txn:
                reason = cache.why_stale(self, txn)
            if not cache.only_behind(reason) or time.monotonic() >= deadline:
                return reason  # current, or not the store's as it stood (lost, replaced): no commit to wait for
            time.sleep(0.01)

    def _rebuild(self, txn) -> None:
        cache.refresh(self, txn, self.cache_report)

    def ensure_cache(self) -> None:
        """Re-check the cache against the store (gc does before it marks, each save before it
        plans)."""
        self._reopen_if_orphaned()
        if self.registry.log is not None:
            cache.ensure_current(self, self.cache_report)

    def _cache_is_own(self) -> bool:
        """Whether no other writer keeps this cache current: a bucket host's, or the private one
        of a read-only open (the shared cache of a local store is written by every commit)."""
        return not self.location.local or self._private_cache is not None

    def _follow_moved_objects(self, key: bytes, rec) -> None:
        """Object `key` is not where the cache says (`rec`): a gc or recode elsewhere moved it. A
        cache of this process's own learns where from the record log; the shared cache of a
        local store is kept current by whoever moved them, so its record is simply looked up
        again. A bucket host's cache that still places it there after catching up may itself be
        damaged (bytes of its file overwritten: an audit's loads of intact checkpoints failed on
        every reopen), so it is rebuilt from the bucket, once per open, before the object is
        called missing."""
        if not self._cache_is_own():
            self._heal_shared_cache(key, rec)
            return
        self.ensure_cache()
        if self.location.local or self._cache_rebuilt or self.objects.record(key) != rec:
            return
        with self.index.read() as txn:
            if rec is not None and self.index.pack_doomed(txn, rec.pack):
                return  # a gc in progress is deleting that pack: the object is gone, not misplaced
        with self.objects.sessions_lock:
            if self.objects.open_sessions:  # a save of this process writes into it: not now
                return
            self._cache_rebuilt = True
            with self.index.write() as txn:
                self.cache_report.reason = f"object {key.hex()} is not where this host's cache placed it"
                cache.rebuild(self, txn, self.cache_report)

    def _heal_shared_cache(self, key: bytes, rec) -> None:
        """The shared cache of a local store placed `key` where it is not, or nowhere, and no
        writer has moved it since (they keep that cache current): when the store holds it after
        all, the cache lost records (bytes of its file overwritten; an audit's loads of intact
        checkpoints said "object file is missing"). The cache is then moved aside and rebuilt
        from the store, once per open; a read-only open builds a private one instead."""
        with self._heal_lock:
            if self._cache_rebuilt or key in self._lost or self.objects.record(key) != rec:
                return
            if not cache.intact_copy(self, key):
                self._lost.add(key)  # lost from the store itself: no scan of every pack again for it
                return
            reason = f"its index had no record of object {key.hex()}, which the store holds"
            if self.readonly:
                self._cache_rebuilt = True
                self._use_private_cache(reason)
                cache.ensure_current(self, self.cache_report)
                warnings.warn(f"cas: the store at {self.path}: {reason}; this read-only open reads from a private "
                              "cache built from the store (`cas repair` rebuilds the index)", stacklevel=2)
                return
            if self.replace_damaged_index(reason) is not None:
                self._cache_rebuilt = True

    def replace_damaged_index(self, reason: str) -> str | None:
        """Move the shared index of a local store aside and build a new one from the store, as
        an open does with a damaged index: writing into a file whose bytes were overwritten is
        not safe (LMDB's own free-page lists may be among them). This process's other users
        reopen it (`ensure_cache`), other processes as when an index is deleted under them.
        Where the index was moved, or None while a save of this store is open in this process
        (it would commit into the old file)."""
        with self.objects.sessions_lock:
            if self.objects.open_sessions or not self.location.local or self._private_cache is not None:
                return None
            damaged = self._damage_found()
            aside = cache.move_aside(self.index.path)
        self.ensure_cache()  # reopens the index at its path: a new one, rebuilt from the store
        if damaged:  # saves go on refusing to reuse them
            with self.index.write() as txn:
                for key, info in damaged:
                    self.index.put_damaged(txn, key, info)
        self.cache_report.reason, self.cache_report.moved_aside = f"{reason}; the index was moved aside and rebuilt", aside
        warnings.warn(f"cas: the store at {self.path}: {reason}; its index was moved to {aside} and rebuilt from "
                      "the store", stacklevel=2)
        return aside

    def _damage_found(self) -> list[tuple[bytes, dict]]:
        """The objects the index records as found damaged, as far as it can still be read."""
        try:
            with self.index.read() as txn:
                return list(self.index.iter_damaged(txn))
        except (CasError, ValueError):  # (a record msgpack cannot read)
            return []

    def _use_private_cache(self, reason: str) -> None:
        """Read from a private cache from now on (a read-only open whose shared one does not
        match the store); built by the caller's ensure_current."""
        self.cache_report.reason = reason
        self._old_indexes.append(self.index)
        self.index, self._private_cache = cache.private_index()
        self.objects.index = self.index
        self.registry = Registry(self.index, self.path, self.records, self._rebuild, sealer=self.location.keys)

    def _see_other_commits(self) -> None:
        """Before the registry is read for a caller: the cache first folds what other hosts or
        processes committed to the record log since it last looked (one stat, or HEAD, of the
        next log entry when there is nothing), so a host polling a bucket sees their new
        checkpoints. A local store's shared cache is kept current by every commit, but not by
        one whose writer was killed between its log entry and its index transaction, or whose
        transaction went into an index replaced under it: exists() said False for a step that
        save() then found committed (the soak of stop 40); a read-only open of a shared cache,
        which cannot write it, reads it as it is. Saves, gc and the store's own bookkeeping
        check the cache where they need it (ensure_cache)."""
        if self.registry.log is None or (self.readonly and not self._cache_is_own()):
            return
        with self.index.read() as txn:
            seq, _ = self.registry.head(txn)
        if self.records.exists(seq + 1):
            self.ensure_cache()

    def _reopen_if_orphaned(self) -> None:
        """When the index files were deleted or replaced while this store was open, open the
        index now at the path (rebuilding it if it must), so this process's changes reach the
        others again; done only while no write session of this store is open (one that is ends
        on the old index, whose commit then fails, nothing committed). The old environment is
        closed with the store."""
        with self.objects.sessions_lock:
            if self._private_cache is not None or self.objects.open_sessions or not self.index.orphaned():
                return
            self._old_indexes.append(self.index)
            self._open_cache()
            self.objects.index = self.index
            self._check_cache()

    def _reopen_when_idle(self, timeout: float = 60.0) -> None:
        """_reopen_if_orphaned, waiting (up to `timeout` seconds) for this store's other write
        sessions on the orphaned index to end first: a recode in the background holds one, and
        its commit there is refused as this save's was."""
        deadline = time.monotonic() + timeout
        while True:
            self._reopen_if_orphaned()
            if not self.index.orphaned() or time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def cache_is_stale(self, txn) -> bool:
        """Whether the cache no longer matches the store (inside the caller's transaction)."""
        return self.registry.log is not None and cache.why_stale(self, txn) is not None

    def _close_cache(self) -> None:
        for old in self._old_indexes:
            old.close()
        self.index.close()
        cache.drop_private(self._private_cache)
