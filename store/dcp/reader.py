"""Loading a DCP checkpoint (CasReader): every rank opens the store read-only, reads the
manifest and rebuilds DCP's Metadata from plain msgpack values (read_metadata); read_data decodes
only the chunks that hold the rows it needs, verifying each chunk's hash, and copies the requested
block into the planner's tensors. Values go back into the planner's state dict directly (int
dict keys of the target kept; an io.BytesIO saved as its bytes comes back as an io.BytesIO);
planner.load_bytes, which unpickles, runs only for values saved as pickle and only with
CasReader(..., allow_pickle=True)."""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from cas.errors import CasError, CorruptionError
from cas.pools import Pool

from .. import pipeline
from .. import tensors as T
from ..location import check_key, parse_target
from ..registry import Checkpoint
from ..store import CheckpointStore
from ..tree import chunk_spans
from .failures import as_cas_errors
from .manifest import DCP_FORMAT, element_size
from .rank import BYTESIO

READ_WINDOW_BYTES = 256 << 20  # decoded chunk bytes a rank holds at once while loading


# --- the store a writer or reader works on ---------------------------------------------------
def store_and_path(target: str | os.PathLike | CheckpointStore) -> tuple[CheckpointStore | None, str]:
    """A writer or reader takes a path, file://PATH or s3://BUCKET/PREFIX (store/location.py),
    or the caller's open CheckpointStore: one process can hold only one LMDB environment per
    store, so a process that has the store open must lend it."""
    if isinstance(target, CheckpointStore):
        return target, target.path
    return None, parse_target(target)[1]


def in_bucket(path: str) -> bool:
    """Whether the store a writer or reader names (its store_and_path) lives in a bucket."""
    return parse_target(path)[0] == "s3"


@contextmanager
def opened(given: CheckpointStore | None, path: str, **options) -> Iterator[CheckpointStore]:
    """The caller's store as is, or one opened here and closed on exit."""
    if given is not None:
        yield given
        return
    with CheckpointStore(path, **options) as store:
        yield store


def same_store(path: str, checkpoint_id) -> bool:
    """Whether a checkpoint_id DCP passes to reset() names the store at `path`."""
    try:
        return parse_target(checkpoint_id)[1] == path
    except (TypeError, CasError):
        return False


# --- the manifest, read back ----------------------------------------------------------------
@dataclass
class Loaded:
    """A DCP checkpoint's manifest, read once per load."""

    checkpoint: Checkpoint
    metadata: Metadata
    shards: dict  # MetadataIndex(fqn, offsets) -> parsed tensor node
    values: dict  # fqn -> {"v": value} or {"pickle": bytes}


def read_manifest(given: CheckpointStore | None, path: str, step: int | None, cache_dir: str | None = None,
                  key=None) -> Loaded:
    """Resolve the checkpoint and read its whole manifest; the index is open only meanwhile
    (a bucket store's cache in `cache_dir`, see StoreOptions)."""
    with opened(given, path, create=False, readonly=True, cache_dir=cache_dir, key=key) as store:
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
    return Loaded(ck, metadata, shards, values)


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


def bytesio_value(entry: dict, fqn: str, step: int) -> io.BytesIO:
    """The io.BytesIO a value entry of rank.bytesio_entry holds, at its saved position (as DCP's
    own unpickling of a BytesIO gives it back); no pickle involved."""
    data, pos = entry.get(BYTESIO), entry.get("pos")
    if not isinstance(data, bytes) or type(pos) is not int or not 0 <= pos <= len(data):
        raise CorruptionError(f"the BytesIO value {fqn!r} is malformed", step=step)
    buffer = io.BytesIO(data)
    buffer.seek(pos)
    return buffer


def planner_mappings(metadata: Metadata) -> dict | None:
    """DefaultSavePlanner's planner_data: each flattened name's path in the original state
    (str dict keys, int list positions); None when the planner left none that looks like it."""
    data = metadata.planner_data
    if not isinstance(data, dict):
        return None
    for path in data.values():
        if not (isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path)):
            return None
    return data


