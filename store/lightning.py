"""PyTorch Lightning: keep a Trainer's checkpoints in a cas store (incremental, deduplicated,
every byte verified on load). Importing this module imports Lightning; nothing else in cas does.

    from cas.store.lightning import CasCheckpointIO, cas_url
    io = CasCheckpointIO("runs/exp1/ckpt")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    trainer.fit(model)
    # later, in a fresh process:
    L.Trainer(plugins=[io], ...).fit(model, ckpt_path="last")       # or "best", or a path
    Model.load_from_checkpoint(cas_url("ckpt/epoch=1-step=8.ckpt"))  # no plugin needed

Markers (store/lightning_markers.py). Lightning decides by the filesystem: it versions a name (-v1) only when a file is
there, links last.ckpt to a file (save_last="link"), finds ckpt_path="last" by listing its
folder. So after each save's commit the plugin writes a marker at the path Lightning named (a
local file, or an object where dirpath is another fsspec filesystem): a zip archive of one
msgpack member (the store, the step, the checkpoint id; never pickle). Lightning code that reads
the path without the plugin (Model.load_from_checkpoint(path), a Trainer without it) reads it
through Lightning's own loader, which this module, once imported, teaches to read markers through
cas (every byte verified; any other file as before). A process that never imported it gets
torch.load's error, which ends with the member's name: what the file is and how to load it.
Through cas_url(path) (cas://PATH, an fsspec protocol the package registers by entry point) the
same code reads the checkpoint the marker names, as a torch.save stream made from verified data
(held in memory while torch.load reads it).

Paths and steps. The store names a checkpoint by a step, Lightning by a path.
- save_checkpoint stores the dict under its "global_step" and lists the path in the checkpoint's
  meta ("lightning_paths"). A second save of the same run (one Trainer.fit, until teardown) at
  the same global step that holds the same training state (ModelCheckpoint's last.ckpt right
  after "epoch=0-step=50.ckpt": the same entries and loop progress) replaces that checkpoint in
  its own commit (dedup makes it nearly free) and keeps the earlier paths naming it. A save
  over a path that alone names the checkpoint at its step replaces it, as a file is
  overwritten. Any other checkpoint at the step stays: one that other paths name (a second run
  into the same dirpath and store finds the first run's, with a warning), or this run's save of
  other content (a weights-only save beside a full one; a save at a batch's end beside one
  after validation). The save goes to the next free step above the store's latest, and meta
  "lightning_global_step" keeps Lightning's step. A save replaces exactly the checkpoint it was
  placed over: two runs sharing a store that reach a step together are placed again, not
  replaced by each other.
- Hyperparameters a store cannot hold (a Path, a device, an Enum, a class, a module: Lightning's
  own file pickles them) are stored as their text, with a warning naming each.
- A path names the checkpoint its marker names. A checkpoint stays while some path still names
  it: remove_checkpoint(path) deletes the marker (or Lightning's link) and then the checkpoint
  if no other marker names it; a pinned checkpoint (a legal hold) always stays. The store's
  retention may delete a checkpoint a marker still names: loading that path then says so.
  Under AsyncCheckpointIO (saves queued on a thread, removals at once), a path removed before
  or while its save runs gets no marker, and that save then deletes its checkpoint if no other
  path names it.
- load_checkpoint(path) reads the marker at the path (a link Lightning made to one resolves to
  it); a path without one (a store saved before markers, or another host's folder) is found by,
  in order: the newest checkpoint that lists it, the number after "step=" in the file name
  (path_for(step) makes one), a name that starts with "last" (the latest checkpoint).
- ckpt_path="best" and "last" work: Lightning finds them among the markers.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Any

import fsspec
import fsspec.core
import fsspec.utils
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from cas.errors import CasError, CheckpointExistsError, CheckpointNotFoundError

from .lightning_markers import (PATHS_META, PROTOCOL, CasFileSystem, Marker, cas_url, holding,  # noqa: F401
                                is_marker, lightning_paths, load_marked, load_named, marked_checkpoint, marker_or_none,
                                marker_place, names_checkpoint, read_file, read_marker, remove_file, small_file,
                                write_marker)
from .opening import given_or_opened
from .registry import Checkpoint
from .store import CheckpointStore
from .lightning_state import plain, same_values, storable

GLOBAL_STEP_META = "lightning_global_step"
_STEP_IN_NAME = re.compile(r"step=(\d+)")
PLACE_ATTEMPTS = 5  # saves placed again after another run sharing the store committed at their step


class CasCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO plugin that saves into a cas store (see the module docstring
    for how paths map to steps)."""

    def __init__(self, store: str | os.PathLike | CheckpointStore, **options) -> None:
        """`store` is an open store (cas.open(...), whose retention then applies too) or a path
        to open one at, with cas.open's `options` (retention= included)."""
        self.store, _ = given_or_opened(store, **options)
        self._run: dict[int, int] = {}  # this run's saves: Lightning's global step -> the store's step
        # paths removed while nothing was there yet: Lightning's AsyncCheckpointIO queues saves on
        # a thread but removes at once, so save_top_k removes a path whose save has not run; that
        # save, when it runs, is skipped (it wrote a marker and a checkpoint nobody kept, for good)
        self._removed_unsaved: set[str] = set()
        # the paths whose markers a running save writes after its commit: their removal meanwhile
        # is left to that save (before, it deleted the just-committed checkpoint, which no marker
        # named yet, and the save then wrote its markers anyway: a removed file came back and
        # last.ckpt named a deleted checkpoint, stop 36's audit)
        self._saving: set[str] = set()
        # a save's placing and its markers, and removals, one at a time (not the save itself)
        self._lock = threading.RLock()
        self._saver: threading.Thread | None = None  # the thread this run's saves ran on

    # --- CheckpointIO ---------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                            f"supported for `{type(self).__name__}`: it saves into its cas store, opened with the "
                            "options given to it")
        global_step = checkpoint.get("global_step")
        if type(global_step) is not int:
            raise TypeError(f"a Lightning checkpoint carries an int 'global_step'; this one has {global_step!r}")
        path = marker_place(path)
        state = storable(checkpoint)
        for attempt in range(PLACE_ATTEMPTS):
            with self._lock:
                self._new_run_if_its_saver_is_gone()
                if self._removed_early(path):
                    return
                cks = self.store.checkpoints()
                previous = self._named(path, cks)
                step, kept = self._place(global_step, path, cks, checkpoint)
                replaced = next((ck for ck in cks if ck.step == step), None)
                paths = kept + [path]
                self._saving.update(paths)
            try:  # replacing exactly what was placed over: another run sharing the store may commit there first
                ck = self.store.save(state, step=step, replace=replaced or False,
                                     meta={PATHS_META: paths, GLOBAL_STEP_META: global_step})
                break
            except CheckpointExistsError:
                with self._lock:
                    self._saving.difference_update(paths)
                if attempt == PLACE_ATTEMPTS - 1:
                    raise
            except BaseException:
                with self._lock:
                    self._saving.difference_update(paths)
                    if [p for p in paths if self._removed_early(p)]:  # removed meanwhile: what they named
                        for named in {ck.step: ck for ck in (replaced, previous) if ck is not None}.values():
                            self._delete_if_unnamed(named)
                raise
        with self._lock:
            self._saving.difference_update(paths)
            self._run[global_step] = step
            removed = [p for p in paths if self._removed_early(p)]
            for named in paths:  # after the commit: a marker never names what is not there
                if named not in removed:
                    write_marker(named, self.store, ck)
            if previous is not None and previous.step != step:
                self._delete_if_unnamed(previous)
            if removed:
                self._delete_if_unnamed(ck)

    def _new_run_if_its_saver_is_gone(self) -> None:
        """A save from a new thread while the last saves' thread is gone starts another run:
        Lightning's AsyncCheckpointIO saves on its own executor thread, shuts it down after
        fit, and does not pass its teardown on to this plugin, so a second fit with the same
        plugin took its saves at the first run's global steps for this run's own and replaced
        them (an audit of stop 36: the first run's checkpoints gone)."""
        me = threading.current_thread()
        if self._saver is not None and self._saver is not me and not self._saver.is_alive():
            self._run.clear()
        self._saver = me

    def _removed_early(self, path: str) -> bool:
        """Whether `path` was removed before its save put anything there (and forget it)."""
        with self._lock:
            removed = path in self._removed_unsaved
            self._removed_unsaved.discard(path)
            return removed

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """The checkpoint dict stored for `path`; tensors on CPU unless map_location is a device."""
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        where = marker_place(path)
        marker = read_marker(where)
        if marker is not None:
            return load_named(marker, where, self.store, device)
        return self.store.load(self.step_for(path), device=device)

    def remove_checkpoint(self, path) -> None:
        """Delete the marker at `path` (or Lightning's link there), then the checkpoint it named
        if no other marker names it. Any other file there is left alone. Nothing there yet: the
        save of `path` has not run (AsyncCheckpointIO's queue), and it is skipped when it does."""
        path = marker_place(path)
        with self._lock:
            saving = path in self._saving  # a running save writes its marker: it is told not to
            ck = None if saving else self._named(path, self.store.checkpoints())
            if os.path.islink(path) or is_marker(path):
                remove_file(path)
            elif not saving and read_file(path) is None:
                saving = True
            if saving:
                self._removed_unsaved.add(path)
            if ck is not None:
                self._delete_if_unnamed(ck)

    def teardown(self) -> None:
        """The run ended (Lightning calls this after fit): a later save at one of its steps is
        another run's."""
        with self._lock:
            self._run.clear()
            self._removed_unsaved.clear()

    # --- paths and steps ------------------------------------------------------------------
    @staticmethod
    def path_for(step: int) -> str:
        """A path that maps to checkpoint `step` (for ckpt_path=)."""
        return f"step={step}.ckpt"

    def latest_path(self) -> str:
        """A path to the latest checkpoint, for ckpt_path= when resuming: one of its markers,
        else path_for(its step)."""
        ck = self.store.latest()
        if ck is None:
            raise CheckpointNotFoundError(f"the store at {self.store.path} holds no checkpoint to resume from")
        live = self._live_paths(ck)
        return live[-1] if live else self.path_for(ck.step)

    def step_for(self, path) -> int:
        """The step a Lightning path names (rules in the module docstring)."""
        local = marker_place(path)
        marker = read_marker(local)
        if marker is not None:
            if self._is_ours(marker) and local == marker.path:
                return marker.step
            ck = holding(self.store, marker)  # a run folder moved or renamed with its store
            if ck is None:
                raise CasError(f"the marker {local} names checkpoint {marker.id[:12]} of the store at {marker.store}, "
                               f"which this plugin's store at {self.store.path} does not hold")
            return ck.step
        cks = self.store.checkpoints()
        given = os.fspath(path)
        listing = [ck for ck in cks if local in lightning_paths(ck) or given in lightning_paths(ck)]
        if listing:
            return max(listing, key=lambda ck: (ck.seq, ck.step)).step  # commit order, never a clock
        name = os.path.basename(local)
        found = _STEP_IN_NAME.findall(name)
        if found:
            step = int(found[-1])
            if not self.store.exists(step):
                raise CheckpointNotFoundError(
                    f"no checkpoint for {given!r}: no marker is there (Lightning removes the files of checkpoints "
                    f"it no longer keeps, save_top_k), and the store at {self.store.path} has no checkpoint with "
                    f"step {step}, the step its name gives")
            return step
        latest = self.store.latest() if name.startswith("last") else None
        if latest is not None:
            return latest.step
        raise CheckpointNotFoundError(f"no checkpoint in the store at {self.store.path} for the path {given!r}: no "
                                      "marker is there, no checkpoint was saved under it, and its name has no 'step=N'")

    def _named(self, path: str, cks: list[Checkpoint]) -> Checkpoint | None:
        """The checkpoint of this store the marker at `path` names, if any."""
        marker = marker_or_none(path)
        if marker is None or not self._is_ours(marker):
            return None
        return next((ck for ck in cks if ck.step == marker.step and names_checkpoint(marker, ck)), None)

    def _live_paths(self, ck: Checkpoint) -> list[str]:
        """The paths that still name `ck`: listed by it, their markers naming it."""
        return [p for p in lightning_paths(ck) if self._named(p, [ck]) is not None]

    def _place(self, global_step: int, path: str, cks: list[Checkpoint], checkpoint: dict) -> tuple[int, list[str]]:
        """(the store step this save goes to, the paths that keep naming it). This run's earlier
        save at the same global step is replaced in the commit (a save that fails leaves it)
        when it holds the same training state (a top-k path and last.ckpt); so is a checkpoint
        only `path` itself names (an overwritten file). Any other checkpoint at the step stays,
        and this save takes the next free step: another run's, a pinned one, or this run's
        earlier save of other content (a weights-only save beside a full one, a save at a
        batch's end beside one after validation: replacing them lost the full checkpoint, or
        resumed the earlier path from the later point, audit of stop 38)."""
        by_step = {ck.step: ck for ck in cks}
        ours = by_step.get(self._run.get(global_step, -1))
        if ours is not None and ours.meta.get(GLOBAL_STEP_META) == global_step and not ours.pinned \
                and self._same_training_state(ours, checkpoint):
            return ours.step, [p for p in self._live_paths(ours) if p != path]
        there = by_step.get(global_step)
        if there is None:
            return global_step, []
        if not there.pinned and self._live_paths(there) == [path]:
            return global_step, []
        step = max(by_step) + 1
        if there.step not in self._run.values():  # (this run's own: no news to the user)
            names = ", ".join(self._live_paths(there)) or "no path"
            warnings.warn(f"step {global_step} of the store at {self.store.path} holds another checkpoint (named by "
                          f"{names}); this save of {path} is kept beside it as step {step}", stacklevel=3)
        return step, []

    def _same_training_state(self, ck: Checkpoint, checkpoint: dict) -> bool:
        """Whether `checkpoint` holds what `ck` holds but for callbacks' own bookkeeping (the
        ModelCheckpoint state a later save of the same moment updated): the same top-level
        entries (a weights-only save has no optimizer states) and the same loop progress."""
        reader = self.store.reader(ck.step)
        if set(reader.entries()) != set(checkpoint):
            return False
        if "loops" not in checkpoint:
            return True
        return same_values(reader.materialize(["loops"])["loops"], plain(checkpoint["loops"]))

    def _is_ours(self, marker: Marker) -> bool:
        """Whether `marker` names this plugin's store, however its path was spelled (a symlinked
        folder, or its real path: spelled otherwise, the removal of a path Lightning no longer
        keeps deleted its marker but left the checkpoint for good)."""
        if marker.store == self.store.path:
            return True
        return self.store.location.local and fsspec.utils.get_protocol(marker.store) == "file" \
            and os.path.realpath(marker.store) == os.path.realpath(self.store.path)

    def _delete_if_unnamed(self, ck: Checkpoint) -> None:
        """Forget `ck` once no marker names it; a pinned checkpoint (a legal hold) always stays."""
        current = next((c for c in self.store.checkpoints() if c.step == ck.step and c.id == ck.id), None)
        if current is not None and not current.pinned and not self._live_paths(current):
            self.store.delete(current.step)

    def close(self) -> None:
        self.store.close()


# --- Lightning's own loader reads markers too -----------------------------------------------
# Model.load_from_checkpoint(path) and a Trainer without this plugin (ckpt_path=path) read a
# checkpoint with Lightning's `pl_load` (fsspec + torch.load), which a marker is not made for.
# Once this module is imported (it is, wherever the plugin is used), that loader reads a marker
# through cas, every byte verified, and any other file exactly as before. A process that never
# imports it gets torch.load's error naming what the file is, or can use cas_url(path).
def _loading_markers_too(original):
    def load(path_or_url, map_location=None, weights_only=None):
        if isinstance(path_or_url, (str, os.PathLike)) and small_file(path_or_url) and is_marker(
                os.fspath(path_or_url)):
            device = map_location if isinstance(map_location, (str, torch.device)) else None
            return load_marked(path_or_url, device=device)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)
    load.cas_reads_markers = True
    load.__wrapped__ = original
    return load


def _teach_lightning_markers() -> None:
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module in (saving, torch_io):
        if not getattr(module.pl_load, "cas_reads_markers", False):
            module.pl_load = _loading_markers_too(module.pl_load)


_teach_lightning_markers()
