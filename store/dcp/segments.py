"""DCP ranks saving into a bucket store: chunks go into segments (packs) that each rank PUTs
straight to the bucket, and the coordinator indexes them at its commit.

In a bucket every object lives in a pack (store/location.py), so a rank cannot dedup by asking
whether an object exists (a stat per chunk would cost a request each, and a chunk is no blob of
its own), and it opens no cache. The planning round trip says instead what is stored:

  1. prepare_local_plan, every rank: the chunk keys of its last save into this store, kept in
     this process's memory (`proposal`: none after a restart).
  2. prepare_global_plan, coordinator: holds them in its barrier session (gc keeps them until
     the commit) and answers with those its cache knows are stored (`confirm`, no request: a
     bucket's pack entries are trusted). A rank none of whose keys is stored (restarted, or its
     last save failed) is seeded with the chunk keys of the latest checkpoint's shards that
     match its plan exactly, confirmed alike.
  3. write_data, every rank: a chunk confirmed stored, or written earlier in this save, is
     skipped; every other chunk is encoded into the current segment, PUT (create-only) once it
     reaches SEGMENT_BYTES and at the end (`SegmentObjects`). Each tensor's WriteResult says
     where its new chunks live (PLACED: key -> pack, offset, length, raw size, base).
  4. finish, coordinator: one stat per reported pack, then the session indexes the placed
     objects at its commit (WriteSession.adopt_packed); a chunk placed by no rank must be one
     the session holds as stored (`adopt_segments`).
Deltas are refused for bucket stores for now: a rank would read its bases back from segments.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from torch.distributed.checkpoint.storage import WriteResult

from cas.codecs import CodecPolicy
from cas.errors import CasError, MissingObjectError
from cas.crypt import namer_of
from cas.objectstore import WriteSession
from cas.packs import PackEntry, PackFiles, salt_entry

from ..location import SEGMENT_BYTES, Location

KNOWN = "cas_known"  # rank -> coordinator: the chunk keys of the rank's last save into the store
STORED = "cas_stored"  # coordinator -> rank: those of them (or of the seed) the store holds
FOR_STEP = "cas_step"
PLACED = "placed"  # in a tensor's WriteResult: {chunk key: [pack, offset, length, raw size, base]}
MAX_STORES = 4  # stores a process remembers its last save's keys of

_last: dict[str, list[bytes]] = {}  # store URL -> chunk keys of this process's last save into it
_lock = threading.Lock()


def proposal(url: str) -> dict:
    with _lock:
        return {KNOWN: list(_last.get(url, ()))}


def remember(url: str, results: list[WriteResult]) -> None:
    """Keep the chunk keys of this rank's save, for the next one's proposal."""
    keys = [k for wr in results if isinstance(wr.storage_data, dict)
            for k in wr.storage_data.get("chunks", ())]
    with _lock:
        _last.pop(url, None)
        _last[url] = list(dict.fromkeys(keys))
        while len(_last) > MAX_STORES:
            _last.pop(next(iter(_last)))


def forget(url: str) -> None:
    with _lock:
        _last.pop(url, None)


def confirm(storage_data, step: int, hold: Callable[[list], list[bool]], seed: Callable[[], list[bytes]]) -> dict:
    """The coordinator's answer to one rank's proposal: `hold(keys)` holds them and says which
    are stored; a rank none of whose keys is stored gets `seed()`'s keys confirmed instead."""
    keys = storage_data.get(KNOWN) if isinstance(storage_data, dict) else None
    keys = [k for k in keys if isinstance(k, bytes) and len(k) == 32] if isinstance(keys, list) else []
    stored = [k for k, ok in zip(keys, hold(keys)) if ok] if keys else []
    if not stored:
        keys = seed()
        stored = [k for k, ok in zip(keys, hold(keys)) if ok] if keys else []
    return {FOR_STEP: step, STORED: stored}


def confirmed(storage_data, step: int) -> set[bytes]:
    """The keys the coordinator confirmed stored for the save of `step` (none for a plan that
    carries no answer for it: a plan cached by the planner writes every chunk)."""
    if not isinstance(storage_data, dict) or storage_data.get(FOR_STEP) != step:
        return set()
    keys = storage_data.get(STORED)
    return {k for k in keys if isinstance(k, bytes)} if isinstance(keys, list) else set()


