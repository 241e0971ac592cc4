"""The writer of DCP saves (CasWriter): the coordinator's set-up and barrier lease, the planning
round trip of delta bases, every rank's write_data (store/dcp/rank.py) and the coordinator's
commit of the manifest (store/dcp/manifest.py) in one transaction."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
import weakref
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from cas import faults
from cas.errors import CasError, CheckpointExistsError, CorruptionError
from cas.index import WHERE_FILE
from cas.objectstore import WriteSession
from cas.pools import Pool

from .. import tensors as T
from ..bases import DELTA_MIN_BYTES
from ..commit import SaveRecord, commit_save
from ..registry import Checkpoint
from ..options import StoreOptions, checked_meta, checked_metrics, checked_step
from ..location import check_key, locate
from ..opening import open_path
from ..store import CheckpointStore
from . import bases
from .failures import as_cas_errors
from .manifest import Manifest, SavedCheckpoint, build_manifest
from . import segments
from .rank import RankObjects, write_rank_items
from .reader import in_bucket, read_manifest, same_store, store_and_path

BARRIER_PURPOSE = "barrier:dcp step {step}"  # cas.gc.writers.BARRIER_PREFIX: gc sweeps wait for it


# --- the coordinator's side of a save --------------------------------------------------------
class PendingCommit:
    """The coordinator's store and barrier session between set-up and finish. Kept apart from
    the writer so that a finalizer can release it when a failed writer is dropped."""

    def __init__(self, store: CheckpointStore, session: WriteSession, created: float, owns_store: bool) -> None:
        self.store = store
        self.session = session
        self.created = created
        self.owns_store = owns_store

    def release(self) -> None:
        """End the lease if it was not committed (objects written become gc's); close the store
        if we opened it."""
        try:
            self.session.abort()
        finally:
            if self.owns_store:
                self.store.close()


def _latest_shards(store: CheckpointStore) -> dict:
    """MetadataIndex -> tensor node of every shard of the latest checkpoint, if a DCP save."""
    try:
        return read_manifest(store, store.path, None).shards
    except CasError:  # none yet, not a DCP save, or damaged (verify's to report): nothing to seed
        return {}


def _seed(latest_shards, plan: SavePlan) -> dict:
    """{shard id: (skew, nbytes, chunk keys)} of the stored shards that this plan's floating-point
    tensor items match exactly (same name, offsets, sizes and dtype): a restarted rank's bases.
    `latest_shards()` reads the latest manifest, only for a plan that has such items."""
    out = {}
    items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None
             and T.is_floating(item.tensor_data.properties.dtype)]
    shards = latest_shards() if items else {}
    for item in items:
        td = item.tensor_data
        node = shards.get(MetadataIndex(item.index.fqn, td.chunk.offsets))
        if node is None or node["shape"] != list(td.chunk.sizes) or node["nbytes"] < DELTA_MIN_BYTES \
                or T.torch_dtype(node["dtype"]) != td.properties.dtype:
            continue
        shard = bases.shard_id(item.index.fqn, td.chunk.offsets, td.chunk.sizes, td.properties.dtype)
        out[shard] = (node["skew"], node["nbytes"], list(node["chunks"]))
    return out


def _matching_keys(latest_shards, plan: SavePlan) -> list[bytes]:
    """The chunk keys of the latest checkpoint's shards that this plan's tensor items match
    exactly (same name, offsets, sizes and dtype): a restarted rank's stored chunks, in a
    bucket store. `latest_shards()` reads the latest manifest, only for a plan with tensors."""
    items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None]
    shards = latest_shards() if items else {}
    keys = []
    for item in items:
        td = item.tensor_data
        node = shards.get(MetadataIndex(item.index.fqn, td.chunk.offsets))
        if node is not None and node["shape"] == list(td.chunk.sizes) \
                and T.torch_dtype(node["dtype"]) == td.properties.dtype:
            keys.extend(node["chunks"])
    return list(dict.fromkeys(keys))


def _readable_roots(session: WriteSession, keys: list[bytes]) -> dict[bytes, bytes]:
    """The roots of the chains of `keys` that ranks can read (full objects in files of their
    own: ranks cannot locate an object inside a pack), held by the session."""
    try:
        chains = session.store.chains(keys)
    except CorruptionError:  # a damaged index: verify reports it; these chunks are stored whole
        return {}
    roots = {}
    for key, chain in chains.items():
        rec = session.store.record(chain[-1]) if len(chain) > 1 else None
        if rec is not None and rec.where == WHERE_FILE and rec.base is None:
            roots[key] = chain[-1]
    if roots:
        session.hold(list(set(roots.values())))
    return {k: r for k, r in roots.items() if session.depth(r) == 0}


def _chains_below(session: WriteSession, keys: list[bytes]) -> dict[bytes, list[bytes]]:
    """Each delta key's chain below it, from the index (held keys: their chains stay); a key
    whose chain cannot be read (a damaged index) is left out, so ranks do not code against it."""
    out = {}
    for key in keys:
        try:
            out[key] = session.store.chain(key)[1:]
        except CorruptionError:
            continue
    return out


def _adopt_chunks(session: WriteSession, manifest: Manifest) -> None:
    """Index the chunk files the ranks reported (at commit). A key the index holds keeps its
    record and file (in a pack too: a rank's file of it is left to gc); a rank's replacement
    file takes the place of an unindexed one (WriteSession.adopt)."""
    objects = session.store.files
    for key in manifest.chunk_keys:
        staged = [objects.staged(key, token) for token in sorted(manifest.replacements.get(key, ()))]
        session.adopt(key, staged[0] if staged else None)
        objects.discard(staged[1:])  # several ranks replaced the same file


# --- the writer ------------------------------------------------------------------------------
class CasWriter(StorageWriter):
    """A DCP StorageWriter that saves checkpoint `step` into the cas store at `path`.

    milestone, metrics, meta: as Store.save. Store options (a StoreOptions, and/or its keywords,
    the same as cas.open's): chunk_size (only when the store is created here), compress,
    compression_level, workers (hashing and encoding threads per rank, at most 8 by default),
    delta, max_chain, delta_memory (each rank codes changed floating-point chunks against its
    own previous save, which it keeps in host memory up to delta_memory bytes and reads back
    from the store's files beyond; see store/dcp/bases.py). retention: a cas.Retention applied
    after the commit when the store is opened here from a path (as cas.open's).
    After a failed direct dcp.save, call abort() or drop the writer to end its barrier lease.

    overwrite: what to do when the store already holds `step` (FileSystemWriter's parameter of
    that name). False (the default) refuses before any rank writes, with a CheckpointExistsError
    (a RuntimeError, like FileSystemWriter's). FileSystemWriter defaults to True and warns that
    it will default to False; here a store holds many steps and a restarted job re-saving a step
    would silently replace a committed checkpoint, so replacing one is asked for, never assumed.
    True replaces the step's checkpoint in the save's own commit (as Store.save(replace=True)):
    until that commit the old checkpoint stays whole, so a save that fails loses nothing; a
    pinned checkpoint is never replaced.
    """

    def __init__(self, path: str | os.PathLike | CheckpointStore, *, step: int, milestone: bool = False,
                 metrics: dict | None = None, meta: dict | None = None, options: StoreOptions | None = None,
                 retention=None, overwrite: bool = False, **option_values) -> None:
        super().__init__()
        checked_step(step)
        self.overwrite = bool(overwrite)
        self.options = StoreOptions.of(options, **option_values)
        self.retention = retention  # a cas.Retention applied after the commit, on a store opened here
        self._store, self.path = store_and_path(path)
        self.in_bucket = in_bucket(self.path)  # ranks write segments (store/dcp/segments.py)
        self.step = step
        self.milestone = bool(milestone)
        self.metrics = checked_metrics(metrics)
        self.meta = checked_meta(meta)  # the user's own; the sharding goes into the provenance
        self.workers = self.options.worker_count(cap=8)
        self.delta = self.options.delta == "forward"  # ranks code against their previous save (store/dcp/bases.py)
        self.recode = self.options.delta is True  # ranks write whole; the coordinator recodes the previous save
        self.max_chain = self.options.chain_limit()
        self.delta_memory = self.options.delta_memory
        if self.delta and self.in_bucket:
            raise CasError(f'DCP delta="forward" saves into a bucket store ({self.path}) are not supported: a rank '
                           "would read its bases back from segments; save with delta=True or False")
        self.is_coordinator = False
        self.checkpoint: Checkpoint | None = None  # on the coordinator, once committed
        self._pending: PendingCommit | None = None
        self._finalizer: weakref.finalize | None = None
        if self._store is None:  # a wrong or missing key said here, as a CasError (check_key)
            check_key(self.path, self.options.key)

    @property
    def checkpoint_id(self) -> str:
        return f"{self.path}@{self.step}"

    def __getstate__(self) -> dict:
        """Picklable for DCP's process executor: nothing open travels."""
        state = self.__dict__.copy()
        state.update(_store=None, _pending=None, _finalizer=None, checkpoint=None)
        return state

    # -- lifecycle --
    def abort(self) -> None:
        """End an uncommitted save's barrier lease and close the store; a no-op otherwise."""
        pending, self._pending = self._pending, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if pending is not None:
            pending.release()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.abort()
        if checkpoint_id is not None and str(checkpoint_id) != self.checkpoint_id \
                and not same_store(self.path, checkpoint_id):
            raise CasError(f"this CasWriter saves step {self.step} into {self.path}; checkpoint_id "
                           f"{checkpoint_id!r} names something else (leave checkpoint_id out)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never auto-selected: pass storage_writer=CasWriter(...)

    def storage_meta(self) -> StorageMeta | None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CasError("CasWriter needs use_collectives=True: one coordinator commits every rank's "
                           "objects in one transaction")
        self.abort()  # a previous save of this writer that failed
        self.is_coordinator = is_coordinator
        self.checkpoint = None
        if is_coordinator:
            self._begin()

    def _begin(self) -> None:
        """Open the store and the barrier lease before any rank looks at object files."""
        owns = self._store is None
        store = self._store or open_path(self.path, options=dataclasses.replace(self.options, workers=self.workers),
                                         retention=self.retention)
        try:
            if store.exists(self.step):
                self._check_overwrite(store)
            session = store.objects.session(BARRIER_PURPOSE.format(step=self.step))
            if not store.location.local:  # after the lease, as a save: gc intents folded before any confirm
                store.ensure_cache()
        except BaseException:
            if owns:
                store.close()
            raise
        self._pending = pending = PendingCommit(store, session, time.time(), owns)
        self._finalizer = weakref.finalize(self, pending.release)

    def _check_overwrite(self, store: CheckpointStore) -> None:
        """An existing step: refused unless overwrite=True (worded as FileSystemWriter's error), and
        a pinned one always, before any rank writes."""
        if not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists and overwrite=False: the store {self.path} holds step {self.step}; "
                "pass CasWriter(..., overwrite=True) to replace it (in this save's commit: a save that fails "
                "keeps it), or save under another step")
        if store.get(self.step).pinned:
            raise CasError(f"checkpoint {self.step} in {self.path} is pinned (a legal hold); overwrite=True cannot "
                           "replace it (unpin it first)")

    # -- planning --
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.in_bucket:
            return dataclasses.replace(plan, storage_data=segments.proposal(self.path))
        if not self.delta:
            return plan
        return dataclasses.replace(plan, storage_data=bases.proposal(self.path))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """With deltas: hold each rank's proposed bases and say which are stored (store/dcp/bases.py).
        In a bucket: hold each rank's proposed chunks and say which are stored (segments.py)."""
        if not (self.delta or self.in_bucket) or self._pending is None:
            return plans
        session = self._pending.session
        latest = functools.cache(functools.partial(_latest_shards, self._pending.store))
        if self.in_bucket:
            return [dataclasses.replace(plan, storage_data=segments.confirm(
                        plan.storage_data, self.step, session.hold, functools.partial(_matching_keys, latest, plan)))
                    for plan in plans]
        return [dataclasses.replace(plan, storage_data=bases.confirm(
                    plan.storage_data, self.step, self.max_chain, session.hold, session.depth,
                    functools.partial(_readable_roots, session), functools.partial(_seed, latest, plan),
                    functools.partial(_chains_below, session)))
                for plan in plans]

    # -- every rank --
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        faults.point("dcp.write_data")
        if self.in_bucket:
            return self._write_segments(plan, planner)
        objects = RankObjects(self.path, compress=self.options.compress, level=self.options.compression_level,
                              workers=self.workers, key=self.options.key)
        deltas = None
        if self.delta:
            if not bases.answers(plan.storage_data, self.step):
                warnings.warn(f"cas: the DCP plan of step {self.step} carries no confirmation of this rank's delta "
                              "bases (a plan cached by the planner, enable_plan_caching?): its chunks are written "
                              "whole", stacklevel=2)
            objects.confirmed, roots = bases.confirmed(plan.storage_data, self.step)
            objects.below = bases.chains_below(plan.storage_data, self.step)
            # the coordinator seeds a rank whose own cache it could not confirm (a restart, a failed save)
            previous = bases.seeded_cache(plan.storage_data, objects.chunk_size) or bases.cached(self.path)
            deltas = bases.RankDeltas(previous, objects.confirmed, roots, self.max_chain, self.delta_memory,
                                          objects.below)
            bases.replace(self.path, None)  # its buffers are overwritten as this save goes
        results = write_rank_items(plan, planner, objects, deltas)
        objects.sync()
        if deltas is not None:
            bases.replace(self.path, deltas.current)
        faults.point("dcp.rank_written")
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_segments(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """A rank's write_data in a bucket store: new chunks in segments PUT straight to the
        bucket, their places reported in the results (store/dcp/segments.py)."""
        objects = segments.SegmentObjects(locate(self.path), compress=self.options.compress,
                                          level=self.options.compression_level, workers=self.workers,
                                          stored=segments.confirmed(plan.storage_data, self.step),
                                          key=self.options.key)
        results = write_rank_items(plan, planner, objects)
        objects.sync()
        objects.report(results)
        segments.remember(self.path, results)
        faults.point("dcp.rank_written")
        future: Future = Future()
        future.set_result(results)
        return future

    # -- coordinator, after every rank succeeded --
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pending = self._pending
        if pending is None:
            raise CasError("CasWriter.finish without set_up_storage_writer on the coordinator")
        try:
            faults.point("dcp.finish")
            self.checkpoint = self._commit(pending, metadata, results)
            if self.recode:  # in the store's background (a store opened here waits for it when closed)
                pending.store.recode_before(self.checkpoint, reused=set(pending.session.reused))
            # retention of a store opened with one, as after save(); before abort() closes a store
            # opened here (after it, every save's retention failed on the closed store, warning)
            pending.store.after_commit(self.checkpoint)
        finally:
            self.abort()
        saved = SavedCheckpoint(self.step, self.checkpoint.id, self.checkpoint.logical_bytes,
                                self.checkpoint.new_bytes)
        metadata.storage_data = saved.to_storage_data()

    def _commit(self, pending: PendingCommit, metadata: Metadata, results: list[list[WriteResult]]) -> Checkpoint:
        store, session = pending.store, pending.session
        manifest = build_manifest(metadata, results, store.chunk_size, store.objects.files, store.objects.namer)
        if self.in_bucket:
            segments.adopt_segments(session, manifest.chunk_keys, results)
        else:
            _adopt_chunks(session, manifest)
        record = SaveRecord(self.step, pending.created, self.milestone, self.metrics, self.meta, manifest.logical_bytes,
                            produced_by={"dcp": {"world_size": len(results), "sharding": manifest.sharding}})
        with Pool(max_workers=2, thread_name_prefix="cas-dcp") as pool:
            return commit_save(store, session, record, manifest.tree, manifest.nodes.blobs, pool, "dcp.nodes_written",
                               replacing=self.overwrite)


def save(state: dict, path: str | os.PathLike | CheckpointStore, step: int, *, planner: SavePlanner | None = None,
         process_group=None, no_dist: bool = False, **options) -> SavedCheckpoint:
    """dcp.save through a CasWriter, on every rank. A failure on any rank raises a CasError on
    every rank (a direct dcp.save raises DCP's CheckpointException, a BaseException, instead)
    and commits nothing. `options` go to CasWriter (milestone, metrics, meta, chunk_size, ...)."""
    writer = CasWriter(path, step=step, **options)
    try:
        with as_cas_errors(f"DCP save of step {step} into {writer.path}"):
            metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group,
                                no_dist=no_dist)
    finally:
        writer.abort()
    return SavedCheckpoint.from_storage_data(metadata.storage_data)
