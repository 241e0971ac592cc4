"""How an integration handed a path, not an open store, opens one: as `cas.open` does, so the
options a user gives it (`retention=` included) mean what they mean to `cas.open`.

The trainer hooks and DCP's writer are entry points like `cas.open`; before this, a path gave
them a bare checkpoint store on which a Retention could not even be passed. The import of the
public API happens here, at call time: no module of cas.store imports cas.gc when imported.
"""

from __future__ import annotations

import os

from cas.errors import NotAStoreError

from .store import CheckpointStore


def open_path(path: str | os.PathLike, **options) -> CheckpointStore:
    """The store at `path`, opened by `cas.open(path, **options)`."""
    import cas  # noqa: PLC0415 - the public entry point, composed above this layer

    return cas.open(path, **options)


def given_or_opened(store: str | os.PathLike | CheckpointStore, **options) -> tuple[CheckpointStore, bool]:
    """(the store, whether it was opened here): an open store as it is, else one at the path."""
    if isinstance(store, CheckpointStore):
        return store, False
    return open_path(store, **options), True


def open_or_create(path: str | os.PathLike, *, chunk_size: int) -> CheckpointStore:
    """The store at `path` as it is, or a new one there with `chunk_size` (a copy's destination:
    made with its source's chunk size, so the source's later saves dedup against it)."""
    try:
        return open_path(path, create=False)
    except NotAStoreError:
        return open_path(path, chunk_size=chunk_size)
