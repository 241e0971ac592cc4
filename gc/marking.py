"""Marking: the objects the committed checkpoints need, from their commit nodes down every
manifest node, chunk and delta base (gc's sweep, a writer's compaction, diff and
exclusive_bytes through cas.api).
"""

from __future__ import annotations

import threading
import weakref

from cas import faults
from cas.errors import CasError, CorruptionError
from cas.progress import ProgressCallback
from cas.store.tree import node_children, parse_node


class RegistryMoved(Exception):
    """A manifest node vanished while it was being marked, and checkpoints were removed since
    the mark began (another process deleted and swept them), or the index was replaced under
    the mark (its registry was no longer the store's). Mark again from the registry, the
    index at the path opened again (ensure_cache)."""


class Marker:
    """The live set: every object reachable from the roots marked so far. With `generation`
    (the index's when the roots were read), an unreadable node is damage only if no checkpoint
    was removed since (RegistryMoved otherwise)."""

    def __init__(self, store, generation: int | None = None) -> None:
        self.store = store
        self.links = node_links(store)
        self.generation = generation
        self.live: set[bytes] = set()
        self.roots: set[bytes] = set()
        self.unindexed: dict[bytes, tuple | None] = {}  # live objects the index has no record of (bases_of)

    def mark(self, roots, progress: ProgressCallback | None = None) -> None:
        stack = [r for r in roots if r not in self.live]
        self.roots.update(roots)
        chunks_seen: list[bytes] = []
        while stack:
            key = stack.pop()
            if key in self.live:
                continue
            links = self.links.get(key)
            if links is None:
                links = node_children(self._read_node(key))
                self.links.put(key, links)
            self.live.add(key)
            faults.point("gc.marking")
            refs, chunks = links
            chunks_seen.extend(c for c in chunks if c not in self.live)
            self.live.update(chunks)
            stack.extend(r for r in refs if r not in self.live)
            if progress and len(self.live) % 4096 < len(chunks) + 1:
                progress("mark", len(self.live), 0)
        self._follow_bases(chunks_seen)

    def _read_node(self, key: bytes) -> dict:
        try:
            return parse_node(self.store.objects.get(key).tobytes(), key)
        except CorruptionError as exc:
            if self.store.index.orphaned():  # replaced under this mark: its roots and records were stale
                raise RegistryMoved() from None
            if self.generation is not None:
                with self.store.index.read() as txn:
                    if self.store.index.generation(txn) != self.generation:
                        raise RegistryMoved() from None
            raise CasError(f"gc stopped before deleting anything of this pass: a manifest node is unreadable "
                           f"({exc}); run `cas verify` to see which checkpoints are damaged") from None

    def follow_current_bases(self) -> None:
        """Follow the base edges of every live object as the index records them now: a recode
        (or a promotion) committed since the first mark may have made a marked chunk a delta of
        an object nothing else keeps, and marking only the new roots would not see it."""
        with self.store.index.read() as txn:
            self.live.update(bases_of(self.store.index, txn, list(self.live), self.live))

    def _follow_bases(self, keys: list[bytes]) -> None:
        """A delta keeps its base alive, and the base's base: edges read from the index (a key
        with no record there is noted in `unindexed`: its base, if any, is not known)."""
        with self.store.index.read() as txn:
            self.live.update(bases_of(self.store.index, txn, keys, self.live, unindexed=self.unindexed))


def bases_of(index, txn, keys, known: set[bytes] = frozenset(), unindexed: dict | None = None) -> set[bytes]:
    """Every object the deltas among `keys` are coded against, down their chains (stopping at
    objects in `known`, whose chains are accounted for already). The keys met that have no
    record go into `unindexed` when given, each with the (key, record) of the delta whose record
    named it as its base, or None for one of `keys`."""
    found: set[bytes] = set()
    for key in keys:
        rec, named_by = index.record(txn, key), None
        while True:
            if rec is None and unindexed is not None and (named_by is not None or key not in unindexed):
                unindexed[key] = named_by
            if rec is None or rec.base is None or rec.base in known or rec.base in found:
                break
            named_by, key = (key, rec), rec.base
            found.add(key)
            rec = index.record(txn, key)
    return found


class NodeLinks:
    """What each manifest node read so far links to ((refs, chunks), by node key), per open
    store. A node is named by its bytes, so its links never change: a gc after every save (a
    bucket's sweep, where each node read is a request) reads only the new checkpoints' nodes."""

    LIMIT = 1 << 21  # keys held (~70 MiB at most); past it, forgotten and read again

    def __init__(self) -> None:
        self._links: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple[list[bytes], list[bytes]] | None:
        return self._links.get(key)

    def put(self, key: bytes, links: tuple[list[bytes], list[bytes]]) -> None:
        with self._lock:
            if self._held > self.LIMIT:
                self._links, self._held = {}, 0
            self._links[key] = links
            self._held += 1 + len(links[0]) + len(links[1])


_NODE_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NODE_LINKS_LOCK = threading.Lock()


def node_links(store) -> NodeLinks:
    with _NODE_LINKS_LOCK:
        links = _NODE_LINKS.get(store)
        if links is None:
            links = _NODE_LINKS[store] = NodeLinks()
        return links


def marked_now(store) -> tuple[set[bytes], int]:
    """What the committed checkpoints need now, and the record log entry that mark saw: for a
    compaction outside a sweep (a writer's, after its recode). CasError when it cannot tell."""
    store.ensure_cache()
    with store.index.read() as txn:
        generation = store.index.generation(txn)
        roots = [ck.key for ck in store.registry.all(txn)]
        head, _ = store.registry.head(txn)
    marker = Marker(store, generation)
    try:
        marker.mark(roots)
    except RegistryMoved:
        raise CasError("packs were not compacted: checkpoints changed while they were marked") from None
    return marker.live, head
