"""torch.distributed.checkpoint (DCP) backed by the store: multi-rank saves with dedup, and
loads at any world size (DCP reshards).

    import torch.distributed.checkpoint as dcp
    from cas.store.dcp import CasWriter, CasReader
    dcp.save(state, storage_writer=CasWriter(path, step=step))        # on every rank
    dcp.load(state, storage_reader=CasReader(path, step=step))        # any world size
    cas.store.dcp.save(state, path, step) / cas.store.dcp.load(state, path)   # same, CasError on failure

Protocol (DCP calls; "coordinator" is DCP's rank 0):
  1. set_up_storage_writer, coordinator only: open the store (create it if missing), refuse an
     existing step, and open a WriteSession whose purpose starts with "barrier:". That lease
     makes every gc sweep batch wait until it ends, and it exists before any rank looks at a
     file: ranks look only in write_data, which DCP runs after the coordinator's set-up.
  2. write_data, every rank, for its own items only: cut each tensor shard into chunks on the
     tensor's global byte grid (a dim-0 shard at row r starts r*row_bytes into the tensor, so
     its `skew` is that modulo the chunk size and chunks fully inside a shard coincide at any
     world size), hash each chunk, skip it when a full object file of it exists, or a delta
     file the coordinator confirmed stored (a file under its final name is complete: it is
     fsynced before it gets that name, and the barrier keeps gc away), else encode it and give
     it its name as a file, never over an existing one (which may be indexed: other
     checkpoints decode through it); for an existing file it cannot reuse, the rank writes a
     temporary replacement, reported with its results; then files.sync(). Ranks never open
     LMDB, so the design holds on a shared
     filesystem where LMDB cannot be shared. Non-tensor values are encoded
     from the planner's ORIGINAL objects as msgpack with type tags (store/values.pack); only
     an object msgpack cannot encode is kept as the planner's pickled bytes, tagged as such.
     WriteResults carry chunk keys and encoded values back to the coordinator.
  3. finish, coordinator only, called by DCP only when every rank succeeded: adopt every
     reported chunk file into the session (indexed at commit; a key the index holds keeps its
     record and file, and a replacement takes an existing file's place only when the index
     does not hold that key), write the manifest nodes (a
     commit node, value nodes, one tensor node per shard: the store's own node kinds, so gc,
     verify, `cas show`, Store.tensors and Store.load work unchanged), then session.commit:
     one LMDB transaction indexes the objects and adds the checkpoint record. metadata's
     storage_data becomes a tiny summary, because DCP broadcasts it to every rank.
  If any rank fails, DCP never calls finish: nothing is committed and earlier checkpoints are
  untouched. DCP has no failure hook, so the barrier lease ends when the writer is aborted:
  by cas.store.dcp.save (which also turns DCP's CheckpointException, a BaseException, into a
  CasError), by abort() (do call it when a direct dcp.save or an async_save future fails), by
  the writer's next save, or by a finalizer when the writer is dropped. A coordinator that
  dies leaves a lease that gc's reap_dead_leases ends (same host); a dead rank leaves only
  unindexed chunk files, which gc sweeps.

Writers and readers take a path or an open Store (py-lmdb refuses to open one store's index
twice in a process, so a process that already has the store open lends it). They pickle
without their open handles, for DCP's process-based async executor.

Loading (CasReader): every rank opens the store read-only, reads the manifest and rebuilds
DCP's Metadata from plain msgpack values (read_metadata); read_data decodes only the chunks
that hold the rows it needs, verifying each chunk's hash, and copies the requested block into
the planner's tensors. Loading thus needs the index readable on every rank (one host, or a
store copied to each node). Values go back into the planner's state dict directly (int
dict keys of the target kept); planner.load_bytes, which unpickles, runs only for values saved
as pickle and only with CasReader(..., allow_pickle=True). Nothing is pickled into the store
(DCP's collectives do pickle plans and results between ranks, in memory, as always).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import io
import os
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cas import faults
from cas.codecs import CodecPolicy, parse_header
from cas.errors import CasError, CheckpointNotFoundError, CorruptionError, MissingObjectError
from cas.hashing import hash_bytes
from cas.index import WHERE_FILE
from cas.localfs import LocalBackend
from cas.objectfiles import FileObjects
from cas.objectstore import MAX_CHAIN_DECODE, WriteSession, decode_chain, last_below

from . import dcp_bases
from . import layout as L
from . import pipeline
from . import tensors as T
from .registry import Checkpoint, add_change, exists_error
from .store import (DEFAULT_MAX_CHAIN, DELTA_MIN_BYTES, Store, _checked_delta_memory, _checked_max_chain, _checked_meta,
                    _checked_metrics)
from .tree import Ref, TensorLeaf, chunk_spans, commit_node, parse_node
from .values import pack, unpack

DCP_FORMAT = 1
DCP_VERSION = "1.0.0"  # DCP's own metadata version (FileSystemWriter writes the same)
BARRIER_PURPOSE = "barrier:dcp step {step}"  # cas.gc.collect.BARRIER_PREFIX: gc sweeps wait for it
WRITE_WINDOW_BYTES = 256 << 20  # tensor bytes a rank holds views or copies of at once
READ_WINDOW_BYTES = 256 << 20  # decoded chunk bytes a rank holds at once while loading
HEADER_BYTES = 64  # enough for any object header (cas.codecs), a delta's base key included
ABSENT, REUSABLE, REPLACE = "absent", "reusable", "replace"  # a rank's view of an existing object file
REPLACEMENTS = "replacements"  # in a tensor's WriteResult: {chunk key: temporary file name}


class DistributedCheckpointError(CasError):
    """A DCP save or load failed on some rank (or its process group broke). `failures` maps each
    failing rank to its exception, when DCP reported them."""

    def __init__(self, message: str, failures: dict | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


@dataclass(frozen=True)
class SavedCheckpoint:
    """What every rank learns about a committed DCP save (kept small: DCP broadcasts it)."""

    step: int
    id: str
    logical_bytes: int
    new_bytes: int

    def to_storage_data(self) -> dict:
        return {"cas": DCP_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_storage_data(cls, data) -> "SavedCheckpoint":
        if not isinstance(data, dict) or data.get("cas") != DCP_FORMAT:
            raise CasError("DCP returned metadata that no CasWriter committed")
        return cls(data["step"], data["id"], data["logical_bytes"], data["new_bytes"])


# --- rank side: chunks and values -----------------------------------------------------------
class _RankObjects:
    """What a rank writes through: the store's object files, never its index. Dedup is by file
    existence, which the coordinator's barrier lease makes safe against gc: a file under its
    final name is complete (written, fsynced, then given its name). A full object is reused; a
    delta only when the coordinator confirmed it stored (`confirmed`: it is indexed with its base
    edge and held), since it may be an unindexed leftover whose base is gone. A rank never
    changes an existing file, which may be indexed (other checkpoints decode through it): for
    any other existing file it writes a replacement under a temporary name (`replacements`),
    which the coordinator puts in place at the commit only if the index does not hold the key."""

    def __init__(self, path: str, *, compress: bool, level: int, workers: int) -> None:
        layout = L.Layout(path)
        self.config = L.read_config(layout)
        self.files = FileObjects(LocalBackend(layout.root))  # the store's folder, no index
        self.codec = CodecPolicy(compress=compress, level=level)
        self.workers = workers
        self._seen: set[bytes] = set()
        self._lock = threading.Lock()
        self.confirmed: dict[bytes, int] = {}
        self.below: dict[bytes, set] = {}  # confirmed delta key -> the keys below it (no cycles)
        self.written: dict[bytes, bytes] = {}  # key -> base key of each delta this rank wrote
        self.replacements: dict[bytes, str] = {}  # key -> temporary file name, for the coordinator

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def put_chunk(self, view: np.ndarray, group: int, base: tuple | None = None) -> bytes:
        """Hash one chunk and store it unless a usable file of it exists; returns its key.
        `base` = (key, bytes, depth, below) of a confirmed stored chunk it may be coded against
        as a delta (below: (its own base's key, that base's bytes), for a `linear` delta, used
        when the stored chunk's header still names that base). Deltas written go to `written`."""
        key = hash_bytes(view)
        with self._lock:
            known = key in self._seen
            self._seen.add(key)
        standing = REUSABLE if known else self._standing(key)
        if standing == REUSABLE:
            return key
        if base is not None and (base[0] == key or key in self.below.get(base[0], ())):
            base = None  # its file is missing or unusable, and the base is it or a delta of it: whole
        below = None
        if base is not None and base[1] is None:  # a chain root or a seeded base: decode its files
            base = self._decoded(base[0], view.nbytes)
            below = base[3] if base is not None else None
        elif base is not None and base[3] is not None and self._header_base(base[0]) == base[3][0]:
            below = base[3][1]
        enc = self.codec.encode(view, group, base[:2] if base else None, below)
        staged = self.files.stage(key, enc.parts, fsync=True)
        placed = standing == ABSENT and self.files.place_new(staged)
        with self._lock:
            if not placed:  # a file holds the name (or appeared meanwhile): the coordinator decides
                self.replacements[key] = staged.token
            if enc.base is not None:
                self.written[key] = enc.base
        return key

    def _header_base(self, key: bytes) -> bytes | None:
        try:
            return parse_header(self.files.head(key, HEADER_BYTES), key=key).base
        except CasError:
            return None

    def _decoded(self, key: bytes, nbytes: int) -> tuple | None:
        """(key, raw bytes, 0, its base's raw bytes or None) of an object, its chain of bases
        followed through the headers of their files and every level hash-checked; None when that
        cannot be done (a base in a pack, a damaged file: the chunk is then stored whole; damage
        is verify's to report)."""
        try:
            chain, blobs = [key], [self.files.get(key)]
            while (base := parse_header(blobs[-1], key=chain[-1]).base) is not None:
                if len(chain) > MAX_CHAIN_DECODE:
                    return None
                chain.append(base)
                blobs.append(self.files.get(base))
            blob_of = dict(zip(chain, blobs))
            raw = decode_chain(chain, blob_of.__getitem__, pipeline.root_buffer(nbytes), check_each=True)
            return key, raw, 0, last_below(nbytes) if len(chain) > 1 else None
        except CasError:
            return None

    def _standing(self, key: bytes) -> str:
        """ABSENT (no file), REUSABLE (a full object, or a delta the coordinator confirmed), or
        REPLACE (a delta of unknown standing, a damaged file, one of another object format)."""
        try:
            head = parse_header(self.files.head(key, HEADER_BYTES), key=key)
        except MissingObjectError:
            return ABSENT
        except CasError:
            return REPLACE
        return REUSABLE if head.base is None or key in self.confirmed else REPLACE

    def sync(self) -> None:
        self.files.sync()


@dataclass
class _TensorJob:
    """One tensor item of a rank's plan: its bytes and where each chunk's key goes."""

    position: int  # in the plan, which is the order of the WriteResults
    item: WriteItem
    data: np.ndarray
    skew: int
    group: int
    keys: list
    shard: tuple | None = None  # its delta identity (dcp_bases.shard_id) when deltas may code it


def global_skew(offsets, sizes, global_size, element_size: int, chunk: int) -> int:
    """Where a shard's first byte falls on the global chunk grid. Only a shard made of whole
    rows (sharded along dim 0 alone) is one contiguous run of the global tensor's bytes; any
    other shard starts its own grid (skew 0)."""
    if len(global_size) == 0 or list(sizes[1:]) != list(global_size[1:]):
        return 0
    row_bytes = element_size
    for d in global_size[1:]:
        row_bytes *= d
    return (offsets[0] * row_bytes) % chunk


@functools.lru_cache(maxsize=None)
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _group_of(dtype: torch.dtype) -> int:
    return T.group_size(dtype) if T.is_floating(dtype) else 1


def _tensor_job(position: int, item: WriteItem, planner: SavePlanner, chunk: int) -> _TensorJob:
    """Resolve one tensor item to its bytes, checking it is what the plan says."""
    fqn = item.index.fqn
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise CasError(f"the planner resolved tensor item {fqn!r} to a {type(tensor).__name__}")
    reason = T.unsupported_tensor_reason(tensor)
    if reason:
        raise CasError(f"cannot store {reason} at {fqn!r}")
    td = item.tensor_data
    if list(tensor.shape) != list(td.chunk.sizes):
        raise CasError(f"the planner resolved {fqn!r} at {list(td.chunk.offsets)} to shape {list(tensor.shape)}, "
                       f"the plan says {list(td.chunk.sizes)}")
    skew = global_skew(td.chunk.offsets, td.chunk.sizes, td.size, tensor.element_size(), chunk)
    data = T.torch_bytes(tensor)
    shard = dcp_bases.shard_id(fqn, td.chunk.offsets, td.chunk.sizes, tensor.dtype) \
        if T.is_floating(tensor.dtype) and data.size >= DELTA_MIN_BYTES else None
    return _TensorJob(position, item, data, skew, _group_of(tensor.dtype), [], shard)


def _write_tensor_jobs(jobs: list[_TensorJob], objects: _RankObjects, pool: ThreadPoolExecutor,
                       deltas: dcp_bases.RankDeltas | None = None) -> None:
    """Hash and store every chunk of `jobs`, filling each job's keys in order; with `deltas`,
    a chunk may be coded against the rank's previous save of the same shard."""
    work = []
    for job in jobs:
        spans = list(chunk_spans(job.data.size, objects.chunk_size, job.skew))
        job.keys = [None] * len(spans)
        work.extend((job, i, s, e) for i, (s, e) in enumerate(spans))

    def one(task) -> None:
        job, i, start, end = task
        base = deltas.base(job.shard, job.skew, job.data.size, i, start, end) if deltas is not None else None
        job.keys[i] = objects.put_chunk(job.data[start:end], job.group, base)

    for _ in pool.map(one, work):
        pass


def _tensor_result(job: _TensorJob, replacements: dict[bytes, str]) -> WriteResult:
    data = {"chunks": job.keys, "skew": job.skew}
    replaced = {key: replacements[key] for key in job.keys if key in replacements}
    if replaced:
        data[REPLACEMENTS] = replaced
    return WriteResult(index=job.item.index, size_in_bytes=int(job.data.size), storage_data=data)


def _original_object(planner: SavePlanner, index: MetadataIndex) -> tuple[bool, Any]:
    """The object the user put in the state (not the planner's torch.save bytes), if the planner
    lets us see it: DefaultSavePlanner and its subclasses keep the flattened state dict."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return True, lookup(index)
    state = getattr(planner, "state_dict", None)
    if isinstance(state, Mapping) and index.fqn in state:
        return True, state[index.fqn]
    return False, None


def _value_result(item: WriteItem, planner: SavePlanner) -> WriteResult:
    """Encode a non-tensor value as msgpack; only what msgpack cannot hold stays pickled."""
    found, obj = _original_object(planner, item.index)
    if found:
        try:
            packed = pack(obj)
            return WriteResult(index=item.index, size_in_bytes=len(packed), storage_data={"msgpack": packed})
        except (TypeError, ValueError, OverflowError):
            pass
    data = planner.resolve_data(item)
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    warnings.warn(f"cas: value {item.index.fqn!r} cannot be stored as plain data; it is kept as the planner's "
                  "pickled bytes, and loading it will need CasReader(..., allow_pickle=True)", stacklevel=2)
    return WriteResult(index=item.index, size_in_bytes=len(raw), storage_data={"pickle": raw})


def write_rank_items(plan: SavePlan, planner: SavePlanner, objects: _RankObjects,
                     deltas: dcp_bases.RankDeltas | None = None) -> list[WriteResult]:
    """Every item of this rank's plan: tensor chunks to files (in parallel), values encoded;
    with `deltas`, floating-point shards coded against this rank's previous save and kept."""
    results: list[WriteResult | None] = [None] * len(plan.items)
    for n, item in enumerate(plan.items):
        if item.type == WriteItemType.BYTE_IO:
            results[n] = _value_result(item, planner)
    jobs = (_tensor_job(n, item, planner, objects.chunk_size) for n, item in enumerate(plan.items)
            if item.type != WriteItemType.BYTE_IO)
    with ThreadPoolExecutor(max_workers=objects.workers, thread_name_prefix="cas-dcp") as pool:
        for batch in pipeline.batches(jobs, lambda job: job.data.size, WRITE_WINDOW_BYTES):  # bounds host copies
            _write_tensor_jobs(batch, objects, pool, deltas)
            for job in batch:
                results[job.position] = _tensor_result(job, objects.replacements)
                if deltas is not None and job.shard is not None:
                    deltas.keep(job.shard, job.data, job.skew, job.keys,
                                list(chunk_spans(job.data.size, objects.chunk_size, job.skew)), objects.written)
    return results


# --- coordinator side: the manifest -----------------------------------------------------------
class _Nodes:
    """Manifest nodes of one save, deduplicated by key."""

    def __init__(self) -> None:
        self.blobs: dict[bytes, bytes] = {}

    def add(self, data: bytes) -> bytes:
        key = hash_bytes(data)
        self.blobs[key] = data
        return key

    def emit(self, node: dict) -> Ref:
        return Ref(self.add(pack(node)))


@dataclass
class _Manifest:
    tree: Ref
    nodes: _Nodes
    chunk_keys: list[bytes]
    logical_bytes: int
    sharding: dict
    replacements: dict[bytes, set[str]]  # chunk key -> ranks' replacement files in tmp/ (_RankObjects)


def _results_by_index(results: list[list[WriteResult]]) -> dict[MetadataIndex, Any]:
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


def _shard_node(fqn: str, dtype_name: str, chunk: ChunkStorageMetadata, data, chunk_size: int) -> dict:
    """The tensor node of one stored shard, in TensorLeaf's format."""
    if not (isinstance(data, dict) and isinstance(data.get("chunks"), list)):
        raise CasError(f"no rank reported the chunks of {fqn!r} at {list(chunk.offsets)}")
    sizes = [int(d) for d in chunk.sizes]
    nbytes = T.nbytes_of(_element_size(T.torch_dtype(dtype_name)), sizes)
    leaf = TensorLeaf(fqn, "torch", dtype_name, sizes, nbytes, 1, None, chunk_size, int(data["skew"]),
                      list(data["chunks"]))
    expected = len(list(chunk_spans(nbytes, chunk_size, leaf.skew)))
    if len(leaf.chunks) != expected:
        raise CasError(f"a rank reported {len(leaf.chunks)} chunks for {fqn!r} at {sizes}, expected {expected}")
    return leaf.node()


def sharding_summary(size, chunks: list[ChunkStorageMetadata]) -> str:
    """A few characters per tensor for `cas show`: "whole", "dim0/2", or "6 blocks"."""
    if len(chunks) == 1 and list(chunks[0].sizes) == list(size):
        return "whole"
    split = {d for c in chunks for d in range(len(size)) if c.sizes[d] != size[d]}
    if len(split) == 1:
        return f"dim{split.pop()}/{len(chunks)}"
    return f"{len(chunks)} blocks"


def _value_entry(fqn: str, data) -> dict:
    if isinstance(data, dict) and "msgpack" in data:
        return {"v": unpack(data["msgpack"], what=f"value {fqn!r}")}
    if isinstance(data, dict) and "pickle" in data:
        return {"pickle": bytes(data["pickle"])}
    raise CasError(f"no rank reported the value {fqn!r}")


def _planner_data(metadata: Metadata):
    try:
        pack(metadata.planner_data)
    except (TypeError, ValueError, OverflowError):
        raise CasError("the save planner's planner_data is not plain data (str, numbers, lists, tuples, dicts); "
                       "it cannot be stored without pickle") from None
    return metadata.planner_data


def _tensor_item(fqn: str, md: TensorStorageMetadata) -> dict:
    """DCP's metadata of one tensor as plain values."""
    dtype_name = T.TORCH_DTYPE_NAMES.get(md.properties.dtype)
    if dtype_name is None:
        raise CasError(f"cannot store tensor dtype {md.properties.dtype} at {fqn!r}")
    return {"t": "tensor", "dtype": dtype_name, "requires_grad": bool(md.properties.requires_grad),
            "size": list(md.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}


def build_manifest(metadata: Metadata, results: list[list[WriteResult]], chunk_size: int,
                   files: FileObjects) -> _Manifest:
    """The state tree of a DCP checkpoint: a root value node referring to a metadata node (DCP's
    Metadata as plain values), a tensors node ({fqn: [tensor node per stored chunk]}) and a values
    node ({fqn: {"v": value} or {"pickle": bytes}}). `files` checks the ranks' replacement files."""
    reported = _results_by_index(results)
    nodes = _Nodes()
    items, shards, values, sharding = {}, {}, {}, {}
    keys: list[bytes] = []
    replacements: dict[bytes, set[str]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"t": "bytes"}
            values[fqn] = _value_entry(fqn, reported.get(MetadataIndex(fqn)))
            continue
        items[fqn] = _tensor_item(fqn, md)
        shard_nodes = [_shard_node(fqn, items[fqn]["dtype"], c, reported.get(MetadataIndex(fqn, c.offsets)),
                                   chunk_size) for c in md.chunks]
        keys.extend(k for node in shard_nodes for k in node["chunks"])
        for c in md.chunks:
            for key, name in _replacements(fqn, reported.get(MetadataIndex(fqn, c.offsets)), files).items():
                replacements.setdefault(key, set()).add(name)
        shards[fqn] = [nodes.emit(node) for node in shard_nodes]
        sharding[fqn] = sharding_summary(md.size, md.chunks)
    logical = sum(T.nbytes_of(_element_size(md.properties.dtype), list(md.size))
                  for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))
    plain = {"items": items, "planner_data": _planner_data(metadata), "version": metadata.version or DCP_VERSION}
    root = {"dcp": {"format": DCP_FORMAT, "world_size": len(results)},
            "metadata": nodes.emit({"k": "value", "v": plain}),
            "tensors": nodes.emit({"k": "value", "v": shards}),
            "values": nodes.emit({"k": "value", "v": values})}
    return _Manifest(nodes.emit({"k": "value", "v": root}), nodes, list(dict.fromkeys(keys)), logical, sharding,
                     replacements)


def _replacements(fqn: str, data, files: FileObjects) -> dict[bytes, str]:
    """A shard's {chunk key: staged token} of replacement files, each token checked to be one a
    rank's FileObjects.stage gives for that key (the backend's staged(): for a local store, a
    plain name in its tmp folder)."""
    given = data.get(REPLACEMENTS, {}) if isinstance(data, dict) else {}
    if not isinstance(given, dict):
        raise CasError(f"a rank reported malformed replacement files for {fqn!r}")
    for key, name in given.items():
        try:
            if not (isinstance(key, bytes) and len(key) == 32 and isinstance(name, str)):
                raise CasError("malformed")
            files.staged(key, name)
        except CasError:
            raise CasError(f"a rank reported a replacement file {name!r} that is not one of its temporary files, "
                           f"for {fqn!r}") from None
    return given


class _PendingCommit:
    """The coordinator's store and barrier session between set-up and finish. Kept apart from
    the writer so that a finalizer can release it when a failed writer is dropped."""

    def __init__(self, store: Store, session: WriteSession, created: float, owns_store: bool) -> None:
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


def _latest_shards(store: Store) -> dict:
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
        shard = dcp_bases.shard_id(item.index.fqn, td.chunk.offsets, td.chunk.sizes, td.properties.dtype)
        out[shard] = (node["skew"], node["nbytes"], list(node["chunks"]))
    return out


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


def _adopt_chunks(session: WriteSession, manifest: _Manifest) -> None:
    """Index the chunk files the ranks reported (at commit). A key the index holds keeps its
    record and file (in a pack too: a rank's file of it is left to gc); a rank's replacement
    file takes the place of an unindexed one (WriteSession.adopt)."""
    objects = session.store.files
    for key in manifest.chunk_keys:
        staged = [objects.staged(key, token) for token in sorted(manifest.replacements.get(key, ()))]
        session.adopt(key, staged[0] if staged else None)
        objects.discard(staged[1:])  # several ranks replaced the same file


# --- the writer ------------------------------------------------------------------------------
def _store_and_path(target: str | os.PathLike | Store) -> tuple[Store | None, str]:
    """A writer or reader takes a path, or the caller's open Store: one process can hold only
    one LMDB environment per store, so a process that has the store open must lend it."""
    if isinstance(target, Store):
        return target, target.path
    return None, os.path.abspath(os.fspath(target))


@contextmanager
def _opened(given: Store | None, path: str, **options) -> Iterator[Store]:
    """The caller's store as is, or one opened here and closed on exit."""
    if given is not None:
        yield given
        return
    with Store(path, **options) as store:
        yield store


def _same_store(path: str, checkpoint_id) -> bool:
    try:
        return os.path.abspath(os.fspath(checkpoint_id)) == path
    except TypeError:
        return False


class CasWriter(StorageWriter):
    """A DCP StorageWriter that saves checkpoint `step` into the cas store at `path`.

    Options: milestone, metrics, meta (as Store.save); chunk_size (only when the store is
    created here); compress, compression_level; workers (hashing and encoding threads per rank);
    delta, max_chain, delta_memory (as cas.open: each rank codes changed floating-point chunks
    against its own previous save, which it keeps in host memory up to delta_memory bytes and
    reads back from the store's files beyond; see store/dcp_bases.py).
    After a failed direct dcp.save, call abort() or drop the writer to end its barrier lease.
    """

    def __init__(self, path: str | os.PathLike | Store, *, step: int, milestone: bool = False,
                 metrics: dict | None = None, meta: dict | None = None, chunk_size: int | None = None,
                 compress: bool = True, compression_level: int = 1, workers: int | None = None,
                 delta: bool = False, max_chain: int = DEFAULT_MAX_CHAIN, delta_memory: int | None = None) -> None:
        super().__init__()
        if type(step) is not int:
            raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
        self._store, self.path = _store_and_path(path)
        self.step = step
        self.milestone = bool(milestone)
        self.metrics = _checked_metrics(metrics)
        self.meta = _checked_meta(meta)
        if "dcp" in self.meta:
            raise CasError('meta key "dcp" is reserved for the world size and sharding of a DCP save')
        self.chunk_size = chunk_size
        self.compress = compress
        self.compression_level = compression_level
        self.workers = workers or min(os.cpu_count() or 2, 8)
        self.delta = bool(delta)
        self.max_chain = _checked_max_chain(max_chain)
        self.delta_memory = _checked_delta_memory(delta_memory)
        self.is_coordinator = False
        self.checkpoint: Checkpoint | None = None  # on the coordinator, once committed
        self._pending: _PendingCommit | None = None
        self._finalizer: weakref.finalize | None = None

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
                and not _same_store(self.path, checkpoint_id):
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
        store = self._store or Store(self.path, chunk_size=self.chunk_size, compress=self.compress,
                                     compression_level=self.compression_level, workers=self.workers)
        try:
            if store.exists(self.step):
                raise exists_error(self.step)
            session = store.objects.session(BARRIER_PURPOSE.format(step=self.step))
        except BaseException:
            if owns:
                store.close()
            raise
        self._pending = pending = _PendingCommit(store, session, time.time(), owns)
        self._finalizer = weakref.finalize(self, pending.release)

    # -- planning --
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.delta:
            return plan
        return dataclasses.replace(plan, storage_data=dcp_bases.proposal(self.path))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """With deltas: hold each rank's proposed bases and say which are stored (dcp_bases)."""
        if not self.delta or self._pending is None:
            return plans
        session = self._pending.session
        latest = functools.cache(functools.partial(_latest_shards, self._pending.store))
        return [dataclasses.replace(plan, storage_data=dcp_bases.confirm(
                    plan.storage_data, self.step, self.max_chain, session.hold, session.depth,
                    functools.partial(_readable_roots, session), functools.partial(_seed, latest, plan),
                    functools.partial(_chains_below, session)))
                for plan in plans]

    # -- every rank --
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        faults.point("dcp.write_data")
        objects = _RankObjects(self.path, compress=self.compress, level=self.compression_level,
                               workers=self.workers)
        deltas = None
        if self.delta:
            if not dcp_bases.answers(plan.storage_data, self.step):
                warnings.warn(f"cas: the DCP plan of step {self.step} carries no confirmation of this rank's delta "
                              "bases (a plan cached by the planner, enable_plan_caching?): its chunks are written "
                              "whole", stacklevel=2)
            objects.confirmed, roots = dcp_bases.confirmed(plan.storage_data, self.step)
            objects.below = dcp_bases.chains_below(plan.storage_data, self.step)
            # the coordinator seeds a rank whose own cache it could not confirm (a restart, a failed save)
            previous = dcp_bases.seeded_cache(plan.storage_data) or dcp_bases.cached(self.path)
            deltas = dcp_bases.RankDeltas(previous, objects.confirmed, roots, self.max_chain, self.delta_memory,
                                          objects.below)
            dcp_bases.replace(self.path, None)  # its buffers are overwritten as this save goes
        results = write_rank_items(plan, planner, objects, deltas)
        objects.sync()
        if deltas is not None:
            dcp_bases.replace(self.path, deltas.current)
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
        finally:
            self.abort()
        pending.store._after_commit(self.checkpoint)  # retention of a store opened with one, as after save()
        saved = SavedCheckpoint(self.step, self.checkpoint.id, self.checkpoint.logical_bytes,
                                self.checkpoint.new_bytes)
        metadata.storage_data = saved.to_storage_data()

    def _commit(self, pending: _PendingCommit, metadata: Metadata, results: list[list[WriteResult]]) -> Checkpoint:
        store, session = pending.store, pending.session
        manifest = build_manifest(metadata, results, store.chunk_size, store.objects.files)
        _adopt_chunks(session, manifest)
        meta = {**self.meta, "dcp": {"world_size": len(results), "sharding": manifest.sharding}}
        commit = commit_node(step=self.step, created=pending.created, milestone=self.milestone,
                             metrics=self.metrics, meta=meta, tree=manifest.tree,
                             logical_bytes=manifest.logical_bytes)
        commit_key = manifest.nodes.add(commit)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cas-dcp") as pool:
            pipeline.write_blobs(session, manifest.nodes.blobs, pool)
        faults.point("dcp.nodes_written")

        def add(txn) -> Checkpoint:
            ck = Checkpoint(step=self.step, id=commit_key.hex(),
                            created=_dt.datetime.fromtimestamp(pending.created, _dt.timezone.utc),
                            milestone=self.milestone, metrics=self.metrics, meta=meta,
                            logical_bytes=manifest.logical_bytes, new_bytes=session.new_bytes)
            seq = store.registry.commit(txn, "save", [add_change(ck, session.packs_written())])
            return dataclasses.replace(ck, seq=seq)

        return store.commit_session(session, add)


# --- loading ---------------------------------------------------------------------------------
@dataclass
class _Loaded:
    """A DCP checkpoint's manifest, read once per load."""

    checkpoint: Checkpoint
    metadata: Metadata
    shards: dict  # MetadataIndex(fqn, offsets) -> parsed tensor node
    values: dict  # fqn -> {"v": value} or {"pickle": bytes}


def read_manifest(given: Store | None, path: str, step: int | None) -> _Loaded:
    """Resolve the checkpoint and read its whole manifest; the index is open only meanwhile."""
    with _opened(given, path, create=False, readonly=True) as store:
        reader = store.reader(step)
        ck = reader.checkpoint
        root = reader.node(reader.commit()["tree"], "value", "")["v"]
        if not (isinstance(root, dict) and isinstance(root.get("dcp"), dict)):
            raise CasError(f"checkpoint step {ck.step} was not saved through DCP; load it with Store.load")
        if root["dcp"].get("format") != DCP_FORMAT:
            raise CorruptionError(f"DCP manifest format {root['dcp'].get('format')!r}, this cas reads {DCP_FORMAT}",
                                  step=ck.step)
        plain = reader.node(root.get("metadata"), "value", "metadata")["v"]
        shard_refs = reader.node(root.get("tensors"), "value", "tensors")["v"]
        values = reader.node(root.get("values"), "value", "values")["v"]
        try:
            metadata, shards = metadata_from_plain(
                plain, shard_refs, lambda ref, p: reader.node(ref, "tensor", p))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptionError(f"the DCP manifest is malformed ({type(exc).__name__}: {exc})", step=ck.step) from None
        if not isinstance(values, dict):
            raise CorruptionError("the DCP manifest's values are malformed", step=ck.step)
    metadata.storage_data = {"cas": DCP_FORMAT, "step": ck.step, "id": ck.id}
    return _Loaded(ck, metadata, shards, values)


def metadata_from_plain(plain: dict, shard_refs: dict, read_shard) -> tuple[Metadata, dict]:
    """Rebuild DCP's Metadata (and the tensor node of each stored chunk) from plain values."""
    sdm: dict = {}
    shards: dict = {}
    for fqn, item in plain["items"].items():
        if item["t"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        dtype = T.torch_dtype(item["dtype"])
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in item["chunks"]]
        refs = shard_refs[fqn]
        if len(refs) != len(chunks):
            raise ValueError(f"{fqn!r} lists {len(chunks)} chunks and {len(refs)} tensor nodes")
        for i, (chunk, ref) in enumerate(zip(chunks, refs)):
            node = read_shard(ref, f"tensors.{fqn}.{i}")
            if node["lib"] != "torch" or node["dtype"] != item["dtype"] or node["shape"] != list(chunk.sizes):
                raise ValueError(f"the tensor node of {fqn!r} at {list(chunk.offsets)} does not match its chunk")
            shards[MetadataIndex(fqn, chunk.offsets)] = node
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype, requires_grad=bool(item["requires_grad"])),
                                         torch.Size(item["size"]), chunks)
    return Metadata(sdm, planner_data=plain.get("planner_data"), version=plain.get("version")), shards


