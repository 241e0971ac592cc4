"""What a store holds: bytes against full copies, codec usage, and its objects by role.

`cas du` and `cas verify` count objects the same way (ObjectCounts): the tensor chunks, manifest
nodes and delta bases the checkpoints reference, and, for du, the objects in the index that no
checkpoint reaches (garbage the next gc sweeps). du's total is every object in the index;
verify's is the referenced ones it checked, so the two agree on a store without garbage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cas.codecs import parse_header
from cas.errors import CorruptionError
from cas.index import Index
from cas.objectstore import ObjectStore

from .registry import Registry
from .tree import node_children, parse_node


@dataclass(frozen=True)
class StoreStats:
    logical_bytes: int  # tensor bytes over all committed checkpoints (what full copies would hold)
    stored_bytes: int  # encoded bytes of every object in the store
    num_objects: int
    num_checkpoints: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass
class Reach:
    """The objects a set of checkpoints references, each once."""

    nodes: set[bytes] = field(default_factory=set)  # manifest nodes read and hash-checked
    chunks: set[bytes] = field(default_factory=set)  # tensor chunks the tensor nodes name
    unreadable: dict[bytes, str] = field(default_factory=dict)  # nodes that do not read: why


def reach(objects: ObjectStore, checkpoints) -> Reach:
    """Walk the checkpoints' manifests (each shared node once), reading every node: a node that
    does not read is recorded as unreadable, and what only it references stays unknown."""
    out = Reach()
    stack = [ck.key for ck in checkpoints]
    while stack:
        key = stack.pop()
        if key in out.nodes or key in out.unreadable:
            continue
        try:
            node = parse_node(objects.get(key).tobytes(), key)
        except CorruptionError as exc:
            out.unreadable[key] = exc.detail
            continue
        out.nodes.add(key)
        refs, chunks = node_children(node)
        out.chunks.update(chunks)
        stack.extend(refs)
    return out


def delta_bases(objects: ObjectStore, chunks) -> set[bytes]:
    """The objects the deltas among `chunks` are coded against, down their chains, that are not
    chunks themselves: kept only so that those deltas decode."""
    chunks = set(chunks)
    return {base for chain in objects.chains(chunks).values() for base in chain[1:]} - chunks


@dataclass(frozen=True)
class ObjectCounts:
    """A store's objects by role, as `cas du` and `cas verify` count them."""

    chunks: int  # tensor chunks the checkpoints reference
    nodes: int  # manifest nodes (commit, value and tensor nodes) of the checkpoints
    bases: int  # kept only as delta bases of those chunks
    unreferenced: int  # in the index, reachable from no checkpoint: the next gc sweeps them
    unreadable_nodes: int = 0  # nodes that do not read (they, and what only they reach, count as unreferenced)

    @property
    def referenced(self) -> int:
        return self.chunks + self.nodes + self.bases

    @property
    def total(self) -> int:
        return self.referenced + self.unreferenced

    def to_json(self) -> dict:
        return {"chunks": self.chunks, "manifest_nodes": self.nodes, "delta_bases": self.bases,
                "referenced": self.referenced, "unreferenced": self.unreferenced, "total": self.total,
                "unreadable_nodes": self.unreadable_nodes}


def object_counts(store) -> ObjectCounts:
    """Every object in the store's index, by role (for `cas du`)."""
    found = reach(store.objects, store.checkpoints())
    bases = delta_bases(store.objects, found.chunks)
    live = found.nodes | found.chunks | bases
    with store.index.read() as txn:
        indexed = {key for key, _ in store.index.iter_records(txn)}
    present = live & indexed  # a missing object is verify's to report, not an object held
    return ObjectCounts(len(found.chunks & present), len(found.nodes & present), len(bases & present),
                        len(indexed - live), len(found.unreadable))


def store_stats(index: Index, registry: Registry) -> StoreStats:
    with index.read() as txn:
        stored = num = 0
        for _, rec in index.iter_records(txn):
            stored += rec.stored_size
            num += 1
        cks = registry.all(txn)
    return StoreStats(sum(c.logical_bytes for c in cks), stored, num, len(cks))


def codec_usage(index: Index, objects: ObjectStore) -> dict[str, dict]:
    """Per codec (as named in object headers): objects, stored bytes (headers included), header
    bytes, raw bytes and the deepest chain. Compare stored minus headers with raw: a `raw`
    object's payload is its raw bytes exactly, its header the only overhead."""
    usage: dict[str, dict] = {}
    with index.read() as txn:
        records = list(index.iter_records(txn))
    for key, rec in records:
        try:
            header = parse_header(objects.head(key, rec, 64), key=key)
            name, header_bytes = header.codec_name, header.payload_offset
        except CorruptionError:
            name, header_bytes = "unreadable", 0
        u = usage.setdefault(name, {"objects": 0, "stored_bytes": 0, "header_bytes": 0, "raw_bytes": 0,
                                    "max_depth": 0})
        u["objects"] += 1
        u["stored_bytes"] += rec.stored_size
        u["header_bytes"] += header_bytes
        u["raw_bytes"] += rec.raw_size
        u["max_depth"] = max(u["max_depth"], rec.depth)
    return usage
