"""Large byte buffers shared by every thread and store of a process (bytes only, no keys).

A store's thread pools are new for every open store, and fresh memory is slow to touch on this
kind of VM (about 1 GB/s, less than a cipher pass or a decode): sealing and opening buffers
(cas/crypt.py) and each read thread's buffer (cas/objectstore.py) are taken from here and given
back, so a new store's threads reuse warm memory.
"""

from __future__ import annotations

import threading

POOL_BYTES = 192 << 20  # at most this much kept between uses


class BufferPool:
    def __init__(self, keep: int = 16) -> None:
        self._free: list[bytearray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least `nbytes` (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        return bytearray(max(nbytes, 1 << 20))

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > self._keep or sum(map(len, self._free)) > POOL_BYTES:
                self._free.remove(min(self._free, key=len))


POOL = BufferPool()


class ThreadBuffer:
    """One thread's pooled buffer, given back to the pool when the thread ends (its
    threading.local goes) or outgrows it."""

    __slots__ = ("buf", "view")

    def __init__(self, nbytes: int) -> None:
        self.buf = POOL.take(nbytes)
        self.view = memoryview(self.buf)

    def __del__(self) -> None:
        POOL.give(self.buf)
