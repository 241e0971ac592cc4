"""PyTorch Lightning: keep a Trainer's checkpoints in a cas store (incremental, deduplicated,
every byte verified on load). Importing this module imports Lightning; nothing else in cas does.

    from cas.store.lightning import CasCheckpointIO, cas_url
    io = CasCheckpointIO("runs/exp1/ckpt")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    trainer.fit(model)
    # later, in a fresh process:
    L.Trainer(plugins=[io], ...).fit(model, ckpt_path="last")       # or "best", or a path
    Model.load_from_checkpoint(cas_url("ckpt/epoch=1-step=8.ckpt"))  # no plugin needed

Markers. Lightning decides by the filesystem: it versions a name (-v1) only when a file is
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

import contextlib
import datetime
import io
import os
import re
import threading
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
import fsspec.core
import fsspec.utils
import msgpack
import torch
from fsspec.spec import AbstractFileSystem
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from cas import fsutil
from cas.errors import CasError, CheckpointExistsError, CheckpointNotFoundError, StoreKeyError

from .opening import given_or_opened, open_named
from .registry import Checkpoint
from .store import CheckpointStore
from .lightning_state import plain, same_values, storable

PATHS_META = "lightning_paths"
GLOBAL_STEP_META = "lightning_global_step"
PROTOCOL = "cas"
_STEP_IN_NAME = re.compile(r"step=(\d+)")
PLACE_ATTEMPTS = 5  # saves placed again after another run sharing the store committed at their step

# The marker's only member. torch.load's error on a marker ends with this name (a zip member not
# in a folder), so it says what the file is and how to load it; a name cannot hold a "/".
MARKER_MEMBER = ("cas checkpoint marker, not a torch.save file: load it through cas.store.lightning "
                 "(the CasCheckpointIO plugin, or the URL cas_url(path) gives)")
MARKER_FORMAT = 1
_MARKER_LIMIT = 64 << 10  # a marker is a few hundred bytes; a larger file is something else


@dataclass(frozen=True)
class Marker:
    """What a marker file says: checkpoint `id` at `step` of the store at `store`, saved at `path`
    (`store_relative`: the store's path from the marker's folder, when both are local)."""

    store: str
    step: int
    id: str
    path: str
    store_relative: str | None = None


# --- the files markers are: local paths, or URLs of another fsspec filesystem (s3://...) -------
def _where(path: str | os.PathLike) -> str:
    """A marker's place, from a path or a cas:// URL: an absolute local path, or a URL."""
    path = os.fspath(path)
    if path.startswith(f"{PROTOCOL}://"):
        path = path[len(PROTOCOL) + 3:]
    if fsspec.utils.get_protocol(path) == "file":
        return os.path.abspath(path.removeprefix("file://"))
    return path


def _remote(path: str) -> tuple[AbstractFileSystem, str] | None:
    """(the filesystem, its path) of a URL; None for a local path."""
    return None if fsspec.utils.get_protocol(path) == "file" else fsspec.core.url_to_fs(path)


