"""Sealing scheme 4: each 1 MiB segment split where a pack's entries meet, so that reading one
entry decrypts none of its neighbours' bytes (cas/crypt.py opens them; docs/format.md, "Sealed
blobs").

Scheme 3 seals a blob in 1 MiB segments, and a pack entry's first and last segments hold bytes
of the entries beside it: every read of an entry decrypted those edges whole, 27% more than the
entries' own bytes over a load of 4 MiB chunks, 30-65% on small models' 1-4 MiB objects, and
AES-GCM on this hardware runs at memcpy speed, so no cache of opened edges pays for itself
(bench/profile.md). Scheme 4 keeps the segment (the slot) at 1 MiB of plain bytes, so a plain
offset still maps to its sealed place by arithmetic, and seals each slot as three messages:

    A: plain bytes [0, p) + tag | B: plain bytes [p, n) + tag | split: p (u32 LE) + tag

p is where a write (a pack entry with its header) begins or ends inside the slot, else n (B is
then empty); n is the slot's plain length (1 MiB but in the blob's last slot). A reader opens
the split message (20 bytes at the slot's end), then only the messages its range covers (or,
reading a chunk, guesses the splits of its edge slots and fetches only those messages:
open_range). Every slot is its plain bytes + 52, and the split message goes out in one write with B (the write
that holds B of a whole slot knows the slot is not the blob's last). Nonces (12 bytes): slot
number (10, big-endian) | kind (0 split, 1 A, 2 B) | 1 in the split message of the blob's last
slot, else 0: a blob cut at a slot's end fails, as in scheme 3. A and B are bound to p
(associated data: the blob's, then p as u32 LE).
p, like every other byte, is sealed: a stored pack shows no entry boundary.
"""

from __future__ import annotations

from .backend import Staged
from .buffers import POOL, copy_bytes
from .segments import HEADER, SPLIT_OVER, TAG, Pieces, StreamSealer

SPLIT_PLAIN = 4
SPLIT = SPLIT_PLAIN + TAG  # sealed bytes of a slot's split message
OVERHEAD = SPLIT_OVER  # sealed bytes a slot adds to its plain bytes: SPLIT + 2 * TAG
A, B = 1, 2  # message kinds (0: the split message)


def nonce(i: int, kind: int, last: bool = False) -> bytes:
    return i.to_bytes(10, "big") + bytes((kind, 1 if last else 0))


def bound(aad: bytes, p: int) -> bytes:
    """A and B's associated data: the blob's, and the slot's split point."""
    return aad + p.to_bytes(SPLIT_PLAIN, "little")


def message_at(kind: int, p: int) -> int:
    """Where message A or B starts, from its slot's start."""
    return 0 if kind == A else p + TAG


def split_at(n: int) -> int:
    """Where the split message of a slot of n plain bytes starts, from the slot's start."""
    return n + 2 * TAG


def seal_split(aead, aad: bytes, i: int, p: int, last: bool, out) -> None:
    aead.encrypt_into(nonce(i, 0, last), p.to_bytes(SPLIT_PLAIN, "little"), aad, out[:SPLIT])


def seal_slot(aead, aad: bytes, i: int, pieces: Pieces, lo: int, hi: int, last: bool, out) -> None:
    """Seal plain bytes [lo, hi) of `pieces` as slot i into `out` (hi - lo + OVERHEAD bytes),
    split at the first boundary of the pieces inside it (a pack entry's start)."""
    p, n = pieces.boundary_in(lo, hi) - lo, hi - lo
    aead.seal_parts_into(nonce(i, A), pieces.views(lo, lo + p) or [b""], bound(aad, p), out[:p + TAG])
    aead.seal_parts_into(nonce(i, B), pieces.views(lo + p, hi) or [b""], bound(aad, p), out[p + TAG:n + 2 * TAG])
    seal_split(aead, aad, i, p, last, out[split_at(n):])


def open_split(aead, aad: bytes, i: int, sealed, short: bool, invalid) -> tuple[int, bool]:
    """(p, whether the slot is marked the blob's last) from slot i's sealed bytes; a slot
    shorter than a whole one must be the last, a whole one may be (raises `invalid`)."""
    out, ct = bytearray(SPLIT_PLAIN), sealed[split_at(len(sealed) - OVERHEAD):]
    try:
        aead.decrypt_into(nonce(i, 0, short), ct, aad, out)
        return int.from_bytes(out, "little"), short
    except invalid:
        if short:
            raise
    aead.decrypt_into(nonce(i, 0, True), ct, aad, out)
    return int.from_bytes(out, "little"), True


def open_messages(aead, aad: bytes, i: int, sealed, p: int, n: int, dest, want=None) -> tuple[int, int]:
    """Decrypt slot i's messages into `dest` (its n plain bytes); with `want` (lo, hi) of the
    slot's plain bytes, only the messages that reach into it (an empty one is always checked).
    Returns the plain bytes of the slot now in `dest`."""
    opened: list[int] = []
    for kind, lo, hi in ((A, 0, p), (B, p, n)):
        if want is not None and hi > lo and (hi <= want[0] or lo >= want[1]):
            continue
        at = message_at(kind, p)
        aead.decrypt_into(nonce(i, kind), sealed[at:at + hi - lo + TAG], bound(aad, p), dest[lo:hi])
        if hi > lo:
            opened += [lo, hi]
    return (min(opened), max(opened)) if opened else (0, 0)


