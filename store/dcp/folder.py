"""Reading a DCP folder (FileSystemWriter's output: `.metadata` and `*.distcp` files) without
running anything it holds, for `cas import` (store/interop.py: import_dcp).

`.metadata` is a pickle of DCP's Metadata. torch's weights-only unpickler cannot read it: DCP
writes it with pickle's default protocol (4: FRAME, STACK_GLOBAL, MEMOIZE), and torch 2.13's
weights-only unpickler knows protocol 2 opcodes only. It is read instead by an Unpickler whose
find_class resolves only the names DCP's metadata is made of (ALLOWED below: DCP's metadata
classes, torch.Size, dtypes and layouts); any other global (a function to call, a class to
build) is refused before anything of it runs, and persistent ids are refused (pickle's default).
The private classes it names are replaced by plain stand-ins (StorageInfo for filesystem's
_StorageInfo, a str for a pathlib path), so no torch-private object is built.

Every item's bytes are then read from its .distcp file by the metadata's (file, offset, length):
FileSystemWriter torch.saves each tensor shard and each non-tensor value there, and each is read
with torch.load(weights_only=True), an io.BytesIO value allowed (its bytes are plain data). A
value that needs more (an arbitrary pickled object) is refused, never unpickled. Tensor shards
are put together into whole tensors, and the state is nested as the saving planner flattened it
(its planner_data mappings).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from .. import tensors as T
from ..interop import DCP_METADATA, ImportRefusedError, unpickling_detail
from .manifest import element_size
from .reader import planner_mappings, set_path

MAX_METADATA_BYTES = 1 << 30  # a larger .metadata is refused before it is read


@dataclass
class StorageInfo:
    """Where FileSystemWriter put one item (its _StorageInfo's fields, read as plain data)."""

    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Sequence[str] | None = None


def _path_text(*parts: str) -> str:
    """A pickled pathlib path (StorageMeta.checkpoint_id) read as its text."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path in the DCP metadata has parts that are not text")
    return os.path.join(*parts) if parts else ""


LAYOUTS = {str(layout): layout for layout in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                                              torch.sparse_bsr, torch.sparse_bsc)}


def _layout(name: str) -> torch.layout:
    """torch.serialization's pickled layout (torch.strided and the like), by its name only."""
    layout = LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r} in the DCP metadata")
    return layout


# the enum TensorProperties pickles its memory format as (taken from its own pickled state)
MEMORY_FORMATS = type(TensorProperties(dtype=torch.float32).__getstate__()[3])
ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls
       for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                   MetadataIndex, StorageMeta, MEMORY_FORMATS)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): _path_text,
    ("pathlib", "PurePosixPath"): _path_text,
    ("pathlib", "WindowsPath"): _path_text,
    ("pathlib", "PureWindowsPath"): _path_text,
    ("collections", "OrderedDict"): dict,
    **{("torch", name): dtype for name, dtype in T.TORCH_DTYPES.items()},
}


class MetadataUnpickler(pickle.Unpickler):
    """An Unpickler that builds only what ALLOWED names: DCP's metadata, nothing that runs."""

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return found


def read_metadata(folder: str) -> Metadata:
    """A DCP folder's Metadata, read with MetadataUnpickler (never pickle.load)."""
    path = os.path.join(folder, DCP_METADATA)
    if os.path.getsize(path) > MAX_METADATA_BYTES:
        raise ImportRefusedError(f"refused {path}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RuntimeError, OverflowError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        raise ImportRefusedError(f"refused {path}: it is not DCP metadata cas reads safely ({type(exc).__name__}: {exc}); "
                             "nothing in it was run") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise ImportRefusedError(f"refused {path}: it does not hold DCP Metadata with FileSystemWriter's storage data")
    return metadata


def _item_bytes(folder: str, files: dict, index: MetadataIndex, storage_data: dict) -> bytes:
    """The bytes FileSystemWriter wrote for one item, from its (file, offset, length)."""
    info = storage_data.get(index)
    where = f"{index.fqn!r}" + (f" at {list(index.offset)}" if index.offset is not None else "")
    if not isinstance(info, StorageInfo):
        raise ImportRefusedError(f"{folder}: the metadata says nothing of where {where} is stored")
    if info.transform_descriptors:
        raise ImportRefusedError(f"{folder}: {where} was written through DCP stream extensions "
                             f"{list(info.transform_descriptors)}, which cas does not decode")
    name = info.relative_path
    if not (isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", "..")):
        raise ImportRefusedError(f"{folder}: {where} is said to be in {name!r}, which is not a file of the folder")
    if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
        raise ImportRefusedError(f"{folder}: {where} has a malformed offset or length")
    f = files.get(name)
    if f is None:
        try:
            f = files[name] = open(os.path.join(folder, name), "rb")
        except FileNotFoundError:
            raise ImportRefusedError(f"{folder}: {name}, which holds {where}, is missing") from None
    f.seek(info.offset)
    data = f.read(info.length)
    if len(data) != info.length:
        raise ImportRefusedError(f"{folder}: {name} ends before the {info.length} bytes of {where}")
    return data


def _weights_only(data: bytes, folder: str, what: str) -> Any:
    """torch.load(weights_only=True) of one item's bytes (io.BytesIO values allowed)."""
    try:
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ImportRefusedError(f"refused {folder}: {what} needs more than weights-only loading "
                             f"({unpickling_detail(exc)}); cas never unpickles arbitrary objects") from None
    except Exception as exc:  # noqa: BLE001 - torch.load fails on bad input in many ways; all mean "cannot read"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImportRefusedError(f"{folder}: cannot read {what} as a torch.save item: {first} (cas reads DCP folders "
                             "written with FileSystemWriter's default torch.save serialization)") from None


