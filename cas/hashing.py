"""Object keys: the blake3 digest of an object's raw (decoded) bytes; in an encrypted store the
keyed blake3 (a key derived from the store's master key, cas/crypt.py), through the store's Namer.

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


class Namer:
    """How one store names its objects (and packs): plain blake3, or blake3 in keyed mode for an
    encrypted store, so a name there reveals nothing of the bytes and the same tensor in two
    stores with different keys gets two names. Each open store has its own (no process-global
    state: stores with different keys may be open in one process); `fingerprint` tells two
    stores that name alike (None: plain)."""

    __slots__ = ("_key", "fingerprint")

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and len(key) != KEY_SIZE:
            raise ValueError("a naming key is 32 bytes")
        self._key = key
        self.fingerprint = None if key is None else blake3.blake3(b"cas namer fingerprint", key=key).digest()[:16]

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def key(self, data) -> bytes:
        """The 32-byte name of a bytes-like object's content in this store."""
        if self._key is None:
            return blake3.blake3(data).digest()
        return blake3.blake3(data, key=self._key).digest()

    def key_of_parts(self, parts) -> bytes:
        """key() of the parts' concatenation, without making it."""
        h = blake3.blake3() if self._key is None else blake3.blake3(key=self._key)
        for part in parts:
            h.update(part)
        return h.digest()

    def __repr__(self) -> str:
        return "Namer(keyed)" if self._key is not None else "Namer(plain)"


PLAIN = Namer()  # the plain stores' naming: blake3 of the raw bytes
