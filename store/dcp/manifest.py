"""The coordinator's manifest of a DCP save: DCP's Metadata as plain values and one tensor node
per stored shard (the store's own node kinds, so gc, verify, `cas show`, Store.tensors and
Store.load work unchanged), built from every rank's WriteResults; and what every rank learns
of the committed save (SavedCheckpoint)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.storage import WriteResult

from cas.errors import CasError
from cas.objectfiles import FileObjects

from .. import tensors as T
from ..tree import NodeWriter, Ref, TensorLeaf, chunk_spans
from ..values import pack, unpack
from .rank import BYTESIO, REPLACEMENTS

DCP_FORMAT = 1
DCP_VERSION = "1.0.0"  # DCP's own metadata version (FileSystemWriter writes the same)


@dataclass(frozen=True)
class SavedCheckpoint:
    """What every rank learns about a committed DCP save (kept small: DCP broadcasts it)."""

    step: int
    id: str
    logical_bytes: int
    new_bytes: int

    def to_storage_data(self) -> dict:
        return {"cas": DCP_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_storage_data(cls, data) -> "SavedCheckpoint":
        if not isinstance(data, dict) or data.get("cas") != DCP_FORMAT:
            raise CasError("DCP returned metadata that no CasWriter committed")
        return cls(data["step"], data["id"], data["logical_bytes"], data["new_bytes"])


@functools.lru_cache(maxsize=None)
def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (cached: asked once per shard)."""
    return torch.empty((), dtype=dtype, device="cpu").element_size()


@dataclass
class Manifest:
    """A DCP save's manifest, built by the coordinator from every rank's results."""

    tree: Ref
    nodes: NodeWriter
    chunk_keys: list[bytes]
    logical_bytes: int
    sharding: dict
    replacements: dict[bytes, set[str]]  # chunk key -> ranks' replacement files in tmp/ (rank.RankObjects)


def _results_by_index(results: list[list[WriteResult]]) -> dict[MetadataIndex, Any]:
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


def _shard_node(fqn: str, dtype_name: str, chunk: ChunkStorageMetadata, data, chunk_size: int) -> dict:
    """The tensor node of one stored shard, in TensorLeaf's format."""
    if not (isinstance(data, dict) and isinstance(data.get("chunks"), list)):
        raise CasError(f"no rank reported the chunks of {fqn!r} at {list(chunk.offsets)}")
    sizes = [int(d) for d in chunk.sizes]
    nbytes = T.nbytes_of(element_size(T.torch_dtype(dtype_name)), sizes)
    leaf = TensorLeaf(fqn, "torch", dtype_name, sizes, nbytes, 1, None, chunk_size, int(data["skew"]),
                      list(data["chunks"]))
    expected = len(list(chunk_spans(nbytes, chunk_size, leaf.skew)))
    if len(leaf.chunks) != expected:
        raise CasError(f"a rank reported {len(leaf.chunks)} chunks for {fqn!r} at {sizes}, expected {expected}")
    return leaf.node()


def sharding_summary(size, chunks: list[ChunkStorageMetadata]) -> str:
    """A few characters per tensor for `cas show`: "whole", "dim0/2", or "6 blocks"."""
    if len(chunks) == 1 and list(chunks[0].sizes) == list(size):
        return "whole"
    split = {d for c in chunks for d in range(len(size)) if c.sizes[d] != size[d]}
    if len(split) == 1:
        return f"dim{split.pop()}/{len(chunks)}"
    return f"{len(chunks)} blocks"


def _value_entry(fqn: str, data) -> dict:
    if isinstance(data, dict) and "msgpack" in data:
        return {"v": unpack(data["msgpack"], what=f"value {fqn!r}")}
    if isinstance(data, dict) and BYTESIO in data:
        if not (isinstance(data[BYTESIO], bytes) and type(data.get("pos")) is int):
            raise CasError(f"a rank reported a malformed BytesIO value {fqn!r}")
        return {BYTESIO: data[BYTESIO], "pos": data["pos"]}
    if isinstance(data, dict) and "pickle" in data:
        return {"pickle": bytes(data["pickle"])}
    raise CasError(f"no rank reported the value {fqn!r}")