def _whole_tensor(folder: str, files: dict, fqn: str, md: TensorStorageMetadata, storage_data: dict) -> torch.Tensor:
    """One tensor put together from its stored shards, each checked against its chunk."""
    size = [int(d) for d in md.size]
    out = torch.zeros(size, dtype=md.properties.dtype, device="cpu")
    covered = 0
    for chunk in md.chunks:
        offsets, sizes = [int(d) for d in chunk.offsets], [int(d) for d in chunk.sizes]
        if len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ImportRefusedError(f"{folder}: a chunk of {fqn!r} lies outside its tensor {size}")
        what = f"the shard of {fqn!r} at {offsets}"
        shard = _weights_only(_item_bytes(folder, files, MetadataIndex(fqn, chunk.offsets), storage_data), folder,
                              what)
        if not isinstance(shard, torch.Tensor) or list(shard.shape) != sizes or shard.dtype != out.dtype:
            raise ImportRefusedError(f"{folder}: {what} is not a {out.dtype} tensor of shape {sizes}")
        out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].copy_(shard)
        covered += shard.numel()
    if covered != out.numel():
        raise ImportRefusedError(f"{folder}: the shards of {fqn!r} hold {covered} of its {out.numel()} elements")
    return out


def _check_size(folder: str, metadata: Metadata) -> None:
    """Refuse metadata that claims more tensor bytes than the folder's files hold (each shard is
    stored whole, torch.saved), before any tensor is allocated."""
    claimed = 0
    for md in metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            try:
                size = [int(d) for d in md.size]
                if any(d < 0 for d in size) or not isinstance(md.properties.dtype, torch.dtype):
                    raise ValueError("malformed")
                claimed += T.nbytes_of(element_size(md.properties.dtype), size)
            except (TypeError, ValueError, AttributeError):
                raise ImportRefusedError(f"{folder}: the metadata holds a malformed tensor description") from None
    held = sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
    if claimed > held:
        raise ImportRefusedError(f"{folder}: the metadata claims {claimed} bytes of tensors, the folder's files hold "
                                 f"{held}")


def _place(state: dict, folder: str, fqn: str, path: tuple, value) -> None:
    """Put one item where the saving planner took it from (planner_mappings)."""
    try:
        set_path(state, path, value)
    except (TypeError, IndexError, KeyError, AttributeError):
        raise ImportRefusedError(f"{folder}: item {fqn!r}'s place {list(path)} clashes with another item's") from None


def read_dcp_folder(folder: str | os.PathLike) -> dict:
    """The state dict a DCP folder holds, whole tensors and values, read without running
    anything in it (see the module docstring). Raises ImportRefusedError for what it refuses."""
    folder = os.fspath(folder)
    metadata = read_metadata(folder)
    _check_size(folder, metadata)
    mappings = planner_mappings(metadata)
    state: dict = {}
    files: dict = {}
    try:
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise ImportRefusedError(f"{folder}: the metadata names an item {fqn!r} that is not a str")
            if isinstance(md, TensorStorageMetadata):
                value = _whole_tensor(folder, files, fqn, md, metadata.storage_data)
            elif isinstance(md, BytesStorageMetadata):
                value = _weights_only(_item_bytes(folder, files, MetadataIndex(fqn), metadata.storage_data), folder,
                                      f"value {fqn!r}")
            else:
                raise ImportRefusedError(f"{folder}: item {fqn!r} has metadata of type {type(md).__name__}")
            _place(state, folder, fqn, mappings[fqn] if mappings is not None and fqn in mappings else (fqn,), value)
    finally:
        for f in files.values():
            f.close()
    return state


def step_of_folder(path: str | os.PathLike) -> int | None:
    """The last number in a folder's name (checkpoint-500 -> 500), as import names files' steps."""
    numbers = re.findall(r"\d+", os.path.basename(os.path.normpath(os.fspath(path))))
    return int(numbers[-1]) if numbers else None
