"""Comparisons between checkpoints of one store (cas.api's diff and exclusive_bytes).

- diff: per tensor path, what changed between two checkpoints, and the stored bytes they share.
- exclusive_bytes: per checkpoint, the stored bytes only it references (what deleting it frees).

This module belongs to cas.store, which knows nothing of gc: the functions that need
reachability take gc's Marker class as an argument (cas.api passes it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Iterable

import numpy as np

from cas.progress import ProgressCallback

from .lazytorch import torch
from .interop import torch_dtype_of
from .reader import Leaf
from .registry import Checkpoint


# --- diff -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorChange:
    path: str
    status: str  # "unchanged", "changed", "added" or "removed"
    dtype: str  # in the newer checkpoint (the older one for a removed tensor)
    shape: list[int]
    chunks_changed: float | None = None  # share of chunks that differ (changed tensors)
    max_abs_diff: float | None = None  # changed floating tensors of one shape (any float dtypes)
    was: str | None = None  # "float32 [4, 4]" when the dtype or shape changed


@dataclass
class DiffReport:
    a: int
    b: int
    tensors: list[TensorChange]
    a_stored_bytes: int  # stored bytes of every object each checkpoint references
    b_stored_bytes: int
    shared_bytes: int  # stored bytes of the objects both reference

    def count(self, status: str) -> int:
        return sum(1 for t in self.tensors if t.status == status)

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b,
                "summary": {s: self.count(s) for s in ("unchanged", "changed", "added", "removed")},
                "tensors": [{**asdict(t), "max_abs_diff": _json_number(t.max_abs_diff)} for t in self.tensors],
                "a_stored_bytes": self.a_stored_bytes, "b_stored_bytes": self.b_stored_bytes,
                "shared_bytes": self.shared_bytes}


def _json_number(x: float | None):
    """JSON has no inf or NaN: those become strings."""
    return x if x is None or np.isfinite(x) else str(x)


def diff(store, a: int, b: int, marker_cls, *, progress: ProgressCallback | None = None) -> DiffReport:
    """Compare checkpoint `a` with checkpoint `b`, per tensor path. Chunk keys tell what changed
    without reading tensor bytes; only changed floating tensors are loaded, for the max abs diff."""
    reader_a, reader_b = store.reader(a), store.reader(b)
    ck_a, ck_b = reader_a.checkpoint, reader_b.checkpoint
    pairs = _paired(reader_a.paths_of_tensors(), reader_b.paths_of_tensors())
    changes = [_compare(path, old, new) for path, old, new in pairs]
    measurable = [i for i, c in enumerate(changes) if c.status == "changed"
                  and _comparable(pairs[i][1].node, pairs[i][2].node)]
    for n, i in enumerate(measurable, 1):
        _, old, new = pairs[i]
        delta = max_abs_diff(reader_a.read_tensor(old), reader_b.read_tensor(new))
        changes[i] = replace(changes[i], max_abs_diff=delta)
        if progress:
            progress("diff", n, len(measurable))
    live_a, live_b = reachable(store, ck_a, marker_cls), reachable(store, ck_b, marker_cls)
    sizes = stored_sizes(store, live_a | live_b)
    return DiffReport(a, b, changes, _total(sizes, live_a), _total(sizes, live_b), _total(sizes, live_a & live_b))


def _paired(before: dict[str, list[Leaf]], after: dict[str, list[Leaf]]) -> list[tuple]:
    """(path, old leaf or None, new leaf or None) per tensor, in the newer checkpoint's order and
    then the removed ones; the n-th of several tensors at one path with the n-th (paths can
    coincide: reader.paths_of_tensors)."""
    pairs = []
    for path in [*after, *(p for p in before if p not in after)]:
        old, new = before.get(path, []), after.get(path, [])
        pairs += [(path, old[i] if i < len(old) else None, new[i] if i < len(new) else None)
                  for i in range(max(len(old), len(new)))]
    return pairs


def _describe(node: dict) -> str:
    return f"{node['dtype']} {node['shape']}"


def _compare(path: str, old: Leaf | None, new: Leaf | None) -> TensorChange:
    if new is None:
        return TensorChange(path, "removed", old.node["dtype"], old.node["shape"])
    n = new.node
    if old is None:
        return TensorChange(path, "added", n["dtype"], n["shape"])
    o = old.node
    same_layout = (o["lib"], o["dtype"], o["shape"], o["skew"]) == (n["lib"], n["dtype"], n["shape"], n["skew"])
    if same_layout and o["chunks"] == n["chunks"]:
        return TensorChange(path, "unchanged", n["dtype"], n["shape"])
    if not same_layout:
        was = _describe(o) if (o["dtype"], o["shape"]) != (n["dtype"], n["shape"]) else None
        return TensorChange(path, "changed", n["dtype"], n["shape"], 1.0, was=was)
    differ = sum(1 for x, y in zip(o["chunks"], n["chunks"]) if x != y)
    return TensorChange(path, "changed", n["dtype"], n["shape"], differ / len(n["chunks"]))


def _is_floating(node: dict) -> bool:
    dtype = torch_dtype_of(node)
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


def _comparable(old: dict, new: dict) -> bool:
    """Whether a max abs difference means something: floating values of one shape (a change of
    precision, fp32 to bf16, included)."""
    return old["shape"] == new["shape"] and _is_floating(old) and _is_floating(new)


def _wide(x) -> np.ndarray:
    """Values as float64 (complex128 for complex), whatever the tensor's dtype (bf16, float8...)."""
    if isinstance(x, torch.Tensor):
        x = x.to(torch.complex128 if x.is_complex() else torch.float64).numpy()
    return np.asarray(x, dtype=np.complex128 if x.dtype.kind == "c" else np.float64)


