"""Content-named files fanned out as <root>/ab/ab12…: the shared layout of objects and packs."""

from __future__ import annotations

import os
from typing import Iterator

from .errors import CasError
from .hashing import KEY_SIZE, to_hex


class FanoutDir:
    """Files named by 64 hex digits under two-digit folders, so no directory grows huge."""

    def __init__(self, root: str, tmp_dir: str) -> None:
        self.root = root
        self.tmp_dir = tmp_dir

    def path(self, key: bytes) -> str:
        if len(key) != KEY_SIZE:
            raise CasError(f"a key must be {KEY_SIZE} bytes, got {len(key)}")
        name = to_hex(key)
        return os.path.join(self.root, name[:2], name)

    def size(self, key: bytes) -> int | None:
        """The file's size, or None when it is absent."""
        try:
            return os.stat(self.path(key)).st_size
        except FileNotFoundError:
            return None

    def unlink(self, key: bytes) -> bool:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return False
        return True

    def names(self) -> Iterator[bytes]:
        """Every key present; names that are not ours (wrong length, not hex) are skipped."""
        if not os.path.isdir(self.root):
            return
        for fan in sorted(os.listdir(self.root)):
            folder = os.path.join(self.root, fan)
            if len(fan) != 2 or not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if len(name) == 2 * KEY_SIZE and name.startswith(fan):
                    try:
                        yield bytes.fromhex(name)
                    except ValueError:
                        continue
