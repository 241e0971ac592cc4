"""Reverse deltas: the newest checkpoint stays whole, older ones become deltas of newer ones.

A resume restores the newest checkpoint, so that one must decode at full speed; old ones are
read rarely. As git's packs store the newest version of a file whole and older versions as
deltas against newer ones, a save writes every changed chunk whole and, once it has committed,
a background job re-encodes the chunks it replaced (the previous save's chunk at the same
position of the same tensor) as deltas of the new ones. An object's key names its raw content,
so nothing that names it changes: only its index record moves, in one transaction, to the new
encoding (WriteSession.write_recoded), which is written into a pack first; its old file is
removed after that commit (a crash in between leaves a superseded file, which gc removes).

Chains stay bounded: each position keeps the chain of older chunks that ends in its current
chunk (`TensorBases.tails`); a chunk whose chain would grow past `max_chain` stays whole (a
keyframe), and so does one whose chain is unknown (the first save after a store was opened).
A chain only ever ends in a full object (a recode codes a full object against a full object,
re-checked inside the commit), so it never loops; gc keeps a base while a delta names it.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from cas import faults
from cas.codecs import decode_into, parse_header
from cas.pools import Pool
from cas.transforms import scratch
from cas.errors import CasError, CorruptionError
from cas.index import WHERE_PACK

from .bases import TensorBases, from_nodes
from .tree import chunk_spans

# A recode keeps a delta that samples under 99% of the whole chunk (saves use 90%: there a delta
# costs the save's time; here the whole copy is written already). Measured on the delta bench's
# AdamW state every 10 steps: fp32 0.7345 -> 0.7311 of the torch.save bytes (exp_avg's chunks
# become deltas a little smaller than whole), bf16 unchanged.
RECODE_MARGIN = 0.99
LOW_PRIORITY = 10  # nice value of the recode threads: training and saves come first


@dataclass
class Pair:
    """One chunk of an older checkpoint (`key`) and the chunk that replaced it (`base`)."""

    key: bytes
    base: bytes
    group: int
    raw: np.ndarray | None  # the older chunk's bytes, when kept in memory
    base_raw: np.ndarray | None
    tail: list | None  # the older chunks whose chain ends in `key`, nearest first (None: not known)
    where: tuple  # (new TensorBases, chunk index): whose tail this recode sets
    keyframe: bool = False  # `key` stays whole (its chain is full or not known): only its codec may change


def plan(previous: dict[str, TensorBases], current: dict[str, TensorBases], max_chain: int) -> list[Pair]:
    """The pairs worth recoding from the previous save to the current one, and each current
    position's tail (what is known before the recode: an unchanged chunk keeps its chain, a
    changed one starts with none until its recode stands). An older chunk that the current
    save holds too, elsewhere (content that moved between tensors, or came back), is left as
    it is: the newest checkpoint stays whole."""
    pairs: list[Pair] = []
    newest = {key for cur in current.values() for key in cur.keys}
    for path, cur in current.items():
        cur.tails = [[] for _ in cur.keys]
        prev = previous.get(path)
        if prev is None or not prev.matches(cur.nbytes, cur.chunk_size, cur.skew) or len(prev.keys) != len(cur.keys):
            continue
        spans = list(chunk_spans(cur.nbytes, cur.chunk_size, cur.skew))
        for i, (x, y) in enumerate(zip(prev.keys, cur.keys)):
            tail = prev.tails[i] if prev.tails is not None else None
            if x == y:
                cur.tails[i] = None if tail is None else list(tail)  # unknown stays unknown
                continue
            if x in newest:
                continue
            start, end = spans[i]
            # unknown chain, or a full one: the older chunk stays whole (a keyframe)
            keyframe = tail is None or len(tail) + 1 > max_chain
            pairs.append(Pair(x, y, cur.group,
                              prev.data[start:end] if prev.data is not None else None,
                              None if keyframe or cur.data is None else cur.data[start:end], tail, (cur, i),
                              keyframe))
    return pairs


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY)
    except (AttributeError, OSError):  # not Linux: threads share the process's priority
        pass


@dataclass(frozen=True)
class BucketLog:
    """A bucket store's part in the sessions of a recode (none in a folder, whose objects are
    its truth): its moves must be in the record log, as a save's objects are."""

    catch_up: Callable[[], None]  # after the session's lease, before it holds anything: fold gc intents
    commit: Callable[[object, object], None]  # (txn, session) inside its commit: name its packs in the log


