"""The checkpoint store: save, load, list, delete and verify checkpoints."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable


from cas import crypt, faults
from cas.codecs import CodecPolicy
from cas.errors import (CasError, CheckpointNotFoundError, IndexReplacedError, NotAStoreError, ReadOnlyStoreError,
                        StoreClosedError, StoreWriteError)
from cas.objectfiles import FileObjects
from cas.objectstore import ObjectStore
from cas.packs import PackFiles
from cas.pools import Pool

from . import signing, snapshots
from . import layout as L
from . import bases as delta_bases
from . import pipeline
from .background import BackgroundSaves, SaveFuture
from .cachekeeping import CacheKeeping
from .changes import RegistryChanges
from .commit import SaveRecord, commit_save
from .loading import Loading
from .location import locate
from .options import StoreOptions, checked_meta, checked_metrics, checked_step
from .recode import BucketLog, Recoder, bases_of_checkpoint
from .records import RecordLog
from .registry import Checkpoint, exists_error
from .stats import StoreStats, codec_usage, store_stats
from .training import resolve_stateful
from .tree import encode_nodes, plan
from .verify import VerifyReport, config_problems, registry_problems, verify_checkpoints


@dataclass(frozen=True)
class _SaveJob:
    step: int
    milestone: bool
    metrics: dict
    meta: dict
    skeleton: object
    leaves: list
    created: float
    # the commit swaps out a checkpoint at the same step (save(replace=True)), or exactly the one
    # whose id this is (save(replace=checkpoint)), refusing another that took the step meanwhile
    replacing: bool | str = False
    reused: set = dataclasses.field(default_factory=set)  # chunk keys the save found stored already


class CheckpointStore(CacheKeeping, Loading, RegistryChanges):
    """A content-addressed checkpoint store in one folder (cas.Store adds retention and gc: open
    one with `cas.open(path)`)."""

    def __init__(self, path: str | os.PathLike, *, options: StoreOptions | None = None, **option_values) -> None:
        """Open (or create) the store at `path`; `options` and/or their keywords, see StoreOptions."""
        self.location = None
        try:
            self._open(path, options, option_values)
        except OSError as exc:  # a folder of a local store we may not read (log/ at mode 000, say)
            if self.location is not None and not self.location.local:
                raise
            raise NotAStoreError(f"cannot open the store at {getattr(self, 'path', None) or os.fspath(path)}: "
                                 f"{exc}") from None

    def _open(self, path: str | os.PathLike, options: StoreOptions | None, option_values: dict) -> None:
        self.options = opts = StoreOptions.of(options, **option_values)
        create, readonly, chunk_size = opts.create, opts.readonly, opts.chunk_size
        self.location = where = locate(path, cache_dir=opts.cache_dir)
        self.path = where.name  # the absolute path, or the bucket URL
        self._pid = os.getpid()  # the process whose threads and LMDB environment these are
        self.layout = where.layout if where.local else None
        self.created = False  # whether this open created the store
        if not where.has_config():
            if not (create and not readonly and where.can_create()):
                if where.local:
                    L.wait_for_creation(where.name)  # another process may be creating it right now
                where.read_config()  # the store that process made, or the precise NotAStoreError
            else:
                self.created = where.create(L.DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size, opts.key)
        self.config = where.read_config()
        where.unlock(self.config, opts.key)  # an encrypted store: its keys, and a backend that seals every blob
        if chunk_size is not None and chunk_size != self.config.chunk_size:
            raise CasError(f"the store at {self.path} was created with chunk_size {self.config.chunk_size}; "
                           f"it cannot be opened with {chunk_size} (leave chunk_size out)")
        self.readonly = readonly or not where.writable()
        self.backend = where.backend
        self.records = RecordLog(self.backend, self.path)
        self._old_indexes: list = []  # environments whose files were deleted or replaced under this store
        self._cache_rebuilt = False  # a cache rebuilt for an object it misplaced or lost (once per open)
        self._heal_lock = threading.Lock()  # read threads that find it so at once: one rebuilds
        self._lost: set[bytes] = set()  # objects a load found in no pack and no file (scanned for once)
        self._open_cache()
        pack_max, pack_target = where.packing(opts.pack_max)
        self.objects = ObjectStore(self.index, FileObjects(self.backend), PackFiles(self.backend),
                                   CodecPolicy(compress=opts.compress, level=opts.compression_level),
                                   pack_max, backend=self.backend, pack_target=pack_target)
        self.objects.on_missing = self._follow_moved_objects
        try:
            faults.point("store.cache_opened")
            self._check_cache()
        except BaseException:
            self._close_cache()
            raise
        self.chunk_size = self.config.chunk_size
        self.window_bytes = opts.window_bytes
        self._workers = opts.worker_count()
        self._pool = Pool(max_workers=self._workers, thread_name_prefix="cas")
        self._hash_pool = Pool(max_workers=self._workers, thread_name_prefix="cas-hash")
        # One read thread per worker: with more threads than cores, a thread that let go of the GIL
        # (AES-GCM, zstd and blake3 do) waits on one the OS preempted. Twice the threads made
        # loads 3-5% slower plain and 10% slower encrypted, warm or cold (stop 29, 2-core VM). A
        # bucket's reads wait on the network instead, so there the pool keeps twice the threads.
        readers = self._workers if where.local else 2 * self._workers
        self._read_pool = Pool(max_workers=readers, thread_name_prefix="cas-read")
        self._background = BackgroundSaves(self.path)
        self.max_inflight = opts.max_inflight
        self.delta = opts.delta
        self.max_chain = opts.chain_limit()
        self.delta_memory = opts.delta_memory  # bytes of the last save kept for deltas; None: all of them
        self.signing_key = opts.signing_key  # signs each commit's record (store/signing.py), or None
        # the last save's floating tensors; None until the first delta save of this open store
        self._bases: dict[str, delta_bases.TensorBases] | None = None
        self._delta_lock = threading.Lock()  # with deltas, saves run one at a time
        self._buffers = delta_bases.Buffers()  # the copies of saves' bytes, reused
        self._recoder = Recoder(self.objects, self._workers, self.after_recode,  # reverse deltas, after each commit
                                None if self.location.local else BucketLog(self.ensure_cache, self._log_recode))
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight saves, then release everything; a background failure nobody
        looked at is raised here."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: its threads and LMDB are the parent's
            self._closed = True
            return
        self._background.wait()
        self.wait_recoding()  # the recodes, and the gc queued after them, run while the store is open
        try:
            self._raise_unobserved()
        finally:
            self._closed = True
            self._background.shutdown()
            self._recoder.shutdown()
            self._pool.shutdown(wait=True)
            self._hash_pool.shutdown(wait=True)
            self._read_pool.shutdown(wait=True)
            crypt.release_buffers(self.backend)
            self._close_cache()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- keys of an encrypted store (cas/crypt.py) -----------------------------------------
    @property
    def encrypted(self) -> bool:
        return self.config.encrypted

    def _keys(self):
        if self.location.keys is None:
            raise CasError(f"the store at {self.path} is not encrypted: it has no keys (create a store with "
                           "cas.open(path, key=...) to encrypt one)")
        return self.location.keys

    def key_ids(self) -> list[str]:
        """The ids of the keys that open this encrypted store (keys/<id>); not stray_key_ids."""
        stray = set(self.stray_key_ids())
        return [k for k in crypt.key_ids(self.backend) if k not in stray]

    def stray_key_ids(self) -> list[str]:
        """The ids of keys/ blobs that open nothing of this store: a creation cut short (killed
        after its first key blob) left them, and another creation then made the store there.
        remove_key deletes them."""
        self._check_open()
        return crypt.stray_key_ids(self.backend, self._keys().master)

    @property
    def key_id(self) -> str | None:
        """The id of the key this store was opened with (None: a plain store)."""
        return self.location.keys.key_id if self.location.keys is not None else None

    def add_key(self, key) -> str:
        """Let another key (a passphrase or 32 raw bytes) open this store: one new keys/ blob,
        created create-only, wrapping the same master key; no data is rewritten. Its id.
        DuplicateKeyError when the key already opens the store (naming its id)."""
        self._check_writable("add a key")
        return crypt.add_key(self.backend, self.config.store_id, self._keys(), key, self.path)

    def remove_key(self, key_id: str) -> None:
        """Remove the key `key_id`: refused for the last key and for the one this store was
        opened with (KeyRemovalRefusedError). The master key, and so every object, stays."""
        self._check_writable("remove a key")
        crypt.remove_key(self.backend, self._keys(), key_id, self.path)

    def __repr__(self) -> str:
        return f"cas.Store({self.path!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.path} is closed")
        _checked_process(self._pid, self.path)  # a forked child has none of the pools' threads

    # --- save ---------------------------------------------------------------------------
    def save(self, state, *, step: int, milestone: bool = False, metrics: dict | None = None,
             meta: dict | None = None, replace: bool | Checkpoint = False) -> Checkpoint:
        """Save `state` as checkpoint `step`. Nothing is visible until the commit, which happens
        only after every object it references is durable. Values with state_dict() and
        load_state_dict() (modules, optimizers, ...) are saved as their state dicts.

        replace=True saves over an existing checkpoint at `step` (a pinned one is refused),
        swapping it out in the commit's own transaction: until that commit the old checkpoint
        stays, so a save that fails loses nothing (for integrations whose own naming reuses
        steps, such as Lightning's last.ckpt). It waits for the save_async calls before it: the
        later call commits later, so it is the newest and retention never removes it for them.
        replace=a Checkpoint replaces exactly that one: if another writer's checkpoint took the
        step meanwhile, the commit is refused with CheckpointExistsError (nothing of it visible)."""
        self._raise_unobserved()
        self._background.make_room(1)  # none in flight: commit order is call order
        replacing = replace.id if isinstance(replace, Checkpoint) else bool(replace)
        return self._write(self._prepare(state, step, milestone, metrics, meta, replacing=replacing))

    def save_async(self, state, *, step: int, milestone: bool = False, metrics: dict | None = None,
                   meta: dict | None = None) -> SaveFuture:
        """Snapshot `state` into host memory and return; hash, encode, write and commit in the
        background. The caller may change the state as soon as this returns. With the default
        max_inflight=1, a second call first waits for the previous save to finish."""
        self._raise_unobserved()  # refuses a forked child before it waits on saves a fork left behind
        self._background.make_room(self.max_inflight)
        job = self._prepare(state, step, milestone, metrics, meta)
        return self._background.submit(step, job.leaves, lambda: self._write(job))

    def wait(self) -> None:
        """Block until every in-flight save is done, and the re-encoding of the checkpoints they
        replaced as deltas (store/recode.py) with the gc queued after it (a bucket's sweep);
        raise a failure nobody has looked at."""
        self._background.wait()
        self.wait_recoding()
        self._raise_unobserved()

    def wait_recoding(self) -> None:
        """Block until the checkpoints replaced by this store's saves so far are re-encoded as
        deltas of the newer ones (store/recode.py); failures there only warn (nothing is lost)."""
        self._recoder.wait()

    def after_recodes(self, task: Callable[[], None]) -> None:
        """Run `task()` on the recode thread once the recodes queued now have ended (wait()
        waits for it too)."""
        self._recoder.then(task)

    def _raise_unobserved(self) -> None:
        self._check_open()
        self._background.raise_unobserved()

    def _prepare(self, state, step, milestone, metrics, meta, replacing: bool | str = False) -> "_SaveJob":
        """Everything a save checks and captures synchronously, before any object is written."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {self.path} is open read-only; it cannot save step {step}")
        checked_step(step)  # before any work
        metrics = checked_metrics(metrics)
        meta = checked_meta(meta)
        self._reopen_if_orphaned()
        if step in self._background.steps or (self._known(step) and not replacing):
            raise exists_error(step)
        skeleton, leaves = plan(resolve_stateful(state), chunk_size=self.chunk_size)
        faults.point("save.planned")
        return _SaveJob(step, bool(milestone), metrics, meta, skeleton, leaves, time.time(), replacing)

    def _write(self, job: "_SaveJob") -> Checkpoint:
        """Write and commit a planned save; a failed file write (OSError) or index transaction
        (the index's StoreWriteError) is a StoreWriteError naming the step."""
        try:
            try:
                return self._write_objects(job)
            except IndexReplacedError:  # deleted under the save, which committed nothing: open it again, once
                self._reopen_when_idle()
                return self._write_objects(job)
        except (OSError, StoreWriteError) as exc:
            kind = type(exc) if isinstance(exc, StoreWriteError) else StoreWriteError  # keep what it says
            raise kind(f"saving step {job.step} into {self.path} failed, nothing was committed: "
                       f"{getattr(exc, 'strerror', None) or exc}") from exc

    def _write_objects(self, job: "_SaveJob") -> Checkpoint:
        if not self.delta:
            return self._commit_job(job, {})
        if self.delta == "forward":  # changed chunks coded against the last save's (the newest is a delta)
            with self._delta_lock:
                if self._bases is None:
                    self._bases = self._latest_bases()
                return self._commit_job(job, self._bases,
                                        lambda written: self._remember_bases(job.leaves, written))
        with self._delta_lock:
            if self._bases is None:
                self._bases = self._latest_recode_bases()
            # the bytes are copied while the nodes are written, unless a recode is still running
            # (then the next one reads this save's chunks back: memory stays at two saves' worth)
            memory = self.delta_memory if not self._recoder.busy() else 0
            current: dict[str, delta_bases.TensorBases] = {}
            previous = self._bases
            ck = self._commit_job(job, {}, lambda _: current.update(
                delta_bases.snapshot(job.leaves, memory, self._buffers)))
            failed = self._bases is None  # the copies failed (out of memory?): the next save reads keys back
            self._bases = None if failed else current
            if job.replacing or failed:  # (replacing: the previous chunks at this step are garbage now)
                self._buffers.give(previous)
            else:
                self._recoder.submit(previous, current, self.max_chain, f"the checkpoint before step {job.step}",
                                     released=self._buffers.give, reused=job.reused)
            return ck

    def _log_recode(self, txn, session) -> None:
        """Name a recode's packs in the record log, inside its commit (a bucket store: every
        host then indexes the moved copies; store/recode.py, Recoder). As a save's commit, it
        fails, nothing committed, if a gc on another host deleted what the session relies on."""
        packs = session.packs_written()
        if packs:
            seq = self.registry.commit(txn, "recode", [], recoded=packs, check=session.check_nothing_lost)
            if snapshots.due(seq):  # taken once this commit is in the cache
                self._recoder.then(lambda: snapshots.take_if_due(self, seq))

    def _latest_recode_bases(self) -> dict[str, delta_bases.TensorBases]:
        """For the first save after the store was opened: the latest checkpoint's chunk keys with
        their chains (recode.bases_of_checkpoint); empty when there is none."""
        latest = self._latest_known()
        try:
            return bases_of_checkpoint(self, latest, self.max_chain) if latest is not None else {}
        except CasError:  # a damaged manifest is verify's to report: nothing is recoded against it
            return {}

    def recode_before(self, ck: Checkpoint, reused: set[bytes] | None = None) -> None:
        """Re-encode, in the background, the checkpoint committed before `ck` as deltas of `ck`
        (a DCP coordinator's commit: its ranks wrote whole chunks); reads both from the store.
        `reused`: the chunks of `ck` that were stored before its save (its commit session's);
        None makes the recode look for content that came back among all of them."""
        if self.readonly:
            return
        with self._delta_lock:
            try:
                older = max((c for c in self.checkpoints() if c.seq < ck.seq), key=lambda c: c.seq, default=None)
                if older is None:
                    return
                previous = bases_of_checkpoint(self, older, self.max_chain)
                current = delta_bases.from_nodes(
                    [(p, leaf.node) for p, leaf in self.reader(ck.step).tensor_leaves().items()])
            except CasError:
                return
            self._recoder.submit(previous, current, self.max_chain, f"step {older.step} against step {ck.step}",
                                 reused=reused)

    def _latest_bases(self) -> dict[str, delta_bases.TensorBases]:
        """Bases for the first delta save after the store was opened (a resumed run): the chunk
        keys of the latest checkpoint's floating-point tensors, with no bytes in memory; the
        workers read them back from the store, as for delta_memory. Empty when there is none."""
        latest = self._latest_known()
        try:
            return delta_bases.from_nodes(
                [(p, leaf.node) for p, leaf in self.reader(latest.step).tensor_leaves().items()]) \
                if latest is not None else {}
        except CasError:  # a damaged manifest is verify's to report; this save is written whole
            return {}

    def _remember_bases(self, leaves: list, written: dict[bytes, bytes]) -> None:
        """Remember this save's floating-point tensors for the next save's deltas, within
        `delta_memory` (store/bases.py; `written`: key -> base key of each delta written)."""
        self._bases = delta_bases.remember(self._bases, leaves, written, self.delta_memory)

    def _commit_job(self, job: "_SaveJob", bases: dict, remember: Callable | None = None) -> Checkpoint:
        """Write and commit one save. With `remember` (delta saves), remember(key -> base key of
        every delta written) runs once the chunks are written, while the nodes are written and
        synced: it overwrites the previous save's bases in memory, so if this save then fails,
        the bases are dropped and the next save reads them back from the latest checkpoint."""
        with self.objects.session(f"save step {job.step}") as session:
            if not self.location.local:  # after the lease: a gc elsewhere sees it, or its intent is folded here
                self.ensure_cache()
            pipeline.write_tensors(session, job.leaves, self._pool, self.window_bytes, bases, self.max_chain,
                                   self._hash_pool)
            job.reused.update(session.reused)
            faults.point("save.chunks_written")
            remembering = self._hash_pool.submit(remember, session.delta_bases()) if remember else None
            try:
                ck = self._commit_nodes(job, session)
            except BaseException:
                if remembering is not None:
                    concurrent.futures.wait([remembering])
                    self._bases = None
                raise
            if remembering is not None and remembering.exception() is not None:
                self._bases = None  # e.g. out of memory for the copies: the next save reads its bases back
        faults.point("save.committed")
        self.after_commit(ck)
        return ck

    def _commit_nodes(self, job: "_SaveJob", session) -> Checkpoint:
        """Write the save's manifest nodes and commit it, registering the checkpoint."""
        root, nodes = encode_nodes(job.skeleton, self.objects.namer)
        record = SaveRecord(job.step, job.created, job.milestone, job.metrics, job.meta,
                            sum(leaf.nbytes for leaf in job.leaves))
        return commit_save(self, session, record, root, nodes, self._pool, "save.nodes_written",
                           replacing=job.replacing)

    def commit_session(self, session, finish: Callable[[object], Checkpoint]) -> Checkpoint:
        """session.commit(finish), where `finish` commits a checkpoint through the registry (its
        record log entry created inside the commit transaction). Once that entry exists the
        checkpoint is committed, whatever happens to the transaction after it: a failure there
        (the index's disk full, say) leaves only the cache behind the store, so the save warns and
        returns its checkpoint, and the cache is rebuilt now if it can be, else at the next open
        (raising "nothing was committed" made the caller retry a step the store already holds)."""
        logged: list[Checkpoint] = []

        def logging(txn) -> Checkpoint:
            logged.append(finish(txn))
            return logged[-1]

        try:
            ck = session.commit(logging)
        except Exception as exc:
            if not logged:
                raise
            warnings.warn(f"cas: step {logged[0].step} is committed (its record log entry exists), but the index "
                          f"of {self.path} could not be updated ({type(exc).__name__}: {exc}); it is rebuilt from "
                          "the store", RuntimeWarning, stacklevel=3)
            try:
                self.ensure_cache()
            except Exception:  # noqa: BLE001 - still failing: the next open rebuilds it
                pass
            return logged[0]
        snapshots.take_if_due(self, ck.seq)
        return ck

    def after_commit(self, ck: Checkpoint) -> None:
        """Called after every committed save (DCP's too); the public store applies retention here."""

    def after_recode(self, packs: set[bytes]) -> None:
        """Called (on the recode thread) with the packs in which a recode left dead entries; the
        public store compacts them there, so the space of the full copies comes back at once."""

    # --- registry -------------------------------------------------------------------------
    def resolve(self, step: int | None) -> Checkpoint:
        """Checkpoint `step`, or the latest when None; CheckpointNotFoundError when absent."""
        self._check_open()
        self._see_other_commits()
        with self.index.read() as txn:
            if step is None:
                ck = self.registry.latest(txn)
                if ck is None:
                    raise CheckpointNotFoundError(f"the store at {self.path} holds no checkpoint yet")
                return ck
            return self.registry.require(txn, step)

    def get(self, step: int) -> Checkpoint:
        self._check_open()
        return self.resolve(step)

    def exists(self, step: int) -> bool:
        self._see_other_commits()
        return self._known(step)

    def _known(self, step: int) -> bool:
        """Whether the cache, as it is, holds checkpoint `step` (a save's early check: its commit
        refuses a step another host committed meanwhile)."""
        with self.index.read() as txn:
            return self.registry.get(txn, step) is not None

    def checkpoints(self) -> list[Checkpoint]:
        self._check_open()
        self._see_other_commits()
        with self.index.read() as txn:
            return self.registry.all(txn)

    def latest(self) -> Checkpoint | None:
        self._check_open()
        self._see_other_commits()
        return self._latest_known()

    def _latest_known(self) -> Checkpoint | None:
        with self.index.read() as txn:
            return self.registry.latest(txn)

    def previous(self, step: int) -> Checkpoint | None:
        """The checkpoint with the largest step below `step`, if any."""
        self._check_open()
        self._see_other_commits()
        with self.index.read() as txn:
            return self.registry.previous(txn, step)

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {self.path} is open read-only; cannot {what}")
        self._reopen_if_orphaned()

    # --- inspection ---------------------------------------------------------------------
    def verify(self, step: int | None = None, *, quick: bool = False, progress=None) -> VerifyReport:
        """Decode every object of one checkpoint (or all) and check it against its hash; with
        quick=True check chunks for presence, size and header only (a damaged payload passes).
        With no step, also read the whole record log and check the index's registry against it.
        What it finds is recorded in the index, so saves write those objects again and
        `cas repair` quarantines them. `progress(phase, done, total)` is called once per
        checkpoint. A checkpoint another process removes meanwhile is not checked, and its
        swept objects are no damage (report.removed_checkpoints)."""
        self._check_open()
        cks = [self.resolve(step)] if step is not None else self.checkpoints()
        report = verify_checkpoints(self, cks, quick=quick, progress=progress)
        if step is not None and report.removed_checkpoints:
            raise CheckpointNotFoundError(f"no checkpoint with step {step} in the store at {self.path} (removed by "
                                          "another process while it was verified)")
        if step is None:  # the whole store: its record log and the registry folded from it too
            report.problems[:0] = config_problems(self) + registry_problems(self)
        return report

    def verify_signatures(self, public_key) -> dict[int, str]:
        """step -> what is wrong, for every checkpoint not signed by `public_key` (32 raw bytes,
        64 hex digits, PEM or OpenSSH, or a path to such a file) as its record now stands;
        empty when every one is (store/signing.py)."""
        self._check_open()
        return signing.check_store(self, public_key)

    def log(self) -> list:
        """The record log, oldest first: every change to the store's checkpoints (saves,
        removals by rm, gc or retention, pins, milestones, copies), with its time, host, pid
        and user. gc never removes it: it is the store's audit trail."""
        self._check_open()
        return list(self.records.entries())

    def stats(self) -> StoreStats:
        self._check_open()
        return store_stats(self.index, self.registry)

    def codec_usage(self) -> dict[str, dict]:
        """Per codec (as named in object headers): objects, stored and raw bytes, deepest chain."""
        self._check_open()
        return codec_usage(self.index, self.objects)

    def tensors(self, step: int) -> list[dict]:
        """Per tensor of a checkpoint: path, dtype, shape, bytes, chunk keys (for `cas show`)."""
        return self.reader(step).tensors()




def _checked_process(pid: int, path: str) -> None:
    """Refuse a Store used by a child forked after it was opened: the child has none of its
    worker threads (a save would wait on them forever) and LMDB forbids using an environment
    across fork."""
    if os.getpid() != pid:
        raise CasError(f"this Store of {path} was opened in process {pid}, and process {os.getpid()} is a child "
                       "forked after that: its worker threads and index do not work here. Open the store again "
                       "in the child (cas.open(path))")

