"""The layout of a sealed blob (cas/crypt.py seals and opens them; docs/format.md, "Sealed
blobs"): its header, its segments and their nonces, the sizes either way; and `SealedStream`,
which seals a blob as a save's workers stream it.

    magic (8 bytes) | salt (16 bytes) | segment 0 + tag | segment 1 + tag | ...
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable

from .backend import Staged
from .buffers import POOL, copy_bytes
from .keys import SEGMENT

TAG = 16
BLOB_MAGIC = b"casenc1\n"  # bound to its name
STREAM_MAGIC = b"casenc2\n"  # streamed: bound to its folder (cas/crypt.py)
SALT = 16
HEADER = len(BLOB_MAGIC) + SALT
SPLIT_OVER = 4 + 3 * TAG  # what a scheme-4 slot adds: its split message (4 bytes sealed) and two tags


def sealed_size(plain: int, segment: int = SEGMENT, over: int = TAG) -> int:
    """A blob's sealed size from its plain one (`over`: the bytes sealing adds per segment)."""
    return HEADER + plain + over * max(1, -(-plain // segment))


def plain_size(sealed: int, segment: int = SEGMENT, over: int = TAG) -> int:
    body = sealed - HEADER
    if body < over:
        return 0
    return body - over * max(1, -(-body // (segment + over)))


def segment_at(i: int, segment: int, over: int = TAG) -> int:
    """Where segment i of a sealed blob starts."""
    return HEADER + i * (segment + over)


@dataclass(frozen=True)
class Layout:
    """A store's sealed layout: plain bytes per segment (slot), and whether each is split where
    entries meet (scheme 4: cas/slots.py, 52 bytes more per slot) or one message (16 more)."""

    segment: int = SEGMENT
    split: bool = True

    @property
    def over(self) -> int:
        return SPLIT_OVER if self.split else TAG

    def at(self, i: int) -> int:
        return segment_at(i, self.segment, self.over)

    def sealed_size(self, plain: int) -> int:
        return sealed_size(plain, self.segment, self.over)

    def plain_size(self, sealed: int) -> int:
        return plain_size(sealed, self.segment, self.over)


def nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


class Pieces:
    """The parts of a write seen as one run of bytes, any range of which is a list of views of
    the parts it lies in (sealed from there with no gather: cas/keys.py BlobCipher)."""

    def __init__(self, parts: Iterable) -> None:
        self.parts = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        self.starts = list(accumulate((len(v) for v in self.parts), initial=0))
        self.total = self.starts[-1]

    def boundary_in(self, lo: int, hi: int) -> int:
        """The first place strictly inside (lo, hi) where one part ends and the next begins; hi
        when there is none."""
        i = bisect.bisect_right(self.starts, lo)
        return self.starts[i] if i < len(self.starts) and self.starts[i] < hi else hi

    def views(self, lo: int, hi: int) -> list[memoryview]:
        """Bytes [lo, hi) as views of the parts they lie in, in order (no copy)."""
        out: list[memoryview] = []
        i = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            off = lo - self.starts[i]
            take = min(hi - lo, len(self.parts[i]) - off)
            out.append(self.parts[i][off:off + take])
            lo, i = lo + take, i + 1
        return out


class StreamSealer:
    """What the streamed writers of every sealing scheme share: the header written first, each
    sealed piece written at its place, and the plain bytes gathered so far (pool buffers) given
    back when the stream is dropped."""

    def __init__(self, inner, aead, aad: bytes, salt: bytes, layout: Layout) -> None:
        self._inner, self._aead, self._aad, self._layout = inner, aead, aad, layout
        self._seg = layout.segment
        self._lock = threading.Lock()
        self._partial: dict = {}  # what gathers: -> [a pool buffer of its plain bytes, how many]
        self._end = 0  # plain bytes: the furthest any write reached
        self._write(0, STREAM_MAGIC + salt)

    def write_at(self, offset: int, parts: list) -> int:
        """Seal and write a write's plain bytes at `offset` (each scheme's `_place`); its length."""
        pieces = Pieces(parts)
        if pieces.total:
            self._place(offset, pieces)
        return pieces.total

    def _write(self, at: int, data) -> None:
        if self._inner.write_at(at, [data]) != len(data):
            raise OSError("a sealed segment was written short")

    def _gathered(self, key, at: int, parts: list, length: int):
        """Copy a write's parts into the gather buffer of `key` from `at`: the buffer once it
        holds all `length` bytes (no longer pending: the caller seals it and gives it back to
        the pool), else None."""
        with self._lock:
            slot = self._partial.get(key)
            if slot is None:
                slot = self._partial[key] = [POOL.take(self._seg), 0]
            for part in parts:
                copy_bytes(memoryview(slot[0])[at:at + len(part)], part)
                at, slot[1] = at + len(part), slot[1] + len(part)
            if slot[1] != length:
                return None
            del self._partial[key]
            return slot[0]

    def writeback(self, offset: int, nbytes: int) -> None:
        seg = self._seg
        first, stop = offset // seg, (offset + nbytes) // seg
        if stop > first:
            self._inner.writeback(self._layout.at(first), (stop - first) * (seg + self._layout.over))

    def discard(self) -> None:
        with self._lock:
            pending = list(self._partial.values())
            self._partial.clear()
        for slot in pending:
            POOL.give(slot[0])
        self._inner.discard()


class SealedStream(StreamSealer):
    """A blob sealed as it is streamed (a pack written at offsets by a save's workers, named
    only once complete: cas/packs.py PackStream), with the STREAM_MAGIC header. Writers give
    plain bytes at plain offsets, from several threads at once; a segment a write covers whole
    is sealed from the write's parts and written at its place straight away (no copy), and one
    shared with a neighbouring write is gathered until all its bytes are in.
    The last segment, sealed as the last (possibly empty), is written at close, when the
    blob's length is known. Plain bytes reach the inner file only sealed."""

    def __init__(self, inner, aead, aad: bytes, salt: bytes, segment: int = SEGMENT) -> None:
        super().__init__(inner, aead, aad, salt, Layout(segment, split=False))  # (partial: segment -> its gather)

    def _seal(self, i: int, parts: list, last: bool, out) -> memoryview:
        n = sum(len(p) for p in parts)
        self._aead.seal_parts_into(nonce(i, last), parts, self._aad, out[:n + TAG])
        return out[:n + TAG]

    def _seal_one(self, i: int, plain, last: bool) -> None:
        """Seal segment i alone and write it at its place."""
        out = POOL.take(len(plain) + TAG)
        try:
            self._write(self._layout.at(i), self._seal(i, [plain], last, memoryview(out)))
        finally:
            POOL.give(out)

    def _place(self, offset: int, pieces: Pieces) -> None:
        end, seg = offset + pieces.total, self._seg
        whole_lo, whole_hi = -(-offset // seg), end // seg  # segments this write covers whole
        if whole_hi > whole_lo:
            buf = POOL.take(seg + TAG)
            try:
                out = memoryview(buf)
                for i in range(whole_lo, whole_hi):
                    self._write(self._layout.at(i),
                                self._seal(i, pieces.views(i * seg - offset, (i + 1) * seg - offset), False, out))
            finally:
                POOL.give(buf)
        for i in sorted({offset // seg, (end - 1) // seg} - set(range(whole_lo, whole_hi))):
            lo, hi = max(offset, i * seg), min(end, (i + 1) * seg)
            self._gather(i, lo - i * seg, pieces.views(lo - offset, hi - offset))
        with self._lock:
            self._end = max(self._end, end)

    def _gather(self, i: int, at: int, parts: list) -> None:
        full = self._gathered(i, at, parts, self._seg)
        if full is not None:  # never the last: a blob's last segment is shorter than SEGMENT (close)
            try:
                self._seal_one(i, memoryview(full)[:self._seg], False)
            finally:
                POOL.give(full)

    def close(self, name: str, *, fsync: bool = True) -> Staged:
        """Seal and write the last segment, then end the inner stream (a staged blob for `name`)."""
        with self._lock:
            last, pending = self._end // self._seg, dict(self._partial)
            self._partial.clear()
        n = self._end - last * self._seg
        slot = pending.pop(last, None)
        try:
            if pending or (n and (slot is None or slot[1] != n)):
                self._inner.discard()
                raise OSError(f"a sealed stream was closed with bytes of {len(pending) + (n > 0)} segment(s) "
                              "never written")
            self._seal_one(last, memoryview(slot[0])[:n] if slot is not None else b"", True)
        finally:
            for one in [slot, *pending.values()]:
                if one is not None:
                    POOL.give(one[0])
        return self._inner.close(name, fsync=fsync)
