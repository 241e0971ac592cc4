"""PyTorch Lightning: keep a Trainer's checkpoints in a cas store (incremental, deduplicated,
every byte verified on load). Importing this module imports Lightning; nothing else in cas does.

    from cas.store.lightning import CasCheckpointIO
    io = CasCheckpointIO("runs/exp1/ckpt")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    trainer.fit(model)
    # later, in a fresh process:
    L.Trainer(plugins=[io], ...).fit(model, ckpt_path=io.latest_path())

Paths and steps. Lightning names a checkpoint by a path (a file it would write); the store
names it by a step. Nothing is written at the paths themselves.
- save_checkpoint stores the checkpoint dict under its "global_step" and lists the path in the
  checkpoint's meta ("lightning_paths"). A second save at a step already stored
  (ModelCheckpoint's "last.ckpt" right after "epoch=0-step=50.ckpt") replaces that step's
  checkpoint (dedup makes it nearly free) and adds its path to the list.
- A path names the newest checkpoint that lists it, like a file that each save overwrites. A
  checkpoint stays while some path still names it: remove_checkpoint(path), or a save that moves
  the path on to a newer step (last.ckpt), deletes a checkpoint that no other path names.
- load_checkpoint(path) finds the step by, in order: the checkpoint the path names; the number
  after "step=" in the file name (Lightning's default names; path_for(step) makes one); a name
  that starts with "last" means the latest checkpoint.
- ckpt_path="best" works (Lightning passes the callback's best_model_path to this plugin);
  ckpt_path="last" does not, because Lightning resolves it by looking for files: pass
  io.latest_path() instead.
Removals are remembered by this plugin object only; a process that resumes learns them again
from ModelCheckpoint's restored state when it rotates its checkpoints.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from cas.errors import CheckpointNotFoundError

from .registry import Checkpoint, exists_error
from .opening import given_or_opened
from .store import CheckpointStore

PATHS_META = "lightning_paths"
_STEP_IN_NAME = re.compile(r"step=(\d+)")


class CasCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO plugin that saves into a cas store (see the module docstring
    for how paths map to steps)."""

    def __init__(self, store: str | os.PathLike | CheckpointStore, **options) -> None:
        """`store` is an open store (cas.open(...), whose retention then applies too) or a path
        to open one at, with cas.open's `options` (retention= included)."""
        self.store, _ = given_or_opened(store, **options)
        self._removed: set[str] = set()

    # --- CheckpointIO ---------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        step = checkpoint.get("global_step")
        if type(step) is not int:
            raise TypeError(f"a Lightning checkpoint carries an int 'global_step'; this one has {step!r}")
        path = os.fspath(path)
        cks = self.store.checkpoints()
        previous = self._named(path, cks)
        paths = [p for p in self._names_to_keep(step, cks) if p != path] + [path]
        self.store.save(_plain(checkpoint), step=step, meta={PATHS_META: paths}, replace=True)
        self._removed.discard(path)
        if previous is not None and previous.step != step:
            self._delete_if_unnamed(previous)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """The checkpoint dict stored for `path`; tensors on CPU unless map_location is a device."""
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return self.store.load(self.step_for(path), device=device)

    def remove_checkpoint(self, path) -> None:
        path = os.fspath(path)
        ck = self._named(path, self.store.checkpoints())
        self._removed.add(path)
        if ck is not None:
            self._delete_if_unnamed(ck)

    # --- paths and steps ------------------------------------------------------------------
    @staticmethod
    def path_for(step: int) -> str:
        """A path that maps to checkpoint `step` (for ckpt_path=)."""
        return f"step={step}.ckpt"

    def latest_path(self) -> str:
        """A path to the latest checkpoint, for ckpt_path= when resuming."""
        ck = self.store.latest()
        if ck is None:
            raise CheckpointNotFoundError(f"the store at {self.store.path} holds no checkpoint to resume from")
        return self.path_for(ck.step)

    def step_for(self, path) -> int:
        """The step a Lightning path names (rules in the module docstring)."""
        path = os.fspath(path)
        ck = self._named(path, self.store.checkpoints())
        if ck is not None:
            return ck.step
        name = os.path.basename(path)
        found = _STEP_IN_NAME.findall(name)
        if found:
            return int(found[-1])
        latest = self.store.latest() if name.startswith("last") else None
        if latest is not None:
            return latest.step
        raise CheckpointNotFoundError(f"no checkpoint in the store at {self.store.path} for the path {path!r}: no "
                                      "checkpoint was saved under it, and its name has no 'step=N'")

    def _named(self, path: str, cks: list[Checkpoint]) -> Checkpoint | None:
        """The newest checkpoint that lists `path`, unless this plugin removed the path."""
        if path in self._removed:
            return None
        listing = [ck for ck in cks if path in _paths(ck)]
        return max(listing, key=lambda ck: (ck.seq, ck.step)) if listing else None  # commit order, never a clock

    def _live_paths(self, ck: Checkpoint, cks: list[Checkpoint]) -> list[str]:
        """The paths that still name `ck`: listed by it, not moved on, not removed."""
        return [p for p in _paths(ck) if (named := self._named(p, cks)) is not None and named.step == ck.step]

    def _names_to_keep(self, step: int, cks: list[Checkpoint]) -> list[str]:
        """The paths that name the checkpoint at `step`, if any: the new save replaces it in
        its commit (save(replace=True): a save that fails leaves it). Only a checkpoint this plugin
        saved is replaced."""
        old = next((ck for ck in cks if ck.step == step), None)
        if old is None:
            return []
        if PATHS_META not in old.meta:
            raise exists_error(step)
        return self._live_paths(old, cks)

    def _delete_if_unnamed(self, ck: Checkpoint) -> None:
        """Forget `ck` once no path names it; a pinned checkpoint (a legal hold) always stays."""
        if not ck.pinned and not self._live_paths(ck, self.store.checkpoints()):
            self.store.delete(ck.step)

    def close(self) -> None:
        self.store.close()


def _paths(ck: Checkpoint) -> list[str]:
    paths = ck.meta.get(PATHS_META)
    return paths if isinstance(paths, list) else []


def _plain(value):
    """The checkpoint with dict subclasses other than OrderedDict (Lightning's AttributeDict of
    hyper_parameters) as plain dicts, which the store holds; everything else as it is."""
    if isinstance(value, dict) and not isinstance(value, OrderedDict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value
