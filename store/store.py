"""The checkpoint store: save, load, list, delete and verify checkpoints."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
import torch
from torch.nn.parameter import is_lazy

from cas import faults
from cas.codecs import CodecPolicy, checked_level, parse_header
from cas.errors import (CasError, CheckpointNotFoundError, CorruptionError, ReadOnlyStoreError, StateMismatchError,
                        StoreClosedError, StoreWriteError)
from cas.index import WHERE_PACK
from cas.localfs import LocalBackend
from cas.objects import FileObjects
from cas.objectstore import DEFAULT_PACK_MAX, MAX_CHAIN_DECODE, ObjectStore
from cas.packs import PackFiles

from . import cache
from . import layout as L
from . import bases as delta_bases
from . import pipeline, tensors
from .commit import SaveRecord, commit_save
from .records import RecordLog
from .registry import Checkpoint, Registry, exists_error, remove_change, set_change, step_key
from .staging import StagingArena
from .training import is_stateful, resolve_stateful
from .tree import Ref, encode_nodes, parse_node, plan, walk_value
from .values import check_texts, checked_text, pack
from .verify import VerifyReport, record_damage, verify_checkpoints

DEFAULT_WINDOW_BYTES = 256 << 20
DEFAULT_MAX_CHAIN = 4  # bench/bench_delta.py: bytes within 1% of chains of 8, deepest restore 1.6x faster


class SaveFuture(concurrent.futures.Future):
    """The result of save_async: result() gives the Checkpoint or raises the save's error."""

    def __init__(self) -> None:
        super().__init__()
        self._observed = False

    def result(self, timeout=None):
        self._observed = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self._observed = True
        return super().exception(timeout)

    def unobserved_exception(self) -> BaseException | None:
        if self._observed or not self.done():
            return None
        return super().exception()


@dataclass(frozen=True)
class _SaveJob:
    step: int
    milestone: bool
    metrics: dict
    meta: dict
    skeleton: object
    leaves: list
    created: float
    replacing: bool = False  # the commit swaps out a checkpoint at the same step (Store._replace)


@dataclass(frozen=True)
class StoreStats:
    logical_bytes: int  # tensor bytes over all committed checkpoints (what full copies would hold)
    stored_bytes: int  # encoded bytes of every object in the store
    num_objects: int
    num_checkpoints: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


