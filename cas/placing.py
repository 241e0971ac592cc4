"""Placing: where a write session's encoded objects go, and the packs that take them.

On a local disk a pack is streamed as the save runs: a large object goes straight into it, and
small ones (nodes, biases, counters) wait to enter it together, in runs; the writer whose
entries take it past stream_target closes and finishes it. Where the backend cannot stream (a
bucket) objects gather in memory for a pack written at once (cas/packs.py lays its small ones
out together too). Every object placed is indexed at the session's commit, which is
WriteSession's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from . import faults
from .index import WHERE_PACK, Index, ObjectRecord
from .packs import PackStream, salt_entry
from .readahead import SMALL

if TYPE_CHECKING:
    from .objectstore import ObjectStore

RUN_BYTES = 1 << 20  # small objects a streamed pack takes at once, side by side (_pack_entry)


class Placing:
    """WriteSession's placement of objects in packs (a mixin: it shares the session's lock and
    its records of what was written)."""

    index: Index
    _lock: threading.Lock
    _written: dict[bytes, ObjectRecord]
    store: "ObjectStore"

    def _start_placing(self) -> None:
        # Packs written as objects arrive (local stores): the open one, every one not yet
        # finished, and what the index will need of each entry once its pack has a name.
        self._stream: PackStream | None = None
        self._streams: list[PackStream] = []
        self._streamed: dict[bytes, tuple] = {}  # key -> (raw size, base, depth)
        self._no_stream = False  # the backend cannot stream: small objects gather in memory
        self._run: list[tuple] = []  # small objects waiting to enter the streamed pack together (_pack_entry)
        self._run_bytes = 0
        self._pending_small: dict[bytes, tuple] = {}  # key -> (encoded, raw size, base, depth)
        self._pending_bytes = 0

    def _pack_entry(self, key: bytes, parts: list, size: int, raw_size: int, base: bytes | None,
                    depth: int) -> None:
        """Put one encoded object into a pack. Where the backend streams packs (local stores),
        a large one goes straight into the streamed pack, and a small one (a node, a bias, a
        counter: readahead.SMALL bytes at most) waits for the others, to enter it as one run
        (RUN_BYTES at a time, and the rest at commit). An encrypted store opens the message
        holding a small object whole: strewn between chunks, a small model's 48 small reads
        opened their neighbours' bytes, 3-7 ms of its load's threads against 10 ms for its
        23 MB of chunks (under 1 ms together).
        Elsewhere (a bucket) objects gather in memory for a pack written at once, which lays
        its small ones out together too (cas/packs.py)."""
        if self._no_stream:
            self._add_small(key, b"".join(parts), raw_size, base, depth)  # one copy, of buffers reused next
            return
        if size > SMALL:
            self._stream_entries([(key, parts, size, raw_size, base, depth)])
            return
        blob = b"".join(parts)  # (a copy: `parts` may be a worker's reused buffers)
        with self._lock:
            self._run.append((key, [blob], len(blob), raw_size, base, depth))
            self._run_bytes += len(blob)
            run = self._take_run() if self._run_bytes >= RUN_BYTES else None
        if run:
            self._stream_entries(run)

    def _take_run(self) -> list:
        """The small objects waiting for the streamed pack (under the lock)."""
        run, self._run, self._run_bytes = self._run, [], 0
        return run

    def _stream_entries(self, items: list[tuple]) -> None:
        """Write (key, parts, size, raw size, base, depth) entries side by side into the
        streamed pack (opened on first use; closed and finished by the writer whose entries
        take it past stream_target), or gather them for a pack written at once where the
        backend cannot stream."""
        while True:
            with self._lock:
                stream = self._stream
                if stream is None and not self._no_stream:
                    stream = self.store.packs.stream()
                    self._no_stream = stream is None
                    if stream is not None:
                        self._stream = stream
                        self._streams.append(stream)
            if stream is None:
                for key, parts, _, raw_size, base, depth in items:
                    self._add_small(key, b"".join(parts), raw_size, base, depth)
                return
            start = stream.reserve([(key, size, raw_size, base) for key, _, size, raw_size, base, _ in items])
            if start is not None:
                break
            with self._lock:  # closed by another writer: the next entries open the next pack
                if self._stream is stream:
                    self._stream = None
        with self._lock:
            for key, _, _, raw_size, base, depth in items:
                self._streamed[key] = (raw_size, base, depth)
            closing = stream.size >= self.store.stream_target and self._stream is stream
            if closing:
                self._stream = None
        if closing:
            stream.close()
        stream.write(start, [(key, parts) for key, parts, *_ in items])
        if closing:
            self._finish_stream(stream)

    def _finish_stream(self, stream: PackStream) -> None:
        """Finish a streamed pack (waiting for its entries still being written) and record
        where each of its objects lives; they are indexed at commit."""
        pack, entries = stream.finish()
        faults.point("session.pack_written")
        with self._lock:
            for e in entries:
                raw_size, base, depth = self._streamed[e.key]
                self._written[e.key] = ObjectRecord(WHERE_PACK, e.length, raw_size, pack, e.offset, base, depth)
            for e in entries:
                self._streamed.pop(e.key, None)
            self._streams.remove(stream)

    def _add_small(self, key: bytes, blob: bytes, raw_size: int, base: bytes | None, depth: int) -> None:
        with self._lock:
            self._pending_small[key] = (blob, raw_size, base, depth)
            self._pending_bytes += len(blob)
            full = self._pending_bytes >= self.store.pack_target
        if full:
            self._flush_pack()

    def _flush_pack(self) -> None:
        """Write the gathered small objects as one pack; they are indexed at commit."""
        with self._lock:
            pending, self._pending_small, self._pending_bytes = self._pending_small, {}, 0
        if not pending:
            return
        pack, placed = self.store.packs.write([(k, item[0], item[1], item[2]) for k, item in pending.items()],
                                              avoid=self._deleted_name, salt=self._salt)
        faults.point("session.pack_written")
        with self._lock:
            for key, offset, length in placed:
                if key not in pending:
                    continue  # the salt
                _, raw_size, base, depth = pending[key]
                self._written[key] = ObjectRecord(WHERE_PACK, length, raw_size, pack, offset, base, depth)

    def _deleted_name(self, pack: bytes) -> bool:
        """Whether a bucket's gc deleted a pack of this name, as this host's cache has it
        (packs are named by their bytes: the same objects written again in the same order)."""
        with self.index.read() as txn:
            return bool(self.index.packs_gone(txn, [pack]))

    def _salt(self) -> tuple[bytes, bytes, int, None]:
        return salt_entry(self.store.codec, self.store.namer)
