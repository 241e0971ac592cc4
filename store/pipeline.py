"""Save and load pipelines: chunk, hash, encode and write (or read, decode and verify) tensors in
a bounded thread pool.

blake3, zstd and file I/O release the GIL, so a pool as wide as the machine keeps every core
busy. Memory is bounded by a window of in-flight chunk bytes, not by the checkpoint size: a
CPU tensor is read in place, and a tensor that needs a host copy (CUDA, non-contiguous) is
copied only when its chunks enter the window.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator

import numpy as np

from cas import faults
from cas.transforms import scratch
from cas.chains import last_below
from cas.errors import CorruptionError
from cas.objectstore import ObjectStore, WriteSession

from .bases import TensorBases
from .tree import TensorLeaf, chunk_spans

CLAIM_BATCH = 64  # chunks hashed, then claimed in one index transaction


def _chunks(leaves: Iterable[TensorLeaf]) -> Iterator[tuple[TensorLeaf, int, np.ndarray]]:
    for leaf in leaves:
        if leaf.nbytes == 0:
            continue
        data = leaf.bytes_view()
        spans = list(chunk_spans(leaf.nbytes, leaf.chunk_size, leaf.skew))
        leaf.chunks = [None] * len(spans)
        for i, (start, end) in enumerate(spans):
            yield leaf, i, data[start:end], start


def batches(items: Iterable, nbytes: Callable[[object], int], max_bytes: int,
            max_count: int | None = None) -> Iterator[list]:
    """Group items into lists of at most `max_bytes` (as `nbytes` measures them; a list closes
    once it reaches the bound) and at most `max_count` items: what bounds memory in flight."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += nbytes(item)
        if size >= max_bytes or (max_count is not None and len(batch) >= max_count):
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _base_of(bases: dict[str, TensorBases], leaf: TensorLeaf, i: int, view: np.ndarray,
             start: int) -> tuple | None:
    """(key, bytes or None, (its own base's key, that base's bytes) or None) of the previous
    save's chunk at the same position of the same tensor, if the layout matches."""
    base = bases.get(leaf.path)
    if base is None or not leaf.floating or not base.matches(leaf.nbytes, leaf.chunk_size, leaf.skew):
        return None
    return base.chunk(i, start, start + view.nbytes)