def state_dict(store: CheckpointStore, step: int | None = None) -> dict:
    """Checkpoint `step` (a DCP save; the latest when None) as one state dict: whole tensors and
    values, nested as the saving planner flattened them (what dcp_to_torch_save makes of a DCP
    folder), loaded by dcp.load in this process. A value saved as pickle is refused: nothing is
    unpickled."""
    loaded = read_manifest(store, store.path, step)
    pickled = [fqn for fqn, entry in loaded.values.items() if isinstance(entry, dict) and "pickle" in entry]
    if pickled:
        raise CasError(f"checkpoint step {loaded.checkpoint.step} holds values saved as pickle ({', '.join(pickled)}); "
                       "they are not unpickled here: load them with CasReader(..., allow_pickle=True) from a store "
                       "you trust")
    mappings = planner_mappings(loaded.metadata) or {}
    target: dict = {}
    for fqn, md in loaded.metadata.state_dict_metadata.items():
        value = torch.empty(list(md.size), dtype=md.properties.dtype, device="cpu") if isinstance(md, TensorStorageMetadata) \
            else None  # a placeholder the loaded value replaces
        set_path(target, tuple(mappings.get(fqn, (fqn,))), value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as asked
        load(target, store, loaded.checkpoint.step, no_dist=True)
    return target


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
    esize = element_size(T.torch_dtype(node["dtype"]))
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
    esize = element_size(dtype)
    shape = node["shape"]
    rows_shape = [region.rows, *shape[1:]] if shape else []
    nbytes = T.nbytes_of(esize, rows_shape)
    raw = region.buffer[region.start:region.start + nbytes]
    if region.start % esize:
        raw = raw.copy()
    block = torch.from_numpy(raw).view(dtype).reshape(rows_shape) if nbytes else torch.empty(rows_shape, dtype=dtype, device="cpu")
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
    allow_pickle=True, which runs the unpickler: use it only for a store you trust. cache_dir:
    where this host keeps a bucket store's cache (StoreOptions.cache_dir); every rank reads the
    bucket itself, so no rank needs another's cache."""

    def __init__(self, path: str | os.PathLike | CheckpointStore, *, step: int | None = None, allow_pickle: bool = False,
                 workers: int | None = None, cache_dir: str | os.PathLike | None = None, key=None) -> None:
        super().__init__()
        self._store, self.path = store_and_path(path)
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.key = key  # an encrypted store's (StoreOptions.key)
        self.step = step
        self.allow_pickle = allow_pickle
        self.workers = workers or min(os.cpu_count() or 2, 8)
        self.is_coordinator = False
        self.checkpoint: Checkpoint | None = None
        self.error: CasError | None = None  # why read_metadata failed, for cas.store.dcp.load
        self._loaded: Loaded | None = None
        if self._store is None:  # a wrong or missing key said here, as a CasError (check_key)
            check_key(self.path, key)

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
                and not same_store(self.path, checkpoint_id):
            raise CasError(f"this CasReader reads {self.checkpoint_id}; checkpoint_id {checkpoint_id!r} names "
                           "something else (leave checkpoint_id out)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        if self._loaded is None:
            try:
                self._loaded = read_manifest(self._store, self.path, self.step, self.cache_dir, self.key)
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

    def _read_value(self, item: ReadItem, planner: LoadPlanner, loaded: Loaded) -> None:
        fqn = item.storage_index.fqn
        entry = loaded.values.get(fqn)
        if not isinstance(entry, dict):
            raise CorruptionError(f"the DCP manifest lacks value {fqn!r}", step=loaded.checkpoint.step)
        if "v" in entry:
            assign_value(planner, item.dest_index.fqn, entry["v"])
        elif BYTESIO in entry:
            assign_value(planner, item.dest_index.fqn, bytesio_value(entry, fqn, loaded.checkpoint.step))
        elif "pickle" not in entry:
            raise CorruptionError(f"value {fqn!r} has an entry of unknown kind {sorted(entry)} (written by a newer "
                                  "cas?)", step=loaded.checkpoint.step)
        elif not self.allow_pickle:
            raise CasError(f"value {fqn!r} of checkpoint step {loaded.checkpoint.step} was saved as pickle "
                           "(msgpack could not encode it); loading it runs the unpickler: pass "
                           "CasReader(..., allow_pickle=True) only for a store you trust")
        else:
            planner.load_bytes(item, io.BytesIO(bytes(entry["pickle"])))

    def _read_tensors(self, items: list[ReadItem], planner: LoadPlanner, loaded: Loaded) -> None:
        if not items:
            return
        with opened(self._store, self.path, create=False, readonly=True, workers=self.workers,
                    cache_dir=self.cache_dir, key=self.key) as store, \
                Pool(max_workers=self.workers, thread_name_prefix="cas-dcp") as pool:
            for batch in pipeline.batches(_regions(items, loaded.shards), lambda r: r[0].buffer.size,
                                          READ_WINDOW_BYTES):
                try:
                    pipeline.read_tensor_chunks(store.objects, [job for _, jobs in batch for job in jobs], pool,
                                                window=4 * self.workers)
                except CorruptionError as exc:
                    raise exc.located(step=loaded.checkpoint.step) from None
                for region, _ in batch:
                    _apply(region, planner)


def load(state: dict, path: str | os.PathLike | CheckpointStore, step: int | None = None, *, planner: LoadPlanner | None = None,
         process_group=None, no_dist: bool = False, allow_pickle: bool = False,
         workers: int | None = None, cache_dir: str | os.PathLike | None = None, key=None) -> Checkpoint:
    """dcp.load through a CasReader (the latest checkpoint when `step` is None), in place, at
    any world size; returns the checkpoint loaded. A missing step is CheckpointNotFoundError and
    any other failure a CasError, on every rank."""
    reader = CasReader(path, step=step, allow_pickle=allow_pickle, workers=workers, cache_dir=cache_dir, key=key)
    what = f"DCP load of step {'latest' if step is None else step} from {reader.path}"
    # a rank that could not read the manifest says why, exactly (reader.error)
    with as_cas_errors(what, lambda: reader.error):
        dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    return reader.checkpoint
