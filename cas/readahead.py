"""Reads of small objects from a bucket, a window at a time, and the read generation that keeps
every cache of reads from answering a verify with bytes read before it.

A load walks a checkpoint's manifest nodes one after another (each names the next ones), and
a save writes them side by side at the end of one pack: 64 tensors make 64 nodes of about 110
bytes each. In a bucket every read is a request, so a fresh host's load of such a state made
66 small GETs in a row before its first chunk (0.14 s against a SeaweedFS on the same host; at
a cloud bucket's 15-30 ms a request, one to two seconds, and a second per 50 more tensors). An
encrypted store did not: its reader opens the 1 MiB segment holding a small object and keeps
it (cas/crypt.py). `Windows` gives every store in a bucket the same: a small read asked to read
ahead fetches the 256 KiB-aligned window around it, and the next small reads in that window are
answered from memory. Packs in a bucket are never rewritten (a name taken is kept, cas/packs.py),
so a window can only be stale if the bucket's bytes were damaged after it was fetched, which is
what a verify looks for: it reads `reading_from_disk()`, and no window fetched before it (nor
any opened segment of an encrypted store) answers for it; the windows it fetches itself answer
its own reads (a verify of 96 small tensors: 392 GETs -> 3; an encrypted store's verify of
800 small tensors opened a segment per object, 5x its plain store's time, and now opens each
once). Every object read from a window is still checked against its hash, like any other.

A window costs at most its 256 KiB over the small read it replaces (a few ms of a bucket's
bandwidth, less than a request's latency); reads of object heads (stats, verify's quick pass,
recode's lookups), spread one per chunk, never ask for one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

WINDOW = 256 << 10  # bytes per window, aligned in the blob
SMALL = 64 << 10  # reads up to this many bytes take their windows
KEEP = 64  # windows of WINDOW bytes a store keeps (16 MiB; as many bytes of larger windows)


class _DiskReads:
    """The read generation, which every start and end of a reading_from_disk context (a
    verify) moves on. What a store keeps of its reads (a bucket store's windows, an encrypted
    store's opened segments and blob salts) carries the generation it was read in and answers
    only reads of the same one: so nothing read before a verify answers it, what the verify
    reads answers its own later reads (the store as it is now), and none of it outlives it."""

    def __init__(self) -> None:
        self.generation = 0
        self._lock = threading.Lock()

    @contextmanager
    def forced(self) -> Iterator[None]:
        with self._lock:
            self.generation += 1
        try:
            yield
        finally:
            with self._lock:
                self.generation += 1


_DISK_READS = _DiskReads()


def reading_from_disk():
    """A context in which every read goes to the store's bytes as they are now: no segment
    opened, no window fetched before it answers. A verify runs in it: bytes read before a blob
    was damaged would otherwise answer for the damaged blob."""
    return _DISK_READS.forced()


def read_generation() -> int:
    """The current read generation: take it before a read whose bytes a cache will keep."""
    return _DISK_READS.generation


class Windows:
    """The most recently fetched windows of a backend's immutable blobs (packs in a bucket),
    shared by a store's read threads. Entries are `bytes` (never written again), so a view
    handed out stays valid after the window is evicted.

    A window is WINDOW bytes, or the backend's `read_unit` rounded up to a multiple of it where
    that is larger (an encrypted store opens whole 1 MiB segments: a 256 KiB window fetched one
    anyway, and the next window in it fetched it again). A window being fetched is fetched once:
    the threads of a load that ask for it meanwhile wait for that fetch (a fresh host's load of a
    small model fetched three of its windows twice, its encrypted store one segment three times)."""

    def __init__(self, backend, keep: int | None = None) -> None:
        unit = getattr(backend, "read_unit", None) or WINDOW
        self._backend = backend
        self.size = -(-WINDOW // unit) * unit
        self._keep = keep if keep is not None else max(4, KEEP * WINDOW // self.size)
        self._table: OrderedDict[tuple[str, int], tuple[int, bytes]] = OrderedDict()  # -> (generation, bytes)
        self._fetching: dict[tuple[str, int], threading.Event] = {}  # windows a thread is fetching now
        self._lock = threading.Lock()

    def read(self, name: str, start: int, length: int):
        """Bytes [start, start + length) of blob `name` from its windows (fetched in one ranged
        read unless all are held from this generation), or None when they do not hold all of it
        (the blob is shorter): the caller then reads it directly, and reports what is wrong."""
        if length <= 0 or length > SMALL:
            return None
        size = self.size
        first, last = start // size, (start + length - 1) // size
        span = [(name, i) for i in range(first, last + 1)]
        generation = read_generation()  # (taken before the fetch: a verify begun meanwhile moves it on)
        while True:
            with self._lock:
                kept = [self._table.get(w) for w in span]
                held = [window for gen, window in filter(None, kept) if gen == generation]
                if len(held) == len(span):
                    for w in span:
                        self._table.move_to_end(w)
                    break
                busy = next((self._fetching[w] for w in span if w in self._fetching), None)
                if busy is None:
                    mine = threading.Event()
                    self._fetching.update((w, mine) for w in span)
            if busy is not None:  # another thread is fetching one of them: take it from there
                busy.wait()
                continue
            try:
                data = bytes(self._backend.get(name, first * size, (last + 1 - first) * size))
                held = [data[i * size:(i + 1) * size] for i in range(last + 1 - first)]
                with self._lock:
                    for w, window in zip(span, held):
                        self._table[w] = (generation, window)
                        self._table.move_to_end(w)
                    while len(self._table) > self._keep:
                        self._table.popitem(last=False)
            finally:
                with self._lock:
                    for w in span:
                        self._fetching.pop(w, None)
                mine.set()
            break
        at = start - first * size
        if len(held) == 1:
            return memoryview(held[0])[at:at + length] if at + length <= len(held[0]) else None
        joined = b"".join(held)
        if any(len(window) < size for window in held[:-1]) or at + length > len(joined):
            return None
        return memoryview(joined)[at:at + length]


__all__ = ["KEEP", "SMALL", "WINDOW", "Windows", "read_generation", "reading_from_disk"]
