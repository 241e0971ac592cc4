"""Verification: walk each checkpoint's Merkle tree and check every object it reaches.

Full: every object (manifest nodes, chunks, delta bases) is read, decoded and checked against
its hash. Quick: manifest nodes are still decoded (they are small and needed to walk the tree),
but chunks are only checked for presence, size and a header that parses and agrees with the
index (one 64-byte read each), for a fast daily check: it cannot see a damaged payload. Each
object is checked once however many checkpoints share it; each problem names the object and
every checkpoint and tensor path that depends on it.

What a check finds is recorded in the index's `damaged` table (record_damage), where the write
path sees it: a save then writes such an object again instead of reusing it or coding a delta
against it, and `cas repair` quarantines it (store/quarantine.py). A full verify that decodes
an object whole clears its record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lmdb

from cas import faults
from cas.codecs import parse_header
from cas.readahead import reading_from_disk
from cas.errors import CasError, CheckpointNotFoundError, CorruptionError, MissingObjectError
from cas.index import WHERE_PACK
from cas.objectstore import MAX_CHAIN_DECODE

from .records import entry_name
from .registry import differences, fold_records
from .stats import delta_bases, reach


@dataclass
class Problem:
    key: str | None
    step: int | None
    path: str | None
    message: str

    def __str__(self) -> str:
        return str(CorruptionError(self.message, key=self.key, step=self.step, path=self.path))


@dataclass
class VerifyReport:
    """What a verify checked, counted as `cas du` counts objects (store/stats.py): chunks,
    manifest nodes and the delta bases decoded with the chunks (presence-checked with quick)."""

    quick: bool = False
    checked_checkpoints: list[int] = field(default_factory=list)
    checked_chunks: int = 0
    checked_nodes: int = 0
    checked_bases: int = 0
    checked_bytes: int = 0  # raw (decoded) bytes of the chunks checked: tensor data, each chunk once
    checked_stored_bytes: int = 0  # their stored bytes, with the nodes' and bases'
    problems: list[Problem] = field(default_factory=list)
    recorded: list[str] = field(default_factory=list)  # objects now recorded as damaged (hex keys)
    # listed when the verify began, then removed (rm, gc, retention of another process) before
    # or while it checked them: not checked, and what their objects' removal looked like is no damage
    removed_checkpoints: list[int] = field(default_factory=list)
    read_only: bool = False  # the store was open read-only: nothing could be recorded

    @property
    def checked_objects(self) -> int:
        return self.checked_chunks + self.checked_nodes + self.checked_bases

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_steps(self) -> list[int]:
        return sorted({p.step for p in self.problems if p.step is not None})

    @property
    def whole_steps(self) -> list[int]:
        damaged = set(self.damaged_steps)
        return [s for s in self.checked_checkpoints if s not in damaged]


def config_problems(store) -> list[Problem]:
    """The config read as written though its bytes are damaged (one bit or byte, proven by the
    digest it ends with: store/layout.py), while they still are; and so the key blob that opened
    an encrypted store."""
    out = []
    written = store.config.written
    if written is not None and bytes(store.backend.get("config")) != written:
        fix = "`cas repair` writes it back" if store.location.local else "cas does not rewrite a bucket's config"
        out.append(Problem(None, None, None, f"the store's config is damaged (one bit or byte); it is read as written, "
                                             f"which the digest it ends with proves; {fix}"))
    keys = store.location.keys
    if keys is not None and keys.mended:
        out.append(Problem(None, None, None, f"the key blob keys/{keys.key_id} that opened the store is damaged (one "
                                             "bit or byte); it is read as written, which the digest it ends with "
                                             f"proves; `cas key add` a key, then with it `cas key remove {keys.key_id}`"))
    return out


def registry_problems(store) -> list[Problem]:
    """The record log read whole (every entry authenticated in an encrypted store and chained
    to the one before) and the cache's registry compared with its fold up to the entry the cache
    holds: a damaged entry, or a cached record or commit order that is not the log's (an index
    damaged or edited, a record put back from an older copy), is a problem naming the step."""
    if store.registry.log is None:
        return []
    store.ensure_cache()
    try:
        with store.index.read() as txn:
            head, _ = store.registry.head(txn)
            cached = {ck.step: ck for ck in store.registry.all(txn)}
            order = set(store.registry.order_keys(txn))
    except CorruptionError as exc:
        return [Problem(exc.key, None, None, f"{exc.detail}; `cas repair` rebuilds the index from the store")]
    try:
        truth = fold_records(store.records.entries(), store.path, upto=head)
    except CorruptionError as exc:
        return [Problem(exc.key, None, None, f"the record log is damaged: {exc.detail}")]
    fix = "`cas repair` writes it back" if store.location.local else "cas does not rewrite a bucket's blobs"
    out = [Problem(None, None, None, f"record log entry {entry_name(seq)} is damaged (one bit or byte); it is read as "
                                      f"written, which the digest the store holds of it proves; {fix}")
           for seq in store.records.still_damaged()]
    for step in sorted(cached.keys() | truth.keys()):
        mine, theirs = cached.get(step), truth.get(step)
        if mine is None or theirs is None:
            what = "is missing from the index" if mine is None else "is in the index but not in the record log"
        else:
            fields = differences(mine, theirs)
            what = f"differs in the index from the record log ({', '.join(fields)})" if fields else None
        if what is not None:
            out.append(Problem(None, step, None, f"checkpoint {step} {what}; `cas repair` rebuilds the index"))
    if order != {(ck.seq, ck.step) for ck in truth.values()}:
        out.append(Problem(None, None, None, "the index's commit order is not the record log's (the newest checkpoint "
                                             "would be wrong); `cas repair` rebuilds the index"))
    return out


def check_present(objects, key: bytes, _depth: int = 0, pack_sizes: dict | None = None) -> int:
    """Presence, size and header of an object, and of its delta bases, from the index, without
    reading its payload. `pack_sizes`: the sizes of packs asked already in this check (in a
    bucket each is a HEAD, and a pack holds hundreds of chunks)."""
    rec = objects.record(key)
    if rec is None and objects.on_missing is not None:  # the index may have lost it: the store's look
        objects.on_missing(key, None)
        rec = objects.record(key)
    if rec is None:
        raise MissingObjectError("object is not in the index", key=key.hex())
    if rec.where == WHERE_PACK:
        known = pack_sizes if pack_sizes is not None else {}
        if rec.pack not in known:
            known[rec.pack] = objects.packs.size(rec.pack)
        size = known[rec.pack]
        if size is None:
            raise MissingObjectError(f"pack {rec.pack.hex()} holding the object is missing", key=key.hex())
        if rec.offset + rec.stored_size > size:
            raise CorruptionError(f"pack {rec.pack.hex()} is shorter than the index says", key=key.hex())
    else:
        size = objects.files.has(key)
        if size is None:
            raise MissingObjectError("object file is missing", key=key.hex())
        if size != rec.stored_size:
            raise CorruptionError(f"object file has {size} bytes, the index says {rec.stored_size}", key=key.hex())
    check_header(objects, key, rec)
    if rec.base is not None and _depth < MAX_CHAIN_DECODE:
        try:
            check_present(objects, rec.base, _depth + 1, pack_sizes)
        except CorruptionError as exc:
            raise CorruptionError(f"the delta base of this object is damaged: {exc}", key=key.hex()) from None
    return rec.raw_size


def check_header(objects, key: bytes, rec) -> None:
    """The object's header parses and says what its index record says (raw size, delta base):
    one small read, which finds a damaged header but not a damaged payload."""
    header = parse_header(objects.head(key, rec, 64), key=key)
    if (header.raw_size, header.base) != (rec.raw_size, rec.base):
        raise CorruptionError(f"object header says {header.raw_size} raw bytes and delta base "
                              f"{header.base.hex() if header.base else None}, the index {rec.raw_size} and "
                              f"{rec.base.hex() if rec.base else None}", key=key.hex())


def locate_damage(objects, key: bytes) -> tuple[bytes, CorruptionError] | None:
    """The object that makes `key` unreadable, with its error: the lowest level of its chain
    that does not decode (a delta is unreadable when its base is, and the error then names the
    delta), or None when it reads whole now (a transient error, or a node of the wrong kind)."""
    try:
        chain = objects.chain(key)
    except CorruptionError as exc:  # a cycle of bases
        return key, exc
    decoded: dict = {}
    for i in reversed(range(len(chain))):
        try:
            decoded = {chain[i]: objects.get(chain[i], chain=chain[i:], decoded=decoded)}
        except CorruptionError as exc:
            return chain[i], exc
    return None


def record_damage(store, keys, by: str) -> list[str]:
    """Record in the index the objects that make these indexed objects (hex keys, as errors
    name them) unreadable, `by` naming who found it; returns the hex keys recorded. A finding
    that cannot be recorded (a read-only store, an index error) is dropped: the next verify
    finds it again, and the caller's own error stands."""
    if store.readonly:
        return []
    try:
        found = {}
        for key in map(bytes.fromhex, dict.fromkeys(k for k in keys if k)):
            located = locate_damage(store.objects, key) if store.objects.record(key) is not None else None
            if located is not None:
                found[located[0]] = located[1].detail
        if found:
            with store.index.write() as txn:
                for key, reason in found.items():
                    store.index.mark_damaged(txn, key, reason, by)
        return [key.hex() for key in found]
    except (CasError, OSError, ValueError, lmdb.Error):
        return []


