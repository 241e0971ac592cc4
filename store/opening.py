"""How an integration handed a path, not an open store, opens one: as `cas.open` does, so the
options a user gives it (`retention=` included) mean what they mean to `cas.open`.

The trainer hooks and DCP's writer are entry points like `cas.open`; before this, a path gave
them a bare checkpoint store on which a Retention could not even be passed. The import of the
public API happens here, at call time: no module of cas.store imports cas.gc when imported.
"""

from __future__ import annotations

import os

from cas.crypt import MasterKey
from cas.errors import CasError, KeyRequiredError, NotAStoreError, NotEncryptedError, WrongKeyError

from .store import CheckpointStore


def open_path(path: str | os.PathLike, **options) -> CheckpointStore:
    """The store at `path`, opened by `cas.open(path, **options)`."""
    import cas  # noqa: PLC0415 - the public entry point, composed above this layer

    return cas.open(path, **options)


def open_named(path: str | os.PathLike, **options) -> CheckpointStore:
    """The store at `path`, named by a file rather than by the caller (a Lightning marker read
    without the plugin): plain as it is, and an encrypted one with $CAS_KEY_FILE's key, as any
    open without key= (store/location.py; KeyRequiredError naming it when unset)."""
    return open_path(path, **options)


def given_or_opened(store: str | os.PathLike | CheckpointStore, **options) -> tuple[CheckpointStore, bool]:
    """(the store, whether it was opened here): an open store as it is, else one at the path."""
    if isinstance(store, CheckpointStore):
        return store, False
    return open_path(store, **options), True


def open_or_create(path: str | os.PathLike, *, chunk_size: int, like: CheckpointStore | None = None) -> CheckpointStore:
    """The store at `path` as it is, or a new one there with `chunk_size` (a copy's destination:
    made with its source's chunk size, so the source's later saves dedup against it). With
    `like` encrypted, the store is opened with the key that opened `like`, and a new one is made
    encrypted with `like`'s master key (so it names objects alike), openable by that key."""
    key = copy_key(like)
    try:
        return open_other(path, like, create=False)
    except NotAStoreError:
        pass
    if like is not None and like.location.keys is not None:
        from .location import locate  # noqa: PLC0415

        where = locate(path, cache_dir=like.options.cache_dir)
        if not where.has_config() and where.can_create():
            where.create(chunk_size, key, master=like.location.keys.master)
    return open_other(path, like, chunk_size=chunk_size)


def copy_key(like: CheckpointStore | None):
    """The key that opened `like` (None for a plain store), to open its copies with."""
    keys = like.location.keys if like is not None else None
    if keys is None:
        return None
    kind, secret = keys.user
    return secret.decode("utf-8") if kind == "passphrase" else secret


def open_other(path: str | os.PathLike, like: CheckpointStore | None, **options) -> CheckpointStore:
    """The store at `path` opened as a copy of (or a source for) `like`: with its key when it is
    encrypted. Stores that cannot share objects (one encrypted, the other not, or two master
    keys) are refused here, before anything is copied."""
    key = copy_key(like)
    try:
        try:
            return open_path(path, key=key, **options)
        except WrongKeyError:  # its user keys changed since the copy: the master key both share opens it
            if like is None or like.location.keys is None:
                raise
            return open_path(path, key=MasterKey(like.location.keys), **options)
    except (KeyRequiredError, NotEncryptedError, WrongKeyError) as exc:
        raise CasError(f"cannot copy checkpoints between {like.path if like is not None else 'this store'} and "
                       f"{os.fspath(path)}: {exc}. {CROSS_KEY}") from None


CROSS_KEY = ("Objects travel under their names, and an encrypted store names them with a key from its master key: "
             "a copy needs both stores plain, or both encrypted with one master key (a push that creates its "
             "destination makes it so); to move checkpoints across keys, export and import them")