def _existing_key(container, part):
    """The key of `container` that a flattened path part names: DCP turns dict keys into str,
    so "1" names the int key 1 when the target dict has it."""
    if isinstance(container, Mapping) and part not in container and isinstance(part, str):
        try:
            number = int(part)
        except ValueError:
            return part
        if str(number) == part and number in container:
            return number
    return part


def _put(container, key, value) -> None:
    if isinstance(container, list):
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def set_path(root: dict, path: tuple, value) -> None:
    """Put `value` at a DCP object path in the user's state, creating missing containers, and
    keeping the target's own keys (int keys stay int)."""
    node = root
    for depth, part in enumerate(path):
        key = _existing_key(node, part)
        if depth == len(path) - 1:
            _put(node, key, value)
            return
        child = node.get(key) if isinstance(node, Mapping) else (node[key] if key < len(node) else None)
        if child is None:
            child = {} if isinstance(path[depth + 1], str) else []
            _put(node, key, child)
        node = child


def assign_value(planner: LoadPlanner, fqn: str, value) -> None:
    """Put a loaded value into the planner's state dict, as DefaultLoadPlanner.load_bytes would,
    without unpickling anything."""
    original = getattr(planner, "original_state_dict", None)
    mappings = getattr(planner, "mappings", None)
    if getattr(planner, "flatten_state_dict", False) and isinstance(original, dict) \
            and isinstance(mappings, Mapping) and fqn in mappings:
        set_path(original, tuple(mappings[fqn]), value)
        return
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        raise CasError(f"cannot put value {fqn!r} back: the load planner {type(planner).__name__} has no state dict")
    state[fqn] = value


