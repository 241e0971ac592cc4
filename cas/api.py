"""The public store: the checkpoint store (cas.store) plus retention and gc (cas.gc).

The layers stay apart: cas.store knows checkpoints but not retention, cas.gc knows both; this
module composes them into what `cas.open` returns.
"""

from __future__ import annotations

import os

from .gc import GcReport, Retention, collect
from .store import Checkpoint
from .store import Store as CheckpointStore


class Store(CheckpointStore):
    """A checkpoint store with retention: `cas.open(path, retention=Retention(keep_last=5))`
    applies the policy after every save, like orbax's max_to_keep."""

    def __init__(self, path: str | os.PathLike, *, retention: Retention | None = None, **options) -> None:
        super().__init__(path, **options)
        self.retention = retention

    def gc(self, retention: Retention | None = None, *, dry_run: bool = False, progress=None,
           **rules) -> GcReport:
        """Remove the checkpoints no rule keeps, then sweep every unreferenced object.

        Rules come as a Retention or as its keywords (keep_last=5, keep_milestones=True, ...);
        with neither, nothing is removed and only garbage is swept."""
        self._check_open()
        if retention is not None and rules:
            raise TypeError("pass a Retention or rule keywords, not both")
        if rules:
            retention = Retention(**rules)
        return collect(self, retention, dry_run=dry_run, progress=progress)

    def pin(self, step: int) -> Checkpoint:
        return self.set_pinned(step, True)

    def unpin(self, step: int) -> Checkpoint:
        return self.set_pinned(step, False)

    def _after_commit(self, ck: Checkpoint) -> None:
        if self.retention is not None:
            collect(self, self.retention)
