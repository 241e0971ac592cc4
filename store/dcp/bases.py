"""Delta bases of DCP saves: each rank keeps its last save's floating-point shard bytes.

A rank codes a changed chunk against the same chunk of its previous save (a `sub` delta, as
Store.save does with delta=True). Ranks never open the index, so a rank cannot tell whether the
chunks it wrote last time were committed (that save may have failed after writing) or are still
stored. The protocol therefore goes through DCP's planning round trip:

  1. prepare_local_plan, every rank: the keys of its cached chunks go to the coordinator in the
     plan's storage_data (`proposal`).
  2. prepare_global_plan, coordinator: holds those keys in its barrier session
     (no gc sweeps them until the commit) and says which are stored; each plan goes back with
     the chain depth of each stored key, or NOT_STORED, and for keys whose chain is full the
     chain's root, when ranks can read it (held too) (`confirm`). A rank none of whose keys is
     stored (restarted: it proposes none; or its last save failed) is seeded with the chunk keys
     of the latest checkpoint's shards matching its plan (`seeded_cache`), read back from files.
  3. write_data, every rank: a confirmed base whose chain is shorter than max_chain is used,
     else the chain's root, decoded from its file (`RankDeltas.base`); the chunk's delta object
     names its base, which the coordinator indexes as a base edge when it adopts the file.
     Then this save's shard bytes replace the cache (`RankDeltas.keep`: store/bases.py's
     Keeper, as Store.save keeps its tensors).

Memory: one copy of the rank's floating-point shards (its share of the state, not the whole
state), plus the previous bytes of the chunks it wrote as deltas (for `linear` deltas), per store
path and process (one rank per process, as DCP runs it), for the MAX_STORES
stores saved into last. A cache is dropped
when a write fails half-way (its buffers were being overwritten).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..bases import Keeper, TensorBases

NOT_STORED = 255  # in a confirmation: the key is not stored (stored depths are capped at 254)
PROPOSAL = "cas_bases"
CONFIRMED = "cas_base_depths"
FOR_STEP = "cas_step"
ROOTS = "cas_base_roots"
SEED = "cas_base_seed"
BELOW = "cas_base_below"  # confirmed key (a delta) -> the keys below it down its chain


@dataclass
class Cache:
    """A rank's bases of its last save into one store: shard id -> TensorBases (`data` None for
    a shard seeded from the latest checkpoint, a restarted rank's: read back from files)."""

    shards: dict = field(default_factory=dict)

    def keys(self) -> list[bytes]:
        return list(dict.fromkeys(k for shard in self.shards.values() for k in shard.keys))


_caches: dict[str, Cache] = {}  # by store path, least recently saved first
_lock = threading.Lock()
MAX_STORES = 4  # a process saving into more stores than this keeps bases for the latest four


def shard_id(fqn: str, offsets, sizes, dtype) -> tuple:
    return fqn, tuple(offsets), tuple(sizes), str(dtype)


def cached(path: str) -> Cache | None:
    with _lock:
        return _caches.get(path)


def replace(path: str, cache: Cache | None) -> None:
    with _lock:
        _caches.pop(path, None)
        if cache is not None:
            _caches[path] = cache
            while len(_caches) > MAX_STORES:
                _caches.pop(next(iter(_caches)))


def proposal(path: str) -> dict:
    cache = cached(path)
    return {PROPOSAL: cache.keys() if cache else []}


def confirm(storage_data, step: int, max_chain: int, hold: Callable[[list], object],
            depth_of: Callable[[bytes], int | None],
            roots_of: Callable[[list], dict[bytes, bytes]], seed: Callable[[], dict] = dict,
            below_of: Callable[[list], dict[bytes, list]] | None = None) -> dict:
    """The coordinator's answer to one rank's proposal: `hold(keys)` holds the keys (gc keeps
    them and their chains until the commit), then `depth_of(key)` gives each stored key's chain
    depth, None for one that is not stored. For keys whose chain is full, `roots_of` gives the
    chain roots a rank may code against instead (held too), as Store.save does. A rank none of
    whose proposals is stored (a restarted process proposes nothing; a failed save's chunks were
    never committed) gets `seed()` instead: {shard id: (skew, nbytes, chunk keys)} of the latest
    checkpoint's shards that match its plan, whose keys are confirmed alike. For the deltas a
    rank may code against directly, `below_of` gives the keys down each one's chain: a rank
    must not code a chunk against a base whose chain holds that chunk (a cycle of bases, as
    when a rollback saves an earlier state whose file is damaged or missing)."""
    keys = storage_data.get(PROPOSAL) if isinstance(storage_data, dict) else None
    keys = [k for k in keys if isinstance(k, bytes)] if isinstance(keys, list) else []
    if keys:
        hold(keys)
    depths = [depth_of(k) for k in keys]
    seeded = {}
    if all(d is None for d in depths):
        seeded = seed()
        keys = list(dict.fromkeys(k for _, _, chunks in seeded.values() for k in chunks))
        if keys:
            hold(keys)
        depths = [depth_of(k) for k in keys]
    full = [k for k, d in zip(keys, depths) if d is not None and d >= max_chain] if max_chain > 0 else []
    deltas = [k for k, d in zip(keys, depths) if d is not None and 0 < d < max_chain]
    return {FOR_STEP: step, PROPOSAL: keys,
            CONFIRMED: bytes(NOT_STORED if d is None else min(d, NOT_STORED - 1) for d in depths),
            ROOTS: roots_of(full) if full else {}, SEED: seeded,
            BELOW: below_of(deltas) if below_of is not None and deltas else {}}