@dataclass
class _Region:
    """One ReadItem's rows of a stored shard, decoded into `buffer` from the chunks it spans."""

    item: ReadItem
    node: dict
    buffer: np.ndarray
    start: int  # offset of the rows' first byte in buffer
    rows: int


def _region(item: ReadItem, node: dict) -> tuple[_Region, list]:
    """The chunks that hold the rows `item` needs (dim 0 of a stored shard is contiguous), and
    the decode jobs that fill them."""
    shape = node["shape"]
    esize = _element_size(T.torch_dtype(node["dtype"]))
    row_bytes = T.nbytes_of(esize, shape[1:]) if shape else esize
    first, rows = (item.storage_offsets[0], item.lengths[0]) if shape else (0, 1)
    lo, hi = first * row_bytes, (first + rows) * row_bytes
    spans = [(i, s, e) for i, (s, e) in enumerate(chunk_spans(node["nbytes"], node["chunk"], node["skew"]))
             if s < hi and e > lo]
    base = spans[0][1] if spans else lo
    buffer = np.empty((spans[-1][2] - base) if spans else 0, dtype=np.uint8)
    path = f"tensors.{item.storage_index.fqn}"
    jobs = [(path, node["chunks"][i], buffer[s - base:e - base], False) for i, s, e in spans]  # fresh buffers
    return _Region(item, node, buffer, lo - base, rows), jobs


