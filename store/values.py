"""Plain values in manifest nodes: msgpack with a few extension types, never pickle.

msgpack keeps None, bool, int (64-bit), float (as float64, so NaN, inf and -0.0 are exact),
str, bytes, lists and maps (with str and int keys, in order). Extension types carry what it
would lose: tuples, OrderedDicts (with a state dict's `_metadata`), Counters, integers beyond 64 bits,
numpy scalars, sets and frozensets, torch dtypes (by name), and references to child nodes. Decoding is bounded: nesting depth and sizes
are limited, and anything malformed is a CorruptionError.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import msgpack
import numpy as np

from cas.errors import CorruptionError
from cas.hashing import KEY_SIZE

EXT_REF = 1  # 32-byte key of a child node
EXT_TUPLE = 2  # packed array
EXT_BIGINT = 3  # signed big-endian two's complement
EXT_NPSCALAR = 4  # packed [dtype str, raw bytes]
EXT_ODICT = 5  # packed [[key, value]...] pairs, then the `_metadata` value or nil
EXT_TORCH_DTYPE = 6  # a torch dtype's name (store/tensors.py TORCH_DTYPE_LAYOUT), UTF-8
EXT_SET = 7  # packed array of the elements, in a fixed order (set_order)
EXT_FROZENSET = 8  # the same, for a frozenset
EXT_COUNTER = 9  # packed [[key, count]...] pairs (a MultiStepLR's milestones)
# msgpack levels one node may nest: the node itself is level 1, and every value that opens a
# level (`opens_level`) puts what it holds one level deeper. Decoding refuses a deeper node; the
# planner counts the same way (and counts lists and dicts too), so a state it accepts loads.
MAX_DEPTH = 64
MAX_BIGINT_BYTES = 4096
ALLOWED_NUMPY_KINDS = "biufc"


@dataclass(frozen=True)
class Ref:
    """A reference to a child node by its key."""

    key: bytes


class _Depth:
    """Tracks the nesting of extension payloads while decoding one node."""

    def __init__(self) -> None:
        self.level = 0


def opens_level(value) -> bool:
    """Whether decoding `value` unpacks a msgpack payload of its own, one level deeper: the
    extension types whose payload is packed msgpack (tuples, OrderedDicts, Counters, numpy
    scalars, sets)."""
    return isinstance(value, (tuple, OrderedDict, Counter, np.generic, set, frozenset))


MAPPINGS = (dict, OrderedDict, Counter)  # the mapping types a state may hold, each loaded as itself


def remade(like: dict, items) -> dict:
    """A mapping of `like`'s type (dict, OrderedDict with its `_metadata`, Counter) holding the
    (key, value) pairs `items`: what walks over a state build in its place."""
    if isinstance(like, Counter):
        out = Counter()
        dict.update(out, items)  # Counter(items) would count the pairs
        return out
    if isinstance(like, OrderedDict):
        out = OrderedDict(items)
        if hasattr(like, "_metadata"):  # a module state dict's versions
            out._metadata = like._metadata
        return out
    return dict(items)


def set_order(items) -> list:
    """A set's elements in an order that does not depend on the process (str hashes are salted
    per process), so the same set always packs to the same bytes."""
    return sorted(items, key=lambda v: (type(v).__name__, _order_text(v)))


def _order_text(value) -> str:
    try:
        return repr(value)
    except ValueError:  # an int past Python's digit limit for str() (4300 by default), somewhere in it
        if type(value) is int:
            return int_text(value)
        if isinstance(value, (tuple, frozenset)):
            parts = map(_order_text, value)
            return f"{type(value).__name__}({', '.join(sorted(parts) if isinstance(value, frozenset) else parts)})"
        raise


def int_text(n: int) -> str:
    """An int as text: decimal, or hex past the digits Python converts to decimal (its limit,
    4300 digits by default, made a set or a dict key holding a bigger one a ValueError)."""
    try:
        return str(n)
    except ValueError:
        return hex(n)


def too_deep(level: int) -> bool:
    """The nesting limit, for the planner and the decoder alike: `level` counts from 1 (a node)."""
    return level > MAX_DEPTH


def checked_text(text: str, where: str) -> str:
    """A str that msgpack can write: UTF-8 has no lone surrogates (what `errors="surrogateescape"`
    decoding leaves in a str), so one would fail only when the node is packed, after the checks."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TypeError(f"cannot store the str {text[:40]!r} at {where}: it holds the lone surrogate "
                        f"{text[exc.start]!r} at position {exc.start}, which UTF-8 cannot encode; "
                        "store it as bytes (text.encode('utf-8', 'surrogateescape'))") from None
    return text