class Recoder:
    """Runs recodes in the background, one at a time in commit order, on low-priority threads."""

    def __init__(self, objects, workers: int, on_recoded=None, logged: BucketLog | None = None) -> None:
        self.objects = objects
        self.on_recoded = on_recoded  # called with the packs whose entries a recode superseded
        # a bucket store's: each session catches up first, as a save does, and its commit names
        # its packs in the record log, so every host indexes the moved copies. There recodes do
        # not relink: a `linear` delta decodes right only through the copy of its base it was
        # coded against, and a host that chose another copy would read it wrong; a plain delta
        # (a recode's, a promotion's) decodes through any.
        self.logged = logged
        self._jobs = Pool(max_workers=1, thread_name_prefix="cas-recode",
                                        initializer=_lower_priority)
        self._pool = Pool(max_workers=workers, thread_name_prefix="cas-recode-w",
                                        initializer=_lower_priority)
        self._pending: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        self.recoded = 0  # objects made deltas so far (for tests and `bench`)
        self.relinked = 0  # deltas coded again as `linear` ones so far
        self.promoted = 0  # chunks of a newest checkpoint made whole again so far

    def busy(self) -> bool:
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            return bool(self._pending)

    def submit(self, previous: dict, current: dict, max_chain: int, label: str,
               released=None, reused: set[bytes] | None = None) -> concurrent.futures.Future:
        """Recode `previous`'s replaced chunks against `current`'s, after what is queued;
        `released(previous)` runs when done (its buffers may be reused). `reused`: the chunks the
        save found stored already (None: not known: every chunk that replaced another may have come back)."""
        def run() -> None:
            try:
                older = _came_back(previous, current, reused)
                promoted, clean, children = promote(self.objects, current, self._pool, label, self._compact, older,
                                                    self.logged)
                self.promoted += len(promoted)
                # chains no tail counts: the deltas that stood on a chunk before it came back
                unseen = ({key for key in older if children.get(key)} | promoted) - clean
                for prev in previous.values():  # the promoted chunks are spliced out of the chains
                    if prev.tails is not None and promoted:
                        prev.tails = [None if t is None else [k for k in t if k not in promoted] for t in prev.tails]
                pairs = plan(previous, current, max_chain)
                for cur in current.values():  # unknown (None): the chunk stays whole when replaced
                    cur.tails = [None if key in unseen else [] if key in clean else tail
                                 for key, tail in zip(cur.keys, cur.tails)]
                count, packs, above = recode(self.objects, pairs, self._pool, label, self.logged)
                self.recoded += count
                self._compact(packs)  # the recoded chunks' whole copies go
                count, packs = relink(self.objects, above if self.logged is None else [], self._pool, label)
                self.relinked += count
                self._compact(packs)
            except Exception as exc:  # noqa: BLE001 - nothing is lost: the older chunks stay whole
                for cur in current.values():
                    cur.tails = [[] for _ in cur.keys]
                warnings.warn(f"cas: re-encoding {label} as deltas failed; the chunks it had not re-encoded yet stay "
                              f"whole, and every checkpoint stays restorable ({type(exc).__name__}: {exc})",
                              RuntimeWarning, stacklevel=1)
            finally:
                if released is not None:
                    released(previous)
        return self.then(run)

    def _compact(self, packs: set[bytes]) -> None:
        """Compact the packs in which a recode left dead entries (their space comes back at once)."""
        if packs and self.on_recoded is not None:
            self.on_recoded(packs)

    def then(self, task) -> concurrent.futures.Future:
        """Run `task()` on the recode thread once every job queued now has ended (the task
        reports its own failures: wait() does not raise them)."""
        future = self._jobs.submit(task)
        with self._lock:
            self._pending.append(future)
        return future

    def wait(self) -> None:
        """Until the queue is empty, tasks queued by tasks included (a sweep after a recode)."""
        while True:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                pending = list(self._pending)
            if not pending:
                return
            concurrent.futures.wait(pending)

    def shutdown(self) -> None:
        self.wait()
        self._jobs.shutdown(wait=True)
        self._pool.shutdown(wait=True)


