"""Lightning's checkpoint paths as markers (store/lightning.py saves them; this module needs no
Lightning): a marker is a small zip archive of one msgpack member, put where Lightning named a
checkpoint file, naming the store, step and id of the checkpoint saved there (never pickle).
Here: reading and writing markers, local or at another fsspec URL; finding the checkpoint a
marker names (in the plugin's store, the store at the marker's relative place, or the store it
names); and `cas://`, the fsspec protocol that serves that checkpoint as a torch.save stream.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import zipfile
from dataclasses import dataclass
from typing import Iterator

import fsspec
import fsspec.core
import fsspec.utils
import msgpack
import torch
from fsspec.spec import AbstractFileSystem

from cas import fsutil
from cas.errors import CasError, CheckpointNotFoundError, StoreKeyError

from .opening import open_named
from .registry import Checkpoint
from .store import CheckpointStore

PATHS_META = "lightning_paths"  # a checkpoint's meta: the paths Lightning saved it at
PROTOCOL = "cas"
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
def marker_place(path: str | os.PathLike) -> str:
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


def read_file(path: str) -> bytes | None:
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


def remove_file(path: str) -> None:
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
    data = read_file(path)
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
    if ck is None or (ck.id != marker.id and marker.path not in lightning_paths(ck)):
        raise CheckpointNotFoundError(
            f"the marker {where} names checkpoint {marker.id[:12]} at step {marker.step} of the store at "
            f"{marker.store}, which no longer holds it (deleted, by retention or `cas rm`, or replaced)")
    return ck


def holding(store: CheckpointStore, marker: Marker) -> Checkpoint | None:
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
            ck = holding(store, marker)
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
    path = marker_place(path)
    marker = read_marker(path)
    if marker is None:
        raise FileNotFoundError(f"no cas checkpoint marker at {path}")
    return load_named(marker, path, store, device)


def load_named(marker: Marker, where: str, store: CheckpointStore | None, device) -> dict:
    with _marked(marker, where, store) as (source, ck):
        return source.load(ck.step, device=device)


def cas_url(path: str | os.PathLike) -> str:
    """The `cas://` URL of a marker path, for Lightning code that reads through fsspec without
    the plugin: Model.load_from_checkpoint(cas_url(path)), Trainer.fit(ckpt_path=cas_url(path))."""
    return f"{PROTOCOL}://{marker_place(path)}"


class CasFileSystem(AbstractFileSystem):
    """fsspec's `cas://` protocol: the file at cas://PATH is the checkpoint the marker at PATH
    names, as a torch.save stream (built in memory from verified data; read-only)."""

    protocol = PROTOCOL
    root_marker = ""

    def info(self, path, **kwargs) -> dict:
        path = marker_place(self._strip_protocol(path))
        if read_marker(path) is None:
            raise FileNotFoundError(f"no cas checkpoint marker at {path}")
        return {"name": path, "size": None, "type": "file"}

    def ls(self, path, detail=True, **kwargs):
        info = self.info(path)
        return [info] if detail else [info["name"]]

    def modified(self, path) -> datetime.datetime:
        return _modified(marker_place(self._strip_protocol(path)))

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"cas:// files are read-only (asked to open {path} with mode {mode!r})")
        stream = io.BytesIO()
        torch.save(load_marked(self._strip_protocol(path)), stream)
        stream.seek(0)
        return stream


fsspec.register_implementation(PROTOCOL, CasFileSystem, clobber=True)  # the entry point, for this process

def marker_or_none(path: str) -> Marker | None:
    """The marker at `path`; None for nothing or some other file there (which names nothing)."""
    try:
        return read_marker(path)
    except CasError:
        return None


def is_marker(path: str) -> bool:
    return marker_or_none(path) is not None


def names_checkpoint(marker: Marker, ck: Checkpoint) -> bool:
    """Whether `marker` names `ck`: its id, or its step and a path `ck` lists (a same-step save
    of the run replaced the checkpoint before its marker was rewritten)."""
    return marker.step == ck.step and (marker.id == ck.id or marker.path in lightning_paths(ck))


def lightning_paths(ck: Checkpoint) -> list[str]:
    paths = ck.meta.get(PATHS_META)
    return paths if isinstance(paths, list) else []


def small_file(path) -> bool:
    """A file no larger than a marker (a real torch.save file is not even opened), local or at
    an fsspec URL (a dirpath in a bucket: one stat)."""
    try:
        path = os.fspath(path)
        remote = _remote(path)
        size = remote[0].size(remote[1]) if remote else os.path.getsize(path)
        return size is not None and size <= _MARKER_LIMIT
    except (OSError, ValueError, ImportError):  # absent, or a protocol fsspec cannot open: Lightning's own load says
        return False
