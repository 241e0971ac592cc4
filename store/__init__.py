"""cas.store: checkpoints over the object store (manifests, save and load, registry).

This layer knows checkpoints but nothing of retention; cas.gc builds on it.
"""

from .registry import Checkpoint
from .options import StoreOptions
from .reader import CheckpointReader
from .store import CheckpointStore, StoreStats
from .verify import Problem, VerifyReport

__all__ = ["Checkpoint", "CheckpointReader", "CheckpointStore", "Problem", "StoreOptions", "StoreStats", "VerifyReport"]