# plain bytes fetched before a read across slots: its pack entry's header (36), where its write
# began, and small entries before it in its slot (whose split is then theirs): up to 64 KiB more
# costs a bucket less than the request that would fetch them after (bench/profile.md)
LEAD = 64 << 10


def open_range(aead, aad: bytes, layout, start: int, length: int, fetch, dest, invalid) -> bool:
    """Open plain bytes [start, start + length) of a blob, a read across a slot's end, into
    dest[LEAD:LEAD + length], fetching (`fetch(sealed start, nbytes)`) only the messages that
    hold them: B of its first slot, split where the write holding the range (a pack entry, its
    header and then the object read here) began, at most LEAD bytes before it, A of its last,
    split where it ended, and the whole slots between. The edge slots are not fetched whole, so
    the entries beside the range cost no bytes (a bucket's GET fetched up to two slots more per
    read: 27% more than the chunks' own bytes over a 256 MiB load of 4 MiB chunks, 60% over a
    small model's). Where an edge slot is split elsewhere (more than LEAD bytes of small
    entries before the range in its first slot, or a write that reached its last slot first),
    one more fetch brings the rest of that message or slot. A and B are bound to their split
    point: a guessed one opens only where it is the sealed one. False where the range does not
    open so (the caller reads the whole slots then and names any damage); raises what `fetch`
    raises."""
    seg, over = layout.segment, layout.over
    first, last = start // seg, (start + length - 1) // seg
    if first == last:
        return False
    q, e = start - first * seg, start + length - last * seg  # (the range's start in its first slot, end in its last)
    f = q - LEAD if q > LEAD else 0  # the first slot's plain bytes fetched from here
    lo = layout.at(first) + (f + TAG if f else 0)
    hi = layout.at(last) + (e + TAG if e < seg else seg + over)
    body = memoryview(fetch(lo, hi - lo))
    if len(body) != hi - lo:
        return False
    held: list = []

    def joined(a, b) -> memoryview:  # a's bytes then b's, in a pool buffer
        buf = POOL.take(len(a) + len(b))
        held.append(buf)
        out = memoryview(buf)[:len(a) + len(b)]
        copy_bytes(out[:len(a)], a)
        copy_bytes(out[len(a):], b)
        return out

    def open_into(nonce_: bytes, ct, bound_: bytes, at: int, n: int) -> None:  # n plain bytes for dest[at:at + n]
        if at >= 0:
            aead.decrypt_into(nonce_, ct, bound_, dest[at:at + n])
            return
        buf = POOL.take(n)  # (they begin before dest: bytes of entries before the range)
        held.append(buf)
        aead.decrypt_into(nonce_, ct, bound_, memoryview(buf)[:n])
        copy_bytes(dest[:at + n], memoryview(buf)[-at:n])

    def place(i: int) -> int:  # where slot i's plain bytes go in dest
        return LEAD + i * seg - start
    try:
        if f:  # B of the first slot (A holds bytes of the entries before the range)
            tail = body[:seg + over - f - TAG]  # (the slot's sealed bytes from plain byte f on)
            p, marked_last = open_split(aead, aad, first, tail, False, invalid)
            if marked_last or p > q:
                return False
            ct = tail[p - f:seg - f + TAG] if p >= f else joined(fetch(layout.at(first) + p + TAG, f - p),
                                                                   tail[:seg - f + TAG])
            if len(ct) != seg - p + TAG:
                return False
            open_into(nonce(first, B), ct, bound(aad, p), place(first) + p, seg - p)
        for i in range(first + 1 if f else first, last + 1 if e == seg else last):  # whole slots
            at = layout.at(i) - lo
            sealed = body[at:at + seg + over]
            p, marked_last = open_split(aead, aad, i, sealed, False, invalid)
            if marked_last and i != last:
                return False
            open_messages(aead, aad, i, sealed, p, seg, dest[place(i):place(i) + seg])
        if e < seg:  # A of the last slot, split where the range ends
            at = layout.at(last) - lo
            a = body[at:at + e + TAG]
            try:
                aead.decrypt_into(nonce(last, A), a, bound(aad, e), dest[place(last):place(last) + e])
            except invalid:  # split elsewhere: the rest of the slot, and its messages as its split says
                sealed = joined(a, fetch(layout.at(last) + e + TAG, seg + over - e - TAG))
                n = len(sealed) - over  # (less than a slot at the blob's end)
                p, _ = open_split(aead, aad, last, sealed, n < seg, invalid)
                if n < e or p > n:
                    return False
                buf = POOL.take(n)
                held.append(buf)
                open_messages(aead, aad, last, sealed, p, n, memoryview(buf)[:n], (0, e))
                copy_bytes(dest[place(last):place(last) + e], memoryview(buf)[:e])
    except invalid:
        return False
    finally:
        for buf in held:
            POOL.give(buf)
    return True


