"""Object keys: the blake3 digest of an object's raw (decoded) bytes.

blake3 releases the GIL, so hashing runs in parallel in the save and load thread pools.
A key names content, never an encoding: the same bytes always get the same key, whatever
codec stored them, so an object can be re-encoded without touching anything that names it.
"""

from __future__ import annotations

import blake3

KEY_SIZE = 32


def hash_bytes(data) -> bytes:
    """The 32-byte key of a bytes-like object (bytes, memoryview, contiguous numpy array)."""
    return blake3.blake3(data).digest()


def to_hex(key: bytes) -> str:
    return key.hex()
