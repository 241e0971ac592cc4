"""Interop with the files other tools read and write (comparisons between checkpoints: compare.py).

- export: a checkpoint's tensors as one safetensors file, the format serving stacks read. A
  weights-only export is NOT a training checkpoint: optimizer step counts, RNG state, the data
  position and every other non-tensor value are left out, so training cannot resume from it.
  With format="torch", the checkpoint's whole state dict as one torch.save file instead (what
  DCP's dcp_to_torch_save writes for a DCP folder; a DCP checkpoint is put together from its
  shards), loadable with torch.load(weights_only=True) when its values allow it.
- import: safetensors files and torch.save files become checkpoints, deduplicated like any save.
  A torch.save file is read with torch.load(weights_only=True) and nothing else: a file that needs
  more (arbitrary pickled objects) is refused, never unpickled. A DCP folder (FileSystemWriter's
  .metadata and *.distcp files) becomes one DCP checkpoint, read without unpickling anything
  arbitrary (store/dcp/folder.py), loadable with CasReader at any world size.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from cas import faults
from cas.errors import CasError, CheckpointNotFoundError
from cas.fsutil import fsync_dir, new_file_mode, tmp_name
from cas.progress import ProgressCallback

from .reader import Leaf
from .registry import Checkpoint, exists_error
from .lazytorch import torch
from .tensors import same_size_int, torch_dtypes
from .values import numpy_dtype

SAFETENSORS_SUFFIXES = (".safetensors",)
EXPORT_FORMATS = ("safetensors", "torch")
DCP_METADATA = ".metadata"  # the file that makes a folder a DCP checkpoint (FileSystemWriter's)
DCP_STEP_RULE = "a DCP folder's step is the last number in its name (checkpoint-500 -> 500)"
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
EXPORT_NOTE = "weights-only export of a cas checkpoint; not a training checkpoint"
STEP_RULE = ("a file's step is the last number in its name without the suffix "
             "(ckpt-500.pt -> 500, step_1000.safetensors -> 1000, epoch=3-step=1200.ckpt -> 1200)")


class ImportRefusedError(CasError):
    """A file to import is not one we read safely: it needs more than weights-only loading,
    is not a checkpoint file, or its step cannot be told."""


def torch_dtype_of(node: dict) -> torch.dtype | None:
    """The torch dtype a tensor node's values have (numpy arrays included); None if torch has none."""
    if node["lib"] == "torch":
        return torch_dtypes()[node["dtype"]]
    try:
        return torch.from_numpy(np.empty(0, dtype=numpy_dtype(node["dtype"]).newbyteorder("="))).dtype
    except TypeError:
        return None