def recode(objects, pairs: list[Pair], pool: ThreadPoolExecutor, label: str,
           logged: BucketLog | None = None) -> tuple[int, set, list]:
    """Re-encode each pair's older chunk as a delta of its newer one in one write session;
    returns how many the commit indexed, the packs that held their copies before (dead
    entries now, for the caller to compact), and the recoded pairs with a chunk below them
    (with the record of their whole copy), for `relink`. Their tails are set for the next recode.
    `logged`: a bucket store's (BucketLog)."""
    if not pairs:
        return 0, set(), []
    faults.point("recode.started")
    with objects.session(f"recode {label}") as session:
        if logged is not None:
            logged.catch_up()
        wanted = [p.key for p in pairs] + [p.base for p in pairs]
        present = dict(zip(wanted, session.hold(wanted)))
        seen: set[bytes] = set()
        todo = []
        for p in pairs:
            if present[p.key] and p.key not in seen and p.key != p.base and session.depth(p.key) == 0 \
                    and (p.keyframe or present[p.base] and session.depth(p.base) == 0):
                seen.add(p.key)
                todo.append(p)
        before = {p.key: objects.record(p.key) for p in todo}
        done = list(pool.map(lambda p: _recode_one(objects, session, p, before[p.key]), todo))
        written = [p for p, how in zip(todo, done) if how == "delta"]
        rewritten = [p.key for p, how in zip(todo, done) if how == "whole"]
        faults.point("recode.encoded")
        by_key = {p.key: p for p in written}

        def finish(txn) -> set[bytes]:
            faults.point("recode.in_txn")
            for key in session.recoded:  # the older chunks below it are one level deeper now
                above = key
                for depth, below in enumerate(by_key[key].tail, start=2):
                    rec = objects.index.record(txn, below)
                    if rec is None or rec.base != above:  # the chain ends here (a promotion cut it)
                        break
                    if rec.depth != depth:
                        objects.index.put_record(txn, below, replace(rec, depth=min(depth, 255)))
                    above = below
            if logged is not None:
                logged.commit(txn, session)
            return set(session.recoded)

        settled = session.commit(finish) if written or rewritten else set()
    faults.point("recode.committed")
    for key in settled:
        p = by_key[key]
        cur, i = p.where
        if cur.tails[i] is not None:  # (None: other chains hang on the newer chunk, of unknown length)
            cur.tails[i] = [p.key] + p.tail
    moved = settled | {key for key in rewritten if objects.record(key) != before[key]}
    if logged is None:  # (a bucket holds no object files)
        _remove_superseded(objects, moved)
    packs = {rec.pack for key in moved if (rec := before.get(key)) is not None and rec.where == WHERE_PACK}
    return len(settled), packs, [(by_key[key], before[key]) for key in settled if by_key[key].tail]


def _recode_one(objects, session, p: Pair, rec) -> str | None:
    """Encode one older chunk as a delta of its newer one ("delta"); where it stays whole (a
    keyframe, or the delta is not smaller by the margin), code it again whole with zstd's own
    level-1 parameters when that is smaller by the margin ("whole"); else None."""
    n = rec.raw_size
    try:
        raw = p.raw if p.raw is not None else objects.get(p.key, scratch(n, "recode older"))
        if not p.keyframe:
            base = p.base_raw if p.base_raw is not None else objects.get(p.base, scratch(n, "recode newer"))
    except CorruptionError:  # damage is verify's (and the load's) to report; this one stays as it is
        return None
    if not p.keyframe:
        enc = objects.codec.encode(raw, p.group, (p.base, base), margin=RECODE_MARGIN)
        if enc.base is not None:
            session.write_recoded(p.key, b"".join(bytes(part) for part in enc.parts), n, p.base, 1)
            return "delta"
    if p.group < 2 or not objects.codec.plain_params_sample_smaller(raw, p.group):
        return None
    # Whole, and older than the newest: decoding speed matters less than bytes here. FLOAT_ZSTD
    # (fast, for the newest) codes Adam's exp_avg 1.3 points larger than zstd's own level 1.
    enc = objects.codec.encode(raw, p.group, floats=False)
    if enc.base is not None or enc.size >= RECODE_MARGIN * rec.stored_size:
        return None
    session.write_encoded(p.key, b"".join(bytes(part) for part in enc.parts), replace(rec, depth=0), pack_only=True)
    return "whole"


