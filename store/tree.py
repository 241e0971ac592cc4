"""A training state as a Merkle tree of manifest nodes.

Three node kinds, each an object named by the blake3 of its msgpack bytes (docs/format.md):
  tensor  {"k": "tensor", "lib", "dtype", "shape", "chunk", "chunks": [chunk keys]}
  value   {"k": "value", "v": a plain value whose tensor-holding parts are Refs to child nodes}
  commit  {"k": "commit", "format", "step", "created", ..., "tree": Ref to the state's root node}
A container becomes a node of its own when it holds a tensor somewhere below it; containers
without tensors stay inline in their parent. Unchanged subtrees therefore hash the same at the
next save and cost nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from cas.codecs import MAX_OBJECT_RAW, can_delta
from cas.errors import CorruptionError
from cas.hashing import KEY_SIZE, PLAIN, Namer

from . import tensors as T
from .lazytorch import torch
from .values import (MAPPINGS, MAX_BIGINT_BYTES, MAX_DEPTH, Ref, check_texts, checked_text, numpy_dtype, opens_level, pack,
                     int_text, remade, set_order, too_deep, unpack)

MANIFEST_FORMAT = 1
MAX_DIMS = 64


@dataclass(eq=False)
class TensorLeaf:
    """A tensor or array found in the state, with the chunk keys its save fills in."""

    path: str
    lib: str  # "torch" or "numpy"
    dtype: str  # torch dtype name, or numpy dtype.str
    shape: list[int]
    nbytes: int
    group: int  # byte-group stride for the codec (1: no grouping)
    source: object  # the tensor or array itself
    chunk_size: int = 0
    skew: int = 0  # the tensor starts this many bytes into a chunk of a global grid (DCP shards)
    chunks: list = field(default_factory=list)
    staged: np.ndarray | None = None  # a host snapshot of the bytes, for asynchronous saves
    floating: bool = False  # floats (float8 included) and complex, up to 8-byte parts: chunks may be deltas

    def bytes_view(self) -> np.ndarray:
        """Flat uint8 view of the values (one copy for CUDA, non-contiguous or lazy tensors)."""
        if self.staged is not None:
            return self.staged
        if self.lib == "torch":
            return T.torch_bytes(self.source)
        return T.numpy_bytes(self.source)

    def node(self) -> dict:
        node = {"k": "tensor", "lib": self.lib, "dtype": self.dtype, "shape": self.shape,
                "chunk": self.chunk_size, "chunks": self.chunks}
        if self.skew:
            node["skew"] = self.skew
        return node


def path_join(path: str, key) -> str:
    text = key if isinstance(key, str) else int_text(key) if type(key) is int else str(key)
    return f"{path}.{text}" if path else text


class _Container:
    """A container that holds tensors: it becomes a value node."""

    def __init__(self, value) -> None:
        self.value = value


def plan(state, *, chunk_size: int) -> tuple[object, list[TensorLeaf]]:
    """Check every leaf and return (skeleton, tensor leaves). In the skeleton each tensor is a
    TensorLeaf and each tensor-holding container a _Container; other values are as given.
    Raises TypeError naming the path of the first value we cannot store."""
    leaves: list[TensorLeaf] = []

    def walk(value, path: str, level: int):
        """`level`: the msgpack level `value` is written at (the root node's is 1)."""
        kind = type(value)
        if kind is int:
            return _checked_int(value, path)
        if kind is str:
            return checked_text(value, _where(path))
        if kind in (type(None), bool, float, bytes):
            return value
        if isinstance(value, torch.Tensor):
            return add_tensor(value, path)
        if kind is np.ndarray:
            return add_array(value, path)
        if isinstance(value, np.generic):
            if value.dtype.kind not in "biufc":
                raise TypeError(f"cannot store numpy scalar of dtype {value.dtype} at {_where(path)}")
            _inner_level(value, level, path)
            return value
        if kind in MAPPINGS:
            inner = _inner_level(value, level, path)
            items = [(_checked_key(k, path), walk(v, path_join(path, k), inner)) for k, v in value.items()]
            out = remade(value, items)
            if kind is OrderedDict and hasattr(value, "_metadata"):
                out._metadata = walk(_copied_metadata(value._metadata, path), path_join(path, "_metadata"), inner)
            return _wrap(out, (v for _, v in items))
        if kind in (list, tuple):
            inner = _inner_level(value, level, path)
            out = kind(walk(v, path_join(path, i), inner) for i, v in enumerate(value))
            return _wrap(out, out)
        if kind in (set, frozenset):  # of plain values only: a tensor has no place in one
            inner = _inner_level(value, level, path)
            held = len(leaves)
            out = kind(walk(v, path_join(path, i), inner) for i, v in enumerate(set_order(value)))
            if len(leaves) != held:
                raise TypeError(f"cannot store a tensor or array inside a {kind.__name__} at {_where(path)}")
            return out
        if isinstance(value, torch.dtype):
            if value not in T.torch_dtype_names():
                raise TypeError(f"cannot store the torch dtype {value} at {_where(path)}")
            return value
        raise TypeError(f"cannot store a value of type {kind.__module__}.{kind.__qualname__} at {_where(path)}")

    def add_tensor(t: torch.Tensor, path: str) -> TensorLeaf:
        reason = T.unsupported_tensor_reason(t)
        if reason:
            raise TypeError(f"cannot store {reason} at {path!r}")
        leaf = TensorLeaf(path, "torch", T.torch_dtype_names()[t.dtype], list(t.shape),
                          t.numel() * t.element_size(), group_of(t.dtype), t, chunk_size, floating=_deltable(t.dtype))
        leaves.append(leaf)
        return leaf

    def add_array(a: np.ndarray, path: str) -> TensorLeaf:
        if a.dtype.kind not in "biufc" or a.dtype.fields is not None:
            raise TypeError(f"cannot store numpy array of dtype {a.dtype} at {path!r}")
        leaf = TensorLeaf(path, "numpy", a.dtype.str, list(a.shape), a.nbytes, group_of(a.dtype), a, chunk_size,
                          floating=_deltable(a.dtype))
        leaves.append(leaf)
        return leaf

    return walk(state, "", 1), leaves


def _where(path: str) -> str:
    return repr(path or "<root>")


def _inner_level(value, level: int, path: str) -> int:
    """The level a container or numpy scalar puts what it holds at, refused past MAX_DEPTH as the
    decoder refuses it. Extension types (`opens_level`) are a level for the decoder too; lists and
    dicts are counted as well, for a bound on recursion that holds across nodes."""
    inner = level + 1
    if too_deep(inner):
        kinds = "tuple, OrderedDict or numpy scalar" if opens_level(value) else "container"
        raise TypeError(f"cannot store {_where(path)}: this {type(value).__name__} is one {kinds} too many, nested "
                        f"deeper than the {MAX_DEPTH} levels a checkpoint node holds (each dict, list, tuple, "
                        "OrderedDict and numpy scalar is a level); flatten the state there")
    return inner


def _checked_key(key, path: str):
    """A dict key a manifest holds: str (UTF-8 encodable) or an int loading can read back."""
    if type(key) is str:
        return checked_text(key, f"a dict key at {_where(path)}")
    if type(key) is int:
        return _checked_int(key, path)
    if type(key) is bool:
        return key
    raise TypeError(f"cannot store dict key {key!r} of type {type(key).__name__} at {_where(path)}: "
                    "keys must be str or int")


def _checked_int(value: int, path: str) -> int:
    """An int loading can read back: loaders refuse integers of more than MAX_BIGINT_BYTES
    (a bound on what a hostile manifest can make them allocate), so saving refuses them too."""
    if (value.bit_length() + 8) // 8 > MAX_BIGINT_BYTES:
        raise TypeError(f"cannot store an int of {value.bit_length()} bits at {path or '<root>'!r}: "
                        f"at most {8 * MAX_BIGINT_BYTES - 1} bits (store it as bytes or str)")
    return value


def group_of(dtype) -> int:
    """The codec's byte-group stride for a dtype (torch or numpy): its part size for floats, else 1."""
    return T.group_size(dtype) if T.is_floating(dtype) else 1


def _deltable(dtype) -> bool:
    """Floats and complex numbers whose chunks may be deltas (`can_delta` of their byte group)."""
    return T.is_floating(dtype) and can_delta(group_of(dtype))


def _wrap(container, children) -> object:
    holds = any(isinstance(c, (TensorLeaf, _Container)) for c in children)
    return _Container(container) if holds else container


def _copied_metadata(meta, path: str):
    """A state dict's `_metadata` (module versions), checked and copied so that an asynchronous
    save does not see later changes."""
    try:
        return unpack(pack(meta))
    except (TypeError, ValueError, OverflowError, CorruptionError) as exc:
        if isinstance(exc, UnicodeEncodeError):  # a lone surrogate: name where it sits
            check_texts(meta, path_join(path, "_metadata"))
        raise TypeError(f"cannot store the _metadata of the state dict at {path or '<root>'!r}") from None


class NodeWriter:
    """The manifest nodes of one save as {key: msgpack bytes}, deduplicated by key (Store.save's
    tree and the DCP coordinator's manifest alike)."""

    def __init__(self, namer: Namer = PLAIN) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.namer = namer  # the store's (keyed when encrypted)

    def add(self, data: bytes) -> bytes:
        key = self.namer.key(data)
        self.blobs[key] = data
        return key

    def emit(self, node: dict, path: str = "") -> Ref:
        """The node's reference; a node larger than an object may be (a reader refuses its
        header) is a TypeError naming `path`, raised before anything is committed: a save of
        a 2 GiB bytes value committed a checkpoint no load could read (audit of stop 38)."""
        data = pack(node)
        if len(data) > MAX_NODE_BYTES:
            biggest = max(_plain_sizes(node.get("v"), path), default=None)
            raise TypeError(f"cannot store {_where(path)}: its plain values pack to {len(data)} bytes, more than the "
                            f"{MAX_NODE_BYTES} one checkpoint node holds"
                            + (f" (the largest, at {_where(biggest[1])}, is {biggest[0]} bytes)" if biggest else "")
                            + "; store large bytes as a uint8 tensor (torch.frombuffer(data, dtype=torch.uint8))")
        return Ref(self.add(data))


MAX_NODE_BYTES = MAX_OBJECT_RAW  # what a reader accepts of one object (cas/codecs.py)


def _plain_sizes(value, path: str) -> Iterator[tuple[int, str]]:
    """(size, path) of each str and bytes value of a node's plain values."""
    if isinstance(value, (str, bytes)):
        yield len(value), path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _plain_sizes(v, path_join(path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _plain_sizes(v, path_join(path, i))


def encode_nodes(skeleton, namer: Namer = PLAIN) -> tuple[Ref, dict[bytes, bytes]]:
    """Turn a planned skeleton whose leaves have their chunk keys into node objects.
    Returns the root reference and {key: msgpack bytes} of every node (deduplicated)."""
    nodes = NodeWriter(namer)
    emit = nodes.emit

    def lower(value, path: str):
        if isinstance(value, TensorLeaf):
            return emit(value.node(), path)
        if isinstance(value, _Container):
            return emit({"k": "value", "v": lower_container(value.value, path)}, path)
        return value

    def lower_container(c, path: str):
        if isinstance(c, dict):
            return remade(c, ((k, lower(v, path_join(path, k))) for k, v in c.items()))
        return type(c)(lower(v, path_join(path, i)) for i, v in enumerate(c))

    root = lower(skeleton, "")
    if not isinstance(root, Ref):  # a state without tensors still gets a root node
        root = emit({"k": "value", "v": root}, "")
    return root, nodes.blobs


def commit_node(*, step: int, created: float, milestone: bool, metrics: dict, meta: dict,
                tree: Ref, logical_bytes: int) -> bytes:
    return pack({"k": "commit", "format": MANIFEST_FORMAT, "step": step, "created": created,
                 "milestone": milestone, "metrics": metrics, "meta": meta, "tree": tree,
                 "logical_bytes": logical_bytes})


# --- reading ------------------------------------------------------------------------------
def parse_node(data: bytes, key: bytes) -> dict:
    """Decode and validate one manifest node; anything unexpected is a CorruptionError."""
    name = key.hex()
    node = unpack(data, key=name)
    if not isinstance(node, dict) or node.get("k") not in ("tensor", "value", "commit"):
        raise CorruptionError("object is not a manifest node", key=name)
    kind = node["k"]
    if kind == "tensor":
        _check_tensor_node(node, name)
    elif kind == "commit":
        if node.get("format") != MANIFEST_FORMAT:
            raise CorruptionError(f"commit node has manifest format {node.get('format')!r}, "
                                  f"this cas reads {MANIFEST_FORMAT}", key=name)
        if not isinstance(node.get("tree"), Ref) or not isinstance(node.get("step"), int):
            raise CorruptionError("commit node lacks its tree or step", key=name)
    elif "v" not in node:
        raise CorruptionError("value node lacks its value", key=name)
    return node


def _check_tensor_node(node: dict, name: str) -> None:
    shape, chunks, chunk = node.get("shape"), node.get("chunks"), node.get("chunk")
    ok = (node.get("lib") in ("torch", "numpy") and isinstance(node.get("dtype"), str)
          and isinstance(shape, list) and len(shape) <= MAX_DIMS
          and all(type(d) is int and 0 <= d < 1 << 63 for d in shape)  # (torch's sizes are int64)
          and isinstance(chunks, list) and all(isinstance(c, bytes) and len(c) == KEY_SIZE for c in chunks)
          and type(chunk) is int and 0 < chunk <= MAX_OBJECT_RAW  # (no chunk is larger than an object can be)
          and type(node.get("skew", 0)) is int and 0 <= node.get("skew", 0) < chunk)
    if not ok:
        raise CorruptionError("tensor node is malformed", key=name)
    if node["lib"] == "torch":
        T.torch_layout(node["dtype"])
    else:
        numpy_dtype(node["dtype"])
    nbytes = T.nbytes_of(T.element_size(node["lib"], node["dtype"]), shape)
    node.setdefault("skew", 0)
    if len(chunks) != (-(-(nbytes + node["skew"]) // chunk) if nbytes else 0):
        raise CorruptionError(f"tensor node lists {len(chunks)} chunks for {nbytes} bytes in chunks of {chunk}",
                              key=name)
    node["nbytes"] = nbytes


def node_children(node: dict) -> tuple[list[bytes], list[bytes]]:
    """(child node keys, chunk keys) that a parsed node references: the edges gc marks along."""
    if node["k"] == "tensor":
        return [], list(node["chunks"])
    refs: list[bytes] = []
    walk_value(node["tree"] if node["k"] == "commit" else node["v"], lambda r, _: refs.append(r.key))
    return refs, []


def chunk_spans(nbytes: int, chunk: int, skew: int = 0) -> Iterator[tuple[int, int]]:
    """(start, end) byte offsets of each chunk of a tensor whose first byte sits `skew` bytes
    into a chunk of the grid (0 for a whole tensor; a shard's global offset for DCP)."""
    start = 0
    while start < nbytes:
        end = min(start + chunk - (skew if start == 0 else 0), nbytes)
        yield start, end
        start = end


def walk_value(value, visit: Callable[[object, str], object], path: str = "", match: type = Ref):
    """Rebuild a plain value, replacing each instance of `match` (a Ref unless told otherwise)
    by `visit(item, path)`. Every mutable part is a new object: a reader caches the nodes it
    parsed, and equal subtrees are one node, so handing out theirs made two places of a loaded
    state (and the next load) one set or one `_metadata` (audit of stop 38)."""
    if isinstance(value, match):
        return visit(value, path)
    if isinstance(value, set):
        return set(value)  # (its elements are hashable, so immutable)
    if isinstance(value, dict):
        out = remade(value, ((k, walk_value(v, visit, path_join(path, k), match)) for k, v in value.items()))
        if hasattr(value, "_metadata"):
            out._metadata = walk_value(value._metadata, visit, path_join(path, "_metadata"), match)
        return out
    if isinstance(value, list):
        return [walk_value(v, visit, path_join(path, i), match) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(walk_value(v, visit, path_join(path, i), match) for i, v in enumerate(value))
    return value