class SplitStream(StreamSealer):
    """A blob of scheme 4 sealed as it is streamed (a pack written at offsets by a save's
    workers: cas/segments.py SealedStream is scheme 3's). A slot's split point is fixed by the
    first write that reaches it, at that write's start or end inside the slot. A message one
    write holds whole is sealed from its parts and written at once (an entry's first and last
    messages too: no gather copy); one that several writes share is gathered until complete.
    A slot's split message says whether it is the blob's last: it goes with B, sealed by the
    write that completes B of a whole slot (so not the last), or at close for the last slot."""

    def __init__(self, inner, aead, aad: bytes, salt: bytes, layout) -> None:
        super().__init__(inner, aead, aad, salt, layout)  # (partial: (slot, kind) -> its gather)
        self._split: dict[int, int] = {}  # slot -> p
        self._sealed: set[tuple[int, int]] = set()

    def _place(self, offset: int, pieces: Pieces) -> None:
        end, seg = offset + pieces.total, self._seg
        slots = range(offset // seg, (end - 1) // seg + 1)
        with self._lock:
            for i in slots:
                if i not in self._split:
                    inside = [b - i * seg for b in (offset, end) if i * seg < b < (i + 1) * seg]
                    self._split[i] = inside[0] if inside else seg  # (none: this write covers the slot)
            splits = [self._split[i] for i in slots]
            self._end = max(self._end, end)
        for i, p in zip(slots, splits):
            base, run = i * seg, []  # the messages of slot i this write holds whole
            for kind, a, b in ((A, 0, p), (B, p, seg)):
                lo, hi = max(offset, base + a), min(end, base + b)
                if a == b and run:  # B of a slot no write splits: this write holds it all
                    run.append((kind, []))
                if lo >= hi:
                    continue
                views = pieces.views(lo - offset, hi - offset)
                if (lo, hi) == (base + a, base + b):
                    run.append((kind, views))
                else:
                    self._gather(i, kind, p, lo - base - a, b - a, views)
            if run:  # (B whole here: the slot is whole, so not the last)
                self._seal(i, p, run, last=False)

    def _seal(self, i: int, p: int, run: list, *, last: bool) -> None:
        """Seal messages of slot i, (kind, views) that lie one after the other (A then B, or
        one of them), and write them at their place in one write, with the slot's split
        message after B when B is among them."""
        sizes = [sum(len(v) for v in views) + TAG for _, views in run]
        tail = SPLIT if run[-1][0] == B else 0
        total = sum(sizes) + tail
        buf = POOL.take(total)
        try:
            out = memoryview(buf)[:total]
            at = 0
            for (kind, views), size in zip(run, sizes):
                self._aead.seal_parts_into(nonce(i, kind), views or [b""], bound(self._aad, p), out[at:at + size])
                at += size
            if tail:
                seal_split(self._aead, self._aad, i, p, last, out[at:])
            self._write(self._layout.at(i) + message_at(run[0][0], p), out)
        finally:
            POOL.give(buf)
        with self._lock:
            self._sealed.update((i, kind) for kind, _ in run)

    def _gather(self, i: int, kind: int, p: int, at: int, length: int, views: list) -> None:
        """Copy a write's share of message `kind` of slot i (`length` plain bytes when the
        slot is whole); the write that completes it seals it."""
        full = self._gathered((i, kind), at, views, length)
        if full is not None:  # (a B that fills: its slot is whole, so not the last)
            try:
                self._seal(i, p, [(kind, [memoryview(full)[:length]])], last=False)
            finally:
                POOL.give(full)

    def close(self, name: str, *, fsync: bool = True) -> Staged:
        """Seal what is left (the messages gathered, the last slot's, the split messages not
        written yet), then end the inner stream (a staged blob for `name`)."""
        with self._lock:
            end, pending = self._end, dict(self._partial)
            self._partial.clear()
            splits, sealed = dict(self._split), set(self._sealed)
        seg = self._seg
        last = end // seg
        try:
            for i in range(last + 1):
                n = seg if i < last else end - last * seg
                p = splits.get(i, n)
                run, held = [], []
                for kind, a, b in ((A, 0, p), (B, p, n)):
                    if (i, kind) in sealed:
                        continue
                    slot = pending.pop((i, kind), None)
                    if slot is not None:
                        held.append(slot[0])
                    if (slot[1] if slot is not None else 0) != b - a:
                        raise OSError(f"a sealed stream was closed with bytes of slot {i} never written")
                    run.append((kind, [memoryview(slot[0])[:b - a]] if slot is not None else []))
                try:
                    if run:
                        self._seal(i, p, run, last=i == last)
                finally:
                    for one in held:
                        POOL.give(one)
            if pending:
                raise OSError("a sealed stream was closed with bytes past its end")
        except BaseException:
            for slot in pending.values():
                POOL.give(slot[0])
            self._inner.discard()
            raise
        return self._inner.close(name, fsync=fsync)


__all__ = ["HEADER", "LEAD", "OVERHEAD", "SPLIT", "SplitStream", "open_messages", "open_range", "open_split",
           "seal_slot", "split_at"]