def _planner_data(metadata: Metadata):
    try:
        pack(metadata.planner_data)
    except (TypeError, ValueError, OverflowError):
        raise CasError("the save planner's planner_data is not plain data (str, numbers, lists, tuples, dicts); "
                       "it cannot be stored without pickle") from None
    return metadata.planner_data


def _tensor_item(fqn: str, md: TensorStorageMetadata) -> dict:
    """DCP's metadata of one tensor as plain values."""
    dtype_name = T.TORCH_DTYPE_NAMES.get(md.properties.dtype)
    if dtype_name is None:
        raise CasError(f"cannot store tensor dtype {md.properties.dtype} at {fqn!r}")
    return {"t": "tensor", "dtype": dtype_name, "requires_grad": bool(md.properties.requires_grad),
            "size": list(md.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}


def build_manifest(metadata: Metadata, results: list[list[WriteResult]], chunk_size: int,
                   files: FileObjects, namer=None) -> Manifest:
    """The state tree of a DCP checkpoint: a root value node referring to a metadata node (DCP's
    Metadata as plain values), a tensors node ({fqn: [tensor node per stored chunk]}) and a values
    node ({fqn: {"v": value}, {"bytesio": bytes, "pos": int} or {"pickle": bytes}}). `files`
    checks the ranks' replacement files."""
    reported = _results_by_index(results)
    nodes = NodeWriter(namer) if namer is not None else NodeWriter()
    items, shards, values, sharding = {}, {}, {}, {}
    keys: list[bytes] = []
    replacements: dict[bytes, set[str]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"t": "bytes"}
            values[fqn] = _value_entry(fqn, reported.get(MetadataIndex(fqn)))
            continue
        items[fqn] = _tensor_item(fqn, md)
        shard_nodes = [_shard_node(fqn, items[fqn]["dtype"], c, reported.get(MetadataIndex(fqn, c.offsets)),
                                   chunk_size) for c in md.chunks]
        keys.extend(k for node in shard_nodes for k in node["chunks"])
        for c in md.chunks:
            for key, name in _replacements_of(fqn, reported.get(MetadataIndex(fqn, c.offsets)), files).items():
                replacements.setdefault(key, set()).add(name)
        shards[fqn] = [nodes.emit(node) for node in shard_nodes]
        sharding[fqn] = sharding_summary(md.size, md.chunks)
    logical = sum(T.nbytes_of(element_size(md.properties.dtype), list(md.size))
                  for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))
    plain = {"items": items, "planner_data": _planner_data(metadata), "version": metadata.version or DCP_VERSION}
    root = {"dcp": {"format": DCP_FORMAT, "world_size": len(results)},
            "metadata": nodes.emit({"k": "value", "v": plain}),
            "tensors": nodes.emit({"k": "value", "v": shards}),
            "values": nodes.emit({"k": "value", "v": values})}
    return Manifest(nodes.emit({"k": "value", "v": root}), nodes, list(dict.fromkeys(keys)), logical, sharding,
                    replacements)


def _replacements_of(fqn: str, data, files: FileObjects) -> dict[bytes, str]:
    """A shard's {chunk key: staged token} of replacement files, each token checked to be one a
    rank's FileObjects.stage gives for that key (the backend's staged(): for a local store, a
    plain name in its tmp folder)."""
    given = data.get(REPLACEMENTS, {}) if isinstance(data, dict) else {}
    if not isinstance(given, dict):
        raise CasError(f"a rank reported malformed replacement files for {fqn!r}")
    for key, name in given.items():
        try:
            if not (isinstance(key, bytes) and len(key) == 32 and isinstance(name, str)):
                raise CasError("malformed")
            files.staged(key, name)
        except CasError:
            raise CasError(f"a rank reported a replacement file {name!r} that is not one of its temporary files, "
                           f"for {fqn!r}") from None
    return given
