"""The checkpoint store: save, load, list, delete and verify checkpoints."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from cas import faults
from cas.codecs import CodecPolicy
from cas.errors import CasError, CheckpointNotFoundError, CorruptionError, StoreClosedError
from cas.hashing import hash_bytes
from cas.index import Index
from cas.objects import FileObjects
from cas.objectstore import DEFAULT_INLINE_MAX, ObjectStore

from . import layout as L
from . import pipeline, tensors
from .registry import TABLE as REGISTRY_TABLE
from .registry import Checkpoint, Registry, exists_error, step_key
from .tree import Ref, commit_node, encode_nodes, parse_node, plan, walk_value
from .values import pack
from .verify import VerifyReport, verify_checkpoints

DEFAULT_WINDOW_BYTES = 256 << 20


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
                 inline_max: int = DEFAULT_INLINE_MAX) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.layout = L.Layout(self.path)
        if not os.path.exists(self.layout.config):
            if not (create and not readonly and L.can_create(self.path)):
                L.read_config(self.layout)  # raises the precise NotAStoreError
            self._create(chunk_size or L.DEFAULT_CHUNK_SIZE)
        self.config = L.read_config(self.layout)
        if chunk_size is not None and chunk_size != self.config.chunk_size:
            raise CasError(f"the store at {self.path} was created with chunk_size {self.config.chunk_size}; "
                           f"it cannot be opened with {chunk_size} (leave chunk_size out)")
        self.readonly = readonly or not os.access(self.layout.index, os.W_OK)
        self.index = Index(self.layout.index, readonly=self.readonly, extra_tables=(REGISTRY_TABLE,))
        self.registry = Registry(self.index, self.path)
        self.objects = ObjectStore(self.index, FileObjects(self.layout.objects, self.layout.tmp),
                                   CodecPolicy(compress=compress, level=compression_level), inline_max)
        self.chunk_size = self.config.chunk_size
        self.window_bytes = window_bytes
        self._workers = workers or os.cpu_count() or 2
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="cas")
        self._closed = False
        self._lock = threading.Lock()

    def _create(self, chunk_size: int) -> None:
        L.check_chunk_size(chunk_size)
        os.makedirs(self.path, exist_ok=True)
        for folder in (self.layout.index, self.layout.objects, self.layout.tmp):
            os.makedirs(folder, exist_ok=True)
        Index(self.layout.index, create=True, extra_tables=(REGISTRY_TABLE,)).close()
        L.write_config(self.layout, chunk_size=chunk_size)

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.index.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"cas.Store({self.path!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.path} is closed")

    # --- save ---------------------------------------------------------------------------
    def save(self, state, *, step: int, milestone: bool = False, metrics: dict | None = None,
             meta: dict | None = None) -> Checkpoint:
        """Save `state` as checkpoint `step`. Nothing is visible until the commit, which happens
        only after every object it references is durable."""
        self._check_open()
        step_key(step)  # type-checks the step before any work
        metrics = _checked_metrics(metrics)
        meta = _checked_meta(meta)
        if self.exists(step):
            raise exists_error(step)
        skeleton, leaves = plan(state, chunk_size=self.chunk_size)
        created = time.time()
        faults.point("save.planned")
        with self.objects.session(f"save step {step}") as session:
            pipeline.write_tensors(session, leaves, self._pool, self.window_bytes)
            faults.point("save.chunks_written")
            root, nodes = encode_nodes(skeleton)
            logical = sum(leaf.nbytes for leaf in leaves)
            commit = commit_node(step=step, created=created, milestone=milestone, metrics=metrics,
                                 meta=meta, tree=root, logical_bytes=logical)
            commit_key = hash_bytes(commit)
            nodes[commit_key] = commit
            pipeline.write_blobs(session, nodes, self._pool)
            faults.point("save.nodes_written")

            def finish(txn) -> Checkpoint:
                ck = Checkpoint(step=step, id=commit_key.hex(),
                                created=_dt.datetime.fromtimestamp(created, _dt.timezone.utc),
                                milestone=milestone, metrics=metrics, meta=meta,
                                logical_bytes=logical, new_bytes=session.new_bytes)
                self.registry.add(txn, ck)
                return ck

            ck = session.commit(finish)
        faults.point("save.committed")
        self._after_commit(ck)
        return ck

    def _after_commit(self, ck: Checkpoint) -> None:
        """Called after every committed save; the public store applies retention here."""

    # --- load ---------------------------------------------------------------------------
    def load(self, step: int | None = None, *, keys=None, device: str | torch.device | None = None):
        """Load a checkpoint's state (the latest when `step` is None); with `keys`, only those
        top-level entries are read. Every byte is checked against its hash."""
        self._check_open()
        ck = self._resolve(step)
        root = self._node(ck.key, ck.step)["tree"]
        tree = self._node(root.key, ck.step)
        value = tree["v"] if tree["k"] == "value" else root
        if keys is not None:
            value = _select(value, keys, ck.step)
        jobs: list = []
        state = walk_value(value, lambda ref, path: self._materialize(ref, path, ck.step, jobs))
        try:
            pipeline.read_tensor_chunks(self.objects, jobs, self._pool, window=4 * self._workers)
        except CorruptionError as exc:
            raise exc.located(step=ck.step) from None
        if device is not None:
            target = torch.device(device)
            state = walk_value(state, lambda t, _: t.to(target), match=torch.Tensor)
        return state

    def _materialize(self, ref: Ref, path: str, step: int, jobs: list):
        node = self._node(ref.key, step, path)
        if node["k"] == "value":
            return walk_value(node["v"], lambda r, p: self._materialize(r, p, step, jobs), path)
        if node["k"] != "tensor":
            raise CorruptionError("a commit node appears inside a state tree", key=ref.key.hex(), step=step, path=path)
        if node["lib"] == "torch":
            out, view = tensors.empty_torch(node["dtype"], node["shape"])
        else:
            out, view = tensors.empty_numpy(node["dtype"], node["shape"])
        for key, (start, end) in zip(node["chunks"], pipeline.chunk_spans(node["nbytes"], node["chunk"])):
            jobs.append((path, key, view[start:end]))
        return out

    def _node(self, key: bytes, step: int, path: str | None = None) -> dict:
        try:
            return parse_node(self.objects.get(key).tobytes(), key)
        except CorruptionError as exc:
            raise exc.located(step=step, path=path) from None

    # --- registry -------------------------------------------------------------------------
    def _resolve(self, step: int | None) -> Checkpoint:
        with self.index.read() as txn:
            if step is None:
                ck = self.registry.latest(txn)
                if ck is None:
                    raise CheckpointNotFoundError(f"the store at {self.path} holds no checkpoint yet")
                return ck
            return self.registry.require(txn, step)

    def get(self, step: int) -> Checkpoint:
        self._check_open()
        return self._resolve(step)

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
        self._check_open()
        with self.index.write() as txn:
            gone = [self.registry.require(txn, step) for step in steps]
            pinned = [ck.step for ck in gone if ck.pinned]
            if pinned:
                raise CasError(f"checkpoint(s) {pinned} are pinned (a legal hold); unpin them first")
            for ck in gone:
                self.registry.remove(txn, ck.step)
            self.index.bump_generation(txn)
        return gone

    def set_milestone(self, step: int, flag: bool = True) -> Checkpoint:
        return self._update(step, milestone=bool(flag))

    def set_pinned(self, step: int, flag: bool = True) -> Checkpoint:
        """A pinned checkpoint cannot be deleted, by hand or by any retention rule."""
        return self._update(step, pinned=bool(flag))

    def _update(self, step: int, **changes) -> Checkpoint:
        self._check_open()
        with self.index.write() as txn:
            ck = self.registry.require(txn, step)
            ck = dataclasses.replace(ck, **changes)
            self.registry.update(txn, ck)
        return ck

    # --- inspection ---------------------------------------------------------------------
    def verify(self, step: int | None = None) -> VerifyReport:
        """Decode every object of one checkpoint (or all) and check it against its hash."""
        self._check_open()
        cks = [self._resolve(step)] if step is not None else self.checkpoints()
        return verify_checkpoints(self, cks)

    def stats(self) -> StoreStats:
        self._check_open()
        with self.index.read() as txn:
            stored = num = 0
            for _, rec in self.index.iter_records(txn):
                stored += rec.stored_size
                num += 1
            cks = self.registry.all(txn)
        return StoreStats(sum(c.logical_bytes for c in cks), stored, num, len(cks))

    def tensors(self, step: int) -> list[dict]:
        """Per tensor of a checkpoint: path, dtype, shape, bytes, chunk keys (for `cas show`)."""
        self._check_open()
        ck = self._resolve(step)
        out: list[dict] = []

        def visit(ref: Ref, path: str):
            node = self._node(ref.key, ck.step, path)
            if node["k"] == "value":
                walk_value(node["v"], visit, path)
            elif node["k"] == "tensor":
                out.append({"path": path, "lib": node["lib"], "dtype": node["dtype"], "shape": node["shape"],
                            "bytes": node["nbytes"], "chunks": node["chunks"]})

        root = self._node(ck.key, ck.step)["tree"]
        visit(root, "")
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


def _checked_metrics(metrics) -> dict:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError("metrics must be a dict with str keys")
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
            v = v.item()
        if type(v) is bool or not isinstance(v, (int, float)):
            raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}")
        out[k] = float(v) if isinstance(v, float) else int(v)
    return out


def _checked_meta(meta) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError("meta must be a dict")
    try:
        pack(meta)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"meta must hold plain values (str, numbers, bools, None, lists, dicts): {exc}") from None
    return meta

