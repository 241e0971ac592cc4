"""Reading one checkpoint: resolve it once, then list its entries, read one entry or one
tensor, walk its nodes, or materialize its whole state.

Load, restore, export, diff, `cas show`, DCP's reader and the trainer hooks all read through a
CheckpointReader, so a checkpoint's commit record is checked in one place, and each manifest
node is read, verified against its key and parsed once per reader however many times the
caller walks it (a restore walks the module entries twice: to check that they fit, then to
decode into them). Only tensor chunks are decoded in bulk, by the store's read pool.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

from cas.errors import CasError, CheckpointNotFoundError, CorruptionError
from cas.objectstore import ObjectStore

from . import pipeline, tensors
from .registry import Checkpoint
from .tree import chunk_spans, parse_node, path_join, walk_value
from .values import Ref

DamageRecorder = Callable[[list, str], object]  # (hex keys a CorruptionError named, who found it)


@dataclass(frozen=True)
class Leaf:
    """One leaf of a checkpoint's state: a tensor (its node and reference) or a plain value."""

    path: str
    ref: Ref | None = None
    node: dict | None = None
    value: object = None

    @property
    def is_tensor(self) -> bool:
        return self.node is not None


class CheckpointReader:
    """One resolved checkpoint of a store. Get one from `Store.reader(step)`."""

    def __init__(self, objects: ObjectStore, checkpoint: Checkpoint, *, pool: ThreadPoolExecutor, window: int,
                 record_damage: DamageRecorder | None = None) -> None:
        self.checkpoint = checkpoint
        self._objects = objects
        self._pool = pool
        self._window = window
        self._record_damage = record_damage
        self._nodes: dict[bytes, dict] = {}

    @property
    def step(self) -> int:
        return self.checkpoint.step

    # --- nodes ----------------------------------------------------------------------------
    def node(self, ref, kind: str | None = None, path: str | None = None) -> dict:
        """The parsed node `ref` (a Ref or a key) names, read and checked once per reader;
        with `kind`, a node of another kind is a CorruptionError."""
        key = ref.key if isinstance(ref, Ref) else ref
        if not isinstance(key, bytes):
            raise CorruptionError("the manifest lacks a node reference", step=self.step, path=path)
        node = self._nodes.get(key)
        if node is None:
            try:
                node = parse_node(self._objects.get(key).tobytes(), key)
            except CorruptionError as exc:
                raise exc.located(step=self.step, path=path) from None
            self._nodes[key] = node
        if kind is not None and node["k"] != kind:
            raise CorruptionError(f"expected a {kind} node, found a {node['k']} node", key=key.hex(),
                                  step=self.step, path=path)
        return node

    def commit(self) -> dict:
        """The commit node the registry names, which must be this step's commit: a damaged or
        crafted record naming another node, or another step's commit, is refused instead of
        loading what it names."""
        ck = self.checkpoint
        node = self.node(ck.key)
        if node["k"] != "commit":
            raise CorruptionError(f"the registry names a {node['k']} node as this checkpoint's commit",
                                  key=ck.id, step=ck.step)
        if node["step"] != ck.step:
            raise CorruptionError(f"the registry names the commit of step {node['step']}", key=ck.id, step=ck.step)
        return node

    def top(self):
        """The state's top value: a dict of top-level entries (values and node references), or
        the reference of a state that was not a dict."""
        root = self.commit()["tree"]
        tree = self.node(root)
        return tree["v"] if tree["k"] == "value" else root

    def entries(self) -> list:
        """The top-level entries' keys (none when the state is not a dict)."""
        top = self.top()
        return list(top) if isinstance(top, dict) else []

    def select(self, keys) -> dict:
        """The top-level entries `keys` names (one key or a list), as references."""
        if not isinstance(keys, (list, tuple, set, frozenset)):
            keys = [keys]  # one key (a str, or an int: a state's top-level keys may be ints)
        top = self.top()
        if not isinstance(top, dict):
            held = self.node(top)["k"] if isinstance(top, Ref) else None
            what = "tensor" if held == "tensor" else type(self.node(top)["v"] if held else top).__name__
            raise CasError(f"checkpoint step {self.step} holds a {what} at its top, not a dict; "
                           "load it without keys=")
        missing = [k for k in keys if k not in top]
        if missing:
            raise CheckpointNotFoundError(f"checkpoint step {self.step} has no top-level entries {missing}; "
                                          f"it has {list(top)}")
        return {k: top[k] for k in keys}

    # --- walking --------------------------------------------------------------------------
    def leaves(self, keys=None) -> Iterator[Leaf]:
        """Every leaf of the state (or of its top-level `keys`) in state order, reading manifest
        nodes only, so that callers pick the tensors whose bytes they need."""
        return self._leaves(self.top() if keys is None else self.select(keys), "")

    def _leaves(self, value, path: str) -> Iterator[Leaf]:
        if isinstance(value, Ref):
            node = self.node(value, path=path)
            if node["k"] == "tensor":
                yield Leaf(path, value, node)
            elif node["k"] == "value":
                yield from self._leaves(node["v"], path)
            else:
                raise CorruptionError("a commit node appears inside a state tree", key=value.key.hex(),
                                      step=self.step, path=path)
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from self._leaves(v, path_join(path, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from self._leaves(v, path_join(path, i))
        else:
            yield Leaf(path, value=set(value) if isinstance(value, set) else value)  # (the cached node's is shared)

    def tensor_leaves(self, keys=None) -> dict[str, Leaf]:
        """The tensor leaves by path (of the top-level `keys` only, when given); of tensors
        whose paths coincide (see paths_of_tensors), the last."""
        return {leaf.path: leaf for leaf in self.leaves(keys) if leaf.is_tensor}

    def paths_of_tensors(self, keys=None) -> dict[str, list[Leaf]]:
        """The tensor leaves by path, in state order. Dotted paths of two tensors can coincide
        ({"a.b": t, "a": {"b": u}}, the int key 1 beside the str key "1", an empty key): such
        a path names a list of several."""
        out: dict[str, list[Leaf]] = {}
        for leaf in self.leaves(keys):
            if leaf.is_tensor:
                out.setdefault(leaf.path, []).append(leaf)
        return out

    def tensors(self) -> list[dict]:
        """Per tensor: path, lib, dtype, shape, bytes and chunk keys (for `cas show`)."""
        return [{"path": leaf.path, "lib": leaf.node["lib"], "dtype": leaf.node["dtype"],
                 "shape": leaf.node["shape"], "bytes": leaf.node["nbytes"], "chunks": leaf.node["chunks"],
                 "spans": list(chunk_spans(leaf.node["nbytes"], leaf.node["chunk"], leaf.node["skew"]))}
                for leaf in self.leaves() if leaf.is_tensor]

    # --- bytes ----------------------------------------------------------------------------
    def read_tensor(self, leaf: Leaf | str):
        """Decode one tensor (every chunk checked against its hash) without the rest."""
        if isinstance(leaf, str):
            found = self.paths_of_tensors().get(leaf, [])
            if not found:
                raise CheckpointNotFoundError(f"checkpoint step {self.step} has no tensor {leaf!r}")
            if len(found) > 1:  # it returned the last of them, silently
                raise CasError(f"the path {leaf!r} names {len(found)} tensors of checkpoint step {self.step} (a key "
                               "holding '.', an int key beside the same str key, or an empty key); pass "
                               "read_tensor the Leaf of the one you mean, from reader.leaves()")
            leaf = found[0]
        elif not isinstance(leaf, Leaf) or not leaf.is_tensor:
            raise TypeError(f"read_tensor takes a tensor's path (a str) or a tensor Leaf from tensor_leaves(), "
                            f"got {type(leaf).__name__} {leaf!r:.80}")
        jobs: list = []
        out = self._materialized(leaf.ref, leaf.path, jobs, {})
        self.decode(jobs)
        return out

    def materialize(self, keys=None, into: dict | None = None):
        """The state (its top-level `keys` only, when given), every byte checked. `into`: per
        top-level entry, {tensor path: the caller's tensor to decode into} (restore); kept per
        entry because flat dotted paths of two entries can coincide ("model" holding "ema",
        and an entry named "model.ema")."""
        value = self.top() if keys is None else self.select(keys)
        jobs: list = []
        try:
            if into and isinstance(value, dict):
                state = {k: walk_value(v, lambda ref, path, own=into.get(k, {}):
                                       self._materialized(ref, path, jobs, own), str(k))
                         for k, v in value.items()}
            else:
                state = walk_value(value, lambda ref, path: self._materialized(ref, path, jobs, {}))
        except CorruptionError as exc:
            self._damaged(exc)
            raise
        self.decode(jobs)
        return state

    def _materialized(self, ref: Ref, path: str, jobs: list, into: dict):
        node = self.node(ref, path=path)
        if node["k"] == "value":
            return walk_value(node["v"], lambda r, p: self._materialized(r, p, jobs, into), path)
        if node["k"] != "tensor":
            raise CorruptionError("a commit node appears inside a state tree", key=ref.key.hex(), step=self.step,
                                  path=path)
        try:
            out, view = tensors.output_for(node, into.get(path))
        except (RuntimeError, MemoryError, OverflowError, ValueError) as exc:  # torch's or numpy's refusal
            raise CasError(f"tensor {path!r} of checkpoint step {self.step} ({node['dtype']}, shape "
                           f"{node['shape']}, {node['nbytes']} bytes) cannot be allocated: {exc}") from None
        guarded = out is into.get(path)  # the caller's own tensor: only verified bytes may land in it
        for key, (start, end) in zip(node["chunks"], chunk_spans(node["nbytes"], node["chunk"], node["skew"])):
            jobs.append((path, key, view[start:end], guarded))
        return out

    def decode(self, jobs: list) -> None:
        """Decode (tensor path, chunk key, output slice, guarded) jobs in the read pool. A
        damaged object is recorded in the index before the CorruptionError is raised, so the
        next save writes it again."""
        try:
            pipeline.read_tensor_chunks(self._objects, jobs, self._pool, window=self._window)
        except CorruptionError as exc:
            self._damaged(exc)
            raise exc.located(step=self.step) from None

    def _damaged(self, exc: CorruptionError) -> None:
        if self._record_damage is not None:
            self._record_damage([exc.key], f"load of step {self.step}")