def promote(objects, current: dict[str, TensorBases], pool: ThreadPoolExecutor, label: str,
            compact: Callable[[set[bytes]], None], older: set[bytes],
            logged: BucketLog | None = None) -> tuple[set[bytes], set[bytes], dict]:
    """Make whole again the chunks of the newest checkpoint that are deltas: content of an older
    checkpoint that came back (a run resumed from an earlier step saving what it saved before,
    a rollback), which a recode made a delta of the chunk that followed it. The newest must
    decode without a chain. Each such chunk is spliced out of the chains that ran through it:
    the deltas recorded against it are coded against its base instead (so no chain grows, and
    the positions' tails, less the spliced chunk, still count every chain). Two sessions, as a
    recode and its relink: first each `linear` delta standing on one of those (it reads that
    one's base) is coded again as `sub`; then, only where that `linear` copy is gone from disk
    (`compact` removed its pack, or its file went), the splice. So an index rebuilt from disk at
    any point finds no `linear` copy beside a rebased base. Each move stands only as
    WriteSession._settle_promotions judges it inside its commit. `older`: chunks of the newest
    that were stored before it (whole ones too may have deltas standing on them). Returns the
    promoted chunks, those of them on which no delta was left, and the deltas recorded against
    each chunk of `older` before the promotion (empty when no chunk came back)."""
    group: dict[bytes, int] = {}
    for cur in current.values():
        for key in cur.keys:
            group.setdefault(key, cur.group)
    with objects.index.read() as txn:
        came_back = {key: rec.base for key in group if (rec := objects.index.record(txn, key)) is not None
                     and rec.base is not None}
        if not came_back and not older:
            return set(), set(), {}
        children = objects.index.delta_children(txn)
    if not came_back:
        return set(), set(), children
    rebases = {child: (base, key) for key, base in came_back.items()  # child -> (new base, old base)
               for child in children.get(key, ()) if child not in came_back}
    unlinks = {child: key for key in rebases for child in children.get(key, ())
               if child not in came_back and child not in rebases and _linear(objects, child)}
    for key, (_, above) in rebases.items():
        group.setdefault(key, group[above])
    for key, above in unlinks.items():
        group.setdefault(key, group[above])
    if unlinks:
        moved, before = _move(objects, pool, f"unlink {label}", {k: ("unlink", b, None) for k, b in unlinks.items()},
                              group, "recode.unlink_encoded", logged)
        faults.point("recode.unlinked")
        compact(_packs_of(before, moved))
        blocked = {unlinks[k] for k in unlinks if k not in moved or not _gone(objects, k, before[k])}
        rebases = {k: v for k, v in rebases.items() if k not in blocked}
    moves = {k: ("whole", None, None) for k in came_back} | {k: ("rebase", b, old) for k, (b, old) in rebases.items()}
    moved, before = _move(objects, pool, f"promote {label}", moves, group, "recode.promote_encoded", logged)
    faults.point("recode.promoted")
    compact(_packs_of(before, moved))
    promoted = {key for key in came_back if key in moved}
    return promoted, {key for key in promoted if all(c in moved for c in children.get(key, ()))}, children


