"""Pack files: many small encoded objects (manifest nodes, small chunks) in one immutable blob.

One file per small object would cost a create, an fsync and a rename each (a 500-tensor state
has 500 tensor nodes); LMDB could hold them, but then losing the index would lose them. A pack
is written once per save (more when it grows past PACK_TARGET), durable before the commit, and
named packs/ab/<blake3 of its bytes> in the backend. It is self-describing, so the index can be
rebuilt from packs and object files alone (`cas repair`):

    magic  b"caspack1"                                     8 bytes
    entry  key (32) | length (u32 LE) | encoded object      repeated
"""

from __future__ import annotations

import struct
from typing import Iterator

from .backend import Backend
from .errors import BlobAbsentError, CorruptionError, MissingObjectError
from .fanout import Fanout
from .hashing import hash_bytes, to_hex

PACK_MAGIC = b"caspack1"
_ENTRY = struct.Struct("<32sI")
PACK_HEADER = len(PACK_MAGIC)  # bytes before the first entry
PACK_ENTRY_HEADER = _ENTRY.size  # bytes before each encoded object
PACK_TARGET = 16 << 20  # a writer starts a new pack past this many bytes
MAX_PACK = 1 << 31
PREFIX = "packs"


class PackFiles(Fanout):
    """Immutable packs, blobs named packs/ab/<64 hex digits>."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, PREFIX)

    def write(self, entries: list[tuple[bytes, bytes]]) -> tuple[bytes, list[tuple[bytes, int, int]]]:
        """Write one pack durably; returns its key and (object key, offset, length) per entry.
        A pack of that name holds these very bytes (its name is their hash), so one already
        there is replaced: a damaged copy is healed, a sound one unchanged."""
        parts, placed, offset = [PACK_MAGIC], [], len(PACK_MAGIC)
        for key, blob in entries:
            parts.append(_ENTRY.pack(key, len(blob)))
            parts.append(blob)
            offset += _ENTRY.size
            placed.append((key, offset, len(blob)))
            offset += len(blob)
        data = b"".join(parts)
        pack = hash_bytes(data)
        staged = self.backend.stage(self.name(pack), [data], fsync=True)
        try:
            if not self.backend.publish(staged):
                self.backend.replace(staged)
        except BaseException:
            self.backend.discard(staged)
            raise
        self.backend.sync()
        return pack, placed

    def read(self, pack: bytes, offset: int, length: int, key: bytes) -> bytes:
        """One entry's bytes, as the index places them."""
        try:
            data = self.backend.get(self.name(pack), offset, length) if offset >= 0 and length >= 0 else b""
        except BlobAbsentError:
            raise MissingObjectError(f"pack {to_hex(pack)} holding the object is missing", key=to_hex(key)) from None
        except MissingObjectError as exc:
            raise MissingObjectError(f"pack {to_hex(pack)} cannot be read: {exc.detail}", key=to_hex(key)) from None
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

    def entries(self, pack: bytes) -> Iterator[tuple[bytes, int, int]]:
        """(object key, offset, length) of each entry, read from the pack itself (for repair).
        Stops at the first entry that runs past the end of a truncated pack."""
        data = self.backend.get(self.name(pack))
        if data[:len(PACK_MAGIC)] != PACK_MAGIC:
            raise CorruptionError(f"pack {to_hex(pack)} does not start with the pack magic")
        offset, size = len(PACK_MAGIC), len(data)
        while offset + _ENTRY.size <= size:
            key, length = _ENTRY.unpack_from(data, offset)
            offset += _ENTRY.size
            if offset + length > size:
                return
            yield key, offset, length
            offset += length