def seeded_cache(storage_data, chunk_size: int) -> Cache | None:
    """The cache a restarted rank starts from: the seeded shards' keys, no bytes."""
    seed = storage_data.get(SEED) if isinstance(storage_data, dict) else None
    if not isinstance(seed, dict) or not seed:
        return None
    return Cache({sid: TensorBases(nbytes, chunk_size, skew, list(chunks)) for sid, (skew, nbytes, chunks) in seed.items()})


def answers(storage_data, step: int) -> bool:
    """Whether a plan carries the coordinator's confirmation made for the save of `step`."""
    return isinstance(storage_data, dict) and storage_data.get(FOR_STEP) == step


def confirmed(storage_data, step: int) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
    """The stored keys of this rank's proposal with their chain depths, and the roots of the full
    chains among them. Empty when the plan carries no confirmation for the save of `step` (a
    cached plan of an earlier save, say)."""
    if not answers(storage_data, step):
        return {}, {}
    keys, depths, roots = storage_data.get(PROPOSAL), storage_data.get(CONFIRMED), storage_data.get(ROOTS)
    if not isinstance(keys, list) or not isinstance(depths, bytes) or len(keys) != len(depths):
        return {}, {}
    return {k: d for k, d in zip(keys, depths) if d != NOT_STORED}, roots if isinstance(roots, dict) else {}


def chains_below(storage_data, step: int) -> dict[bytes, set]:
    """Confirmed delta key -> the keys below it down its chain (see confirm); a delta missing
    here (its chain could not be read) is not coded against."""
    below = storage_data.get(BELOW) if answers(storage_data, step) else None
    if not isinstance(below, dict):
        return {}
    return {k: set(v) for k, v in below.items() if isinstance(k, bytes) and isinstance(v, list)}


@dataclass
class RankDeltas:
    """One rank's delta coding in one save: what it may code against, and the cache it fills."""

    previous: Cache | None
    stored: dict  # confirmed key -> chain depth
    roots: dict  # confirmed key whose chain is full -> its chain's root (a full object file)
    max_chain: int
    memory: int | None = None  # bytes of this save kept for the next; None: all (CasWriter's delta_memory)
    below: dict = field(default_factory=dict)  # confirmed delta key -> keys below it (chains_below)

    def __post_init__(self) -> None:
        self.keeper = Keeper(self.previous.shards if self.previous is not None else None, self.memory)

    @property
    def current(self) -> Cache:
        """The bases this save leaves for the next (filled by keep)."""
        return Cache(self.keeper.current)

    def base(self, shard, skew: int, nbytes: int, index: int, start: int, end: int) -> tuple | None:
        """(key, bytes, depth, below) of the previous save's chunk at this position, when it is
        stored and its chain is shorter than max_chain (below: (its own base's key, that base's
        bytes) when they were kept; the caller checks the stored chunk is still that delta);
        (root key, None, 0, None) when the chain is full and its root can be read (the caller
        decodes it); else None."""
        prev = self.previous.shards.get(shard) if self.previous is not None and shard is not None else None
        if prev is None or prev.skew != skew or prev.nbytes != nbytes or index >= len(prev.keys):
            return None
        key = prev.keys[index]
        depth = self.stored.get(key)
        if depth is None or self.max_chain == 0:
            return None
        if depth >= self.max_chain:
            root = self.roots.get(key)
            return (root, None, 0, None) if isinstance(root, bytes) else None
        if depth > 0 and key not in self.below:  # its chain could not be read: no telling what is below
            return None
        _, data, below = prev.chunk(index, start, end)
        return key, data, depth, below

    def keep(self, shards: list[tuple[tuple, TensorBases, Callable[[], np.ndarray]]], written: dict) -> None:
        """Remember shards just written, for the next save (store/bases.py's Keeper: their bytes
        while they fit in `memory`, in plan order, else only their keys; within the same budget,
        the previous bytes of their chunks written as deltas, `written`: key -> base key)."""
        self.keeper.keep(shards, written)