def write_tensors(session: WriteSession, leaves: list[TensorLeaf], pool: ThreadPoolExecutor,
                  window_bytes: int, bases: dict[str, TensorBases] | None = None, max_chain: int = 0,
                  hash_pool: ThreadPoolExecutor | None = None) -> None:
    """Fill every leaf's chunk keys and store the chunks the store lacks; with `bases`, a changed
    chunk may be coded as a delta against the previous save's chunk at its position, as long as
    that base is stored and its chain is shorter than `max_chain`. Hashing runs on `hash_pool`
    when given, so the next batch is hashed while the previous one is encoded and written."""
    bases = bases or {}
    namer = session.store.namer  # the store's object names (keyed when encrypted)
    inflight: deque[tuple[int, Future]] = deque()
    inflight_bytes = 0
    try:
        for batch in batches(_chunks(leaves), lambda c: c[2].nbytes, max(window_bytes // 2, 1), CLAIM_BATCH):
            keys = list((hash_pool or pool).map(lambda c: namer.key(c[2]), batch))
            candidates = [_base_of(bases, *item) if bases else None for item in batch]
            session.hold([c[0] for c in candidates if c is not None] + keys)  # one index transaction
            stored = session.claim(keys)
            faults.point("save.hashed")
            todo = [(leaf, i, view, key, cand) for (leaf, i, view, _), key, present, cand
                    in zip(batch, keys, stored, candidates) if not present]
            for (leaf, i, view, _), key in zip(batch, keys):
                leaf.chunks[i] = key
            for (leaf, i, view, key, cand), base in zip(todo, _delta_bases(session, todo, max_chain)):
                inflight.append((view.nbytes, pool.submit(_write_chunk, session, key, view, leaf.group, base)))
                inflight_bytes += view.nbytes
            while inflight and inflight_bytes > window_bytes:
                size, fut = inflight.popleft()
                fut.result()
                inflight_bytes -= size
        for _, fut in inflight:
            fut.result()
    except BaseException:
        wait([f for _, f in inflight])  # no worker may still write once the caller aborts
        raise


def _delta_bases(session: WriteSession, todo: list, max_chain: int) -> list:
    """Per chunk to write, what it may be coded against: (key, raw bytes, depth, below) of the
    previous save's chunk while its chain is shorter than `max_chain` (bytes None when only its
    key was kept: the worker decodes it; below, the bytes of that chunk's own base, when they
    were kept and the stored chunk is still a delta of that base); once the chain is full,
    (key, None, 0, None) of the chain's root (a full object, decoded by the worker), so a long
    chain ends in a delta against its root rather than in a full copy; or None."""
    out: list = []
    full: dict[int, bytes] = {}  # position -> the previous chunk whose chain is full
    for n, (_, _, _, key, cand) in enumerate(todo):
        depth = session.depth(cand[0]) if cand is not None and cand[0] != key else None
        if depth is not None and depth < max_chain:
            below = cand[2][1] if cand[2] is not None and session.base_of(cand[0]) == cand[2][0] else None
            out.append((cand[0], cand[1], depth, below))
            continue
        out.append(None)
        if depth is not None and max_chain > 0:
            full[n] = cand[0]
    deltas = {n: base[0] for n, base in enumerate(out) if base is not None and base[2] > 0}
    try:
        chains = session.store.chains(list(full.values()) + list(deltas.values())) if full or deltas else {}
    except CorruptionError:  # a damaged index (a cycle of bases) is verify's to report: these chunks go whole
        chains = {}
    for n, base in deltas.items():  # a chunk whose key is below its base (a rollback over a lost file): whole
        if base not in chains or todo[n][3] in chains[base]:
            out[n] = None
    roots = {n: chains[top][-1] for n, top in full.items() if top in chains}
    if roots:  # held from here on, so no gc can take a root before the commit
        present = session.hold(list(roots.values()))
        for (n, root), ok in zip(roots.items(), present):
            out[n] = (root, None, 0, None) if ok else None
    return out


def _write_chunk(session: WriteSession, key: bytes, view: np.ndarray, group: int, base: tuple | None) -> int:
    if base is not None and base[1] is None:  # a chain root, or a base whose bytes were not kept
        try:
            base = decoded_base(session.store, base[0], view.nbytes, base[2])
        except CorruptionError:
            base = None  # a damaged base is verify's to report; this chunk is stored whole
    return session.write(key, view, group, base)


def decoded_base(objects: ObjectStore, key: bytes, nbytes: int, depth: int) -> tuple:
    """(key, raw bytes, depth, below) of a stored base decoded in this worker thread (into its
    per-thread buffers); for a delta, `below` is its own base's bytes, which its decode passes
    through anyway (a `linear` delta may extrapolate from the two)."""
    chain = objects.chain(key)
    raw = objects.get(key, root_buffer(nbytes), chain=chain)
    return key, raw, depth, last_below(nbytes) if len(chain) > 1 else None


def root_buffer(nbytes: int) -> np.ndarray:
    """A per-thread buffer for decoded chain roots (Store.save's workers and DCP ranks'): fresh
    memory is slow to touch here."""
    return scratch(nbytes, "chain root")


def write_blobs(session: WriteSession, blobs: dict[bytes, bytes], pool: ThreadPoolExecutor) -> None:
    """Store small objects (manifest nodes) under their keys, skipping those already stored."""
    keys = list(blobs)
    stored = session.claim(keys)
    futures = [pool.submit(session.write, k, blobs[k]) for k, present in zip(keys, stored) if not present]
    for fut in futures:
        fut.result()


def _decoded_or_none(objects: ObjectStore, key: bytes) -> np.ndarray | None:
    """A shared base, or None when it is damaged: then each chunk needing it reports that."""
    try:
        return objects.get(key)
    except CorruptionError:
        return None


def read_tensor_chunks(objects: ObjectStore, jobs: list[tuple[str, bytes, np.ndarray, bool]],
                       pool: ThreadPoolExecutor, window: int) -> None:
    """Decode each (tensor path, chunk key, output slice, guarded) into its slice, verifying
    every chunk's hash; a damaged chunk raises a CorruptionError naming the tensor. A guarded
    slice (a caller's own tensor, for restore) gets only verified bytes: the chunk is decoded
    in a per-thread buffer and copied after its check (a copy costs a tenth of a decode); an
    unguarded one (a new tensor) is decoded in place. Delta bases that several chunks' chains
    share are decoded once, first (up to `window` of them)."""
    chains = objects.chains(key for _, key, _, _ in jobs)
    uses = Counter(base for chain in chains.values() for base in chain[1:])
    shared = [base for base, n in uses.items() if n > 1][:window]
    decoded = {base: raw for base, raw in zip(shared, pool.map(lambda k: _decoded_or_none(objects, k), shared))
               if raw is not None}

    def one(job):
        path, key, out, guarded = job
        try:
            if guarded:
                out[:] = objects.get(key, scratch(out.size, "verified"), chain=chains[key], decoded=decoded)
            else:
                objects.get(key, out, chain=chains[key], decoded=decoded)
        except CorruptionError as exc:
            raise exc.located(path=path) from None

    inflight: deque[Future] = deque()
    try:
        for job in jobs:
            inflight.append(pool.submit(one, job))
            if len(inflight) >= window:
                inflight.popleft().result()
        while inflight:
            inflight.popleft().result()
    except BaseException:
        wait(list(inflight))
        raise
