"""Undo one damaged byte of a small blob whose hash another record, or the blob itself, holds.

A store keeps some small blobs whose hashes are written elsewhere: each record-log entry's
blake3 is in the next entry's `prev`, and the newest one's in the index's head; the config
ends with the blake3 of the bytes before it. When such a
blob no longer matches, the cheapest and most common damage (a flipped bit, one byte
overwritten) can be undone exactly: try every such change and keep the one whose hash is the
recorded one. A 256-bit hash matching is proof that the bytes are the original ones, so the
result is never a guess; anything else (a truncation, a zeroed sector) finds nothing.
"""

from __future__ import annotations

from typing import Callable

from .hashing import hash_bytes

# The search hashes the whole blob once per change tried, so its cost grows with the square of
# the size: these bounds keep it under about a second on one core (a record-log entry of a save
# is about 500 bytes: 8 ms for its bit flips, 0.15 s for its byte changes).
MAX_BIT_FLIPS = 16 << 10  # blobs up to this size have every single-bit flip tried (8 a byte)
MAX_BYTE_CHANGES = 2 << 10  # and up to this size every other single-byte value (247 more a byte)


def undo_one_error(data: bytes, digest: bytes,
                   hash_fn: Callable[[bytes | bytearray], bytes] = hash_bytes) -> bytes | None:
    """The bytes that differ from `data` in one bit, or else in one byte, and hash to
    `digest`; None when no such bytes exist (or `data` is too large to search)."""
    if hash_fn(data) == digest:
        return bytes(data)
    return first_fix(data, lambda candidate: hash_fn(candidate) == digest)


def first_fix(data: bytes, proves: Callable[[bytearray], bool]) -> bytes | None:
    """The first bytes differing from `data` in one bit, or else in one byte, that `proves`
    accepts (it must check a digest: anything weaker would be a guess); None if none does."""
    buf = bytearray(data)
    if len(buf) <= MAX_BIT_FLIPS:
        for i, was in enumerate(data):
            for bit in (1, 2, 4, 8, 16, 32, 64, 128):
                buf[i] = was ^ bit
                if proves(buf):
                    return bytes(buf)
            buf[i] = was
    if len(buf) <= MAX_BYTE_CHANGES:
        for i, was in enumerate(data):
            for value in range(256):
                if (value ^ was) & ((value ^ was) - 1):  # two or more bits differ (one-bit tried above)
                    buf[i] = value
                    if proves(buf):
                        return bytes(buf)
            buf[i] = was
    return None