def _read_file(path: str) -> bytes | None:
    """The first bytes of the file at `path`, up to past a marker's limit; None when absent."""
    remote = _remote(path)
    try:
        with (remote[0].open(remote[1], "rb") if remote else open(path, "rb")) as f:
            return f.read(_MARKER_LIMIT + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CasError(f"{path} is a folder, not a cas checkpoint marker") from None


def _write_file(path: str, data: bytes) -> None:
    """Readers see all of `data` at `path` or what was there (a local file is renamed into
    place; an object store's PUT is atomic)."""
    remote = _remote(path)
    if remote:
        remote[0].pipe_file(remote[1], data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fsutil.atomic_write(path, [data])


def _remove_file(path: str) -> None:
    remote = _remote(path)
    if remote is None:
        fsutil.unlink_quietly(path)
        return
    with contextlib.suppress(FileNotFoundError):
        remote[0].rm_file(remote[1])


def _modified(path: str) -> datetime.datetime:
    remote = _remote(path)
    if remote:
        return remote[0].modified(remote[1])
    return datetime.datetime.fromtimestamp(os.path.getmtime(path), tz=datetime.timezone.utc)


def write_marker(path: str, store: CheckpointStore, ck: Checkpoint) -> None:
    """Put the marker of `ck` at `path` (replacing what is there: a save at a path overwrites
    it, as Lightning expects of a file)."""
    fields = {"format": MARKER_FORMAT, "store": store.path, "step": ck.step, "id": ck.id, "path": path}
    if _remote(path) is None and _remote(store.path) is None:  # found again when the run folder moves
        fields["store_relative"] = os.path.relpath(store.path, os.path.dirname(path))
    body = msgpack.packb(fields, use_bin_type=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(zipfile.ZipInfo(MARKER_MEMBER, date_time=(1980, 1, 1, 0, 0, 0)), body)
    _write_file(path, buffer.getvalue())


def read_marker(path: str) -> Marker | None:
    """The marker at `path` (a link followed), or None when nothing is there; CasError for a
    file that is not one (a torch.save file, say)."""
    data = _read_file(path)
    if data is None:
        return None
    try:
        if len(data) > _MARKER_LIMIT:
            raise ValueError("larger than any marker")
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            if archive.namelist() != [MARKER_MEMBER]:
                raise ValueError("an archive of other files")
            fields = msgpack.unpackb(archive.read(MARKER_MEMBER), raw=False)
        if not isinstance(fields, dict) or fields.get("format") != MARKER_FORMAT:
            raise ValueError(f"marker format {fields.get('format') if isinstance(fields, dict) else None!r}, "
                             f"not {MARKER_FORMAT}")
        marker = Marker(fields["store"], fields["step"], fields["id"], fields["path"], fields.get("store_relative"))
        if not (isinstance(marker.store, str) and type(marker.step) is int and isinstance(marker.id, str)
                and isinstance(marker.path, str) and isinstance(marker.store_relative, (str, type(None)))):
            raise ValueError("fields of the wrong types")
    # EOFError, NotImplementedError, RuntimeError: zipfile's for a truncated, compressed or encrypted member
    except (zipfile.BadZipFile, ValueError, KeyError, TypeError, EOFError, NotImplementedError, RuntimeError,
            msgpack.UnpackException) as exc:
        why = ("not a zip archive" if isinstance(exc, zipfile.BadZipFile)
               else f"no field {exc}" if isinstance(exc, KeyError) else str(exc))
        raise CasError(f"{path} is not a cas checkpoint marker ({why}); CasCheckpointIO loads only checkpoints "
                       "of its store: to resume from a torch.save file, import it (`cas --store STORE import "
                       "FILE --step N`) and pass ckpt_path=CasCheckpointIO.path_for(N) ('step=N.ckpt')") from None
    return marker


def marked_checkpoint(store: CheckpointStore, marker: Marker, where: str) -> Checkpoint:
    """The checkpoint `marker` (read at `where`) names, still in `store`: the one with its id,
    or one that replaced it at its step and lists its path (a same-step save of its run)."""
    try:
        ck = store.get(marker.step)
    except CheckpointNotFoundError:
        ck = None
    if ck is None or (ck.id != marker.id and marker.path not in _paths(ck)):
        raise CheckpointNotFoundError(
            f"the marker {where} names checkpoint {marker.id[:12]} at step {marker.step} of the store at "
            f"{marker.store}, which no longer holds it (deleted, by retention or `cas rm`, or replaced)")
    return ck


def _holding(store: CheckpointStore, marker: Marker) -> Checkpoint | None:
    """The checkpoint of `store` with the marker's id (its step first): an id is the hash of a
    checkpoint's content, so any store holding it holds that checkpoint."""
    try:
        ck = store.get(marker.step)
    except CheckpointNotFoundError:
        ck = None
    if ck is not None and ck.id == marker.id:
        return ck
    return next((c for c in store.checkpoints() if c.id == marker.id), None)


def _stores_to_try(marker: Marker, where: str, opened: CheckpointStore | None) -> list[str]:
    """Where a marker read at `where` may find its checkpoint, in order: the plugin's own store,
    the store at the marker's relative place (a run folder moved or renamed with its store),
    and the store it names."""
    paths = [opened.path] if opened is not None else []
    if marker.store_relative is not None and _remote(where) is None:
        paths.append(os.path.normpath(os.path.join(os.path.dirname(where), marker.store_relative)))
    paths.append(marker.store)
    return list(dict.fromkeys(paths))


@contextlib.contextmanager
def _marked(marker: Marker, where: str, opened: CheckpointStore | None) -> Iterator[tuple[CheckpointStore, Checkpoint]]:
    """(store, checkpoint) the marker read at `where` names. A store holding the marker's id
    holds it; else, only while the marker is still at the path it was written to, the save that
    replaced it at its step in the store it names (marked_checkpoint). A marker moved or
    copied elsewhere never stands for another run's checkpoint that lists its old path (a
    renamed run resumed from the run that then took over its old folder, with no error)."""
    tried, locked = [], None
    for path in _stores_to_try(marker, where, opened):
        store = opened if opened is not None and path == opened.path else None
        owned = store is None
        if owned:
            try:
                store = open_named(path, create=False, readonly=True)  # an encrypted one: $CAS_KEY_FILE's key
            except StoreKeyError as exc:  # a store there that this process has no key for: say that
                locked = locked or exc
                continue
            except CasError as exc:
                tried.append(f"{path} ({exc})")
                continue
        try:
            ck = _holding(store, marker)
            if ck is None and path == marker.store and where == marker.path:
                ck = marked_checkpoint(store, marker, where)
            if ck is not None:
                yield store, ck
                return
            tried.append(path)
        finally:
            if owned:
                store.close()
    if locked is not None:
        raise locked
    raise CheckpointNotFoundError(
        f"the marker {where} names checkpoint {marker.id[:12]} at step {marker.step} of the store at {marker.store}, "
        f"which no store holds any more (tried: {'; '.join(tried)}): deleted, by retention or `cas rm`, or replaced")


def load_marked(path: str | os.PathLike, *, store: CheckpointStore | None = None,
                device: str | torch.device | None = None) -> dict:
    """The checkpoint dict the marker at `path` names, every byte verified (read from `store`
    when the marker names it, else from the store it names, opened read-only)."""
    path = _where(path)
    marker = read_marker(path)
    if marker is None:
        raise FileNotFoundError(f"no cas checkpoint marker at {path}")
    return _load(marker, path, store, device)


def _load(marker: Marker, where: str, store: CheckpointStore | None, device) -> dict:
    with _marked(marker, where, store) as (source, ck):
        return source.load(ck.step, device=device)


def cas_url(path: str | os.PathLike) -> str:
    """The `cas://` URL of a marker path, for Lightning code that reads through fsspec without
    the plugin: Model.load_from_checkpoint(cas_url(path)), Trainer.fit(ckpt_path=cas_url(path))."""
    return f"{PROTOCOL}://{_where(path)}"


class CasFileSystem(AbstractFileSystem):
    """fsspec's `cas://` protocol: the file at cas://PATH is the checkpoint the marker at PATH
    names, as a torch.save stream (built in memory from verified data; read-only)."""

    protocol = PROTOCOL
    root_marker = ""

    def info(self, path, **kwargs) -> dict:
        path = _where(self._strip_protocol(path))
        if read_marker(path) is None:
            raise FileNotFoundError(f"no cas checkpoint marker at {path}")
        return {"name": path, "size": None, "type": "file"}

    def ls(self, path, detail=True, **kwargs):
        info = self.info(path)
        return [info] if detail else [info["name"]]

    def modified(self, path) -> datetime.datetime:
        return _modified(_where(self._strip_protocol(path)))

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"cas:// files are read-only (asked to open {path} with mode {mode!r})")
        stream = io.BytesIO()
        torch.save(load_marked(self._strip_protocol(path)), stream)
        stream.seek(0)
        return stream


fsspec.register_implementation(PROTOCOL, CasFileSystem, clobber=True)  # the entry point, for this process


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
        path = _where(path)
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
        where = _where(path)
        marker = read_marker(where)
        if marker is not None:
            return _load(marker, where, self.store, device)
        return self.store.load(self.step_for(path), device=device)

    def remove_checkpoint(self, path) -> None:
        """Delete the marker at `path` (or Lightning's link there), then the checkpoint it named
        if no other marker names it. Any other file there is left alone. Nothing there yet: the
        save of `path` has not run (AsyncCheckpointIO's queue), and it is skipped when it does."""
        path = _where(path)
        with self._lock:
            saving = path in self._saving  # a running save writes its marker: it is told not to
            ck = None if saving else self._named(path, self.store.checkpoints())
            if os.path.islink(path) or _is_marker(path):
                _remove_file(path)
            elif not saving and _read_file(path) is None:
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
        local = _where(path)
        marker = read_marker(local)
        if marker is not None:
            if self._is_ours(marker) and local == marker.path:
                return marker.step
            ck = _holding(self.store, marker)  # a run folder moved or renamed with its store
            if ck is None:
                raise CasError(f"the marker {local} names checkpoint {marker.id[:12]} of the store at {marker.store}, "
                               f"which this plugin's store at {self.store.path} does not hold")
            return ck.step
        cks = self.store.checkpoints()
        given = os.fspath(path)
        listing = [ck for ck in cks if local in _paths(ck) or given in _paths(ck)]
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
        marker = _marker_or_none(path)
        if marker is None or not self._is_ours(marker):
            return None
        return next((ck for ck in cks if ck.step == marker.step and _names(marker, ck)), None)

    def _live_paths(self, ck: Checkpoint) -> list[str]:
        """The paths that still name `ck`: listed by it, their markers naming it."""
        return [p for p in _paths(ck) if self._named(p, [ck]) is not None]

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


def _marker_or_none(path: str) -> Marker | None:
    """The marker at `path`; None for nothing or some other file there (which names nothing)."""
    try:
        return read_marker(path)
    except CasError:
        return None


def _is_marker(path: str) -> bool:
    return _marker_or_none(path) is not None


def _names(marker: Marker, ck: Checkpoint) -> bool:
    """Whether `marker` names `ck`: its id, or its step and a path `ck` lists (a same-step save
    of the run replaced the checkpoint before its marker was rewritten)."""
    return marker.step == ck.step and (marker.id == ck.id or marker.path in _paths(ck))


def _paths(ck: Checkpoint) -> list[str]:
    paths = ck.meta.get(PATHS_META)
    return paths if isinstance(paths, list) else []


# --- Lightning's own loader reads markers too -----------------------------------------------
# Model.load_from_checkpoint(path) and a Trainer without this plugin (ckpt_path=path) read a
# checkpoint with Lightning's `pl_load` (fsspec + torch.load), which a marker is not made for.
# Once this module is imported (it is, wherever the plugin is used), that loader reads a marker
# through cas, every byte verified, and any other file exactly as before. A process that never
# imports it gets torch.load's error naming what the file is, or can use cas_url(path).
def _loading_markers_too(original):
    def load(path_or_url, map_location=None, weights_only=None):
        if isinstance(path_or_url, (str, os.PathLike)) and _small_file(path_or_url) and _is_marker(
                os.fspath(path_or_url)):
            device = map_location if isinstance(map_location, (str, torch.device)) else None
            return load_marked(path_or_url, device=device)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)
    load.cas_reads_markers = True
    load.__wrapped__ = original
    return load


def _small_file(path) -> bool:
    """A file no larger than a marker (a real torch.save file is not even opened), local or at
    an fsspec URL (a dirpath in a bucket: one stat)."""
    try:
        path = os.fspath(path)
        remote = _remote(path)
        size = remote[0].size(remote[1]) if remote else os.path.getsize(path)
        return size is not None and size <= _MARKER_LIMIT
    except (OSError, ValueError, ImportError):  # absent, or a protocol fsspec cannot open: Lightning's own load says
        return False


def _teach_lightning_markers() -> None:
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module in (saving, torch_io):
        if not getattr(module.pl_load, "cas_reads_markers", False):
            module.pl_load = _loading_markers_too(module.pl_load)


_teach_lightning_markers()