def check_texts(value, where: str) -> None:
    """Raise checked_text's TypeError for the first str in a plain value (dict keys included)
    that UTF-8 cannot encode, naming where it sits."""
    if isinstance(value, str):
        checked_text(value, repr(where))
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                checked_text(k, f"a dict key at {where!r}")
            check_texts(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_texts(v, f"{where}.{i}")


def pack(value) -> bytes:
    """Encode a value tree (already checked by the tree builder) to msgpack bytes."""
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def _default(obj):
    if isinstance(obj, Ref):
        return msgpack.ExtType(EXT_REF, obj.key)
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack(list(obj)))
    if isinstance(obj, OrderedDict):
        meta = getattr(obj, "_metadata", None)
        return msgpack.ExtType(EXT_ODICT, pack([[[k, v] for k, v in obj.items()], meta]))
    if isinstance(obj, Counter):
        return msgpack.ExtType(EXT_COUNTER, pack([[k, v] for k, v in obj.items()]))
    if isinstance(obj, int):  # beyond 64 bits (msgpack refuses it natively), or an int subclass
        n = int(obj)
        size = (n.bit_length() + 8) // 8
        return msgpack.ExtType(EXT_BIGINT, n.to_bytes(size, "big", signed=True))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(EXT_NPSCALAR, pack([obj.dtype.str, obj.tobytes()]))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(EXT_SET if isinstance(obj, set) else EXT_FROZENSET, pack(set_order(obj)))
    if type(obj).__name__ == "dtype" and type(obj).__module__ == "torch":  # (no torch import to ask)
        from .tensors import torch_dtype_names

        return msgpack.ExtType(EXT_TORCH_DTYPE, torch_dtype_names()[obj].encode())
    if isinstance(obj, dict):  # strict_types sends dict subclasses here; the builder refused others
        return dict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def unpack(data, *, what: str = "manifest node", key: str | None = None):
    """Decode msgpack bytes into values, turning every malformation into CorruptionError."""
    depth = _Depth()
    try:
        return _unpack(data, depth)
    except CorruptionError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, OverflowError, UnicodeDecodeError, KeyError) as exc:
        raise CorruptionError(f"{what} is not valid: {type(exc).__name__}: {exc}", key=key) from None


def _unpack(data, depth: _Depth):
    depth.level += 1
    if too_deep(depth.level):
        raise CorruptionError(f"value nesting deeper than {MAX_DEPTH}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                               ext_hook=lambda code, payload: _ext(code, payload, depth))
    finally:
        depth.level -= 1


def _ext(code: int, payload: bytes, depth: _Depth):
    if code == EXT_REF:
        if len(payload) != KEY_SIZE:
            raise CorruptionError(f"node reference of {len(payload)} bytes")
        return Ref(bytes(payload))
    if code == EXT_TUPLE:
        items = _unpack(payload, depth)
        if not isinstance(items, list):
            raise CorruptionError("tuple extension does not hold an array")
        return tuple(items)
    if code == EXT_ODICT:
        body = _unpack(payload, depth)
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], list)):
            raise CorruptionError("OrderedDict extension is malformed")
        out = OrderedDict()
        for pair in body[0]:
            if not (isinstance(pair, list) and len(pair) == 2) or isinstance(pair[0], (list, dict)):
                raise CorruptionError("OrderedDict extension holds a malformed pair")
            out[pair[0]] = pair[1]
        if body[1] is not None:
            out._metadata = body[1]
        return out
    if code == EXT_COUNTER:
        pairs = _unpack(payload, depth)
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and not isinstance(p[0], (list, dict))
                                                  for p in pairs):
            raise CorruptionError("Counter extension is malformed")
        return remade(Counter(), pairs)
    if code == EXT_BIGINT:
        if len(payload) > MAX_BIGINT_BYTES:
            raise CorruptionError("integer extension is implausibly large")
        return int.from_bytes(payload, "big", signed=True)
    if code == EXT_NPSCALAR:
        body = _unpack(payload, depth)
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str) and isinstance(body[1], bytes)):
            raise CorruptionError("numpy scalar extension is malformed")
        dtype = numpy_dtype(body[0])
        if dtype.itemsize != len(body[1]):
            raise CorruptionError(f"numpy scalar of {body[0]} holds {len(body[1])} bytes")
        return np.frombuffer(body[1], dtype=dtype)[0]
    if code in (EXT_SET, EXT_FROZENSET):
        items = _unpack(payload, depth)
        if not isinstance(items, list):
            raise CorruptionError("set extension does not hold an array")
        return set(items) if code == EXT_SET else frozenset(items)  # an unhashable element: TypeError, damage
    if code == EXT_TORCH_DTYPE:
        from .tensors import torch_dtype, torch_layout

        name = payload.decode()
        torch_layout(name)  # a name we store tensors of (checked without torch), else CorruptionError
        return torch_dtype(name)  # (imports torch: only a node holding a dtype value does)
    raise CorruptionError(f"unknown value extension type {code}")


def numpy_dtype(text: str) -> np.dtype:
    """A numeric numpy dtype from its `.str`, refusing object, structured and string dtypes."""
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError):
        raise CorruptionError(f"unknown numpy dtype {text!r}") from None
    if dtype.kind not in ALLOWED_NUMPY_KINDS or dtype.fields is not None or dtype.str != text:
        raise CorruptionError(f"numpy dtype {text!r} is not one we store")
    return dtype
