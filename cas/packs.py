"""Pack files: many small encoded objects (manifest nodes, small chunks) in one immutable file.

One file per small object would cost a create, an fsync and a rename each (a 500-tensor state
has 500 tensor nodes); LMDB could hold them, but then losing the index would lose them. A pack
is written once per save (more when it grows past PACK_TARGET), fsynced before the commit, and
named by the blake3 of its bytes. It is self-describing, so the index can be rebuilt from packs
and object files alone (`cas repair`):

    magic  b"caspack1"                                     8 bytes
    entry  key (32) | length (u32 LE) | encoded object      repeated
"""

from __future__ import annotations

import os
import struct
from typing import Iterator

from .errors import CorruptionError, MissingObjectError
from .fsutil import atomic_write, fsync_dir
from .fanout import FanoutDir
from .hashing import hash_bytes, to_hex

PACK_MAGIC = b"caspack1"
_ENTRY = struct.Struct("<32sI")
PACK_HEADER = len(PACK_MAGIC)  # bytes before the first entry
PACK_ENTRY_HEADER = _ENTRY.size  # bytes before each encoded object
PACK_TARGET = 16 << 20  # a writer starts a new pack past this many bytes
MAX_PACK = 1 << 31


class PackFiles(FanoutDir):
    """Immutable pack files under packs/ab/<64 hex digits>."""

    def write(self, entries: list[tuple[bytes, bytes]]) -> tuple[bytes, list[tuple[bytes, int, int]]]:
        """Write one pack durably; returns its key and (object key, offset, length) per entry."""
        parts, placed, offset = [PACK_MAGIC], [], len(PACK_MAGIC)
        for key, blob in entries:
            parts.append(_ENTRY.pack(key, len(blob)))
            parts.append(blob)
            offset += _ENTRY.size
            placed.append((key, offset, len(blob)))
            offset += len(blob)
        data = b"".join(parts)
        pack = hash_bytes(data)
        path = self.path(pack)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, [data], tmp_dir=self.tmp_dir)
        fsync_dir(os.path.dirname(path))
        fsync_dir(self.root)
        return pack, placed

    def read(self, pack: bytes, offset: int, length: int, key: bytes) -> bytes:
        try:
            fd = os.open(self.path(pack), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise MissingObjectError(f"pack {to_hex(pack)} holding the object is missing", key=to_hex(key)) from None
        except OSError as exc:
            raise MissingObjectError(f"pack {to_hex(pack)} cannot be read: {exc}", key=to_hex(key)) from None
        try:
            size = os.fstat(fd).st_size
            if offset < 0 or length < 0 or offset + length > size:  # a damaged record asks for more
                raise CorruptionError(f"pack {to_hex(pack)} holds {size} bytes, the index places the object at "
                                      f"{offset}..{offset + length}", key=to_hex(key))
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise CorruptionError(f"pack {to_hex(pack)} is truncated", key=to_hex(key))
        return data

    def delete(self, pack: bytes) -> None:
        self.unlink(pack)

    def iterate(self) -> Iterator[bytes]:
        return self.names()

    def entries(self, pack: bytes) -> Iterator[tuple[bytes, int, int]]:
        """(object key, offset, length) of each entry, read from the pack itself (for repair).
        Stops at the first entry that runs past the end of a truncated pack."""
        path = self.path(pack)
        size = os.stat(path).st_size
        with open(path, "rb", buffering=0) as f:
            if f.read(len(PACK_MAGIC)) != PACK_MAGIC:
                raise CorruptionError(f"pack {to_hex(pack)} does not start with the pack magic")
            offset = len(PACK_MAGIC)
            while offset + _ENTRY.size <= size:
                key, length = _ENTRY.unpack(os.pread(f.fileno(), _ENTRY.size, offset))
                offset += _ENTRY.size
                if offset + length > size:
                    return
                yield key, offset, length
                offset += length
