"""Undo one damaged byte of a small blob whose hash another record, or the blob itself, holds.

A store keeps some small blobs whose hashes are written elsewhere: each record-log entry's
blake3 is in the next entry's `prev`, and the newest one's in the index's head. The config and
log entries also end with a digest of their own bytes (`with_digest`: a last msgpack field
`digest`, which readers that do not know it ignore). When such a
blob no longer matches, the cheapest and most common damage (a flipped bit, one byte
overwritten) can be undone exactly: try every such change and keep the one whose hash is the
recorded one. A 256-bit hash matching is proof that the bytes are the original ones, so the
result is never a guess; anything else (a truncation, a zeroed sector) finds nothing.
"""

from __future__ import annotations

from typing import Callable

import msgpack

from .hashing import KEY_SIZE, hash_bytes

# The search hashes the whole blob once per change tried, so its cost grows with the square of
# the size: these bounds keep it under about a second on one core (a record-log entry of a save
# is about 500 bytes: 8 ms for its bit flips, 0.15 s for its byte changes).
MAX_BIT_FLIPS = 16 << 10  # blobs up to this size have every single-bit flip tried (8 a byte)
MAX_BYTE_CHANGES = 2 << 10  # and up to this size every other single-byte value (247 more a byte)


# A self-digested blob's last field: the key "digest" and a 32-byte bin's header, as msgpack
# packs them, then the blake3 of every byte of the blob before this field.
DIGEST_FIELD = b"\xa6digest\xc4\x20"
DIGESTED = len(DIGEST_FIELD) + KEY_SIZE


def with_digest(prefix: bytes, body: dict) -> bytes:
    """`prefix` + msgpack of `body` (a map) with a last field `digest`: the blake3 of the bytes
    before that field, so that the blob proves itself (`proves_itself`)."""
    data = prefix + msgpack.packb({**body, "digest": bytes(KEY_SIZE)}, use_bin_type=True)
    return data[:-KEY_SIZE] + hash_bytes(data[:-DIGESTED])


def proves_itself(data) -> bool:
    """Whether `data` ends with the digest field of the bytes before it (with_digest)."""
    return len(data) > DIGESTED and data[-DIGESTED:-KEY_SIZE] == DIGEST_FIELD \
        and hash_bytes(memoryview(data)[:-DIGESTED]) == data[-KEY_SIZE:]


def claims_a_digest(raw) -> bool:
    """Whether a decoded map says it was written with a digest: it has one, or its last field
    is a six-letter key holding 32 bytes (the digest under a damaged name)."""
    if not isinstance(raw, dict) or not raw:
        return False
    if "digest" in raw:
        return True
    name, value = list(raw.items())[-1]
    return isinstance(name, str) and len(name) == 6 and isinstance(value, bytes) and len(value) == KEY_SIZE


def undo_own_error(data: bytes, magic: bytes) -> bytes | None:
    """A self-digested blob as written, where `data` is one bit or byte from it; None if not
    (or if `data` does not look like such a blob: its magic or its digest field in place)."""
    if not (data.startswith(magic) or data[-DIGESTED:-KEY_SIZE] == DIGEST_FIELD):
        return None
    return first_fix(data, proves_itself)


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
