"""Content-addressed objects over the index and the backends: lookups, reads that decode and
verify along delta chains, and the door to writing (`session()`, a WriteSession of
cas/session.py, which holds the write protocol).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .chains import MAX_CHAIN_DECODE, decode_chain, walk_chain
from .codecs import CodecPolicy, Header, parse_header
from .crypt import namer_of
from .errors import CorruptionError, MissingObjectError
from .index import WHERE_FILE, WHERE_PACK, Index, ObjectRecord
from .backend import Backend
from .buffers import ThreadBuffer
from .objectfiles import FileObjects
from .packs import PACK_TARGET, STREAM_TARGET, PackFiles
from .readahead import SMALL as SMALL_READ
from .leases import LEASE_PREFIX, begin_lease, lease_name
from .session import WriteSession

__all__ = ["DEFAULT_PACK_MAX", "LEASE_PREFIX", "MAX_CHAIN_DECODE", "ObjectStore", "WriteSession", "begin_lease",
           "lease_name"]

DEFAULT_PACK_MAX = None  # None: every object goes into packs; N: encoded objects above N bytes get files
HEADER_READ = 256  # bytes of an object that hold its codec header (a delta's base key and shift included)
RECHAIN_ATTEMPTS = 3  # decodes of an object along a chain looked up again because it moved meanwhile


_local = threading.local()


def _read_buffer(nbytes: int) -> memoryview:
    """A per-thread reusable read buffer. What fetch() returns in it is valid until the same
    thread's next fetch: decoding consumes it before it resolves a delta's base. It comes from
    the process's buffer pool and goes back when the thread ends (a store's pool threads are
    new for each open store; fresh memory is slow to touch here)."""
    held = getattr(_local, "read", None)
    if held is None or len(held.buf) < nbytes:
        held = _local.read = ThreadBuffer(max(nbytes, 1 << 20))
    return held.view


class ObjectStore:
    def __init__(self, index: Index, files: FileObjects, packs: PackFiles, codec: CodecPolicy,
                 pack_max: int | None = DEFAULT_PACK_MAX, backend: Backend | None = None,
                 pack_target: int = PACK_TARGET, stream_target: int = STREAM_TARGET) -> None:
        self.index = index
        self.files = files
        self.packs = packs
        self.codec = codec
        self.pack_max = pack_max  # None: no object files; large objects are streamed into packs
        self.stream_target = stream_target  # a streamed pack is closed past this
        self.pack_target = pack_target  # a writer starts a new pack (a segment, in a bucket) past this
        # In an object store blobs are immutable and only gc deletes them, so an indexed pack
        # entry is trusted without asking the store per object (a HEAD each would cost an
        # unchanged re-save one request per chunk); a local pack is checked, one stat each.
        self.trust_packs = backend is not None and not backend.capabilities.batched_sync
        self.backend = backend  # where writers' leases live (None: leases in the index alone)
        self.namer = namer_of(packs.backend)  # how this store names objects (keyed when encrypted)
        # called when an object is not where the index says (a store shared by hosts, or a
        # private cache: the caller's cache catches up with the gc or recode that moved it, then
        # the record is looked up again)
        self.on_missing: Callable[[bytes, ObjectRecord | None], None] | None = None
        self.open_sessions = 0  # write sessions not yet committed or aborted (the index must not change under them)
        self.sessions_lock = threading.Lock()
        # lease files of this object's own sessions: their holds go to this very index, but a
        # session takes its file just before its index lease and drops it just after, and gc
        # must not take either moment for a writer whose holds it cannot see (gc/collect.py)
        self.own_lease_files: set[str] = set()

    def record(self, key: bytes) -> ObjectRecord | None:
        with self.index.read() as txn:
            return self.index.record(txn, key)

    def fetch(self, key: bytes):
        """The encoded bytes of an object, wherever it lives (a file object's in a per-thread
        buffer, valid until this thread's next fetch); MissingObjectError if nowhere."""
        for attempt in range(2):
            rec = self.record(key)
            try:
                if rec is None or rec.where == WHERE_FILE:
                    return self.files.get(key, _read_buffer)
                return self.packs.read(rec.pack, rec.offset, rec.stored_size, key, _read_buffer, ahead=True)
            except MissingObjectError:
                # gc may have repacked it, or a recode moved it into a new pack, between our lookup
                # and the read: look again (a cache no writer keeps first learns where it went)
                if attempt:
                    raise
                if self.on_missing is not None:
                    self.on_missing(key, rec)
                if self.record(key) == rec:
                    raise
        raise AssertionError("unreachable")

    def get(self, key: bytes, out: np.ndarray | None = None, *, verify: bool = True,
            chain: list[bytes] | None = None, decoded: dict[bytes, np.ndarray] | None = None) -> np.ndarray:
        """Decoded raw bytes of an object (into `out` when given), checked against its hash
        unless verify=False. A delta is decoded from the bottom of its chain up (`chain`, when
        the caller looked it up already), each level applied in place in the one output
        buffer, starting from the highest base found in `decoded` (bases a load shares between
        chunks, decoded once). Only the top is hash-checked on the way (a wrong base makes a
        wrong result, which that check refuses); only then is the chain decoded again with
        every level checked, to name the damaged object."""
        chain = chain or self.chain(key)
        for attempt in range(RECHAIN_ATTEMPTS):
            try:
                return self._decode_chain(chain, out, verify=verify, check_each=False, decoded=decoded or {})
            except CorruptionError:
                # a recode (store/recode.py) may have moved an object of the chain to a delta
                # encoding since the chain was looked up: decode along the chain the index has now
                fresh = self.chain(key)
                if fresh == chain:
                    break
                chain = fresh
        if len(chain) == 1 or not verify:
            return self._decode_chain(chain, out, verify=verify, check_each=False, decoded={})
        return self._decode_chain(chain, out, verify=True, check_each=True, decoded={})

    def chain(self, key: bytes) -> list[bytes]:
        """[key, its base, the base's base, ...] down to a full object, from the index (or from
        the object's own header when the index does not know it)."""
        return self.chains([key])[key]

    def chains(self, keys) -> dict[bytes, list[bytes]]:
        """chain() of many keys, looked up in one index transaction."""
        out: dict[bytes, list[bytes]] = {}
        with self.index.read() as txn:
            def indexed_base(key: bytes) -> bytes | None:
                rec = self.index.record(txn, key)
                return rec.base if rec is not None else None
            for key in keys:
                out[key] = walk_chain([key], indexed_base)
            unknown = [c for c in out.values() if self.index.record(txn, c[-1]) is None]
        for chain in unknown:  # not indexed (a store being repaired): the headers say
            walk_chain(chain, self._header_base)
        return out

    def _header_base(self, key: bytes) -> bytes | None:
        try:
            return parse_header(self.fetch(key), key=key).base
        except CorruptionError:
            return None  # decoding it reports the problem, naming the object

    def _decode_chain(self, chain: list[bytes], out: np.ndarray | None, *, verify: bool,
                      check_each: bool, decoded: dict[bytes, np.ndarray]) -> np.ndarray:
        return decode_chain(chain, self.fetch, out, verify=verify, check_each=check_each, decoded=decoded,
                            namer=self.namer)

    def header_at(self, key: bytes, rec: ObjectRecord) -> Header:
        """The codec header of the copy of `key` that `rec` places (a pack entry or its file),
        read alone: which kind of delta a copy is, without decoding it."""
        return parse_header(self.head(key, rec), key=key)

    def head(self, key: bytes, rec: ObjectRecord, nbytes: int = HEADER_READ):
        """The first `nbytes` of the copy `rec` places, read alone. A small object's comes with
        its window in a bucket (cas/readahead.py): small objects lie side by side in packs and
        a pass over heads reads their neighbours next; a large one's is read alone (chunks' heads
        are megabytes apart)."""
        if rec.where == WHERE_PACK:
            return self.packs.read(rec.pack, rec.offset, min(rec.stored_size, nbytes), key,
                                   ahead=rec.stored_size <= SMALL_READ)
        return self.files.head(key, nbytes)

    def codec_of(self, key: bytes) -> str:
        return parse_header(self.fetch(key), key=key).codec_name

    def session(self, purpose: str) -> "WriteSession":
        with self.sessions_lock:
            self.open_sessions += 1
        try:
            return WriteSession(self, purpose)
        except BaseException:
            self.session_ended()
            raise

    def session_ended(self) -> None:
        with self.sessions_lock:
            self.open_sessions -= 1
