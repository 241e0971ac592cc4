"""cas: a content-addressed, incremental checkpoint store for PyTorch training.

    import cas
    with cas.open("runs/exp1/ckpt") as store:
        store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=step)
        state = store.load()

The names that need torch (cas.Store, cas.Checkpoint, ...) load on first use (PEP 562), so
the storage layer (cas.hashing, cas.objectstore, ...) imports, and is tested, without torch,
cas.store or cas.gc.
"""

from __future__ import annotations

import importlib
import os

from .errors import (CasError, CheckpointExistsError, CheckpointNotFoundError, CorruptionError,
                     DistributedCheckpointError, DuplicateKeyError, FormatVersionError, IndexDamagedError, KeyFileError,
                     KeyRemovalRefusedError, KeyRequiredError,
                     MissingObjectError, NotAStoreError, NotEncryptedError, ObjectStoreError, ReadOnlyStoreError,
                     RetentionRefusedError, StateMismatchError, StoreClosedError, StoreKeyError, StoreWriteError,
                     IndexReplacedError,
                     UnresumableStateError, UnsupportedFilesystemError, WrongKeyError)

__version__ = "0.1.0"

# name -> the module it comes from, imported when the name is first asked for
_LAZY = {
    "Store": "cas.api",
    "GcReport": "cas.gc",
    "Retention": "cas.gc",
    "Checkpoint": "cas.store",
    "CheckpointReader": "cas.store",
    "StoreOptions": "cas.store",
    "StoreStats": "cas.store",
    "VerifyReport": "cas.store",
    "RNGState": "cas.store.training",
    "ResumableRandomSampler": "cas.store.sampler",
}
# subpackages that `import cas` used to import, so that `cas.store.X` after `import cas` works
_SUBMODULES = frozenset({"api", "store", "gc"})


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


def open(path: str | os.PathLike, **options):  # noqa: A001 - mirrors the builtin on purpose
    """Open the store at `path`, creating it when the path is missing or an empty folder.

    Options: a cas.StoreOptions as `options=`, and/or its fields as keywords (create, readonly,
    chunk_size, compress, compression_level, workers, window_bytes, pack_max, max_inflight,
    delta, max_chain, delta_memory: see StoreOptions); and retention (a cas.Retention applied
    after every save).
    """
    from .api import Store

    return Store(path, **options)


__all__ = ["RNGState", "ResumableRandomSampler", "Checkpoint", "CheckpointReader", "StoreOptions", "GcReport", "Retention", "Store", "StoreStats", "VerifyReport", "CasError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptionError",
           "FormatVersionError", "MissingObjectError", "NotAStoreError", "ReadOnlyStoreError",
           "RetentionRefusedError", "StateMismatchError", "StoreClosedError", "StoreWriteError", "IndexReplacedError",
           "UnresumableStateError", "UnsupportedFilesystemError", "DistributedCheckpointError", "ObjectStoreError",
           "StoreKeyError", "KeyRequiredError", "WrongKeyError", "NotEncryptedError", "KeyRemovalRefusedError",
           "KeyFileError", "DuplicateKeyError", "IndexDamagedError", "open"]