def _move(objects, pool: ThreadPoolExecutor, purpose: str, moves: dict[bytes, tuple], group: dict[bytes, int],
          point: str, logged: BucketLog | None = None) -> tuple[set[bytes], dict]:
    """Code each object of `moves` again in one write session: ("whole", None, None) whole,
    with the fast float parameters (the newest); ("rebase", base, old base) or ("unlink", base,
    None) as a `sub` delta of `base`, whatever it saves (a chain's edges must hold). Returns the
    objects whose record the commit moved and each one's record before. `logged`: as recode's."""
    with objects.session(purpose) as session:
        if logged is not None:
            logged.catch_up()
        keys = list(moves)
        held = dict(zip(keys, session.hold(keys + [b for _, b, _ in moves.values() if b is not None])))
        before = {key: objects.record(key) for key in keys if held[key]}

        def move(key: bytes) -> None:
            (kind, base, old_base), rec = moves[key], before[key]
            try:
                raw = objects.get(key, scratch(rec.raw_size, "recode older"))
                base_raw = objects.get(base, scratch(rec.raw_size, "recode newer")) if base is not None else None
            except CorruptionError:  # damage is verify's to report; this one stays as it is
                return
            if base is None:
                enc = objects.codec.encode(raw, group[key])
                session.write_whole_again(key, b"".join(bytes(part) for part in enc.parts), rec.raw_size)
                return
            enc = objects.codec.encode(raw, group[key], (base, base_raw), margin=float("inf"))
            if enc.base != base:  # it does not code as a delta at all: left as it is
                return
            blob = b"".join(bytes(part) for part in enc.parts)
            if kind == "rebase":
                session.write_rebased(key, blob, rec.raw_size, base, old_base)
            else:
                session.write_unlinked(key, blob, rec.raw_size, base)

        list(pool.map(move, list(before)))
        faults.point(point)
        session.commit(lambda txn: logged.commit(txn, session) if logged is not None else None)
    moved = {key for key in before if (rec := objects.record(key)) != before[key] and rec is not None
             and rec.base == moves[key][1]}  # (what another writer moved meanwhile is not ours)
    if logged is None:  # (a bucket holds no object files)
        _remove_superseded(objects, moved)
    return moved, before


def _packs_of(before: dict, moved: set[bytes]) -> set[bytes]:
    """The packs that held the copies `moved` superseded (dead entries now, to compact)."""
    return {rec.pack for key in moved if (rec := before[key]) is not None and rec.where == WHERE_PACK}


def _came_back(previous: dict[str, TensorBases], current: dict[str, TensorBases],
               reused: set[bytes] | None) -> set[bytes]:
    """The chunks of `current` that replaced another at their position and were stored before
    the save (in `reused`; every such chunk when that is not known): content that came back,
    on which deltas may stand that no position's tail counts."""
    out = set()
    for path, cur in current.items():
        prev = previous.get(path)
        before = prev.keys if prev is not None and len(prev.keys) == len(cur.keys) else [None] * len(cur.keys)
        out.update(y for x, y in zip(before, cur.keys) if x != y and (reused is None or y in reused))
    return out


def _linear(objects, key: bytes) -> bool:
    """Whether the indexed copy of `key` is a `linear` delta (an unreadable one is left alone)."""
    rec = objects.record(key)
    try:
        return rec is not None and objects.header_at(key, rec).needs_below
    except CasError:
        return False


def relink(objects, recoded: list[tuple[Pair, object]], pool: ThreadPoolExecutor, label: str) -> tuple[int, set]:
    """Code the chunk below each just-recoded chunk again, as a `linear` delta extrapolating
    backward from the recoded chunk and the newer one it is now a delta of (`_relink_one`), in
    one write session; returns how many the commit indexed and the packs their `sub` copies
    were in. Only where the recoded chunk's whole copy is gone from disk (its pack compacted
    away, its file removed): a `linear` delta reads its base's base, so its base must be a delta
    of that in every copy an index rebuilt from disk could choose (store/cache.py prefers
    whole copies)."""
    todo = [(p, whole) for p, whole in recoded if _gone(objects, p.key, whole)]
    if not todo:
        return 0, set()
    with objects.session(f"relink {label}") as session:
        wanted = [k for p, _ in todo for k in (p.tail[0], p.key, p.base)]
        present = dict(zip(wanted, session.hold(wanted)))
        todo = [p for p, _ in todo if all(present[k] for k in (p.tail[0], p.key, p.base))]
        before = {p.tail[0]: objects.record(p.tail[0]) for p in todo}
        written = [p for p, ok in zip(todo, pool.map(lambda p: _relink_one(objects, session, p, before[p.tail[0]]),
                                                     todo)) if ok]
        faults.point("recode.relink_encoded")
        settled = session.commit(lambda txn: set(session.relinked)) if written else set()
    faults.point("recode.relinked")
    return len(settled), {rec.pack for key in settled if (rec := before[key]) is not None and rec.where == WHERE_PACK}


