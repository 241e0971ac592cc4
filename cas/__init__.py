"""cas: a content-addressed, incremental checkpoint store for PyTorch training.

    import cas
    with cas.open("runs/exp1/ckpt") as store:
        store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=step)
        state = store.load()
"""

from __future__ import annotations

import os

from .errors import (CasError, CheckpointExistsError, CheckpointNotFoundError, CorruptionError,
                     FormatVersionError, MissingObjectError, NotAStoreError, ReadOnlyStoreError,
                     RetentionRefusedError, StateMismatchError, StoreClosedError, StoreWriteError,
                     UnsupportedFilesystemError)

from .api import Store
from .gc import GcReport, Retention
from .store import Checkpoint, StoreStats, VerifyReport
from .store.training import ResumableRandomSampler, RNGState

__version__ = "0.1.0"


def open(path: str | os.PathLike, **options):  # noqa: A001 - mirrors the builtin on purpose
    """Open the store at `path`, creating it when the path is missing or an empty folder.

    Options: create (default True), readonly, chunk_size (fixed at creation, default 4 MiB),
    compress (default True), compression_level (zstd, default 1), workers (default: CPU count; loads use twice as many threads),
    window_bytes (in-flight chunk bytes while saving, default 256 MiB), retention (a
    cas.gc.Retention applied after every save).
    """
    return Store(path, **options)


__all__ = ["RNGState", "ResumableRandomSampler", "Checkpoint", "GcReport", "Retention", "Store", "StoreStats", "VerifyReport", "CasError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptionError",
           "FormatVersionError", "MissingObjectError", "NotAStoreError", "ReadOnlyStoreError",
           "RetentionRefusedError", "StateMismatchError", "StoreClosedError", "StoreWriteError",
           "UnsupportedFilesystemError", "open"]
