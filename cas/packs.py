"""Pack files: many small encoded objects (manifest nodes, small chunks) in one immutable blob.

One file per small object would cost a create, an fsync and a rename each (a 500-tensor state
has 500 tensor nodes); LMDB could hold them, but then losing the index would lose them. A pack
is written once per save (more when it grows past PACK_TARGET), durable before the commit, and
named packs/ab/<blake3 of its bytes> in the backend. It is self-describing, so the index can be
rebuilt from packs and object files alone (`cas repair`):

    magic   b"caspack2"                                     8 bytes (b"caspack1": no footer)
    entry   key (32) | length (u32 LE) | encoded object     repeated
    footer  msgpack [[key, offset, length, raw size, base key or nil], ...]
    trailer footer length (u32 LE) | b"caspidx2"            12 bytes

The footer lists what the entries' headers say, so a cache is rebuilt from a pack's tail alone:
one ranged read per pack instead of the whole pack, which in a bucket is the difference between
opening a store on a fresh host in a second and downloading it. Entries stay where format 1 had
them; a format-1 pack is read by walking its entries.
"""

from __future__ import annotations

import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Iterator

import msgpack
import numpy as np

from .backend import Backend
from .codecs import MAGIC as OBJECT_MAGIC
from .errors import BlobAbsentError, CasError, CorruptionError, MissingObjectError
from .fanout import Fanout
from .crypt import namer_of
from .hashing import to_hex
from .readahead import SMALL, Windows

PACK_MAGIC = b"caspack2"
PACK_MAGIC_V1 = b"caspack1"
FOOTER_MAGIC = b"caspidx2"
_ENTRY = struct.Struct("<32sI")
_TRAILER = struct.Struct("<I8s")
TAIL_READ = 64 << 10  # bytes read from a pack's end to find its footer (a second read when longer)
PACK_HEADER = len(PACK_MAGIC)  # bytes before the first entry
PACK_ENTRY_HEADER = _ENTRY.size  # bytes before each encoded object
PACK_TARGET = 16 << 20  # a writer starts a new pack past this many bytes
STREAM_TARGET = 256 << 20  # a streamed pack (a local save's chunks) is closed past this many bytes
WRITEBACK_MIN = 1 << 20  # entries at least this large start their writeback at once (start_writeback)
MAX_PACK = 1 << 31
PREFIX = "packs"


def salt_entry(codec, namer) -> tuple[bytes, bytes, int, None]:
    """A pack entry no checkpoint names (16 random bytes, encoded and named as any object):
    added to a pack that must not take a name the store used before (one a bucket's gc
    deleted: PackFiles.write `avoid`; a DCP rank's, which cannot know those names)."""
    raw = secrets.token_bytes(16)
    enc = codec.encode(np.frombuffer(raw, dtype=np.uint8))
    return namer.key(raw), b"".join(bytes(part) for part in enc.parts), len(raw), None


@dataclass(frozen=True)
class PackEntry:
    """One object in a pack, as its footer lists it."""

    key: bytes
    offset: int
    length: int
    raw_size: int
    base: bytes | None