def _gone(objects, key: bytes, whole) -> bool:
    """Whether the copy `whole` (a record of `key` before its recode) is no longer on disk."""
    if whole is None:
        return False
    if whole.where == WHERE_PACK:
        return objects.packs.size(whole.pack) is None
    return objects.files.has(key) is None


def _relink_one(objects, session, p: Pair, rec) -> bool:
    """Code `p.tail[0]` (a delta of `p.key`) again as a `linear` delta of `p.key`, with `p.base`
    (what `p.key` is now a delta of) as the base's base: its prediction p.key + (p.key -
    p.base) / 2^h extrapolates backward (docs/format.md, stage 5). The newest chunk has no base,
    so the recode of the chunk below it could only code `sub`. Kept only when smaller than the
    `sub` by the recode's margin; False else."""
    key = p.tail[0]
    if rec is None or rec.base != p.key:
        return False
    n = rec.raw_size
    try:
        above = p.raw if p.raw is not None else objects.get(p.key, scratch(n, "recode older"))
        top = p.base_raw if p.base_raw is not None else objects.get(p.base, scratch(n, "recode newer"))
        data = objects.fetch(key)
        if parse_header(data, key=key).needs_below or above.size != n:
            return False
        raw = decode_into(data, key, scratch(n, "relink"), above, namer=objects.namer)
    except CasError:  # damage is verify's to report; moved meanwhile: left as it is
        return False
    enc = objects.codec.encode(raw, p.group, (p.key, above), below=top, margin=RECODE_MARGIN)
    if enc.base != p.key or not parse_header(enc.parts[0], key=key).needs_below \
            or enc.size >= RECODE_MARGIN * rec.stored_size:
        return False
    session.write_relinked(key, b"".join(bytes(part) for part in enc.parts), n, p.key, p.base)
    return True


def _remove_superseded(objects, keys) -> None:
    """Remove the files of objects whose records now place them in a pack (readers that looked
    a file up before the move look again when it is gone: ObjectStore.fetch). Not on an index
    deleted or replaced meanwhile: the records that say so may be in it alone."""
    if objects.index.orphaned():
        return
    removed = False
    for key in keys:
        rec = objects.record(key)
        if rec is not None and rec.where == WHERE_PACK and objects.files.has(key) is not None:
            objects.files.delete(key)
            removed = True
    if removed:
        objects.files.sync()
    faults.point("recode.files_removed")


def bases_of_checkpoint(store, ck, max_chain: int) -> dict[str, TensorBases]:
    """Keys-only bases of checkpoint `ck`'s floating tensors, each chunk's tail read from the
    checkpoints before it (commit order) and the index: the chunk at the same position one
    checkpoint back is in the tail while its record names the chunk above it as its base (one
    that does not is passed over: a promotion splices chunks out of chains). What a reopened
    store (or a DCP coordinator, which keeps nothing between saves) recodes from."""
    current = from_nodes([(p, leaf.node) for p, leaf in store.reader(ck.step).tensor_leaves().items()])
    older = sorted((c for c in store.checkpoints() if c.seq < ck.seq), key=lambda c: c.seq, reverse=True)
    history = []
    for c in older[:max_chain]:
        try:
            history.append({p: leaf.node for p, leaf in store.reader(c.step).tensor_leaves().items()})
        except CasError:  # a damaged manifest is verify's to report: the chains known stop here
            break
    for path, cur in current.items():
        cur.tails = []
        for i, key in enumerate(cur.keys):
            tail, above = [], key
            for nodes in history:
                node = nodes.get(path)
                if node is None or node["nbytes"] != cur.nbytes or len(node["chunks"]) != len(cur.keys):
                    break
                below = node["chunks"][i]
                if below == above:
                    continue
                rec = store.objects.record(below)
                if rec is None or rec.base != above:  # not on this chain (a chunk a promotion spliced out)
                    continue
                tail.append(below)
                above = below
            cur.tails.append(tail)
    return current
