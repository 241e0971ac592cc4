"""The layout of a sealed blob (cas/crypt.py seals and opens them; docs/format.md, "Sealed
blobs"): its header, its segments and their nonces, the sizes either way; and `SealedStream`,
which seals a blob as a save's workers stream it.

    magic (8 bytes) | salt (16 bytes) | segment 0 + tag | segment 1 + tag | ...
"""

from __future__ import annotations

import bisect
import threading
from itertools import accumulate
from typing import Iterable

from .backend import Staged
from .buffers import POOL, copy_bytes, fresh
from .keys import SEGMENT

TAG = 16
BLOB_MAGIC = b"casenc1\n"  # bound to its name
STREAM_MAGIC = b"casenc2\n"  # streamed: bound to its folder (cas/crypt.py)
SALT = 16
HEADER = len(BLOB_MAGIC) + SALT


def sealed_size(plain: int, segment: int = SEGMENT) -> int:
    return HEADER + plain + TAG * max(1, -(-plain // segment))


def plain_size(sealed: int, segment: int = SEGMENT) -> int:
    body = sealed - HEADER
    if body < TAG:
        return 0
    return body - TAG * max(1, -(-body // (segment + TAG)))


def segment_at(i: int, segment: int) -> int:
    """Where segment i of a sealed blob starts."""
    return HEADER + i * (segment + TAG)


def nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


class Pieces:
    """The parts of a write seen as one run of bytes, any range of which is one buffer: a view
    where it lies inside one part, else gathered into the scratch buffer given (or a new one)."""

    def __init__(self, parts: Iterable) -> None:
        self.views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        self.starts = list(accumulate((len(v) for v in self.views), initial=0))
        self.total = self.starts[-1]

    def span(self, lo: int, hi: int, scratch=None) -> memoryview | bytes:
        if hi <= lo:
            return b""
        i = bisect.bisect_right(self.starts, lo) - 1
        off = lo - self.starts[i]
        if off + hi - lo <= len(self.views[i]):
            return self.views[i][off:off + hi - lo]
        out = (memoryview(scratch) if scratch is not None and len(scratch) >= hi - lo else fresh(hi - lo))[:hi - lo]
        filled = 0
        while filled < hi - lo:
            take = min(hi - lo - filled, len(self.views[i]) - off)
            copy_bytes(out[filled:filled + take], self.views[i][off:off + take])
            filled, i, off = filled + take, i + 1, 0
        return out


class SealedStream:
    """A blob sealed as it is streamed (a pack written at offsets by a save's workers, named
    only once complete: cas/packs.py PackStream), with the STREAM_MAGIC header. Writers give
    plain bytes at plain offsets, from several threads at once; a segment a write covers whole
    is sealed and written at its place straight away (no copy, unless it spans the write's
    parts), and one shared with a neighbouring write is gathered until all its bytes are in.
    The last segment, sealed as the last (possibly empty), is written at close, when the
    blob's length is known. Plain bytes reach the inner file only sealed."""

    def __init__(self, inner, aead, aad: bytes, salt: bytes, segment: int = SEGMENT) -> None:
        self._inner, self._aead, self._aad, self._seg = inner, aead, aad, segment
        self._lock = threading.Lock()
        self._partial: dict[int, list] = {}  # segment -> [its plain bytes so far, how many]
        self._end = 0  # plain bytes: the furthest any write reached
        self._write(0, STREAM_MAGIC + salt)

    def _write(self, at: int, data) -> None:
        if self._inner.write_at(at, [data]) != len(data):
            raise OSError("a sealed segment was written short")

    def _seal(self, i: int, plain, last: bool, out) -> memoryview:
        n = len(plain)
        self._aead.encrypt_into(nonce(i, last), plain, self._aad, out[:n + TAG])
        return out[:n + TAG]

    def _seal_one(self, i: int, plain, last: bool) -> None:
        """Seal segment i alone and write it at its place."""
        self._write(segment_at(i, self._seg), self._seal(i, plain, last, fresh(len(plain) + TAG)))

    def write_at(self, offset: int, parts: list) -> int:
        pieces = Pieces(parts)
        total = pieces.total
        if not total:
            return 0
        end, seg = offset + total, self._seg
        whole_lo, whole_hi = -(-offset // seg), end // seg  # segments this write covers whole
        if whole_hi > whole_lo:
            buf = POOL.take((whole_hi - whole_lo) * (seg + TAG))
            try:
                out = memoryview(buf)
                for j, i in enumerate(range(whole_lo, whole_hi)):
                    plain = pieces.span(i * seg - offset, (i + 1) * seg - offset)
                    self._seal(i, plain, False, out[j * (seg + TAG):])
                self._write(segment_at(whole_lo, seg), out[:(whole_hi - whole_lo) * (seg + TAG)])
            finally:
                POOL.give(buf)
        for i in sorted({offset // seg, (end - 1) // seg} - set(range(whole_lo, whole_hi))):
            lo, hi = max(offset, i * seg), min(end, (i + 1) * seg)
            self._gather(i, lo - i * seg, pieces.span(lo - offset, hi - offset))
        with self._lock:
            self._end = max(self._end, end)
        return total

    def _gather(self, i: int, at: int, plain) -> None:
        with self._lock:
            slot = self._partial.get(i)
            if slot is None:
                slot = self._partial[i] = [fresh(self._seg), 0]
            copy_bytes(slot[0][at:at + len(plain)], plain)
            slot[1] += len(plain)
            full = slot[1] == self._seg
            if full:
                del self._partial[i]
        if full:  # never the last: a blob's last segment is shorter than SEGMENT (close)
            self._seal_one(i, slot[0], False)

    def writeback(self, offset: int, nbytes: int) -> None:
        seg = self._seg
        first, stop = offset // seg, (offset + nbytes) // seg
        if stop > first:
            self._inner.writeback(segment_at(first, seg), (stop - first) * (seg + TAG))

    def close(self, name: str, *, fsync: bool = True) -> Staged:
        """Seal and write the last segment, then end the inner stream (a staged blob for `name`)."""
        with self._lock:
            last, pending = self._end // self._seg, dict(self._partial)
            self._partial.clear()
        n = self._end - last * self._seg
        slot = pending.pop(last, None)
        if pending or (n and (slot is None or slot[1] != n)):
            self._inner.discard()
            raise OSError(f"a sealed stream was closed with bytes of {len(pending) + (n > 0)} segment(s) never written")
        plain = memoryview(slot[0])[:n] if slot is not None else b""
        self._seal_one(last, plain, True)
        return self._inner.close(name, fsync=fsync)

    def discard(self) -> None:
        self._inner.discard()
