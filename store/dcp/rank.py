"""The rank side of a DCP save: every rank cuts its own tensor items into chunks on the global
byte grid, hashes them and writes the chunks the store lacks as object files (never through the
index, which ranks do not open), and encodes its values; the WriteResults carry the chunk keys,
the encoded values and any replacement files back to the coordinator (store/dcp/writer.py)."""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from cas.codecs import CodecPolicy, parse_header
from cas.errors import CasError, MissingObjectError
from cas.crypt import namer_of
from cas.localfs import LocalBackend
from cas.objectfiles import FileObjects
from cas.chains import decode_chain, last_below, walk_chain
from cas.pools import Pool

from .. import layout as L
from ..location import Location
from .. import pipeline
from .. import tensors as T
from ..bases import DELTA_MIN_BYTES, TensorBases
from ..tree import chunk_spans, group_of, plan
from ..values import pack
from . import bases

WRITE_WINDOW_BYTES = 256 << 20  # tensor bytes a rank holds views or copies of at once
HEADER_BYTES = 64  # enough for any object header (cas.codecs), a delta's base key included
ABSENT, REUSABLE, REPLACE = "absent", "reusable", "replace"  # a rank's view of an existing object file
REPLACEMENTS = "replacements"  # in a tensor's WriteResult: {chunk key: temporary file name}
BYTESIO = "bytesio"  # a value entry holding an io.BytesIO's bytes (with "pos", its position)


class RankObjects:
    """What a rank writes through: the store's object files, never its index. Dedup is by file
    existence, which the coordinator's barrier lease makes safe against gc: a file under its
    final name is complete (written, fsynced, then given its name). A full object is reused; a
    delta only when the coordinator confirmed it stored (`confirmed`: it is indexed with its base
    edge and held), since it may be an unindexed leftover whose base is gone. A rank never
    changes an existing file, which may be indexed (other checkpoints decode through it): for
    any other existing file it writes a replacement under a temporary name (`replacements`),
    which the coordinator puts in place at the commit only if the index does not hold the key."""

    def __init__(self, path: str, *, compress: bool, level: int, workers: int, key=None) -> None:
        layout = L.Layout(path)
        self.config = L.read_config(layout)
        where = Location("local", layout.root, LocalBackend(layout.root))
        where.unlock(self.config, key)  # an encrypted store: its files sealed, its names keyed
        self.files = FileObjects(where.backend)  # the store's folder, no index
        self.namer = namer_of(where.backend)
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
        key = self.namer.key(view)
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
        cannot be done (a base in a pack, a damaged file, a chain too deep: the chunk is then
        stored whole; damage is verify's to report)."""
        blobs: dict[bytes, object] = {}

        def base_of(k: bytes) -> bytes | None:
            blobs[k] = self.files.get(k)
            return parse_header(blobs[k], key=k).base

        try:
            chain = walk_chain([key], base_of)
            raw = decode_chain(chain, blobs.__getitem__, pipeline.root_buffer(nbytes), check_each=True,
                               namer=self.namer)
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
    shard: tuple | None = None  # its delta identity (bases.shard_id) when deltas may code it


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
    shard = bases.shard_id(fqn, td.chunk.offsets, td.chunk.sizes, tensor.dtype) \
        if T.is_floating(tensor.dtype) and data.size >= DELTA_MIN_BYTES else None
    return _TensorJob(position, item, data, skew, group_of(tensor.dtype), [], shard)


def _write_tensor_jobs(jobs: list[_TensorJob], objects: RankObjects, pool: ThreadPoolExecutor,
                       deltas: bases.RankDeltas | None = None) -> None:
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


def bytesio_entry(buffer: io.BytesIO) -> dict:
    """An io.BytesIO as plain data: its bytes and position. DCP carries non-tensor objects in
    BytesIO values (its end-to-end tests keep a torch.save'd list of losses in one); their bytes
    are the user's, so they are kept as bytes and never go through pickle (reader.bytesio_value)."""
    return {BYTESIO: buffer.getvalue(), "pos": buffer.tell()}


def _plain_as_it_is(obj) -> bool:
    """Whether a value is held as plain data exactly as it is, types included, by Store.save's
    own checks: msgpack packed a namedtuple or a torch.Size as a tuple, an IntEnum as an int, a
    bytearray as bytes, and a numpy datetime as a scalar no load reads (audit of stop 38)."""
    try:
        _, leaves = plan(obj, chunk_size=1 << 20)
    except (TypeError, ValueError, OverflowError):
        return False
    return not leaves


def _value_result(item: WriteItem, planner: SavePlanner) -> WriteResult:
    """Encode a non-tensor value as msgpack (an io.BytesIO as its bytes); only what msgpack
    cannot hold stays pickled."""
    found, obj = _original_object(planner, item.index)
    if found and isinstance(obj, io.BytesIO):
        entry = bytesio_entry(obj)
        return WriteResult(index=item.index, size_in_bytes=len(entry[BYTESIO]), storage_data=entry)
    if found and _plain_as_it_is(obj):
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


def write_rank_items(plan: SavePlan, planner: SavePlanner, objects: RankObjects,
                     deltas: bases.RankDeltas | None = None) -> list[WriteResult]:
    """Every item of this rank's plan: tensor chunks to files (in parallel), values encoded;
    with `deltas`, floating-point shards coded against this rank's previous save and kept."""
    results: list[WriteResult | None] = [None] * len(plan.items)
    for n, item in enumerate(plan.items):
        if item.type == WriteItemType.BYTE_IO:
            results[n] = _value_result(item, planner)
    jobs = (_tensor_job(n, item, planner, objects.chunk_size) for n, item in enumerate(plan.items)
            if item.type != WriteItemType.BYTE_IO)
    with Pool(max_workers=objects.workers, thread_name_prefix="cas-dcp") as pool:
        for batch in pipeline.batches(jobs, lambda job: job.data.size, WRITE_WINDOW_BYTES):  # bounds host copies
            _write_tensor_jobs(batch, objects, pool, deltas)
            for job in batch:
                results[job.position] = _tensor_result(job, objects.replacements)
            if deltas is not None:
                deltas.keep([(job.shard, TensorBases(job.data.size, objects.chunk_size, job.skew, job.keys),
                              (lambda data=job.data: data)) for job in batch if job.shard is not None],
                            objects.written)
    return results