def max_abs_diff(x, y) -> float:
    """The largest |x - y| over the elements (the modulus for complex values). Equal values,
    infinities included, and NaN against NaN count 0; NaN against a number counts infinity."""
    wx, wy = _wide(x).reshape(-1), _wide(y).reshape(-1)  # 0-dim too (AdamW's step counters)
    if wx.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, set right below
        delta = np.abs(wx - wy)
    delta[np.isnan(delta)] = np.inf
    delta[(wx == wy) | (np.isnan(wx) & np.isnan(wy))] = 0.0
    return float(delta.max())


# --- reachability (gc's Marker passed in) ---------------------------------------------------
def reachable(store, ck: Checkpoint, marker_cls) -> set[bytes]:
    """Every object key checkpoint `ck` references (manifest nodes and chunks)."""
    marker = marker_cls(store)
    marker.mark([ck.key])
    return marker.live


def stored_sizes(store, keys: Iterable[bytes]) -> dict[bytes, int]:
    """Each indexed object's stored (encoded) size; objects missing from the index are left out."""
    with store.index.read() as txn:
        return {k: rec.stored_size for k in keys if (rec := store.index.record(txn, k)) is not None}


def _total(sizes: dict[bytes, int], keys: Iterable[bytes]) -> int:
    return sum(sizes.get(k, 0) for k in keys)


class _FirstReach(set):
    """A Marker's live set that notes which root was being marked when each key came in. The
    Marker adds keys with add, update or |=; a key already in stays with its first root."""

    def __init__(self) -> None:
        super().__init__()
        self.root: int | None = None
        self.first: dict[bytes, int] = {}

    def add(self, key: bytes) -> None:
        if key not in self:
            self.first[key] = self.root
            super().add(key)

    def update(self, *iterables) -> None:
        for keys in iterables:
            for key in keys:
                self.add(key)

    def __ior__(self, other):
        self.update(other)
        return self


def _first_reachers(store, cks: list[Checkpoint], marker_cls,
                    progress: ProgressCallback | None) -> dict[bytes, int]:
    """For each object, the step of the first checkpoint in `cks` that references it: one Marker
    marks the roots in turn, and a root's walk stops where an earlier root's walk went."""
    marker = marker_cls(store)
    marker.live = reach = _FirstReach()
    for ck in cks:
        reach.root = ck.step
        marker.mark([ck.key], progress)
    return reach.first


def exclusive_bytes(store, marker_cls, checkpoints: list[Checkpoint] | None = None, *,
                    progress: ProgressCallback | None = None) -> dict[int, int]:
    """Per checkpoint step, the stored bytes of the objects no other checkpoint references: what
    deleting it (then gc) would free. Marking oldest-first gives each object's first referencing
    checkpoint, newest-first its last; an object is exclusive when the two are the same. Each
    pass visits each object once: O(unique objects), not checkpoints x objects."""
    cks = list(checkpoints) if checkpoints is not None else store.checkpoints()
    first = _first_reachers(store, cks, marker_cls, progress)
    last = _first_reachers(store, cks[::-1], marker_cls, progress)
    sizes = stored_sizes(store, first)
    out = dict.fromkeys((ck.step for ck in cks), 0)
    for key, step in first.items():
        if last[key] == step:
            out[step] += sizes.get(key, 0)
    return out