class PackFiles(Fanout):
    """Immutable packs, blobs named packs/ab/<64 hex digits>."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, PREFIX)
        # in a bucket, where each read is a request and packs are never rewritten, small reads
        # that ask to read ahead share windows (cas/readahead.py)
        self.windows = Windows(backend) if not backend.capabilities.batched_sync else None

    def write(self, entries: list[tuple[bytes, bytes, int, bytes | None]], *, avoid=None,
              salt=None) -> tuple[bytes, list[tuple[bytes, int, int]]]:
        """Write one pack durably from (key, encoded object, raw size, base key) entries; returns
        its key and (object key, offset, length) per entry. A pack of that name holds these very
        bytes (its name is their hash): where the backend may replace, one already there is
        replaced (a damaged copy is healed, a sound one unchanged); in a bucket it is kept. A
        name `avoid(name)` refuses (one a bucket's gc deleted: the log says it is gone for good,
        and a pack created again under it would be ignored) gets `salt()`, one more entry (an
        object no checkpoint names), and so another name. In a bucket, so does a name that is
        taken: the pack there is another writer's, and its fate another gc's (two gcs copying
        the same live entries in the same order made one pack, which the second doomed as the
        first's and then deleted, its own copies with it), so a writer relies only on packs it
        created."""
        parts, placed, pack = self._laid_out(entries)
        while avoid is not None and avoid(pack):
            entries = [*entries, salt()]
            parts, placed, pack = self._laid_out(entries)
        if not self.backend.capabilities.batched_sync:  # an object store: durable once it answers
            while not self.backend.put_if_absent(self.name(pack), parts) and salt is not None:
                entries = [*entries, salt()]
                parts, placed, pack = self._laid_out(entries)
            return pack, placed
        staged = self.backend.stage(self.name(pack), parts, fsync=True)
        try:
            if not self.backend.publish(staged):
                self.backend.replace(staged)
        except BaseException:
            self.backend.discard(staged)
            raise
        self.backend.sync()
        return pack, placed

    def _laid_out(self, entries) -> tuple[list, list[tuple[bytes, int, int]], bytes]:
        """The parts of a pack of `entries`, where each entry lands (in the order given), and the
        pack's name. The small entries (those a bucket's reader fetches with their window: nodes,
        biases, counters) go after the large ones, together: a fresh host's load of a small
        model fetched 5 windows of them strewn between its chunks (an encrypted store's reader,
        5 whole 1 MiB segments), and now fetches one or two."""
        parts, listed, offset = [PACK_MAGIC], [], len(PACK_MAGIC)
        where: dict[int, tuple[bytes, int, int]] = {}
        for i in _small_last(entries):
            key, blob, raw_size, base = entries[i]
            parts.append(_ENTRY.pack(key, len(blob)))
            parts.append(blob)
            offset += _ENTRY.size
            where[i] = (key, offset, len(blob))
            listed.append([key, offset, len(blob), raw_size, base])
            offset += len(blob)
        footer = msgpack.packb(listed, use_bin_type=True)
        parts += [footer, _TRAILER.pack(len(footer), FOOTER_MAGIC)]
        # named and written from the parts: no copy of the whole pack (the backend, or the
        # cipher of an encrypted one, gathers them as it writes)
        placed = [where[i] for i in range(len(entries))]
        return parts, placed, namer_of(self.backend).key_of_parts(parts)  # keyed when encrypted: reveals nothing

    def stream(self) -> "PackStream | None":
        """A pack to write entry by entry while a save encodes, or None where the backend
        cannot stream (a bucket: a segment is one PUT of its whole body)."""
        opener = getattr(self.backend, "stream", None)
        if opener is None or not self.backend.capabilities.batched_sync:
            return None
        return PackStream(self, opener(self.name(b"\0" * 32)))

    def read(self, pack: bytes, offset: int, length: int, key: bytes, buffer=None, *, ahead: bool = False):
        """One entry's bytes, as the index places them (with `buffer`, read into the reusable
        buffer it gives, as for object files). `ahead`: the reader will read this entry's
        neighbours next (a load's walk), so in a bucket a small one comes with its window."""
        try:
            data = None
            if ahead and self.windows is not None and offset >= 0:
                data = self.windows.read(self.name(pack), offset, length)
            if data is None:
                data = self.backend.get(self.name(pack), offset, length, buffer=buffer) \
                    if offset >= 0 and length >= 0 else b""
        except BlobAbsentError:
            raise MissingObjectError(f"pack {to_hex(pack)} holding the object is missing", key=to_hex(key)) from None
        except MissingObjectError as exc:
            raise MissingObjectError(f"pack {to_hex(pack)} cannot be read: {exc.detail}", key=to_hex(key)) from None
        except CorruptionError as exc:  # an encrypted pack's segment fails its check: name the object
            raise CorruptionError(f"pack {to_hex(pack)} holding it: {exc.detail}", key=to_hex(key)) from None
        if len(data) != length:  # a damaged record asks for more than the pack holds
            size = self.size(pack) or 0
            if offset < 0 or length < 0 or offset + length > size:
                raise CorruptionError(f"pack {to_hex(pack)} holds {size} bytes, the index places the object at "
                                      f"{offset}..{offset + length}", key=to_hex(key))
            raise CorruptionError(f"pack {to_hex(pack)} is truncated", key=to_hex(key))
        return data

    def delete(self, pack: bytes) -> None:
        """Remove the pack (absent is fine); durable after the backend's sync()."""
        self.backend.delete(self.name(pack))

    def keys(self, pack: bytes) -> list[bytes]:
        """The keys of a pack's entries: from its footer (one read of its tail), else walked."""
        size = self.size(pack)
        try:
            listed = self.listed(pack, size) if size is not None else None
        except CorruptionError:  # a damaged footer: the entries up to the damage, walked
            listed = None
        return [e.key for e in listed] if listed is not None else [key for key, _, _ in self.entries(pack)]

    def entry_header(self, pack: bytes, offset: int) -> tuple[bytes, int]:
        """(key, length) from the header before the entry at `offset` (one small read)."""
        if offset < PACK_HEADER + _ENTRY.size:
            raise CorruptionError(f"pack {to_hex(pack)} has no entry at {offset}")
        return _ENTRY.unpack(self.backend.get(self.name(pack), offset - _ENTRY.size, _ENTRY.size))

    def footer_trusted(self, pack: bytes) -> bool:
        """Whether the pack's footer is the one it was written with. Its name is the hash of its
        footer and trailer (a streamed pack) or of all its bytes (`write`), so recomputing it
        proves the list. gc deletes and rewrites a pack by that list: a key damaged in it would
        have made a live entry look dead (an audit lost a checkpoint that way)."""
        try:
            return self._footer_names_pack(pack) or namer_of(self.backend).key(self.backend.get(self.name(pack))) == pack
        except (CasError, OSError):
            return False

    def _footer_names_pack(self, pack: bytes) -> bool:
        """Whether the pack's footer and trailer hash to its name (a streamed pack's, intact)."""
        size = self.size(pack)
        if size is None or size < _TRAILER.size:
            return False
        name = self.name(pack)
        try:
            length, magic = _TRAILER.unpack(self.backend.get(name, size - _TRAILER.size, _TRAILER.size))
            return magic == FOOTER_MAGIC and length + _TRAILER.size <= size \
                and namer_of(self.backend).key(self.backend.get(name, size - length - _TRAILER.size,
                                                                length + _TRAILER.size)) == pack
        except (CasError, OSError, struct.error):
            return False

    def listing_agrees(self, pack: bytes, listed: list[PackEntry]) -> bool:
        """Whether a footer's list can be taken without reading the pack: it names the pack (a
        streamed pack's), or every entry's own header in the pack says the key and length it
        lists (a pack named by all its bytes: one small read an entry, on a local disk)."""
        if self._footer_names_pack(pack):
            return True
        try:
            return all(self.entry_header(pack, e.offset) == (e.key, e.length) for e in listed)
        except (CasError, OSError, struct.error):
            return False

    def entries(self, pack: bytes) -> Iterator[tuple[bytes, int, int]]:
        """(object key, offset, length) of each entry, read from the pack itself (for repair).
        Stops at the first entry that runs past the end of a truncated pack, or whose bytes do
        not start as an object does (a damaged header, or the footer reached where the trailer
        that says where it starts is damaged). A pack that cannot be read whole (an encrypted
        one with a damaged segment) is walked by ranged reads up to the first that fails: a
        damaged last segment, the footer's, dropped every entry of the pack at repair (audit
        of stop 39)."""
        name = self.name(pack)
        try:
            data = self.backend.get(name)
        except CorruptionError:
            size = self.backend.stat(name) or 0
            yield from _walk(pack, lambda at, n: self.backend.get(name, at, n), size)
            return
        size = _entries_end(pack, data) if data[:len(PACK_MAGIC)] == PACK_MAGIC else len(data)
        yield from _walk(pack, lambda at, n: data[at:at + n], size)

    def listed(self, pack: bytes, size: int, *, end_to_end: bool = False) -> list[PackEntry] | None:
        """The pack's footer, read from its tail (one ranged read, two for a long footer); None
        for a format-1 pack, which lists nothing (walk its entries). A footer that does not
        parse, or places an entry outside the pack, is a CorruptionError; with `end_to_end`,
        so is one whose entries do not lie end to end from the magic to the footer, as every
        writer of packs places them (write, PackStream): a damaged offset or length shows with
        no read of the entries."""
        name = self.name(pack)
        if size < len(PACK_MAGIC) + _TRAILER.size:
            raise CorruptionError(f"pack {to_hex(pack)} is too short to be a pack ({size} bytes)")
        start = max(0, size - TAIL_READ)
        tail = self.backend.get(name, start, size - start)
        if start == 0 and tail[:len(PACK_MAGIC)] == PACK_MAGIC_V1:
            return None
        length, magic = _TRAILER.unpack_from(tail, len(tail) - _TRAILER.size)
        if magic != FOOTER_MAGIC:
            if start > 0 and self.backend.get(name, 0, len(PACK_MAGIC_V1)) == PACK_MAGIC_V1:
                return None
            raise CorruptionError(f"pack {to_hex(pack)} has no footer (truncated or damaged)")
        end = size - _TRAILER.size
        if length > end - len(PACK_MAGIC):
            raise CorruptionError(f"pack {to_hex(pack)} names a footer longer than itself")
        footer = tail[len(tail) - _TRAILER.size - length:len(tail) - _TRAILER.size] if end - length >= start \
            else self.backend.get(name, end - length, length)
        listed = _parse_footer(pack, footer, end - length)
        if end_to_end and not _end_to_end(listed, end - length):
            raise CorruptionError(f"pack {to_hex(pack)} has a footer whose entries do not lie end to end")
        return listed


class PackStream:
    """A pack written as its objects arrive, by several threads at once: each reserves the
    next range (reserve), writes its entry there with no copy and no lock held (write), and
    the pack is finished once the writer stops adding (finish): footer and trailer, one fsync,
    its name. Memory holds no pack: only the entries' places.

    Its name is the blake3 of its footer and trailer rather than of all its bytes: the footer
    lists every entry's key, place, length, raw size and base, so two packs of one name hold the
    same objects at the same places (each entry checked by its own key on every read, as
    before); hashing the whole pack would read every byte again, or join it in memory. Nothing
    reads a pack's name as a checksum of its bytes."""

    def __init__(self, packs: PackFiles, staged) -> None:
        self._packs, self._file = packs, staged
        self._lock = threading.Condition()
        self._end = PACK_HEADER
        self._listed: list = []
        self._writing = 0
        self._failed = False
        self.closed = False
        staged.write_at(0, [PACK_MAGIC])

    @property
    def size(self) -> int:
        return self._end

    def reserve(self, entries: list[tuple[bytes, int, int, bytes | None]]) -> int | None:
        """Places for (key, length, raw size, base) entries side by side, one write's worth:
        where the first one's 36-byte entry header goes (each encoded object follows its
        header); None once the pack is closed."""
        with self._lock:
            if self.closed:
                return None
            start = at = self._end
            for key, length, raw_size, base in entries:
                at += _ENTRY.size
                self._listed.append([key, at, length, raw_size, base])
                at += length
            self._end = at
            self._writing += 1
            return start

    def write(self, start: int, entries: list[tuple[bytes, list]]) -> None:
        """Write reserved (key, parts) entries from `start` in one call (in the reserving
        thread). A failed write still ends the reservation, so finish() never waits for it; the
        pack then fails at finish."""
        try:
            parts: list = []
            for key, pieces in entries:
                parts.append(_ENTRY.pack(key, sum(memoryview(p).nbytes for p in pieces)))
                parts += pieces
            length = sum(memoryview(p).nbytes for p in parts)
            written = self._file.write_at(start, parts)
            if written != length:
                raise OSError(f"pack entries were written short ({written} of {length} bytes)")
            if length >= WRITEBACK_MIN:
                self._file.writeback(start, written)
        except BaseException:
            with self._lock:
                self._writing -= 1
                self._failed = True
                self._lock.notify_all()
            raise
        with self._lock:
            self._writing -= 1
            self._lock.notify_all()

    def close(self) -> None:
        """No more entries (the next reserve gets None)."""
        with self._lock:
            self.closed = True

    def finish(self) -> tuple[bytes, list[PackEntry]]:
        """Wait for the entries being written, write footer and trailer, fsync and name the pack
        (create-only; an existing pack of the name holds the same entries at the same places,
        and is replaced only as PackFiles.write replaces: a damaged copy is healed). Returns its
        key and entries."""
        with self._lock:
            self.closed = True
            while self._writing:
                self._lock.wait()
            listed = list(self._listed)
        if self._failed:
            self.discard()
            raise OSError("writing a pack entry failed; the pack is discarded")
        footer = msgpack.packb(listed, use_bin_type=True)
        tail = footer + _TRAILER.pack(len(footer), FOOTER_MAGIC)
        if self._file.write_at(self._end, [tail]) != len(tail):
            self.discard()
            raise OSError("a pack footer was written short")
        pack = namer_of(self._packs.backend).key(tail)  # keyed in an encrypted store
        backend = self._packs.backend
        staged = self._file.close(self._packs.name(pack), fsync=True)
        try:
            if not backend.publish(staged):
                backend.replace(staged)
        except BaseException:
            backend.discard(staged)
            raise
        return pack, [PackEntry(k, o, n, r, b) for k, o, n, r, b in listed]

    def discard(self) -> None:
        """Drop the pack's temporary file (a save that aborts)."""
        self._file.discard()


def _small_last(entries) -> list[int]:
    """The order a pack written whole lays `entries` out in: the large ones, then those a reader
    fetches with their window (readahead.SMALL), each kind in the order given."""
    small = [len(blob) <= SMALL for _, blob, _, _ in entries]
    return [i for i, s in enumerate(small) if not s] + [i for i, s in enumerate(small) if s]


def _end_to_end(listed: list[PackEntry], footer_start: int) -> bool:
    end = len(PACK_MAGIC)
    for e in listed:
        if e.offset != end + _ENTRY.size:
            return False
        end = e.offset + e.length
    return end == footer_start


def _walk(pack: bytes, read, size: int) -> Iterator[tuple[bytes, int, int]]:
    """PackFiles.entries over `read(offset, n)`, the pack's bytes up to `size`: a read that
    raises CorruptionError (a damaged sealed segment) ends the walk, after the pack's magic."""
    try:
        magic = bytes(read(0, len(PACK_MAGIC)))
    except CorruptionError:
        return
    if magic not in (PACK_MAGIC, PACK_MAGIC_V1):
        raise CorruptionError(f"pack {to_hex(pack)} does not start with the pack magic")
    offset = len(PACK_MAGIC)
    while offset + _ENTRY.size <= size:
        try:
            head = read(offset, min(_ENTRY.size + len(OBJECT_MAGIC), size - offset))
        except CorruptionError:
            return
        key, length = _ENTRY.unpack_from(head, 0)
        offset += _ENTRY.size
        if offset + length > size or bytes(head[_ENTRY.size:]) != OBJECT_MAGIC:
            return
        yield key, offset, length
        offset += length


def _entries_end(pack: bytes, data) -> int:
    """Where a format-2 pack's entries end: at its footer, where the trailer places one that
    parses; else before the trailer (or at the end), for the walk to stop where entries do."""
    footer = _footer_size(data)
    if footer:
        try:
            _parse_footer(pack, data[len(data) - footer:len(data) - _TRAILER.size], len(data) - footer)
            return len(data) - footer
        except CorruptionError:
            pass
    return len(data) - (_TRAILER.size if bytes(data[-len(FOOTER_MAGIC):]) == FOOTER_MAGIC else 0)


def _footer_size(data) -> int:
    """Bytes of a format-2 pack's footer and trailer (0 when it has none that fits)."""
    if len(data) < len(PACK_MAGIC) + _TRAILER.size:
        return 0
    length, magic = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    return length + _TRAILER.size if magic == FOOTER_MAGIC and length + _TRAILER.size <= len(data) else 0


def _parse_footer(pack: bytes, footer, limit: int) -> list[PackEntry]:
    try:
        rows = msgpack.unpackb(bytes(footer), raw=False)
        out = [PackEntry(bytes(k), int(o), int(n), int(r), None if b is None else bytes(b)) for k, o, n, r, b in rows]
    except (ValueError, TypeError, msgpack.UnpackException):
        raise CorruptionError(f"pack {to_hex(pack)} has a damaged footer") from None
    for e in out:
        if len(e.key) != 32 or (e.base is not None and len(e.base) != 32) or e.offset < len(PACK_MAGIC) \
                or e.length < 0 or e.offset + e.length > limit:
            raise CorruptionError(f"pack {to_hex(pack)} has a footer entry outside the pack")
    return out
