"""Save and load pipelines: chunk, hash, encode and write (or read, decode and verify) tensors in
a bounded thread pool.

blake3, zstd and file I/O release the GIL, so a pool as wide as the machine keeps every core
busy. Memory is bounded by a window of in-flight chunk bytes, not by the checkpoint size: a
CPU tensor is read in place, and a tensor that needs a host copy (CUDA, non-contiguous) is
copied only when its chunks enter the window.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterable, Iterator

import numpy as np

from cas import faults
from cas.errors import CorruptionError
from cas.hashing import hash_bytes
from cas.objectstore import ObjectStore, WriteSession

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
            yield leaf, i, data[start:end]


def _batches(items: Iterator, max_count: int, max_bytes: int) -> Iterator[list]:
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += item[2].nbytes
        if len(batch) >= max_count or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_tensors(session: WriteSession, leaves: list[TensorLeaf], pool: ThreadPoolExecutor,
                  window_bytes: int) -> None:
    """Fill every leaf's chunk keys and store the chunks the store lacks."""
    inflight: deque[tuple[int, Future]] = deque()
    inflight_bytes = 0
    try:
        for batch in _batches(_chunks(leaves), CLAIM_BATCH, max(window_bytes // 2, 1)):
            keys = list(pool.map(lambda c: hash_bytes(c[2]), batch))
            stored = session.claim(keys)
            faults.point("save.hashed")
            for (leaf, i, view), key, present in zip(batch, keys, stored):
                leaf.chunks[i] = key
                if not present:
                    inflight.append((view.nbytes, pool.submit(session.write, key, view, leaf.group)))
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


def write_blobs(session: WriteSession, blobs: dict[bytes, bytes], pool: ThreadPoolExecutor) -> None:
    """Store small objects (manifest nodes) under their keys, skipping those already stored."""
    keys = list(blobs)
    stored = session.claim(keys)
    futures = [pool.submit(session.write, k, blobs[k]) for k, present in zip(keys, stored) if not present]
    for fut in futures:
        fut.result()


def read_tensor_chunks(objects: ObjectStore, jobs: list[tuple[str, bytes, np.ndarray]],
                       pool: ThreadPoolExecutor, window: int) -> None:
    """Decode each (tensor path, chunk key, output slice) straight into its slice, verifying
    every chunk's hash; a damaged chunk raises a CorruptionError naming the tensor."""

    def one(job):
        path, key, out = job
        try:
            objects.get(key, out)
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
