"""Content names fanned out as <prefix>/ab/ab12…: the shared naming of objects and packs.

Blob names, not paths: a backend (cas.localfs) decides where a name lives. Two-digit folders
keep any one directory (or listing page) small.
"""

from __future__ import annotations

from typing import Iterator

from .errors import CasError
from .hashing import KEY_SIZE, to_hex


class Fanout:
    """Keys as blob names `<prefix>/<first two hex digits>/<64 hex digits>` in a backend."""

    def __init__(self, backend, prefix: str) -> None:
        self.backend = backend
        self.prefix = prefix

    def name(self, key: bytes) -> str:
        if len(key) != KEY_SIZE:
            raise CasError(f"a key must be {KEY_SIZE} bytes, got {len(key)}")
        hexed = to_hex(key)
        return f"{self.prefix}/{hexed[:2]}/{hexed}"

    def path(self, key: bytes) -> str:
        """The key's file, for a local backend only (tests and tools damage or inspect files)."""
        return self.backend.path(self.name(key))

    def size(self, key: bytes) -> int | None:
        """The blob's size, or None when it is absent."""
        return self.backend.stat(self.name(key))

    def iterate(self) -> Iterator[bytes]:
        """Every key present; names that are not ours (wrong length, not hex, wrong folder) are
        skipped."""
        for name in self.backend.list(self.prefix + "/"):
            key = self._key_of(name)
            if key is not None:
                yield key

    def sizes(self) -> dict[bytes, int]:
        """Every key present with its blob's size, from one listing (a bucket's carries sizes)."""
        out = {}
        for name, size in self.backend.list_sizes(self.prefix + "/"):
            key = self._key_of(name)
            if key is not None:
                out[key] = size
        return out

    def _key_of(self, name: str) -> bytes | None:
        fan, _, hexed = name[len(self.prefix) + 1:].partition("/")
        if len(fan) == 2 and len(hexed) == 2 * KEY_SIZE and hexed.startswith(fan):
            try:
                return bytes.fromhex(hexed)
            except ValueError:
                return None
        return None
