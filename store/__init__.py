"""cas.store: checkpoints over the object store (manifests, save and load, registry).

This layer knows checkpoints but nothing of retention; cas.gc builds on it.
"""

from .registry import Checkpoint
from .store import Store, StoreStats
from .verify import Problem, VerifyReport

__all__ = ["Checkpoint", "Problem", "Store", "StoreStats", "VerifyReport"]