def _clear_damage(store, keys) -> None:
    """Drop the damage records of objects that a full verify decoded whole."""
    if store.readonly:
        return
    with store.index.read() as txn:
        recorded = [key for key in keys if store.index.damaged(txn, key) is not None]
    if recorded:  # a verify of a sound store writes nothing
        with store.index.write() as txn:
            for key in recorded:
                store.index.clear_damaged(txn, key)


def _count_nodes_and_bases(store, report: VerifyReport, checkpoints, sound: list[bytes]) -> None:
    """Count the manifest nodes that read (each once, as du does) and the delta bases below the
    sound chunks (a chunk checks whole only when its chain decodes, or, quick, is present), and
    add up the stored bytes of everything checked."""
    found = reach(store.objects, checkpoints)
    bases = delta_bases(store.objects, sound)
    report.checked_nodes, report.checked_bases = len(found.nodes), len(bases)
    with store.index.read() as txn:
        for key in (*sound, *found.nodes, *bases):
            rec = store.index.record(txn, key)
            report.checked_stored_bytes += rec.stored_size if rec is not None else 0


def _drop_removed(store, report: VerifyReport, checkpoints) -> None:
    """A checkpoint with problems that is no longer in the store as it was listed (another
    process removed it, and its gc may have swept its objects while this verify read them) is
    moved to `removed_checkpoints` with its problems: the objects only it needed went by design.
    A checkpoint still there keeps every problem, even of objects it shares with a removed one."""
    damaged = set(report.damaged_steps)
    if not damaged:
        return
    now = {ck.step: ck.key for ck in store.checkpoints()}
    gone = {ck.step for ck in checkpoints if ck.step in damaged and now.get(ck.step) != ck.key}
    if gone:
        report.problems = [p for p in report.problems if p.step not in gone]
        report.checked_checkpoints = [s for s in report.checked_checkpoints if s not in gone]
        report.removed_checkpoints = sorted({*report.removed_checkpoints, *gone})


