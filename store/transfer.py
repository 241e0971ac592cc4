"""Copy checkpoints between stores with only the objects the destination lacks: push, pull and
the mirror's background pushes.

Objects travel as their ENCODED bytes (no decode and re-encode: a delta stays a delta of the same
base), but each one is decoded once as it is read from the source and checked against its key,
so a damaged source object is a CorruptionError naming it and nothing of that checkpoint is
committed. Every object a checkpoint reaches is copied unless the destination holds it:
manifest nodes, chunks, and every delta base down each chunk's chain (a base before the deltas
coded against it). The checkpoint then commits in the destination as a save does: one write
session (claims hold every object against the destination's gc), its objects durable first,
then one record log entry with the same commit key (the same checkpoint id), step, created
time, metrics, meta and flags. Only the stores' public API and the object layer are used, so
any pair of stores works (folders, buckets).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from cas.errors import CasError, CheckpointExistsError, CorruptionError, ReadOnlyStoreError
from cas import faults
from cas.chains import decode_chain
from cas.codecs import parse_header
from cas.objectstore import WriteSession
from cas.pools import Pool
from cas.progress import ProgressCallback

from .registry import Checkpoint, add_change
from .tree import node_children, parse_node

if TYPE_CHECKING:
    from .store import CheckpointStore

BATCH = 256  # objects claimed in the destination in one index transaction


@dataclass
class TransferReport:
    """What a copy did: checkpoints committed in the destination, those it held already (same
    id), and the objects it wrote (encoded bytes) or found there."""

    source: str
    destination: str
    copied: list[Checkpoint] = field(default_factory=list)
    already_there: list[Checkpoint] = field(default_factory=list)
    removed_meanwhile: list[Checkpoint] = field(default_factory=list)  # the source's gc removed them mid-copy
    objects_copied: int = 0
    objects_skipped: int = 0  # nodes and chunks the destination held (their chains are its own)
    bytes_copied: int = 0

    def to_json(self) -> dict:
        return {"source": self.source, "destination": self.destination,
                "copied": [ck.to_json() for ck in self.copied],
                "already_there": [ck.to_json() for ck in self.already_there],
                "removed_meanwhile": [ck.to_json() for ck in self.removed_meanwhile],
                "objects_copied": self.objects_copied, "objects_skipped": self.objects_skipped,
                "bytes_copied": self.bytes_copied}


def chosen(src: "CheckpointStore", steps=None) -> list[Checkpoint]:
    """The checkpoints of `src` to copy, in commit order: all when `steps` is None (a step or
    several; a missing one is CheckpointNotFoundError)."""
    if steps is None:
        cks = src.checkpoints()
    else:
        steps = [steps] if isinstance(steps, int) else list(steps)
        cks = [src.resolve(step) for step in dict.fromkeys(steps)]
    return sorted(cks, key=lambda ck: (ck.seq, ck.step))


def copy_checkpoints(src: "CheckpointStore", dst: "CheckpointStore", steps=None, *,
                     progress: ProgressCallback | None = None, why: str = "copy") -> TransferReport:
    """Copy checkpoints `steps` of `src` (all when None) into `dst`, in commit order, each in one
    registry commit. A step `dst` holds with the same id is skipped (already there); with
    another id the copy is refused (CheckpointExistsError naming the step and both ids) before
    anything is written. `why` is what dst's record log says made the change (push, pull, mirror)."""
    report = TransferReport(src.path, dst.path)
    if src.objects.namer.fingerprint != dst.objects.namer.fingerprint:
        from .opening import CROSS_KEY  # noqa: PLC0415

        def kind(store) -> str:
            return "encrypted" if store.encrypted else "not encrypted"
        raise CasError(f"cannot copy checkpoints from {src.path} ({kind(src)}) to {dst.path} ({kind(dst)}"
                       f"{', another master key' if src.encrypted and dst.encrypted else ''}). {CROSS_KEY}")
    if dst.readonly:
        raise ReadOnlyStoreError(f"the store at {dst.path} is open read-only; cannot copy checkpoints into it")
    dst.ensure_cache()
    todo = []
    for ck in chosen(src, steps):
        there = _held(dst, ck)
        if there is None:
            todo.append(ck)
        else:
            report.already_there.append(there)
    workers = max(src.options.worker_count(), 2)
    window = max(2 * workers, min(64, src.window_bytes // max(src.chunk_size, 1)))
    visited: set[bytes] = set()  # nodes walked (and so copied or found) by this transfer
    with Pool(max_workers=workers, thread_name_prefix="cas-copy") as pool:
        for n, ck in enumerate(todo):
            walked = set(visited)
            try:
                committed, fresh = _Copier(src, dst, pool, window, report).copy(ck, visited, why)
            except CorruptionError:
                if _still_committed(src, ck):
                    raise
                # a gc (of another host, say) removed it from the source while it was copied: not
                # damage, and no reason to give up the others; nothing of it was committed, and
                # what it walked is walked again by a checkpoint that shares it
                visited.clear()
                visited.update(walked)
                report.removed_meanwhile.append(ck)
                continue
            (report.copied if fresh else report.already_there).append(committed)
            if progress:
                progress("copy", n + 1, len(todo))
    return report


def _still_committed(src: "CheckpointStore", ck: Checkpoint) -> bool:
    """Whether the source still holds checkpoint `ck` (it may have had it removed meanwhile)."""
    src.ensure_cache()
    with src.index.read() as txn:
        now = src.registry.get(txn, ck.step)
    return now is not None and now.id == ck.id


def _held(dst: "CheckpointStore", ck: Checkpoint) -> Checkpoint | None:
    """dst's checkpoint at ck's step when it is this very checkpoint; CheckpointExistsError when
    the step holds another one; None when the step is free."""
    with dst.index.read() as txn:
        there = dst.registry.get(txn, ck.step)
    if there is not None and there.id != ck.id:
        raise conflict(dst, ck, there)
    return there


def conflict(dst: "CheckpointStore", ck: Checkpoint, there: Checkpoint) -> CheckpointExistsError:
    return CheckpointExistsError(f"step {ck.step} of the store at {dst.path} holds checkpoint {there.id}, not "
                                 f"the copied checkpoint {ck.id}; nothing of it was copied (delete it there "
                                 "first, or copy other steps)")


class _Copier:
    """One checkpoint's copy: walk its tree in the source, write what the destination lacks in
    one write session, commit."""

    def __init__(self, src: "CheckpointStore", dst: "CheckpointStore", pool: ThreadPoolExecutor, window: int,
                 report: TransferReport) -> None:
        self.src, self.dst, self.pool, self.window, self.report = src, dst, pool, window, report
        self.lock = threading.Lock()  # the report's counts, from the workers

    def copy(self, ck: Checkpoint, visited: set[bytes], why: str) -> tuple[Checkpoint, bool]:
        """(the checkpoint as dst now holds it, whether this copy committed it: False when another
        writer committed the same checkpoint there meanwhile)."""
        with self.dst.objects.session(f"{why} step {ck.step} from {self.src.path}") as session:
            try:
                for batch in _batches(self._walk(ck.key, visited), BATCH):
                    self._copy_batch(session, batch)
            except CorruptionError as exc:
                raise exc.located(step=ck.step) from None
            found: list[Checkpoint] = []

            def finish(txn) -> Checkpoint:
                there = self.dst.registry.get(txn, ck.step)
                if there is not None:  # committed meanwhile: this very checkpoint, or a conflict
                    if there.id != ck.id:
                        raise conflict(self.dst, ck, there)
                    found.append(there)
                    return there
                new = dataclasses.replace(ck, new_bytes=session.new_bytes, seq=0, mirrored=False, extra={})
                seq = self.dst.registry.commit(txn, why, [add_change(new, session.packs_written())])
                return dataclasses.replace(new, seq=seq)

            committed = self.dst.commit_session(session, finish)
            return committed, not found

    def _walk(self, root: bytes, visited: set[bytes]) -> Iterator[bytes]:
        """Every node and chunk key of the tree under `root`, each once, read and checked from the
        source (a node this transfer walked already is skipped with its subtree: it is in dst)."""
        stack = [root]
        chunks_seen: set[bytes] = set()
        while stack:
            key = stack.pop()
            if key in visited:
                continue
            visited.add(key)
            node = parse_node(self.src.objects.get(key).tobytes(), key)
            refs, chunks = node_children(node)
            yield key
            for chunk in chunks:
                if chunk not in chunks_seen:
                    chunks_seen.add(chunk)
                    yield chunk
            stack.extend(r for r in refs if r not in visited)

    def _copy_batch(self, session: WriteSession, keys: list[bytes]) -> None:
        """Claim `keys` in dst; copy those it lacks, each with the levels of its source chain that
        dst lacks, bottom up. A level several chains share is written by the first job that
        reaches it; a later job waits for that one (it started earlier: the pool is FIFO)."""
        stored = session.claim(keys)
        tops = [key for key, ok in zip(keys, stored) if not ok]
        self.report.objects_skipped += len(keys) - len(tops)
        if not tops:
            return
        chains = self.src.objects.chains(tops)
        faults.point("transfer.chains_planned")
        lower = list(OrderedDict.fromkeys(k for top in tops for k in chains[top][1:]))
        present = dict(zip(lower, session.claim(lower))) if lower else {}
        held = {key for key, ok in present.items() if ok}  # dst's own copies: their chains are dst's
        needed = set(tops) | {key for key, ok in present.items() if not ok}  # this batch writes them
        owner: dict[bytes, int] = {}
        jobs: list[tuple[list[bytes], set[bytes], set[int]]] = []
        for top in tops:
            chain = chains[top]
            if top in owner:  # a level of an earlier chain: copied with it
                continue
            n = len(jobs)
            for key in chain:
                if key in needed:
                    owner.setdefault(key, n)
            mine = {k for k in chain if owner.get(k) == n}
            jobs.append((chain, mine, {owner[k] for k in chain if k in owner and owner[k] != n}))
        futures: list[Future] = []
        try:
            for chain, mine, before in jobs:
                futures.append(self.pool.submit(self._copy_chain, session, chain, mine, [futures[i] for i in before],
                                                held))
                while sum(not f.done() for f in futures) > self.window:
                    wait(futures, return_when="FIRST_COMPLETED")
            for fut in futures:
                fut.result()
        except BaseException:
            wait(futures)  # no worker may still write once the session aborts
            raise

    def _copy_chain(self, session: WriteSession, chain: list[bytes], mine: set[bytes], before: list[Future],
                    held: set[bytes]) -> None:
        """Decode `chain` from the source, its top checked against its key (a wrong level below
        makes a wrong top; a failed check decodes again checking each level, to name the damaged
        one), then put the levels in `mine` into dst bottom up, once the jobs writing the levels
        below them are done. A `linear` delta whose base dst holds (`held`) encoded otherwise
        than the source (whole, or a delta of another base) is coded again against that base:
        it extrapolates from the base's own base, which dst's copy does not name."""
        kept: dict[bytes, bytes] = {}

        def fetch(key: bytes):
            data = self.src.objects.fetch(key)
            if key in mine:
                kept[key] = bytes(data)  # the fetch buffer is reused by this thread's next read
            return data

        try:
            raw = decode_chain(chain, fetch, check_each=False, namer=self.src.objects.namer)
        except CorruptionError:
            if self.src.objects.chain(chain[0]) != chain:
                # a recode in the source made a level a delta of a newer chunk since the chain
                # was planned (a pull beside a save): copy these objects by their content
                for key in (k for k in chain if k in mine):
                    self._count(self._copy_content(session, key))
                return
            if len(chain) == 1:
                raise
            raw = decode_chain(chain, fetch, check_each=True, namer=self.src.objects.namer)  # names the damaged level
        for fut in before:
            fut.result()
        for level in reversed(range(len(chain))):
            key = chain[level]
            if key in mine:
                base = chain[level + 1] if level + 1 < len(chain) else None
                below = chain[level + 2] if level + 2 < len(chain) else None
                head = parse_header(kept[key], key=key)
                if head.needs_below and session.base_of(base) != below:  # dst's base is coded otherwise
                    size = self._code_again(session, key, base, head.element_size)
                else:
                    size = session.put_encoded(key, kept[key], raw_size=raw.size, base=base)
                self._count(size)

    def _count(self, size: int) -> None:
        with self.lock:
            self.report.objects_copied += 1
            self.report.bytes_copied += size

    def _copy_content(self, session: WriteSession, key: bytes) -> int:
        """Write `key` into dst whole, coded by dst's codec from the source's decoded bytes
        (checked, along the chain the source has now)."""
        element_size = parse_header(self.src.objects.fetch(key), key=key).element_size
        return session.write(key, self.src.objects.get(key), element_size)

    def _code_again(self, session: WriteSession, key: bytes, base: bytes, element_size: int) -> int:
        """Write `key` into dst coded by dst's codec against `base` alone (a `sub` delta, or whole
        when that does not pay), from the source's decoded bytes of both (checked)."""
        raw = self.src.objects.get(key)
        base_raw = self.src.objects.get(base)
        return session.write(key, raw, element_size, (base, base_raw, session.depth(base) or 0))


def _batches(items: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
