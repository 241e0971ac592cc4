"""Encryption at rest: the backend wrapper that seals every blob (the keys: cas/keys.py; the
sealed layout and the streamed writer: cas/segments.py).

Blobs (`EncryptedBackend`, the cas/backend.py contract around any backend): every blob but the
config, `keys/` and `leases/` (which hold no user data) is written as
    magic (8 bytes) | salt (16 random bytes) | segment 0 | segment 1 | ...
each segment 1 MiB of plaintext (64 KiB in stores of scheme 1 and 2: cas/keys.py; the last one
shorter, possibly empty) sealed with AES-256-GCM
(16-byte tag) under the blob key blake3(key=aead subkey, b"cas blob key\\0" + salt), nonce =
segment number (11 bytes, big-endian) | 1 for the last segment else 0; in stores of scheme 4,
each segment is split where pack entries meet and sealed as three messages (cas/slots.py), so a
read of one entry opens none of its neighbours' bytes. The associated data
binds each blob to where it belongs: with magic b"casenc1\\n" the blob's whole name (a blob
moved to another name fails its check); with b"casenc2\\n", a *streamed* blob (a pack written
at offsets while a save encodes, named by its footer only once complete), its folder (packs/):
it cannot pass for a blob of another kind, and every entry read from it is checked against its
own key, so a pack moved to another pack's name fails on its first read. Either way a segment
moved, reordered, dropped or cut off fails its check. A ranged read decrypts only the segments
it covers; sizes (stat, list_sizes, peek) are the plaintext's, computed from the ciphertext's.
The save and load pools seal and open in their workers; cryptography lets go of the GIL in each
AES-GCM call, so the pass runs beside hashing and compression on the other cores.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

from .backend import Buffer, Staged
from .bitrot import first_fix
from .buffers import POOL as _POOL
from .buffers import copy_bytes, fresh
from . import slots
from .segments import (BLOB_MAGIC, HEADER, SALT, STREAM_MAGIC, TAG, Layout, Pieces, SealedStream,  # noqa: F401
                       nonce, plain_size, sealed_size, segment_at)
from .errors import BlobAbsentError, CorruptionError
from .hashing import Namer
from .readahead import read_generation
from .keys import (AEAD_NAME, KEY_MAGIC, KEYS_PREFIX, NAMING, REMOVING_PREFIX, SCRYPT_ENV,  # noqa: F401
                   SCRYPT_LOG_N, SCRYPT_P, SCRYPT_R, ENCRYPTION_VERSION, SEGMENT, SEGMENT_V1, MasterKey, StoreKeys,
                   add_key, aead_cipher, check_fields, check_of, encryption_fields, invalid_tag, key_blob,
                   key_from_env, key_ids, new_key_id, read_key_file, remove_key, segment_of, stray_key_ids, unlock,
                   user_key)

_RANGE_FROM_ZERO = 256 << 10  # a ranged read this close to the start reads the header with it


# --- the encrypted backend -------------------------------------------------------------------
MENDED_PREFIXES = ("log/",)  # small sealed blobs whose one damaged bit or byte a read undoes
MAX_MENDED = 4096  # sealed bytes searched (a log entry is about 600); each try is one AES-GCM pass


def plain_blob(name: str) -> bool:
    """Blobs kept readable without the master key: they hold no user data (the config, the
    wrapped keys, writers' leases: pid, host, start time, purpose)."""
    return name == "config" or name.startswith((KEYS_PREFIX, REMOVING_PREFIX, "leases/"))


def _output(buffer: Buffer | None, nbytes: int) -> memoryview:
    """Where a read's plain bytes go: the caller's buffer, else a new one."""
    return fresh(nbytes) if buffer is None else buffer(max(nbytes, 1))[:nbytes]


def _pooled(held: list) -> Buffer:
    """A read's buffer: one from the pool, kept in `held` for the caller to give back."""
    def take(nbytes: int) -> memoryview:
        held.append(_POOL.take(nbytes))
        return memoryview(held[-1])
    return take


def _aad(name: str) -> bytes:
    return b"cas-blob-1\0" + name.encode("utf-8")


def _stream_aad(name: str) -> bytes:
    """A streamed blob's associated data: its folder (its name is not known while it is sealed)."""
    return b"cas-blob-2\0" + name.partition("/")[0].encode("utf-8")


def _key_of(name: str) -> str | None:
    """The object key a blob name carries (objects/ab/<hex>), for errors."""
    tail = name.rpartition("/")[2]
    return tail if name.startswith("objects/") and len(tail) == 64 else None


class EncryptedBackend:
    """A backend whose blobs are sealed (module docstring); everything else is the inner one's."""

    def __init__(self, inner, keys: StoreKeys, *, streams: bool = True, segment: int = SEGMENT,
                 split: bool = True) -> None:
        self.inner = inner
        self.segment = segment  # plaintext bytes per sealed segment (the store's scheme: cas/keys.py)
        self.layout = Layout(segment, split)  # split: scheme 4 (cas/slots.py)
        self.keys = keys
        self.namer = keys.namer
        self.capabilities = inner.capabilities
        self._salts: dict[str, tuple] = {}  # blob name -> its sealing (_salt), for ranged reads (bounded)
        self._opened = _OpenedSegments()  # edge segments opened lately, shared by the read threads
        # small blobs (MENDED_PREFIXES) read as sealed: one bit or byte of their stored bytes is
        # damaged, and the AEAD tags proved which (cas/bitrot.py); name -> the sealed bytes as written
        self.mended: dict[str, bytes] = {}
        # Packs stream, sealed as they are written, where the inner backend streams and the
        # store's scheme has streamed blobs (version 2); else they are gathered and sealed whole
        # (cas/packs.py PackFiles.stream asks for this attribute).
        self.stream = self._open_stream if streams and getattr(inner, "stream", None) is not None else None

    def release_buffers(self) -> None:
        """Give the opened segments' buffers back to the process's pool: a closed store's would
        otherwise be freed with it, and the next store's reads would fault in fresh pages (slow
        to touch on a VM; measured: 4 new buffers, 7 MiB, per load of a small model)."""
        self._opened.clear()

    @property
    def read_unit(self) -> int:
        """The plaintext bytes a small read opens at least: one sealed segment (readahead.Windows
        sizes a bucket's windows by it)."""
        return self.segment

    def __getattr__(self, attr):  # path(), root, url, ...: the inner backend's
        return getattr(self.inner, attr)

    # --- sealing ---------------------------------------------------------------------------
    def seal(self, name: str, parts: Iterable, into=None) -> memoryview:
        """The sealed bytes of a blob, in `into` (a buffer of the pool, given back by the caller
        once the inner write consumed them) or a new one."""
        pieces, seg, layout = Pieces(parts), self.segment, self.layout
        total = pieces.total
        nseg = max(1, -(-total // seg))
        size = layout.sealed_size(total)
        out = (memoryview(into) if into is not None and len(into) >= size else fresh(size))[:size]
        salt = os.urandom(SALT)
        out[:len(BLOB_MAGIC)] = BLOB_MAGIC
        out[len(BLOB_MAGIC):HEADER] = salt
        aead, aad = self.keys.blob_aead(salt), _aad(name)
        for i in range(nseg):
            lo, hi = i * seg, min(total, (i + 1) * seg)
            at = layout.at(i)
            if layout.split:
                slots.seal_slot(aead, aad, i, pieces, lo, hi, i == nseg - 1, out[at:at + hi - lo + layout.over])
            else:
                aead.seal_parts_into(nonce(i, i == nseg - 1), pieces.views(lo, hi) or [b""], aad,
                                     out[at:at + hi - lo + TAG])
        return out

    def _open_stream(self, name_hint: str) -> "SealedStream":
        """A pack sealed as it is streamed (cas/packs.py PackStream): see SealedStream."""
        salt = os.urandom(SALT)
        inner, aead, aad = self.inner.stream(name_hint), self.keys.blob_aead(salt), _stream_aad(name_hint)
        if self.layout.split:
            return slots.SplitStream(inner, aead, aad, salt, self.layout)
        return SealedStream(inner, aead, aad, salt, self.segment)

    def _damaged(self, name: str, why: str) -> CorruptionError:
        return CorruptionError(f"{name} fails its authentication check ({why}: damaged or tampered ciphertext)",
                               key=_key_of(name))

    def _salt(self, name: str, head, generation: int) -> tuple:
        """(salt, associated data, key check, read generation) of a blob, from its header read
        in `generation` (readahead.read_generation, taken before the read): what its segments
        are opened with and kept under in the segment cache, and which a verify, in a later
        generation, does not take from the cache."""
        magic = bytes(head[:len(BLOB_MAGIC)]) if len(head) >= HEADER else b""
        if magic not in (BLOB_MAGIC, STREAM_MAGIC):
            raise self._damaged(name, "no encrypted blob header")
        # (salt, associated data, the master key's check, the read generation): the key check keeps
        # another store's segments, opened under its key, from answering for this one in the
        # segment cache; the generation keeps what was opened before a verify from answering it
        sealing = (bytes(head[len(BLOB_MAGIC):HEADER]), _aad(name) if magic == BLOB_MAGIC else _stream_aad(name),
                   self.keys.check, generation)
        if len(self._salts) > 4096:
            self._salts.clear()
        self._salts[name] = sealing
        return sealing

    def _open_segments(self, name: str, sealing: tuple, body, first: int, out, *, whole: bool,
                       skip: int = 0, want: tuple[int, int] | None = None) -> int:
        """Decrypt the segments in `body` (segment `first` onwards) and place their plain bytes
        from `skip` on into `out`, as far as it reaches; the plain length of `body` is returned.
        Segments inside the range decrypt straight into `out`; the edge ones are opened into
        the store's cache of recent segments, or found there: the small objects of a pack
        share them, whichever read thread reads them. With `whole`, body runs to the blob's
        end, whose last segment must say it is the last. `want` (scheme 4, a large read into
        whole segments): the plain bytes of `body` asked for; a split segment's message outside
        them is not opened."""
        (salt, aad, _, _), invalid, seg = sealing, invalid_tag(), self.segment
        aead = self.keys.blob_aead(salt)
        body, end = memoryview(body), skip + len(out)
        pos, plain, i = 0, 0, first
        over = self.layout.over
        while pos < len(body) or (whole and pos == 0):
            ct = body[pos:pos + seg + over]
            if len(ct) < over:
                raise self._damaged(name, f"segment {i} is cut short")
            n = len(ct) - over
            short = n < seg or (whole and pos + len(ct) == len(body))
            inside = skip <= plain and plain + n <= end
            lo = max(skip, plain)
            hi = max(lo, min(end, plain + n))  # (of the plain bytes: what `out` takes of this segment)
            marked_last = None if inside else self._opened.copy_out(sealing, i, n, short, out[lo - skip:hi - skip],
                                                                    lo - plain)
            if marked_last is None:
                held = None if inside else _POOL.take(n)
                dest = out[plain - skip:plain - skip + n] if inside else memoryview(held)[:n]
                valid = (0, n)  # (the plain bytes of the segment opened)
                try:
                    try:
                        if self.layout.split:
                            p, marked_last = slots.open_split(aead, aad, i, ct, short, invalid)
                            if p > n:
                                raise invalid
                            if inside:  # (all of it, or the messages a large read asked for)
                                asked = None if want is None else (want[0] - plain, want[1] - plain)
                            else:  # (the messages holding the small read's bytes, for the cache)
                                asked = (lo - plain, hi - plain)
                            valid = slots.open_messages(aead, aad, i, ct, p, n, dest, asked)
                        else:
                            aead.decrypt_into(nonce(i, short), ct, aad, dest)
                            marked_last = short
                    except invalid:
                        if self.layout.split or short or not self._try_last(aead, aad, ct, i, dest):
                            raise self._damaged(name, f"segment {i}") from None
                        marked_last = True
                    if held is not None:
                        copy_bytes(out[lo - skip:hi - skip], dest[lo - plain:hi - plain])
                        self._opened.put(sealing, i, held, n, marked_last, valid)
                        held = None
                finally:
                    if held is not None:
                        _POOL.give(held)
            if marked_last and not short and (whole or pos + len(ct) < len(body)):
                raise self._damaged(name, f"segment {i} is marked last but more follows")
            pos, plain, i = pos + len(ct), plain + n, i + 1
        return plain

    def _cached_range(self, sealing: tuple, start: int, length: int, into) -> bool:
        """Fill `into` with plain bytes [start, start + length) from the opened segments,
        with no read, when they hold all of it (a small object next to one just read)."""
        seg = self.segment
        first, last = start // seg, (start + length - 1) // seg
        return last - first <= 1 and self._opened.copy_range(sealing, first, start - first * seg, into[:length], seg)

    @staticmethod
    def _try_last(aead, aad, ct, i, out) -> bool:
        try:
            aead.decrypt_into(nonce(i, True), ct, aad, out)
            return True
        except invalid_tag():
            return False

    def _sealed_write(self, write, name: str, parts: Iterable):
        parts = list(parts)
        buf = _POOL.take(self.layout.sealed_size(sum(memoryview(p).nbytes for p in parts)))
        try:
            return write(name, [self.seal(name, parts, buf)])
        finally:
            _POOL.give(buf)

    # --- reads -----------------------------------------------------------------------------
    def get(self, name: str, start: int = 0, length: int | None = None, *, buffer: Buffer | None = None):
        if plain_blob(name):
            return self.inner.get(name, start, length, buffer=buffer)
        if start == 0 and length is None:
            held: list = []
            pooled = _pooled(held)
            try:
                generation = read_generation()
                sealed = self.inner.get(name, 0, None, buffer=pooled)
                if name in self.mended and bytes(sealed) != self.mended[name]:
                    sealed = self.mended[name]
                size = self.layout.plain_size(len(sealed))
                out = _output(buffer, size)
                try:
                    self._open_segments(name, self._salt(name, sealed, generation), memoryview(sealed)[HEADER:], 0,
                                        memoryview(out), whole=True)
                except CorruptionError:
                    written = self._mend(name, bytes(sealed))
                    if written is None:
                        raise
                    self._open_segments(name, self._salt(name, written, generation), memoryview(written)[HEADER:],
                                        0, memoryview(out), whole=True)
            finally:
                for one in held:
                    _POOL.give(one)
            return out if buffer is not None else bytes(out)
        if length is None:
            size = self.stat(name)
            if size is None:
                raise BlobAbsentError(f"{name} is missing from {self.inner.where(name)}")
            length = max(size - start, 0)
        return self._ranged(name, start, length, buffer)

    def _mend(self, name: str, sealed: bytes) -> bytes | None:
        """The sealed bytes as written of a small blob (a log entry) one bit or byte from
        `sealed`, proven by every segment's AEAD tag; None for any other damage or blob."""
        if not name.startswith(MENDED_PREFIXES) or len(sealed) > MAX_MENDED:
            return None

        def opens(candidate) -> bool:
            out = memoryview(bytearray(self.layout.plain_size(len(candidate))))
            try:
                self._open_segments(name, self._salt(name, bytes(candidate), read_generation()),
                                    memoryview(candidate)[HEADER:], 0, out, whole=True)
                return True
            except CorruptionError:
                return False
        written = first_fix(sealed, opens)
        self._salts.pop(name, None)  # (the candidates' salts)
        if written is not None:
            self.mended[name] = written
        return written

    def still_mended(self, name: str) -> bool:
        """Whether `name` is read as written while its stored bytes are still the damaged ones."""
        return name in self.mended and bytes(self.inner.get(name)) != self.mended[name]

    def _known_salt(self, name: str, generation: int) -> tuple | None:
        """The blob's sealing as read earlier in this read generation, else None (read it)."""
        sealing = self._salts.get(name)
        return sealing if sealing is not None and sealing[3] == generation else None

    def _ranged(self, name: str, start: int, length: int, buffer: Buffer | None = None):
        """Plain bytes [start, start + length) of a blob. An object of a segment or more (a
        tensor chunk) has all its covering segments decrypted straight into the caller's
        `buffer`, the edge ones whole, and is returned as a view into it: no copy, no new
        memory. (Its neighbours decrypt those edges again: measured, AES-GCM runs as fast as
        the copy out of a cache would.) A smaller one decrypts its inner segments into
        `buffer`, and opens its edge segments once into the store's segment cache, which the
        small objects beside it in the pack copy from, whichever thread reads them."""
        if length <= 0:
            self.inner.get(name, 0, 0)  # absent or unreadable: said so
            return b"" if buffer is None else buffer(1)[:0]
        seg, layout = self.segment, self.layout
        first, last = start // seg, (start + length - 1) // seg
        cstart = layout.at(first)
        clen = (last - first + 1) * (seg + layout.over)
        generation = read_generation()  # (before any read: a verify begun meanwhile keeps nothing of this one)
        sealing = self._known_salt(name, generation)
        if sealing is not None and length <= seg:
            into = _output(buffer, length)
            if self._cached_range(sealing, start, length, into):
                return bytes(into) if buffer is None else into
        # a read of a slot or more (a chunk; not a bucket's window of small objects, 256 KiB, whose
        # ends are no entry's and whose guesses would fail) fetches only its messages
        if layout.split and first < last and length >= seg and (sealing is not None or cstart > _RANGE_FROM_ZERO):
            if sealing is None:
                sealing = self._salt(name, self.inner.get(name, 0, HEADER), generation)
            tight = self._tight_range(name, sealing, start, length, buffer)
            if tight is not None:
                return tight
        for attempt in range(2):
            sealing = self._known_salt(name, generation) if attempt == 0 else None
            held: list = []
            pooled = _pooled(held)  # pooled buffers: no fresh pages per read
            try:
                if sealing is None and cstart <= _RANGE_FROM_ZERO:
                    sealed = self.inner.get(name, 0, cstart + clen, buffer=pooled)
                    sealing, body = self._salt(name, sealed, generation), sealed[cstart:]
                else:
                    if sealing is None:
                        sealing = self._salt(name, self.inner.get(name, 0, HEADER), generation)
                    body = self.inner.get(name, cstart, clen, buffer=pooled)
                skip, want = start - first * seg, None
                if length >= seg:  # a large object: every covering segment decrypts in place, edges too
                    into = _output(buffer, layout.plain_size(HEADER + len(body)))
                    at, skip, want = skip, 0, (skip, skip + length)  # (split ones: only what it asks for)
                else:
                    into, at = _output(buffer, length), 0
                try:
                    n = self._open_segments(name, sealing, body, first, into, whole=False, skip=skip, want=want)
                except CorruptionError:
                    if attempt == 0 and name in self._salts:  # the blob was replaced (a healed pack): read afresh
                        self._salts.pop(name, None)
                        continue
                    raise
                into = into[at:at + max(0, min(length, n - skip - at))]
                return bytes(into) if buffer is None else into
            finally:
                for one in held:
                    _POOL.give(one)
        raise AssertionError("unreachable")

    def _tight_range(self, name: str, sealing: tuple, start: int, length: int, buffer: Buffer | None):
        """A large read of a blob whose salt is known (scheme 4), fetching only the messages
        that hold it (slots.open_range); None where that does not open it (read whole slots)."""
        held: list = []

        def fetch(at: int, nbytes: int):
            return self.inner.get(name, at, nbytes, buffer=_pooled(held))
        into = _output(buffer, slots.LEAD + length)
        try:
            if not slots.open_range(self.keys.blob_aead(sealing[0]), sealing[1], self.layout, start, length, fetch,
                                    into, invalid_tag()):
                return None
        finally:
            for one in held:
                _POOL.give(one)
        into = into[slots.LEAD:slots.LEAD + length]
        return bytes(into) if buffer is None else into

    def stat(self, name: str) -> int | None:
        size = self.inner.stat(name)
        return size if size is None or plain_blob(name) else self.layout.plain_size(size)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def list_sizes(self, prefix: str) -> list[tuple[str, int]]:
        return [(n, s if plain_blob(n) else self.layout.plain_size(s)) for n, s in self.inner.list_sizes(prefix)]

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        if plain_blob(staged.name):
            return self.inner.peek(staged, nbytes)
        segs = max(1, -(-nbytes // self.segment))
        generation = read_generation()
        size, head = self.inner.peek(staged, self.layout.at(segs))
        sealing = self._salt(staged.name, head, generation)
        body = memoryview(head)[HEADER:]
        out = bytearray(len(body))
        n = self._open_segments(staged.name, sealing, body, 0, memoryview(out), whole=len(head) == size)
        return self.layout.plain_size(size), bytes(out[:min(n, nbytes)])

    # --- writes ----------------------------------------------------------------------------
    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        if plain_blob(name):
            return self.inner.put_if_absent(name, parts)
        return self._sealed_write(self.inner.put_if_absent, name, parts)

    def stage(self, name: str, parts: Iterable, *, fsync: bool = False) -> Staged:
        if plain_blob(name):
            return self.inner.stage(name, parts, fsync=fsync)
        return self._sealed_write(lambda n, p: self.inner.stage(n, p, fsync=fsync), name, parts)

    def publish(self, staged: Staged, *, fsync: bool = False) -> bool:
        self._salts.pop(staged.name, None)
        return self.inner.publish(staged, fsync=fsync)

    def replace(self, staged: Staged) -> None:
        self._salts.pop(staged.name, None)
        self.inner.replace(staged)

    def discard(self, staged: Staged) -> None:
        self.inner.discard(staged)

    def staged(self, name: str, token: str) -> Staged:
        return self.inner.staged(name, token)

    def sync(self) -> None:
        self.inner.sync()

    def delete(self, name: str) -> bool:
        self._salts.pop(name, None)
        return self.inner.delete(name)

    def move(self, name: str, new_name: str) -> bool:
        """Moved as sealed (quarantine: its bytes may be damaged): it stays sealed under its old
        name's associated data, so `cas` never reads it back; docs/format.md says how to by hand."""
        self._salts.pop(name, None)
        return self.inner.move(name, new_name)

    def free_bytes(self):
        return self.inner.free_bytes()

    def where(self, name: str) -> str:
        return self.inner.where(name)

    def clean_tmp(self) -> int:
        return self.inner.clean_tmp()

    def lease(self, name: str, info: bytes):
        return self.inner.lease(name, info)

    def take_over_lease(self, name: str, info: bytes):
        return self.inner.take_over_lease(name, info)

    def lease_alive(self, name: str):
        return self.inner.lease_alive(name)


class _OpenedSegments:
    """A store's most recently opened edge segments of small objects, shared by its read
    threads, keyed by their blob's salt (random per write: a rewritten blob never matches),
    associated data (a blob copied under another name opens nothing from here), the master
    key's check, the read generation it was read in (a verify, which moves the generation on,
    opens what is on disk now, and its own opened segments answer its own reads:
    readahead.reading_from_disk) and number. A segment that holds several small objects of a
    pack is decrypted once, whichever read thread comes first (each would otherwise decrypt it
    again: on a small model as many bytes again as the whole payload). Only authenticated plaintext enters, and an
    entry is a pool buffer, copied from and evicted only under the lock.
    It lives as long as the store's open: a new open (repair, another process) reads the disk."""

    KEEP_BYTES = 32 << 20  # 32 segments of 1 MiB (two edges for each of 16 read threads), 512 of 64 KiB

    def __init__(self) -> None:
        self._table: dict[tuple, tuple] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def copy_out(self, sealing: tuple, i: int, n: int, short: bool, dst, at: int) -> bool | None:
        """Copy segment i's plain bytes from `at` into `dst` if it was opened lately, as this
        read would open it (n bytes; a short one marked as the last, a whole one either way),
        and say whether it was marked the last; None if it is not here."""
        with self._lock:  # (an entry is given back to the pool when evicted: never while copied from)
            entry = self._table.get((sealing, i))
            if entry is None or entry[1] != n or (short and not entry[2]) or not _holds(entry, at, at + len(dst)):
                return None
            copy_bytes(dst, memoryview(entry[0])[at:at + len(dst)])
            return entry[2]

    def copy_range(self, sealing: tuple, first: int, at: int, dst, segment: int) -> bool:
        """Copy plain bytes from `at` in segment `first` on into `dst` (reaching into the next
        segment at most) if the segments opened lately hold all of them; False otherwise."""
        with self._lock:
            parts, lo, hi = [], at, at + len(dst)
            for i in (first, first + 1) if hi > segment else (first,):
                entry = self._table.get((sealing, i))
                if entry is None or not _holds(entry, max(lo, 0), min(hi, entry[1])):
                    return False
                parts.append(memoryview(entry[0])[:entry[1]])
                lo, hi = lo - segment, hi - segment
            if len(parts) == 2 and len(parts[0]) != segment:
                return False
            pieces = Pieces(parts)
            if at + len(dst) > pieces.total:
                return False
            done = 0
            for part in pieces.views(at, at + len(dst)):
                copy_bytes(dst[done:done + len(part)], part)
                done += len(part)
            return True

    def put(self, sealing: tuple, i: int, buf, n: int, marked_last: bool, valid: tuple[int, int]) -> None:
        """Keep segment i (n plain bytes, of which `valid` were opened: a split segment's
        messages that a read needed) opened into `buf` (a pool buffer, this cache's now)."""
        with self._lock:
            old = self._table.pop((sealing, i), None)
            if old is not None:
                self._drop(old)
            self._table[(sealing, i)] = (buf, n, marked_last, valid)
            self._bytes += len(buf)
            while len(self._table) > 1 and self._bytes > self.KEEP_BYTES:
                self._drop(self._table.pop(next(iter(self._table))))  # the oldest (dicts keep insertion order)

    def _drop(self, entry: tuple) -> None:
        self._bytes -= len(entry[0])
        _POOL.give(entry[0])

    def clear(self) -> None:
        """Give every entry back to the pool (the store closes: the next store's reads reuse them)."""
        with self._lock:
            while self._table:
                self._drop(self._table.popitem()[1])


def _holds(entry: tuple, lo: int, hi: int) -> bool:
    """Whether a cached segment holds its plain bytes [lo, hi) opened."""
    return entry[3][0] <= lo and hi <= entry[3][1]


def wrap(backend, keys: StoreKeys | None, version: int = ENCRYPTION_VERSION):
    """The backend as a store with `keys` sees it (as it is for a plain store); `version`: the
    store's sealing scheme (its config's), which says whether packs may be streamed."""
    if keys is None or isinstance(backend, EncryptedBackend):
        return backend
    return EncryptedBackend(backend, keys, streams=version >= 2, segment=segment_of(version), split=version >= 4)


def release_buffers(backend) -> None:
    """What a store does as it closes: an encrypted backend's cached buffers go back to the pool."""
    if isinstance(backend, EncryptedBackend):
        backend.release_buffers()


def namer_of(backend) -> Namer:
    from .hashing import PLAIN

    return getattr(backend, "namer", None) or PLAIN