def _apply(region: _Region, planner: LoadPlanner) -> None:
    """Copy the requested block of the decoded rows into the planner's tensor."""
    node, item = region.node, region.item
    dtype = T.torch_dtype(node["dtype"])
    esize = _element_size(dtype)
    shape = node["shape"]
    rows_shape = [region.rows, *shape[1:]] if shape else []
    nbytes = T.nbytes_of(esize, rows_shape)
    raw = region.buffer[region.start:region.start + nbytes]
    if region.start % esize:
        raw = raw.copy()
    block = torch.from_numpy(raw).view(dtype).reshape(rows_shape) if nbytes else torch.empty(rows_shape, dtype=dtype)
    for d in range(1, len(shape)):
        block = block.narrow(d, item.storage_offsets[d], item.lengths[d])
    dest = planner.resolve_tensor(item).detach()
    if list(dest.shape) != list(block.shape):
        raise CasError(f"{item.dest_index.fqn!r}: the planner's destination has shape {list(dest.shape)}, "
                       f"the stored block {list(block.shape)}")
    dest.copy_(block)
    planner.commit_tensor(item, dest)


def _regions(items: list[ReadItem], shards: dict) -> Iterator[tuple[_Region, list]]:
    for item in items:
        node = shards.get(item.storage_index)
        if node is None:
            raise CasError(f"the checkpoint holds no chunk of {item.storage_index.fqn!r} at "
                           f"{list(item.storage_index.offset or [])}")
        yield _region(item, node)


