"""Large byte buffers shared by every thread and store of a process (bytes only, no keys).

A store's thread pools are new for every open store, and fresh memory is slow to touch on this
kind of VM (about 1 GB/s, less than a cipher pass or a decode): sealing and opening buffers
(cas/crypt.py) and each read thread's buffer (cas/objectstore.py) are taken from here and given
back, so a new store's threads reuse warm memory.

A new buffer is `numpy.empty`, not `bytearray(n)`: bytearray zero-fills it while holding the
GIL, so the first touch of fresh pages (slow on a VM) ran one thread at a time; the loads and
saves of an encrypted store, whose threads each take one, stalled on it as cores were added
(16 cores: an encrypted load took 3.2x a plain one). Empty pages are first touched by the
cipher or the read that fills them, outside the GIL, in parallel.
"""

from __future__ import annotations

import threading

import numpy as np

POOL_BYTES = 192 << 20  # at most this much kept between uses
POOL_COUNT = 64  # and at most this many (a read thread holds one; a bucket store runs two per core)


class BufferPool:
    def __init__(self, keep: int = POOL_COUNT) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._lock = threading.Lock()
        self.made = 0  # new buffers made so far (the rest were reused)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes` (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            if fits:  # (by position: arrays compare element by element, so list.remove is out)
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
            self.made += 1
        return np.empty(max(nbytes, 1 << 20), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > self._keep or sum(map(len, self._free)) > POOL_BYTES:
                self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))


POOL = BufferPool()

_GIL_FREE_COPY = 64 << 10  # numpy's call costs a few microseconds more: worth it from here on


def fresh(nbytes: int) -> memoryview:
    """A new writable byte buffer, not zero-filled (bytearray's memset holds the GIL)."""
    return memoryview(np.empty(nbytes, dtype=np.uint8))


def copy_bytes(dst, src) -> None:
    """dst[:] = src, for byte buffers of one length. A memoryview's slice assignment holds the
    GIL through its memcpy, so the cipher calls of other threads, each of which must take the
    GIL back when it ends, wait for it; numpy lets the GIL go while it copies."""
    if len(src) >= _GIL_FREE_COPY:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        memoryview(dst).cast("B")[:] = memoryview(src).cast("B")


class ThreadBuffer:
    """One thread's pooled buffer, given back to the pool when the thread ends (its
    threading.local goes) or outgrows it."""

    __slots__ = ("buf", "view")

    def __init__(self, nbytes: int) -> None:
        self.buf = POOL.take(nbytes)
        self.view = memoryview(self.buf)

    def __del__(self) -> None:
        POOL.give(self.buf)