def verify_checkpoints(store, checkpoints, *, quick: bool = False, progress=None) -> VerifyReport:
    """Check every object the checkpoints need as it is on disk now (no segment of an encrypted
    store, no window of a bucket's pack that this process read before answers for it:
    readahead.reading_from_disk)."""
    with reading_from_disk():
        return _verify_checkpoints(store, checkpoints, quick=quick, progress=progress)


def _verify_checkpoints(store, checkpoints, *, quick: bool, progress) -> VerifyReport:
    report = VerifyReport(quick=quick, read_only=store.readonly)
    verdict: dict[bytes, CorruptionError | None] = {}

    sizes: dict[bytes, int] = {}
    pack_sizes: dict[bytes, int | None] = {}  # (a quick check's: each pack's size asked once)

    def check(key: bytes, span: tuple[int, int]) -> CorruptionError | None:
        if key not in verdict:
            try:
                sizes[key] = check_present(store.objects, key, pack_sizes=pack_sizes) if quick else \
                    store.objects.get(key).size
                report.checked_chunks += 1
                report.checked_bytes += sizes[key]
                verdict[key] = None
            except CorruptionError as exc:
                verdict[key] = exc
        if verdict[key] is None and sizes[key] != span[1] - span[0]:  # a node that does not fit its chunks
            return CorruptionError(f"the tensor node places {span[1] - span[0]} bytes in this chunk, which holds "
                                   f"{sizes[key]}", key=key.hex())
        return verdict[key]

    for i, ck in enumerate(checkpoints):
        if progress:
            progress("verify", i, len(checkpoints))
        faults.point("verify.checkpoint")
        try:
            tensors = store.tensors(ck.step)
        except CheckpointNotFoundError:
            report.removed_checkpoints.append(ck.step)
            continue
        except CorruptionError as exc:  # a manifest node is damaged: the rest of this tree is unreachable
            report.checked_checkpoints.append(ck.step)
            report.problems.append(Problem(exc.key, ck.step, exc.path, exc.detail + "; the checkpoint cannot be read"))
            continue
        report.checked_checkpoints.append(ck.step)
        faults.point("verify.tree_read")
        for tensor in tensors:
            for key, span in zip(tensor["chunks"], tensor["spans"]):
                err = check(key, span)
                if err is not None:
                    report.problems.append(Problem(err.key, ck.step, tensor["path"], err.detail))
    _drop_removed(store, report, checkpoints)
    checked = set(report.checked_checkpoints)
    _count_nodes_and_bases(store, report, [ck for ck in checkpoints if ck.step in checked],
                           [key for key, err in verdict.items() if err is None])
    if not quick:
        _clear_damage(store, [key for key, err in verdict.items() if err is None])
    report.recorded = record_damage(store, [p.key for p in report.problems], "verify --quick" if quick else "verify")
    return report