class Store:
    """A content-addressed checkpoint store in one folder. Open with `cas.open(path)`."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True, readonly: bool = False,
                 chunk_size: int | None = None, compress: bool = True, compression_level: int = 1,
                 workers: int | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 pack_max: int = DEFAULT_PACK_MAX, max_inflight: int = 1, delta: bool = False,
                 max_chain: int = DEFAULT_MAX_CHAIN, delta_memory: int | None = None) -> None:
        checked_max_chain(max_chain)
        checked_delta_memory(delta_memory)
        checked_level(compression_level)
        if type(max_inflight) is not int or max_inflight < 1:
            raise CasError(f"max_inflight must be an int >= 1 (saves in flight at once), got {max_inflight!r}")
        self.path = os.path.abspath(os.fspath(path))
        self._pid = os.getpid()  # the process whose threads and LMDB environment these are
        self.layout = L.Layout(self.path)
        self.created = False  # whether this open created the store
        if not os.path.exists(self.layout.config):
            if not (create and not readonly and L.can_create(self.path)):
                L.read_config(self.layout)  # raises the precise NotAStoreError
            self._create(chunk_size or L.DEFAULT_CHUNK_SIZE)
        self.config = L.read_config(self.layout)
        if chunk_size is not None and chunk_size != self.config.chunk_size:
            raise CasError(f"the store at {self.path} was created with chunk_size {self.config.chunk_size}; "
                           f"it cannot be opened with {chunk_size} (leave chunk_size out)")
        self.readonly = readonly or not _writable(self.layout)
        self.backend = LocalBackend(self.path)
        self.records = RecordLog(self.backend, self.path)
        self._old_indexes: list = []  # environments whose files were deleted or replaced under this store
        self._open_cache()
        self.objects = ObjectStore(self.index, FileObjects(self.backend), PackFiles(self.backend),
                                   CodecPolicy(compress=compress, level=compression_level), pack_max,
                                   backend=self.backend)
        try:
            self._check_cache()
        except BaseException:
            self._close_cache()
            raise
        self.chunk_size = self.config.chunk_size
        self.window_bytes = window_bytes
        self._workers = workers or os.cpu_count() or 2
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="cas")
        self._hash_pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="cas-hash")
        # Loads wait on reads more than saves wait on writes: twice the threads keep the cores busy
        # (measured by bench/bench_core.py; more threads made saves slower, fewer made loads slower).
        self._read_pool = ThreadPoolExecutor(max_workers=2 * self._workers, thread_name_prefix="cas-read")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cas-async")
        self.max_inflight = max_inflight
        self._inflight: list[SaveFuture] = []
        self._inflight_steps: set[int] = set()
        self._arenas: list[StagingArena] = []
        self.delta = delta
        self.max_chain = max_chain
        self.delta_memory = delta_memory  # bytes of the last save kept for deltas; None: all of them
        # the last save's floating tensors; None until the first delta save of this open store
        self._bases: dict[str, delta_bases.TensorBases] | None = None
        self._delta_lock = threading.Lock()  # with deltas, saves run one at a time
        self._closed = False

    def _create(self, chunk_size: int) -> None:
        """Create the store, unless another process did while this one waited for the lock."""
        L.check_chunk_size(chunk_size)
        with L.creation_lock(self.path):
            if os.path.exists(self.layout.config):
                return  # another process created it while this one waited
            if not L.can_create(self.path):  # someone put something else here meanwhile
                L.read_config(self.layout)
            for folder in L.LAYOUT_FOLDERS:
                os.makedirs(os.path.join(self.path, folder), exist_ok=True)
            faults.point("store.creating")
            L.write_config(self.layout, chunk_size=chunk_size)  # the cache is built at the first open
            self.created = True

    # --- the index: a cache of the store -------------------------------------------------
    def _open_cache(self) -> None:
        """Open the LMDB cache; a read-only open whose cache does not match the store uses a
        private one instead (store/cache.py), so it changes nothing in the store."""
        self.cache_report = report = cache.RebuildReport()
        self.index, self._private_cache = cache.open_index(self.layout, readonly=self.readonly, report=report)
        legacy = self.config.format == 1 and self.readonly  # read as format 1 wrote it, no log
        self.registry = Registry(self.index, self.path, None if legacy else self.records, self._rebuild)
        if legacy or not self.readonly or self._private_cache is not None:
            return
        with self.index.read() as txn:
            report.reason = cache.why_stale(self, txn)
        if report.reason is not None:
            self.index.close()
            self.index, self._private_cache = cache.private_index()
            self.registry = Registry(self.index, self.path, self.records, self._rebuild)

    def _check_cache(self) -> None:
        """Make the cache provably current: upgrade a format-1 store, or rebuild a cache that
        does not match the store's objects and record log."""
        if self.registry.log is None:
            return
        if self.config.format == 1:
            cache.migrate_v1(self, self.cache_report)
        else:
            cache.ensure_current(self, self.cache_report)

    def _rebuild(self, txn) -> None:
        cache.rebuild(self, txn, self.cache_report)

    def ensure_cache(self) -> None:
        """Re-check the cache against the store (gc does before it marks, each save before it
        plans)."""
        self._reopen_if_orphaned()
        if self.registry.log is not None:
            cache.ensure_current(self, self.cache_report)

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

    def cache_is_stale(self, txn) -> bool:
        """Whether the cache no longer matches the store (inside the caller's transaction)."""
        return self.registry.log is not None and cache.why_stale(self, txn) is not None

    def _close_cache(self) -> None:
        for old in self._old_indexes:
            old.close()
        self.index.close()
        cache.drop_private(self._private_cache)

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight saves, then release everything; a background failure nobody
        looked at is raised here."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: its threads and LMDB are the parent's
            self._closed = True
            return
        concurrent.futures.wait(list(self._inflight))
        try:
            self._raise_unobserved()
        finally:
            self._closed = True
            self._background.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._hash_pool.shutdown(wait=True)
            self._read_pool.shutdown(wait=True)
            self._close_cache()
            self._arenas.clear()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"cas.Store({self.path!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.path} is closed")
        _checked_process(self._pid, self.path)  # a forked child has none of the pools' threads

    # --- save ---------------------------------------------------------------------------
    def save(self, state, *, step: int, milestone: bool = False, metrics: dict | None = None,
             meta: dict | None = None) -> Checkpoint:
        """Save `state` as checkpoint `step`. Nothing is visible until the commit, which happens
        only after every object it references is durable. Values with state_dict() and
        load_state_dict() (modules, optimizers, ...) are saved as their state dicts."""
        self._raise_unobserved()
        return self._write(self._prepare(state, step, milestone, metrics, meta))

    def save_async(self, state, *, step: int, milestone: bool = False, metrics: dict | None = None,
                   meta: dict | None = None) -> "SaveFuture":
        """Snapshot `state` into host memory and return; hash, encode, write and commit in the
        background. The caller may change the state as soon as this returns. With the default
        max_inflight=1, a second call first waits for the previous save to finish."""
        self._raise_unobserved()  # refuses a forked child before it waits on saves a fork left behind
        while len(self._inflight) >= self.max_inflight:
            concurrent.futures.wait(self._inflight, return_when=concurrent.futures.FIRST_COMPLETED)
            self._raise_unobserved()
        job = self._prepare(state, step, milestone, metrics, meta)
        arena = self._arenas.pop() if self._arenas else StagingArena()
        arena.stage(job.leaves)
        faults.point("save.staged")
        future = SaveFuture()
        self._inflight.append(future)
        self._inflight_steps.add(step)

        def run() -> None:
            result, failure = None, None
            try:
                result = self._write(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                failure = exc
            finally:  # before the future completes: its waiter may save this step again at once
                for leaf in job.leaves:
                    leaf.staged = None
                self._arenas.append(arena)
                self._inflight_steps.discard(step)
            if failure is None:
                future.set_result(result)
            else:
                future.set_exception(failure)

        self._background.submit(run)
        return future

    def wait(self) -> None:
        """Block until every in-flight save is done; raise a failure nobody has looked at."""
        concurrent.futures.wait(list(self._inflight))
        self._raise_unobserved()

    def _raise_unobserved(self) -> None:
        """Raise the failures of finished background saves that nobody looked at: the first,
        with the others named in its notes (each is raised once)."""
        self._check_open()
        failures = []
        for future in [f for f in self._inflight if f.done()]:
            self._inflight.remove(future)
            if future.unobserved_exception() is not None:
                failures.append(future.exception())
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"another background save failed too: {type(other).__name__}: {other}")
            raise first

    def _prepare(self, state, step, milestone, metrics, meta, replacing: bool = False) -> "_SaveJob":
        """Everything a save checks and captures synchronously, before any object is written."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {self.path} is open read-only; it cannot save step {step}")
        step_key(step)  # type-checks the step before any work
        metrics = checked_metrics(metrics)
        meta = checked_meta(meta)
        self._reopen_if_orphaned()
        if step in self._inflight_steps or (self.exists(step) and not replacing):
            raise exists_error(step)
        skeleton, leaves = plan(resolve_stateful(state), chunk_size=self.chunk_size)
        faults.point("save.planned")
        return _SaveJob(step, bool(milestone), metrics, meta, skeleton, leaves, time.time(), replacing)

    def _replace(self, state, *, step: int, meta: dict | None = None) -> Checkpoint:
        """Save `state` as `step`, swapping out the checkpoint there in the commit's own
        transaction (a pinned one is refused): for integrations whose own naming reuses steps
        (Lightning's last.ckpt). Until that commit the old checkpoint stays, so a save that
        fails loses nothing."""
        self._raise_unobserved()
        return self._write(self._prepare(state, step, False, None, meta, replacing=True))

    def _write(self, job: "_SaveJob") -> Checkpoint:
        """Write and commit a planned save; a failed file write (OSError) or index transaction
        (the index's StoreWriteError) is a StoreWriteError naming the step."""
        try:
            return self._write_objects(job)
        except (OSError, StoreWriteError) as exc:
            kind = type(exc) if isinstance(exc, StoreWriteError) else StoreWriteError  # keep what it says
            raise kind(f"saving step {job.step} into {self.path} failed, nothing was committed: "
                       f"{getattr(exc, 'strerror', None) or exc}") from exc

    def _write_objects(self, job: "_SaveJob") -> Checkpoint:
        if not self.delta:
            return self._commit_job(job, {})
        with self._delta_lock:
            if self._bases is None:
                self._bases = self._latest_bases()
            return self._commit_job(job, self._bases, lambda written: self._remember_bases(job.leaves, written))

    def _latest_bases(self) -> dict[str, delta_bases.TensorBases]:
        """Bases for the first delta save after the store was opened (a resumed run): the chunk
        keys of the latest checkpoint's floating-point tensors, with no bytes in memory; the
        workers read them back from the store, as for delta_memory. Empty when there is none."""
        latest = self.latest()
        try:
            return delta_bases.from_nodes(self._tensor_nodes(latest.step)) if latest is not None else {}
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
            pipeline.write_tensors(session, job.leaves, self._pool, self.window_bytes, bases, self.max_chain,
                                   self._hash_pool)
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
        root, nodes = encode_nodes(job.skeleton)
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
            return session.commit(logging)
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

    def after_commit(self, ck: Checkpoint) -> None:
        """Called after every committed save (DCP's too); the public store applies retention here."""

    # --- load ---------------------------------------------------------------------------
    def load(self, step: int | None = None, *, keys=None, device: str | torch.device | None = None):
        """Load a checkpoint's state (the latest when `step` is None); with `keys`, only those
        top-level entries are read. Every byte is checked against its hash."""
        self._check_open()
        ck = self.resolve(step)
        state = self._load(ck, keys)
        if device is not None:
            target = torch.device(device)
            state = walk_value(state, lambda t, _: t.to(target), match=torch.Tensor)
        return state

    def restore(self, targets: dict, *, step: int | None = None) -> dict:
        """Restore stateful objects in place (model, optimizer, scheduler, scaler, sampler,
        cas.RNGState, ...) from a checkpoint (the latest when `step` is None).

        Returns the checkpoint's top-level entries, with each stateful target in place of its
        state dict. Tensors are decoded straight into the targets' own tensors where dtype and
        shape match, so no second full copy of a model is held; memory two entries share (tied
        weights) is decoded into once, the other entry through load_state_dict. Only verified
        bytes are written into a target. Modules are checked against the checkpoint first and
        restored last, after every other target accepted its state: a module that does not fit
        (StateMismatchError) or another target that refuses its state leaves the modules as they
        were. A damaged object (CorruptionError) stops the restore with the targets partly
        restored, each chunk either as it was or as the checkpoint holds it."""
        self._check_open()
        if not isinstance(targets, dict):
            raise TypeError("restore takes a dict of targets, like the state that was saved")
        ck = self.resolve(step)
        top = self._top_value(ck)
        missing = [k for k in targets if not isinstance(top, dict) or k not in top]
        if missing:
            have = list(top) if isinstance(top, dict) else []
            raise CheckpointNotFoundError(f"checkpoint step {ck.step} has no entries {missing} to restore "
                                          f"into (it has {have})")
        own_of: dict = {}  # target key -> {tensor path: its tensor}, for the targets decoded into
        modules: dict = {}  # module targets' keys -> their tensors (checked against the checkpoint)
        for key, target in targets.items():
            if not is_stateful(target):
                continue
            own: dict[str, torch.Tensor] = {}
            walk_value(target.state_dict(), lambda t, p: own.setdefault(p, t), path=str(key), match=torch.Tensor)
            lazy = any(is_lazy(t) for t in own.values())  # load_state_dict gives a lazy module its shapes
            if isinstance(target, torch.nn.Module):
                modules[key] = {} if lazy else own
            if not lazy:
                own_of[key] = own
        if modules:
            self._check_modules_fit(ck, {k: own for k, own in modules.items() if own})
        into = _split_targets(own_of)
        if not isinstance(top, dict):  # no targets (a dict of targets names top-level entries)
            return self._load(ck, None)
        # Everything but the modules first: an optimizer or scheduler that refuses its state
        # (another number of parameter groups, say) then leaves the model untouched.
        first = [k for k in top if k not in modules]
        loaded = self._load(ck, first, into) if first else {}
        self._load_targets(targets, loaded, ck.step)
        if modules:
            loaded.update(self._load(ck, list(modules), into))
            self._load_targets(targets, loaded, ck.step)
        return {k: loaded[k] for k in top}

    @staticmethod
    def _load_targets(targets: dict, loaded: dict, step: int) -> None:
        """Hand each stateful target its loaded state (once), and put the target in its place.
        A target that refuses its state is named in a StateMismatchError."""
        for key, target in targets.items():
            if is_stateful(target) and key in loaded and loaded[key] is not target:
                try:
                    target.load_state_dict(loaded[key])
                except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                    raise StateMismatchError(f"restore target {key!r} refused the state of checkpoint step {step}: "
                                             f"{exc}") from exc
                loaded[key] = target

    def _check_modules_fit(self, ck: Checkpoint, modules: dict) -> None:
        """Refuse, before any byte is decoded into them, module targets whose tensors
        load_state_dict would refuse (a missing or unexpected name, another shape): a failed
        restore must leave the model as it was."""
        for key, own in modules.items():
            theirs = dict(self._nodes_of(ck, key))
            missing = sorted(set(own) - set(theirs))
            unexpected = sorted(set(theirs) - set(own))
            shapes = sorted(p for p in set(own) & set(theirs)  # a module's extra state may change its shape
                            if list(own[p].shape) != theirs[p]["shape"] and "_extra_state" not in p.split("."))
            if missing or unexpected or shapes:
                what = "; ".join(f"{label}: {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}"
                                 for label, paths in (("not in the checkpoint", missing),
                                                      ("not in the module", unexpected),
                                                      ("of another shape", shapes)) if paths)
                raise StateMismatchError(f"{key!r} does not fit checkpoint step {ck.step} ({what}); nothing was "
                                         "restored")

    def commit_record(self, ck: Checkpoint) -> dict:
        """The commit node a registry record names, which must be that step's commit: a damaged
        or crafted record naming another node, or another step's commit, is refused instead
        of loading what it names."""
        node = self._node(ck.key, ck.step)
        if node["k"] != "commit":
            raise CorruptionError(f"the registry names a {node['k']} node as this checkpoint's commit",
                                  key=ck.id, step=ck.step)
        if node["step"] != ck.step:
            raise CorruptionError(f"the registry names the commit of step {node['step']}", key=ck.id, step=ck.step)
        return node

    def _top_value(self, ck: Checkpoint):
        root = self.commit_record(ck)["tree"]
        tree = self._node(root.key, ck.step)
        return tree["v"] if tree["k"] == "value" else root

    def _load(self, ck: Checkpoint, keys, into: dict | None = None):
        """Load the checkpoint's state (the top-level `keys` only, when given). `into`: per
        top-level entry, {tensor path: the caller's tensor to decode into} (restore); kept per
        entry because flat dotted paths of two entries can coincide ("model" holding "ema",
        and an entry named "model.ema"). A damaged object it meets is recorded in the index
        before the CorruptionError is raised, so the next save writes it again."""
        try:
            value = self._top_value(ck)
            if keys is not None:
                value = _select(value, keys, ck.step)
            jobs: list = []
            if into and isinstance(value, dict):
                state = {k: walk_value(v, lambda ref, path, own=into.get(k, {}):
                                       self._materialize(ref, path, ck.step, jobs, own), str(k))
                         for k, v in value.items()}
            else:
                state = walk_value(value, lambda ref, path: self._materialize(ref, path, ck.step, jobs, {}))
            pipeline.read_tensor_chunks(self.objects, jobs, self._read_pool, window=4 * self._workers)
        except CorruptionError as exc:
            record_damage(self, [exc.key], f"load of step {ck.step}")
            raise exc.located(step=ck.step) from None
        return state

    def _materialize(self, ref: Ref, path: str, step: int, jobs: list, into: dict):
        node = self._node(ref.key, step, path)
        if node["k"] == "value":
            return walk_value(node["v"], lambda r, p: self._materialize(r, p, step, jobs, into), path)
        if node["k"] != "tensor":
            raise CorruptionError("a commit node appears inside a state tree", key=ref.key.hex(), step=step, path=path)
        out, view = tensors.output_for(node, into.get(path))
        guarded = out is into.get(path)  # the caller's own tensor: only verified bytes may land in it
        for key, (start, end) in zip(node["chunks"], pipeline.chunk_spans(node["nbytes"], node["chunk"], node["skew"])):
            jobs.append((path, key, view[start:end], guarded))
        return out

    def _node(self, key: bytes, step: int, path: str | None = None) -> dict:
        try:
            return parse_node(self.objects.get(key).tobytes(), key)
        except CorruptionError as exc:
            raise exc.located(step=step, path=path) from None

    # --- registry -------------------------------------------------------------------------
    def resolve(self, step: int | None) -> Checkpoint:
        """The checkpoint at `step`, or the latest when None (CheckpointNotFoundError if none)."""
        self._check_open()
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
        with self.index.read() as txn:
            return self.registry.get(txn, step) is not None

    def checkpoints(self) -> list[Checkpoint]:
        self._check_open()
        with self.index.read() as txn:
            return self.registry.all(txn)

    def latest(self) -> Checkpoint | None:
        self._check_open()
        with self.index.read() as txn:
            return self.registry.latest(txn)

    def previous(self, step: int) -> Checkpoint | None:
        """The checkpoint with the largest step below `step`, if any."""
        self._check_open()
        with self.index.read() as txn:
            return self.registry.previous(txn, step)

    def delete(self, step: int) -> None:
        """Forget a checkpoint. Its objects stay until gc finds them unreferenced."""
        self.forget([step])

    def forget(self, steps) -> list[Checkpoint]:
        """Remove checkpoints from the registry in one transaction; pinned ones are refused."""
        self._check_writable("delete checkpoints")
        with self.index.write() as txn:
            gone = [self.registry.require(txn, step) for step in dict.fromkeys(steps)]
            pinned = [ck.step for ck in gone if ck.pinned]
            if pinned:
                raise CasError(f"checkpoint(s) {pinned} are pinned (a legal hold); unpin them first")
            if gone:
                self.registry.commit(txn, "delete", [remove_change(ck) for ck in gone])
            self.index.bump_generation(txn)
        return gone

    def _forget_chosen(self, choose: Callable[[list[Checkpoint]], list[int]]) -> list[Checkpoint]:
        """Remove the checkpoints that `choose` picks from the registry as it reads inside this
        one write transaction (gc's retention: a decision on an earlier read removed a checkpoint
        made a milestone since, and failed on one another gc had removed). Pinned ones stay."""
        self._check_writable("remove checkpoints")
        with self.index.write() as txn:
            cks = self.registry.all(txn)
            chosen = set(choose(cks))
            gone = [ck for ck in cks if ck.step in chosen and not ck.pinned]
            if gone:
                self.registry.commit(txn, "gc", [remove_change(ck) for ck in gone])
                self.index.bump_generation(txn)
        return gone

    def set_milestone(self, step: int, flag: bool = True) -> Checkpoint:
        return self._update(step, "milestone" if flag else "unmilestone", milestone=bool(flag))

    def set_pinned(self, step: int, flag: bool = True) -> Checkpoint:
        """A pinned checkpoint cannot be deleted, by hand or by any retention rule."""
        return self._update(step, "pin" if flag else "unpin", pinned=bool(flag))

    def _update(self, step: int, why: str, **flags: bool) -> Checkpoint:
        """Change a checkpoint's flags: one record log entry, so the change outlives the cache."""
        self._check_writable(f"change checkpoint {step}")
        with self.index.write() as txn:
            ck = self.registry.require(txn, step)
            self.registry.commit(txn, why, [set_change(ck, **flags)])
        return dataclasses.replace(ck, **flags)

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"the store at {self.path} is open read-only; cannot {what}")
        self._reopen_if_orphaned()

    # --- inspection ---------------------------------------------------------------------
    def verify(self, step: int | None = None, *, quick: bool = False, progress=None) -> VerifyReport:
        """Decode every object of one checkpoint (or all) and check it against its hash; with
        quick=True check chunks for presence, size and header only (a damaged payload passes).
        What it finds is recorded in the index, so saves write those objects again and
        `cas repair` quarantines them. `progress(phase, done, total)` is called once per
        checkpoint."""
        self._check_open()
        cks = [self.resolve(step)] if step is not None else self.checkpoints()
        return verify_checkpoints(self, cks, quick=quick, progress=progress)

    def stats(self) -> StoreStats:
        self._check_open()
        with self.index.read() as txn:
            stored = num = 0
            for _, rec in self.index.iter_records(txn):
                stored += rec.stored_size
                num += 1
            cks = self.registry.all(txn)
        return StoreStats(sum(c.logical_bytes for c in cks), stored, num, len(cks))

    def codec_usage(self) -> dict[str, dict]:
        """Per codec (as named in object headers): objects, stored and raw bytes, deepest chain."""
        usage: dict[str, dict] = {}
        with self.index.read() as txn:
            records = list(self.index.iter_records(txn))
        for key, rec in records:
            try:
                if rec.where == WHERE_PACK:
                    head = self.objects.packs.read(rec.pack, rec.offset, min(rec.stored_size, 64), key)
                else:
                    head = self.objects.files.head(key, 64)
                name = parse_header(head, key=key).codec_name
            except CorruptionError:
                name = "unreadable"
            u = usage.setdefault(name, {"objects": 0, "stored_bytes": 0, "raw_bytes": 0, "max_depth": 0})
            u["objects"] += 1
            u["stored_bytes"] += rec.stored_size
            u["raw_bytes"] += rec.raw_size
            u["max_depth"] = max(u["max_depth"], rec.depth)
        return usage

    def tensors(self, step: int) -> list[dict]:
        """Per tensor of a checkpoint: path, dtype, shape, bytes, chunk keys (for `cas show`)."""
        return [{"path": path, "lib": node["lib"], "dtype": node["dtype"], "shape": node["shape"],
                 "bytes": node["nbytes"], "chunks": node["chunks"]} for path, node in self._tensor_nodes(step)]

    def _tensor_nodes(self, step: int) -> list[tuple[str, dict]]:
        """(path, tensor node) of every tensor of a checkpoint, in state order."""
        self._check_open()
        return self._nodes_of(self.resolve(step))

    def _nodes_of(self, ck: Checkpoint, entry=None) -> list[tuple[str, dict]]:
        """_tensor_nodes of a resolved checkpoint (of one top-level `entry` only, when given):
        a restore reads the checkpoint it resolved, even if the step is replaced meanwhile."""
        out: list[tuple[str, dict]] = []

        def visit(ref: Ref, path: str):
            node = self._node(ref.key, ck.step, path)
            if node["k"] == "value":
                walk_value(node["v"], visit, path)
            elif node["k"] == "tensor":
                out.append((path, node))

        if entry is None:
            visit(self.commit_record(ck)["tree"], "")
        else:
            top = self._top_value(ck)
            if isinstance(top, dict) and entry in top:
                walk_value(top[entry], visit, str(entry))
        return out


def _writable(layout: L.Layout) -> bool:
    """Whether this process may change the store (its folder, and its index when present)."""
    return os.access(layout.root, os.W_OK) and (not os.path.exists(layout.index) or os.access(layout.index, os.W_OK))


def _split_targets(own_of: dict) -> dict:
    """Per target key, the tensors to decode into, minus each one whose memory an earlier one
    (of any target) shares: two decodes must never write the same bytes at once."""
    flat = {(key, path): t for key, own in own_of.items() for path, t in own.items()}
    kept = tensors.without_shared_memory(flat)
    out: dict = {}
    for (key, path), t in kept.items():
        out.setdefault(key, {})[path] = t
    return out


def _select(value, keys, step: int):
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(value, dict):
        raise CasError(f"checkpoint step {step} holds a {type(value).__name__} at its top, not a dict; "
                       "load it without keys=")
    missing = [k for k in keys if k not in value]
    if missing:
        raise CheckpointNotFoundError(f"checkpoint step {step} has no top-level entries {missing}; "
                                      f"it has {list(value)}")
    return {k: value[k] for k in keys}


def checked_metrics(metrics) -> dict:
    """A save's metrics as the registry records them: str keys, one number each."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError("metrics must be a dict with str keys")
    out = {}
    for k, v in metrics.items():
        checked_text(k, "a metrics key")
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
            if v.size != 1 if isinstance(v, (np.ndarray, np.generic)) else v.numel() != 1:
                raise TypeError(f"metric {k!r} must be one number, got a {type(v).__name__} of shape {tuple(v.shape)}")
            v = v.item()
        if type(v) is bool or not isinstance(v, (int, float)):
            raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}")
        if not isinstance(v, float) and not -(1 << 63) <= v < 1 << 64:  # what a registry record holds
            raise TypeError(f"metric {k!r} is an int beyond 64 bits; give it as a float")
        out[k] = float(v) if isinstance(v, float) else int(v)
    return out


def checked_max_chain(max_chain) -> int:
    """A bound restore can follow: chains deeper than MAX_CHAIN_DECODE are refused as cycles."""
    if type(max_chain) is not int or not 0 <= max_chain <= MAX_CHAIN_DECODE:
        raise CasError(f"max_chain must be an int from 0 to {MAX_CHAIN_DECODE}, got {max_chain!r}")
    return max_chain


def checked_delta_memory(delta_memory) -> int | None:
    """The bytes of the last save kept for deltas (None: all of them)."""
    if delta_memory is not None and (type(delta_memory) is not int or delta_memory < 0):
        raise CasError(f"delta_memory must be a number of bytes (an int >= 0) or None, got {delta_memory!r}")
    return delta_memory


def _checked_process(pid: int, path: str) -> None:
    """Refuse a Store used by a child forked after it was opened: the child has none of its
    worker threads (a save would wait on them forever) and LMDB forbids using an environment
    across fork."""
    if os.getpid() != pid:
        raise CasError(f"this Store of {path} was opened in process {pid}, and process {os.getpid()} is a child "
                       "forked after that: its worker threads and index do not work here. Open the store again "
                       "in the child (cas.open(path))")


def checked_meta(meta) -> dict:
    """A copy of a save's meta, checked to hold only what the registry and commit node can."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError("meta must be a dict")
    try:
        plain = msgpack.packb(meta, use_bin_type=True)  # as the registry record holds it
        pack(meta)  # and the commit node
        # a copy: the caller of save_async may change its dict once the call returns
        return msgpack.unpackb(plain, raw=False, strict_map_key=False)
    except (TypeError, ValueError, OverflowError) as exc:  # a tuple key comes back unhashable, say
        if isinstance(exc, UnicodeEncodeError):  # a lone surrogate: name where it sits
            check_texts(meta, "meta")  # (msgpack got that far, so this walk stays within its nesting limit)
        raise TypeError(f"meta must hold plain values (str, 64-bit ints, floats, bools, None, lists, dicts "
                        f"with str or int keys): {exc}") from None