class SegmentObjects:
    """What a rank writes through in a bucket store: segments of encoded chunks, PUT by the
    thread that fills one. `stored`: the keys the coordinator confirmed (held until its commit)."""

    def __init__(self, location: Location, *, compress: bool, level: int, workers: int,
                 stored: set[bytes], key=None) -> None:
        self.config = location.read_config()
        location.unlock(self.config, key)  # an encrypted store: segments sealed, names keyed
        self.packs = PackFiles(location.backend)
        self.namer = namer_of(location.backend)
        self.codec = CodecPolicy(compress=compress, level=level)
        self.workers = workers
        self.stored = stored
        self.placed: dict[bytes, list] = {}  # key -> [pack, offset, length, raw size, base]
        self.replacements: dict[bytes, str] = {}  # none in a bucket: write_rank_items reports them
        self.written: dict[bytes, bytes] = {}  # deltas written: none
        self._seen: set[bytes] = set()
        self._pending: list[tuple[bytes, bytes, int, None]] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def put_chunk(self, view: np.ndarray, group: int, base: tuple | None = None) -> bytes:
        """Hash one chunk and add it to the current segment unless it is stored or written."""
        key = self.namer.key(view)
        with self._lock:
            known = key in self._seen or key in self.stored
            self._seen.add(key)
        if known:
            return key
        enc = self.codec.encode(view, group, None, None)
        blob = b"".join(bytes(p) for p in enc.parts)
        with self._lock:
            self._pending.append((key, blob, view.nbytes, None))
            self._pending_bytes += len(blob)
            batch = self._take() if self._pending_bytes >= SEGMENT_BYTES else None
        if batch:
            self._write(batch)
        return key

    def _take(self) -> list:
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        return batch

    def _write(self, batch: list) -> None:
        # salted: a rank has no cache to tell it which pack names a gc deleted, and a segment of
        # chunks saved before in the same order would take one (cas.packs salt_entry)
        pack, placed = self.packs.write([*batch, salt_entry(self.codec, self.namer)])  # one create-only PUT
        with self._lock:
            for (key, offset, length), (_, _, raw_size, base) in zip(placed, batch):
                self.placed[key] = [pack, offset, length, raw_size, base]

    def sync(self) -> None:
        """PUT the last segment."""
        with self._lock:
            batch = self._take()
        if batch:
            self._write(batch)

    def report(self, results: list[WriteResult]) -> None:
        """Say in each tensor's WriteResult where its chunks written by this rank live."""
        for wr in results:
            data = wr.storage_data
            if isinstance(data, dict) and "chunks" in data:
                data[PLACED] = {k: self.placed[k] for k in data["chunks"] if k in self.placed}


def placements(results: list[list[WriteResult]]) -> dict[bytes, dict[bytes, PackEntry]]:
    """pack -> {key: its entry} of every chunk the ranks report placed (the first report of a
    key placed twice, by two ranks, wins; the other copy is gc's)."""
    out: dict[bytes, dict[bytes, PackEntry]] = {}
    seen: set[bytes] = set()
    for rank_results in results:
        for wr in rank_results:
            placed = wr.storage_data.get(PLACED, {}) if isinstance(wr.storage_data, dict) else {}
            if not isinstance(placed, dict):
                raise CasError(f"a rank reported malformed chunk placements for {wr.index.fqn!r}")
            for key, where in placed.items():
                entry = _entry(key, where, wr.index.fqn)
                if key not in seen:
                    seen.add(key)
                    out.setdefault(where[0], {})[key] = entry
    return out


def _entry(key, where, fqn: str) -> PackEntry:
    try:
        pack, offset, length, raw_size, base = where
        if not (isinstance(key, bytes) and len(key) == 32 and isinstance(pack, bytes) and len(pack) == 32
                and all(type(n) is int for n in (offset, length, raw_size))
                and (base is None or isinstance(base, bytes) and len(base) == 32)):
            raise ValueError
    except (TypeError, ValueError):
        raise CasError(f"a rank reported a malformed chunk placement for {fqn!r}") from None
    return PackEntry(key, offset, length, raw_size, base)


def adopt_segments(session: WriteSession, chunk_keys: list[bytes], results: list[list[WriteResult]]) -> None:
    """Index every chunk the ranks placed in segments (one stat per pack), and check that each
    other chunk of the manifest is one the session holds as stored."""
    by_pack = placements(results)
    for pack, entries in by_pack.items():
        session.adopt_packed(pack, list(entries.values()))
    placed = {k for entries in by_pack.values() for k in entries}
    rest = [k for k in chunk_keys if k not in placed]
    missing = [k for k, ok in zip(rest, session.hold(rest)) if not ok] if rest else []
    if missing:
        raise MissingObjectError(f"{len(missing)} chunk(s) a rank skipped as stored are not in the store",
                                 key=missing[0].hex())
