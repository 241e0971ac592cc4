"""Object keys: the blake3 digest of an object's raw (decoded) bytes.

blake3 releases the GIL, so hashing runs in parallel in the save and load thread pools.
A key names content, never an encoding: the same bytes always get the same key, whatever
codec stored them, so an object can be re-encoded without touching anything that names it.
"""

from __future__ import annotations

import blake3

from .errors import CasError

KEY_SIZE = 32
_HEX_DIGITS = frozenset("0123456789abcdef")


def hash_bytes(data) -> bytes:
    """The 32-byte key of a bytes-like object (bytes, memoryview, contiguous numpy array)."""
    return blake3.blake3(data).digest()


def to_hex(key: bytes) -> str:
    return key.hex()


def from_hex(text: str) -> bytes:
    """Parse a full 64-digit lowercase hex key, refusing anything else by name."""
    if len(text) != 2 * KEY_SIZE or not set(text) <= _HEX_DIGITS:
        raise CasError(f"not an object key: {text!r} (expected {2 * KEY_SIZE} lowercase hex digits)")
    return bytes.fromhex(text)
