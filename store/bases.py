"""Delta bases: what the last save leaves in host memory for the next one to code against.

Store.save (store/store.py) and every DCP rank (store/dcp/bases.py) keep, per floating-point
tensor (or shard) worth a delta, the chunk keys of its last save and, within a memory budget
(`delta_memory`), its bytes: the next save codes each changed chunk against the bytes at the
same position (a `sub` delta), or has a worker read the base back from the store where only the
key was kept. Within the same budget, the chunks a save wrote as deltas of the kept bytes
("moved") keep those previous bytes too ("below"): the next save may extrapolate from the two
(`linear` deltas). Buffers are reused from one save to the next (fresh memory is slow to touch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from . import tensors as T
from .tree import TensorLeaf, chunk_spans
from .values import numpy_dtype

DELTA_MIN_BYTES = 64 << 10  # smaller tensors are not worth a delta


@dataclass
class TensorBases:
    """One tensor's (or shard's) chunk keys at the last save and, when kept, its bytes (`data`;
    None when only the keys were kept: whoever codes a chunk reads its base back from the store).
    `below` holds, at the spans of the chunks `below_keys` names (chunk index -> the key of that
    chunk's own delta base), the bytes of those bases, from which `linear` deltas extrapolate.
    `group`: the codec's byte-group stride; `tails`: per chunk, the older chunks recoded into a
    chain that ends in it, nearest first (store/recode.py; None: not known)."""

    nbytes: int
    chunk_size: int
    skew: int
    keys: list
    data: np.ndarray | None = None
    below: np.ndarray | None = None
    below_keys: dict = field(default_factory=dict)
    group: int = 1
    tails: list | None = None

    def matches(self, nbytes: int, chunk_size: int, skew: int) -> bool:
        """Whether a tensor of this layout has its chunks where these bases have theirs."""
        return (self.nbytes, self.chunk_size, self.skew) == (nbytes, chunk_size, skew)

    def chunk(self, index: int, start: int, end: int) -> tuple[bytes, np.ndarray | None, tuple | None]:
        """(key, kept bytes or None, (its own base's key, that base's bytes) or None) of chunk
        `index`, which spans bytes start:end."""
        if self.data is None:
            return self.keys[index], None, None
        below = (self.below_keys[index], self.below[start:end]) if index in self.below_keys else None
        return self.keys[index], self.data[start:end], below


def floating_node(node: dict) -> bool:
    """Whether a (checked) tensor node holds a floating-point dtype."""
    if node["lib"] == "torch":
        return T.torch_layout(node["dtype"])[1] > 0
    return T.is_floating(numpy_dtype(node["dtype"]))


def from_nodes(nodes: Iterable[tuple[object, dict]]) -> dict[object, TensorBases]:
    """Keys-only bases of the floating-point tensor nodes worth a delta, by name: what a save
    that has nothing in memory (a resumed run) codes against, reading each base back."""
    return {name: TensorBases(node["nbytes"], node["chunk"], node["skew"], list(node["chunks"]), group=_group(node))
            for name, node in nodes if floating_node(node) and node["nbytes"] >= DELTA_MIN_BYTES}


def _group(node: dict) -> int:
    if node["lib"] == "torch":
        return T.torch_layout(node["dtype"])[1]
    return T.group_size(numpy_dtype(node["dtype"]))


class Buffers:
    """Byte buffers of one size class reused from save to save (fresh memory is slow to touch),
    keeping at most `keep` bytes idle."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self.keep = 0

    def take(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        return free.pop() if free else np.empty(nbytes, dtype=np.uint8)

    def give(self, bases: dict | None) -> None:
        idle = sum(b.nbytes for bufs in self._free.values() for b in bufs)
        for tb in (bases or {}).values():
            if tb.data is not None and idle + tb.data.nbytes <= self.keep:
                self._free.setdefault(tb.data.nbytes, []).append(tb.data)
                idle += tb.data.nbytes
            tb.data = None


def snapshot(leaves: list[TensorLeaf], memory: int | None, buffers: Buffers) -> dict[str, TensorBases]:
    """What a save leaves for the recode of its predecessor and for the next one: its floating
    tensors worth a delta, by path, with a copy of their bytes while they fit in `memory` (None:
    all of them; the rest is read back from the store)."""
    out, kept = {}, 0
    for leaf in leaves:
        if not (leaf.floating and leaf.nbytes >= DELTA_MIN_BYTES):
            continue
        data = None
        if memory is None or kept + leaf.nbytes <= memory:
            data = buffers.take(leaf.nbytes)
            np.copyto(data, leaf.bytes_view())
            kept += leaf.nbytes
        out[leaf.path] = TensorBases(leaf.nbytes, leaf.chunk_size, leaf.skew, list(leaf.chunks), data, group=leaf.group)
    buffers.keep = max(buffers.keep, kept)
    return out


class Keeper:
    """Makes the next save's bases from the tensors a save just wrote, in the order given: their
    bytes while they fit in `memory` (None: all of them), else their keys alone; then, within
    what is left, the previous bytes of their moved chunks. A tensor's buffers from `previous`
    are reused (overwritten): only that tensor's own chunks were coded against them."""

    def __init__(self, previous: dict | None, memory: int | None) -> None:
        self.previous = previous or {}
        self.memory = memory
        self.current: dict[object, TensorBases] = {}
        self.kept_bytes = 0

    def _take(self, nbytes: int) -> bool:
        if self.memory is not None and self.kept_bytes + nbytes > self.memory:
            return False
        self.kept_bytes += nbytes
        return True

    def keep(self, saved: Iterable[tuple[object, TensorBases, Callable[[], np.ndarray]]],
             deltas: dict[bytes, bytes]) -> None:
        """Remember tensors just written: (name, their keys and layout, a function giving their
        bytes, called only for those kept). `deltas`: key -> base key of each delta written."""
        saved = list(saved)
        kept = [(name, new, view) for name, new, view in saved if self._take(new.nbytes)]
        for name, new, _ in saved:
            self.current[name] = new
        belows = {name: self._below(name, new, deltas) for name, new, _ in kept}  # before any data buffer is reused
        for name, new, view in kept:
            prev = self.previous.get(name)
            reuse = prev is not None and prev.data is not None and prev.data.size == new.nbytes
            buf = prev.data if reuse else np.empty(new.nbytes, dtype=np.uint8)
            np.copyto(buf, view())
            self.current[name] = dataclasses.replace(new, data=buf, **belows[name])

    def _below(self, name, new: TensorBases, deltas: dict[bytes, bytes]) -> dict:
        """The last save's kept bytes of the chunks of `new` written as deltas of them, copied
        into a reused buffer while they fit. (Chunks coded against a chain root keep nothing:
        extrapolating a root's motion measured no gain.)"""
        prev = self.previous.get(name)
        if prev is None or prev.data is None or not prev.matches(new.nbytes, new.chunk_size, new.skew):
            return {}
        moved = {i: prev.keys[i] for i, key in enumerate(new.keys) if deltas.get(key) == prev.keys[i]}
        if not moved or not self._take(new.nbytes):
            return {}
        below = prev.below if prev.below is not None and prev.below.size == new.nbytes \
            else np.empty(new.nbytes, dtype=np.uint8)
        for i, (start, end) in enumerate(chunk_spans(new.nbytes, new.chunk_size, new.skew)):
            if i in moved:
                below[start:end] = prev.data[start:end]
        return {"below": below, "below_keys": moved}


def remember(previous: dict | None, leaves: list[TensorLeaf], deltas: dict[bytes, bytes],
             memory: int | None) -> dict[str, TensorBases]:
    """The bases Store.save leaves for the next save: its floating-point tensors worth a delta,
    by path, kept in state order (see Keeper)."""
    keeper = Keeper(previous, memory)
    keeper.keep(((leaf.path, TensorBases(leaf.nbytes, leaf.chunk_size, leaf.skew, list(leaf.chunks)), leaf.bytes_view)
                 for leaf in leaves if leaf.floating and leaf.nbytes >= DELTA_MIN_BYTES), deltas)
    return keeper.current