def _native(a: np.ndarray) -> np.ndarray:
    """`a` in this machine's byte order (torch and safetensors take no other): the same
    values; a big-endian array saved from numpy is exported as its values."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


# --- export ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportReport:
    path: str
    step: int
    checkpoint_id: str
    tensors: int
    bytes: int
    skipped: list[str]  # paths of the non-tensor values left out
    format: str = "safetensors"
    # the globals torch.load(weights_only=True) of a torch export needs allowed
    # (torch.serialization.safe_globals), e.g. "_io.BytesIO"; empty: it loads as it is
    needs_safe_globals: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@functools.cache
def safetensors_dtypes() -> frozenset:
    """The torch dtypes that survive a safetensors round trip (probed: safetensors writes some
    dtypes it cannot read back)."""
    from safetensors.torch import load, save

    ok = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        for dtype in torch_dtypes().values():
            with contextlib.suppress(Exception):
                if load(save({"x": torch.zeros(1, dtype=dtype)}))["x"].dtype == dtype:
                    ok.add(dtype)
    return frozenset(ok)


def export_format(path: str | os.PathLike, format: str | None) -> str:
    """The export format asked for, or the one the file name says (.pt, .pth, .bin, .ckpt: torch;
    anything else: safetensors)."""
    if format is None:
        return "torch" if file_kind(os.fspath(path)) == "torch.save" else "safetensors"
    if format not in EXPORT_FORMATS:
        raise CasError(f"unknown export format {format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    return format


def export(store, step: int, path: str | os.PathLike, *, keys=None, relative: bool = False,
           progress: ProgressCallback | None = None, format: str | None = None) -> ExportReport:
    """Write checkpoint `step`'s tensors (or those under the top-level `keys`) to one
    safetensors file, names flattened with dots ("model.layer.weight"), for serving or
    evaluation. It is a weights-only artifact, not a training checkpoint: non-tensor values are
    left out (and listed in the report) and nothing in it can resume training. With `relative`
    and exactly one key, names drop that key ("layer.weight"), as the model's load_state_dict
    expects. The file's metadata carries the step and checkpoint id. format="torch" (the
    default for a .pt, .pth, .bin or .ckpt path) writes the whole state instead (export_torch)."""
    target = os.path.realpath(os.fspath(path))
    if os.path.commonpath([target, os.path.realpath(store.path)]) == os.path.realpath(store.path):
        raise CasError(f"refusing to export into the store itself ({path}): choose a path outside {store.path}")
    if export_format(path, format) == "torch":
        return export_torch(store, step, path, keys=keys, relative=relative, progress=progress)
    reader = store.reader(step)
    ck = reader.checkpoint
    keys = [keys] if isinstance(keys, str) else keys
    prefix = _relative_prefix(keys, relative)
    leaves = list(reader.leaves(keys))
    todo = [leaf for leaf in leaves if leaf.is_tensor]
    names = _export_names(todo, prefix)
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, leaf) in enumerate(zip(names, todo), 1):
        value = reader.read_tensor(leaf)
        tensors[name] = torch.from_numpy(_native(value)) if isinstance(value, np.ndarray) else value
        if progress:
            progress("export", i, len(todo))
    metadata = {"format": "pt", "cas.step": str(ck.step), "cas.checkpoint_id": ck.id, "cas.note": EXPORT_NOTE}
    if keys is not None:
        metadata["cas.keys"] = json.dumps(list(keys))
    _write_safetensors(tensors, os.fspath(path), metadata)
    return ExportReport(os.fspath(path), ck.step, ck.id, len(tensors), sum(leaf.node["nbytes"] for leaf in todo),
                        [leaf.path for leaf in leaves if not leaf.is_tensor])


def _relative_prefix(keys, relative: bool) -> str:
    if not relative:
        return ""
    if keys is None or len(keys) != 1:
        raise CasError("relative names need exactly one selected key (e.g. keys=['model'])")
    return f"{keys[0]}."


def _export_names(leaves: list[Leaf], prefix: str) -> list[str]:
    """Each tensor's name in the file, refusing dtypes safetensors cannot hold and names that two
    paths flatten to, before any tensor bytes are read."""
    names, seen = [], set()
    for leaf in leaves:
        if torch_dtype_of(leaf.node) not in safetensors_dtypes():
            raise CasError(f"tensor {leaf.path!r} has dtype {leaf.node['dtype']}, which safetensors cannot hold; "
                           "select other keys to leave it out")
        name = leaf.path[len(prefix):] if prefix and leaf.path.startswith(prefix) else leaf.path
        name = name or "tensor"  # a checkpoint that is one bare tensor
        if name in seen:
            raise CasError(f"two tensors flatten to the name {name!r}; a safetensors file needs distinct names")
        seen.add(name)
        names.append(name)
    return names


def export_torch(store, step: int, path: str | os.PathLike, *, keys=None, relative: bool = False,
                 progress: ProgressCallback | None = None) -> ExportReport:
    """Write checkpoint `step`'s state dict (or its top-level `keys`; with `relative` and one key,
    that entry's own state) as one torch.save file: tensors and values alike, so unlike the
    safetensors export it holds all the store does. A DCP checkpoint is put together from its
    shards into whole tensors, nested as its planner flattened them (dcp_to_torch_save's output
    for a DCP folder; store/dcp/reader.py: state_dict). The report lists the globals that
    torch.load(weights_only=True) needs allowed for it (none for tensors and plain values)."""
    reader = store.reader(step)
    ck = reader.checkpoint
    keys = [keys] if isinstance(keys, str) else keys
    _relative_prefix(keys, relative)  # refuses relative without exactly one key
    if is_dcp_checkpoint(reader):
        from .dcp import state_dict

        state = _selected(state_dict(store, ck.step), keys, ck.step)
    else:
        state = store.load(ck.step, keys=keys)
    if relative:
        state = state[keys[0]]
    tensors = list(_tensors_in(state))
    _check_weights_only_ints(state, "")
    _write_atomically(os.fspath(path), lambda tmp: torch.save(state, tmp))
    if progress:
        progress("export", 1, 1)
    needs = torch.serialization.get_unsafe_globals_in_checkpoint(os.fspath(path))
    return ExportReport(os.fspath(path), ck.step, ck.id, len(tensors),
                        sum(t.numel() * t.element_size() for t in tensors), [], "torch", sorted(needs))


def is_dcp_checkpoint(reader) -> bool:
    """Whether a checkpoint was saved through DCP (CasWriter's manifest: store/dcp/manifest.py)."""
    top = reader.top()
    return isinstance(top, dict) and isinstance(top.get("dcp"), dict) and "format" in top["dcp"] \
        and {"metadata", "tensors", "values"} <= set(top)


def _selected(state: dict, keys, step: int) -> dict:
    if keys is None:
        return state
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointNotFoundError(f"checkpoint step {step} has no top-level entries {missing}; "
                                      f"it has {list(state)}")
    return {k: state[k] for k in keys}


# pickle writes an int of more than 255 bytes with its LONG4 opcode, which torch.load's weights-only
# unpickler does not read: such a file would load only with weights_only=False.
WEIGHTS_ONLY_INT_BYTES = 255


def _check_weights_only_ints(value, path: str) -> None:
    """Refuse, before anything is written, a state holding an int torch.load(weights_only=True)
    cannot read back (a checkpoint may hold ints of up to 32767 bits)."""
    if type(value) is int and value.bit_length() > 8 * WEIGHTS_ONLY_INT_BYTES - 9 \
            and len(pickle.encode_long(value)) > WEIGHTS_ONLY_INT_BYTES:
        raise CasError(f"cannot export {path or 'the state'!r} to a torch.save file: its int of {value.bit_length()} "
                       f"bits takes more than the {WEIGHTS_ONLY_INT_BYTES} bytes torch.load(weights_only=True) "
                       "reads; export the tensors alone as safetensors, or leave that key out (keys=)")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_weights_only_ints(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_weights_only_ints(v, f"{path}.{i}" if path else str(i))


def _tensors_in(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def _write_safetensors(tensors: dict, path: str, metadata: dict) -> None:
    from safetensors.torch import save_file

    _write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` a file next to `path`, then give it that name: a reader never sees a
    half-written file under the final name."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise CasError(f"cannot write {path}: the folder {directory} does not exist")
    tmp = tmp_name(directory, os.path.basename(path))
    try:
        write(tmp)
        os.chmod(tmp, new_file_mode())  # safetensors and torch.save create 0o600; an export is a user's file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(directory)


# --- import ---------------------------------------------------------------------------------
def file_kind(path: str) -> str | None:
    """"safetensors", "torch.save" or None (not a checkpoint file), from the file's suffix."""
    name = os.path.basename(path).lower()
    if name.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    if name.endswith(TORCH_SAVE_SUFFIXES):
        return "torch.save"
    return None


def step_from_name(path: str) -> int | None:
    """The step a checkpoint file's name gives (see STEP_RULE); None when it holds no number."""
    stem = os.path.splitext(os.path.basename(path))[0]
    numbers = re.findall(r"\d+", stem)
    return int(numbers[-1]) if numbers else None


def read_weights_file(path: str) -> tuple[object, dict]:
    """(state, meta) of a safetensors or torch.save file. Nothing but tensors and plain
    containers is ever unpickled."""
    kind = file_kind(path)
    if kind is None:
        raise ImportRefusedError(f"{path} is not a checkpoint file cas imports (suffixes: "
                                 f"{', '.join(SAFETENSORS_SUFFIXES + TORCH_SAVE_SUFFIXES)})")
    state, meta = _read_safetensors(path) if kind == "safetensors" else _read_torch_save(path)
    return state, {"imported_from": os.path.basename(path), "import_format": kind, **meta}


def _read_safetensors(path: str) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            return {name: f.get_tensor(name) for name in f.keys()}, {"safetensors_metadata": metadata}
    except SafetensorError as exc:
        raise CasError(f"cannot read {path} as a safetensors file: {exc}") from None


def _read_torch_save(path: str) -> tuple[object, dict]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise ImportRefusedError(
            f"refused {path}: weights-only loading failed ({unpickling_detail(exc)}); cas reads torch.save "
            "files only with torch.load(weights_only=True) and never unpickles arbitrary objects: re-save it "
            "holding only tensors and plain containers, or as .safetensors") from None
    except Exception as exc:  # noqa: BLE001 - torch.load fails on bad input in many ways; all mean "cannot read"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CasError(f"cannot read {path} as a torch.save file: {first}") from None
    return state, {}


def unpickling_detail(exc: Exception) -> str:
    """The one informative part of torch's long weights-only error: the global it refused
    (torch 2.13 puts it mid-paragraph), else its one informative paragraph."""
    refused = re.search(r"Unsupported global: GLOBAL \S+", str(exc))
    if refused:
        return refused.group(0).rstrip(".")
    for part in str(exc).split("\n\n"):
        part = " ".join(part.split())
        if part and not part.startswith(("Weights only load failed", "Check the documentation")):
            return part.removeprefix("Please file an issue with the following so that we can make "
                                     "`weights_only=True` compatible with your use case: ")
    return "unknown reason"


def import_file(store, path: str | os.PathLike, *, step: int | None = None) -> Checkpoint:
    """Save one safetensors or torch.save file as checkpoint `step` (default: the number in its
    name, see STEP_RULE). Dedup applies: tensors the store holds already cost nothing."""
    path = os.fspath(path)
    if step is None:
        step = step_from_name(path)
        if step is None:
            raise ImportRefusedError(f"cannot tell the step of {path}: {STEP_RULE}; give the step explicitly")
    if store.exists(step):
        raise exists_error(step)
    state, meta = read_weights_file(path)
    try:
        return store.save(state, step=step, meta=meta)
    except TypeError as exc:
        raise TypeError(f"{path}: {exc}") from None


def is_dcp_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder DCP's FileSystemWriter wrote (it holds a .metadata file)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


def import_dcp(store, folder: str | os.PathLike, *, step: int | None = None) -> Checkpoint:
    """Save a DCP folder (FileSystemWriter's output) as one DCP checkpoint `step` (default: the
    last number in the folder's name), as if dcp.save had saved its state through a CasWriter:
    CasReader loads it at any world size, io.BytesIO values included. Nothing in the folder is
    unpickled beyond DCP's metadata classes and weights-only items (store/dcp/folder.py)."""
    from .dcp import save as dcp_save
    from .dcp.folder import read_dcp_folder, step_of_folder

    folder = os.fspath(folder)
    if not is_dcp_folder(folder):
        raise ImportRefusedError(f"{folder} is not a DCP folder (it has no {DCP_METADATA} file)")
    if step is None:
        step = step_of_folder(folder)
        if step is None:
            raise ImportRefusedError(f"cannot tell the step of {folder}: {DCP_STEP_RULE}; give the step explicitly")
    if store.exists(step):
        raise exists_error(step)
    state = read_dcp_folder(folder)
    meta = {"imported_from": os.path.basename(os.path.normpath(folder)), "import_format": "dcp"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as asked
        dcp_save(state, store, step, no_dist=True, meta=meta)
    return store.get(step)


@dataclass
class FolderImport:
    checkpoints: list[tuple[str, Checkpoint]] = field(default_factory=list)  # (file, checkpoint)
    ignored: list[str] = field(default_factory=list)  # names that are not checkpoint files
    # (file, checkpoint) of files an earlier, interrupted import of the folder committed already
    already_imported: list[tuple[str, Checkpoint]] = field(default_factory=list)


def plan_folder(store, folder: str) -> tuple[list[tuple[int, str]], list[str]]:
    """((step, file) in step order, ignored names) for a folder of checkpoint files, one per
    step. Refuses, before anything is imported, files whose step cannot be told and two files
    with one step (steps the store holds: see split_imported)."""
    files, ignored, unnumbered = [], [], []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if not os.path.isfile(full) or file_kind(name) is None:
            ignored.append(name)
        elif (step := step_from_name(name)) is None:
            unnumbered.append(name)
        else:
            files.append((step, full))
    if unnumbered:
        raise ImportRefusedError(f"cannot tell the step of {', '.join(unnumbered)} in {folder}: {STEP_RULE}; "
                                 "rename them, or import each with an explicit step")
    if not files:
        raise ImportRefusedError(f"{folder} holds no checkpoint files "
                                 f"({', '.join(SAFETENSORS_SUFFIXES + TORCH_SAVE_SUFFIXES)})")
    _refuse_step_clashes(files)
    return sorted(files), ignored


def _refuse_step_clashes(files: list[tuple[int, str]]) -> None:
    by_step: dict[int, list[str]] = {}
    for step, path in files:
        by_step.setdefault(step, []).append(os.path.basename(path))
    twice = [names for names in by_step.values() if len(names) > 1]
    if twice:
        raise ImportRefusedError(f"these files give the same step: {'; '.join(', '.join(n) for n in twice)}")


def split_imported(store, files: list[tuple[int, str]]) -> tuple[list[tuple[int, str]], list[tuple[str, Checkpoint]]]:
    """(files to import, (file, checkpoint) of those imported already). A step the store holds
    counts as imported when its checkpoint came from a file of that name and holds the same
    values (an import killed half way, run again); any other held step is refused, before
    anything is imported: steps are never overwritten."""
    todo, done, clash = [], [], []
    for step, path in files:
        if not store.exists(step):
            todo.append((step, path))
        elif _imported_from(store, store.get(step), path):
            done.append((path, store.get(step)))
        else:
            clash.append((step, os.path.basename(path)))
    if clash:
        raise ImportRefusedError(
            f"the store already holds steps {[step for step, _ in clash]}, and not as imports of these files "
            f"({', '.join(name for _, name in clash)}); steps are never overwritten: import into another store, "
            "or `cas rm` those steps first")
    return todo, done


def _imported_from(store, ck: Checkpoint, path: str) -> bool:
    """Whether checkpoint `ck` is the import of the file at `path`: its name, format and every
    value the same (tensors bit for bit, read back with their hashes checked)."""
    if ck.meta.get("imported_from") != os.path.basename(path) or ck.meta.get("import_format") != file_kind(path):
        return False
    state, _ = read_weights_file(path)
    return same_values(store.load(ck.step), state)


def same_values(a, b) -> bool:
    """Equal structure, keys in order, types, and values; tensors and arrays bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and _raw(a) == _raw(b)
    if isinstance(a, np.ndarray):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and np.ascontiguousarray(a).tobytes() == \
            np.ascontiguousarray(b).tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b  # NaN
    return a == b


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes in standard layout, compared as bits, not values (NaN equals NaN): viewed
    as an integer type first, as torch cannot copy some dtypes (float4, bits) into a layout."""
    t = t.detach().cpu()
    as_int = same_size_int(t.element_size())
    t = (t.view(as_int) if as_int is not None else t).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def import_folder(store, folder: str | os.PathLike, *, progress: ProgressCallback | None = None) -> FolderImport:
    """Import every checkpoint file of a folder (one file per step, the step from each name).
    Files an earlier, interrupted run of the same import committed are skipped (and reported)."""
    files, ignored = plan_folder(store, os.fspath(folder))
    todo, done = split_imported(store, files)
    out = FolderImport(ignored=ignored, already_imported=done)
    try:
        for i, (step, path) in enumerate(todo, 1):
            out.checkpoints.append((path, import_file(store, path, step=step)))
            faults.point("import.file_imported")
            if progress:
                progress("import", i, len(todo))
    except BaseException as exc:  # all or nothing: the steps imported before the bad file go again
        _take_back(store, [ck.step for _, ck in out.checkpoints], exc)
        raise
    return out


def _take_back(store, steps: list[int], exc: BaseException) -> None:
    """Remove the steps this import committed before `exc` stopped it. Whatever goes wrong
    here is added to `exc` as a note: the error that stopped the import is the one raised."""
    if not steps:
        return
    try:
        store.delete([step for step in steps if store.exists(step)])
    except Exception as undo:  # noqa: BLE001 - reported on the import's own error, never instead of it
        exc.add_note(f"the {len(steps)} checkpoint(s) imported before it could not all be removed again "
                     f"({type(undo).__name__}: {undo}); remove steps {steps} with `cas rm`")
        return
    exc.add_note(f"nothing was imported: the {len(steps)} checkpoint(s) imported before it were "
                 "removed again (their objects are garbage for the next gc)")