class CasReader(StorageReader):
    """A DCP StorageReader for checkpoint `step` (the latest when None) of the store at `path`.

    Values that were saved as pickle (msgpack could not encode them) load only with
    allow_pickle=True, which runs the unpickler: use it only for a store you trust."""

    def __init__(self, path: str | os.PathLike | Store, *, step: int | None = None, allow_pickle: bool = False,
                 workers: int | None = None) -> None:
        super().__init__()
        self._store, self.path = _store_and_path(path)
        self.step = step
        self.allow_pickle = allow_pickle
        self.workers = workers or min(os.cpu_count() or 2, 8)
        self.is_coordinator = False
        self.checkpoint: Checkpoint | None = None
        self.error: CasError | None = None  # why read_metadata failed, for cas.store.dcp.load
        self._loaded: _Loaded | None = None

    @property
    def checkpoint_id(self) -> str:
        return f"{self.path}@{'latest' if self.step is None else self.step}"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_store=None, _loaded=None)
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._loaded = None
        if checkpoint_id is not None and str(checkpoint_id) != self.checkpoint_id \
                and not _same_store(self.path, checkpoint_id):
            raise CasError(f"this CasReader reads {self.checkpoint_id}; checkpoint_id {checkpoint_id!r} names "
                           "something else (leave checkpoint_id out)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        if self._loaded is None:
            try:
                self._loaded = read_manifest(self._store, self.path, self.step)
            except CasError as exc:
                self.error = exc
                raise
            self.error = None
            self.checkpoint = self._loaded.checkpoint
        return self._loaded.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._loaded is None:
            raise CasError("CasReader.set_up_storage_reader before read_metadata")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data={"cas_checkpoint": self._loaded.checkpoint.id})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Every rank must read the same checkpoint: with step=None each resolved "latest" alone."""
        ids = {p.storage_data.get("cas_checkpoint") for p in plans if isinstance(p.storage_data, dict)}
        if len(ids) > 1:
            raise CasError(f"the ranks resolved different checkpoints of {self.path} (one was committed while "
                           "they read the latest); pass step= to load one for certain")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        loaded = self._loaded
        if loaded is None:
            raise CasError("CasReader.read_data before read_metadata")
        try:
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    self._read_value(item, planner, loaded)
            self._read_tensors([i for i in plan.items if i.type != LoadItemType.BYTE_IO], planner, loaded)
        finally:
            self._loaded = None  # the next load resolves its step afresh
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_value(self, item: ReadItem, planner: LoadPlanner, loaded: _Loaded) -> None:
        fqn = item.storage_index.fqn
        entry = loaded.values.get(fqn)
        if not isinstance(entry, dict):
            raise CorruptionError(f"the DCP manifest lacks value {fqn!r}", step=loaded.checkpoint.step)
        if "v" in entry:
            assign_value(planner, item.dest_index.fqn, entry["v"])
        elif not self.allow_pickle:
            raise CasError(f"value {fqn!r} of checkpoint step {loaded.checkpoint.step} was saved as pickle "
                           "(msgpack could not encode it); loading it runs the unpickler: pass "
                           "CasReader(..., allow_pickle=True) only for a store you trust")
        else:
            planner.load_bytes(item, io.BytesIO(bytes(entry["pickle"])))

    def _read_tensors(self, items: list[ReadItem], planner: LoadPlanner, loaded: _Loaded) -> None:
        if not items:
            return
        with _opened(self._store, self.path, create=False, readonly=True, workers=self.workers) as store, \
                ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="cas-dcp") as pool:
            for batch in pipeline.batches(_regions(items, loaded.shards), lambda r: r[0].buffer.size,
                                          READ_WINDOW_BYTES):
                try:
                    pipeline.read_tensor_chunks(store.objects, [job for _, jobs in batch for job in jobs], pool,
                                                window=4 * self.workers)
                except CorruptionError as exc:
                    raise exc.located(step=loaded.checkpoint.step) from None
                for region, _ in batch:
                    _apply(region, planner)


# --- wrappers that turn DCP's failures into CasErrors -----------------------------------------
def _converted(exc: CheckpointException, what: str) -> CasError:
    """One CasError for a CheckpointException: the first rank's CasError itself when a rank
    raised one (its class says what went wrong), else a DistributedCheckpointError naming all."""
    failures = sorted(exc.failures.items())
    for rank, (err, _) in failures:
        if isinstance(err, CasError):
            err.add_note(f"{what}: raised on rank {rank}")
            return err
    detail = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in failures)
    return DistributedCheckpointError(f"{what} failed ({detail})", {rank: err for rank, (err, _) in failures})


def save(state: dict, path: str | os.PathLike | Store, step: int, *, planner: SavePlanner | None = None,
         process_group=None, no_dist: bool = False, **options) -> SavedCheckpoint:
    """dcp.save through a CasWriter, on every rank. A failure on any rank raises a CasError on
    every rank (a direct dcp.save raises DCP's CheckpointException, a BaseException, instead)
    and commits nothing. `options` go to CasWriter (milestone, metrics, meta, chunk_size, ...)."""
    writer = CasWriter(path, step=step, **options)
    what = f"DCP save of step {step} into {writer.path}"
    try:
        metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group,
                            no_dist=no_dist)
    except CheckpointException as exc:
        raise _converted(exc, what) from None
    except CasError:
        raise
    except Exception as exc:  # a dead peer breaks the process group with a RuntimeError
        raise DistributedCheckpointError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        writer.abort()
    return SavedCheckpoint.from_storage_data(metadata.storage_data)


def load(state: dict, path: str | os.PathLike | Store, step: int | None = None, *, planner: LoadPlanner | None = None,
         process_group=None, no_dist: bool = False, allow_pickle: bool = False,
         workers: int | None = None) -> Checkpoint:
    """dcp.load through a CasReader (the latest checkpoint when `step` is None), in place, at
    any world size; returns the checkpoint loaded. A missing step is CheckpointNotFoundError and
    any other failure a CasError, on every rank."""
    reader = CasReader(path, step=step, allow_pickle=allow_pickle, workers=workers)
    what = f"DCP load of step {'latest' if step is None else step} from {reader.path}"
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        if reader.error is not None:  # this rank could not read the manifest: say why, exactly
            raise reader.error from None
        raise _converted(exc, what) from None
    except CasError:
        raise
    except Exception as exc:
        raise DistributedCheckpointError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    return reader.checkpoint
