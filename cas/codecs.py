"""Object encoding: a small fixed header naming the codec stages, then the payload.

Stages are applied in the order the header lists them when encoding and in reverse when
decoding, so a new stage (an XOR delta against a base object, say) slots in without a format
break. Decoding always ends by checking blake3 of the result against the object's key: a
wrong byte is an error, never data. See docs/format.md, "Object encoding".
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zstandard

from .errors import CorruptionError, FormatVersionError
from .hashing import KEY_SIZE, hash_bytes, to_hex

MAGIC = b"caso"
OBJECT_FORMAT = 1
_HEADER = struct.Struct("<4sBBQ")  # magic, object format, number of stages, raw size
_STAGE = struct.Struct("<BB")  # stage id, stage argument

STAGE_BYTEGROUP = 1  # argument: element size; byte k of every element, for k = 0..size-1
STAGE_ZSTD = 2  # argument: the level it was written with (informational)
STAGE_XOR = 3  # argument 0; the 32-byte key of the base object follows the stage entry
STAGE_NAMES = {STAGE_BYTEGROUP: "bytegroup", STAGE_ZSTD: "zstd", STAGE_XOR: "xor"}
DELTA_MARGIN = 0.9  # a delta is kept only when its sample codes to under 90% of the plain sample

MAX_OBJECT_RAW = 1 << 31  # refuse headers that claim more; chunks and nodes are far smaller
MAX_STAGES = 4
SAMPLE_BYTES = 64 << 10  # compress this much first; skip zstd when the sample does not shrink
SAMPLE_MAX_RATIO = 0.97

_local = threading.local()


def _zstd_c(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: zstd contexts are not thread-safe, and reusing
    one keeps its working memory warm."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _zstd_d() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _scratch(nbytes: int, slot: str = "scratch") -> np.ndarray:
    """A per-thread reusable byte buffer: fresh large allocations are slow on this kind of VM."""
    buf = getattr(_local, slot, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def group_bytes(raw: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """Byte k of every element together, for each k: floats' sign/exponent bytes compress well
    once they are next to each other. `raw.size` must be a multiple of `element_size`."""
    planes = out.reshape(element_size, -1)
    elements = raw.reshape(-1, element_size)
    for k in range(element_size):  # one strided pass per plane: ~4 GB/s, 3x numpy's .T copy
        planes[k] = elements[:, k]
    return out


def ungroup_bytes(grouped: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """Inverse of group_bytes, written straight into `out` (restore's hot loop)."""
    planes = grouped.reshape(element_size, -1)
    elements = out.reshape(-1, element_size)
    for k in range(element_size):
        elements[:, k] = planes[k]
    return out


@dataclass(frozen=True)
class Encoded:
    """An encoded object: [header, payload] parts (written without concatenating), and the key
    of the base object when it was coded as a delta."""

    parts: list
    base: bytes | None = None

    @property
    def size(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


@dataclass(frozen=True)
class CodecPolicy:
    """How new objects are encoded. Recorded per object in its header, so it may change freely."""

    compress: bool = True
    level: int = 1  # measured: after byte grouping level 3 is no smaller and 1.3-1.9x slower

    def encode(self, raw, element_size: int = 1, base: tuple[bytes, np.ndarray] | None = None) -> Encoded:
        """Encode raw bytes. `element_size` > 1 asks for byte grouping (floating dtypes). With
        `base` = (key, raw bytes of the same size), the XOR against it is coded instead when a
        sample says that is smaller by a margin. Raw storage when nothing compresses."""
        view = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        n = view.size
        if not self.compress or n == 0:
            return Encoded([_header(n, ()), view])
        group = element_size if element_size > 1 and n % element_size == 0 else 0
        sampled = n > 2 * SAMPLE_BYTES
        plain_sample = self._sample_size(view, group) if sampled or base is not None else None
        if base is not None and base[1].size == n:
            delta_sample = self._sample_size(view, group, base[1])
            if delta_sample < DELTA_MARGIN * plain_sample:
                xored = np.bitwise_xor(view, base[1], out=_scratch(n, "xor"))
                packed = self._pack(xored, group)
                if len(packed) < n:
                    stages = ((STAGE_XOR, 0),) + (((STAGE_BYTEGROUP, group),) if group else ()) + ((STAGE_ZSTD, self.level),)
                    return Encoded([_header(n, stages, base[0]), packed], base[0])
        if sampled and plain_sample >= SAMPLE_MAX_RATIO * min(n, SAMPLE_BYTES):
            return Encoded([_header(n, ()), view])
        packed = self._pack(view, group)
        if len(packed) >= n:
            return Encoded([_header(n, ()), view])
        stages = (((STAGE_BYTEGROUP, group),) if group else ()) + ((STAGE_ZSTD, self.level),)
        return Encoded([_header(n, stages), packed])

    def _pack(self, data: np.ndarray, group: int) -> bytes:
        if group:
            data = group_bytes(data, group, _scratch(data.size))
        return _zstd_c(self.level).compress(data)

    def _sample_size(self, view: np.ndarray, group: int, base: np.ndarray | None = None) -> int:
        """Compressed size of the first SAMPLE_BYTES (XORed with the base's when given)."""
        end = min(view.size, SAMPLE_BYTES)
        end -= end % max(group, 1)
        sample = view[:end] if base is None else np.bitwise_xor(view[:end], base[:end])
        if group:
            sample = group_bytes(sample, group, np.empty(sample.size, dtype=np.uint8))
        return len(_zstd_c(self.level).compress(sample))


def _header(raw_size: int, stages: tuple, base: bytes | None = None) -> bytes:
    head = _HEADER.pack(MAGIC, OBJECT_FORMAT, len(stages), raw_size)
    for sid, arg in stages:
        head += _STAGE.pack(sid, arg) + (base if sid == STAGE_XOR else b"")
    return head


@dataclass(frozen=True)
class Header:
    raw_size: int
    stages: tuple  # ((stage id, argument), ...) in encoding order
    payload_offset: int
    base: bytes | None = None  # the base object's key, for an XOR delta

    @property
    def codec_name(self) -> str:
        return "+".join(f"{STAGE_NAMES[s]}{a if s == STAGE_BYTEGROUP else ''}" for s, a in self.stages) or "raw"


def parse_header(data, *, key: bytes | None = None) -> Header:
    """Read and bound-check an object header; every problem is a CorruptionError naming the key."""
    name = to_hex(key) if key else None
    if len(data) < _HEADER.size:
        raise CorruptionError(f"object is truncated ({len(data)} bytes, header needs {_HEADER.size})", key=name)
    magic, fmt, nstages, raw_size = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptionError("object does not start with the cas object magic", key=name)
    if fmt != OBJECT_FORMAT:
        raise FormatVersionError(f"object {name} has object format {fmt}; this cas reads format {OBJECT_FORMAT}")
    if nstages > MAX_STAGES or raw_size > MAX_OBJECT_RAW:
        raise CorruptionError(f"object header is implausible ({nstages} stages, {raw_size} raw bytes)", key=name)
    offset = _HEADER.size
    stages, base = [], None
    for _ in range(nstages):
        if len(data) < offset + _STAGE.size:
            raise CorruptionError("object is truncated inside its header", key=name)
        sid, arg = _STAGE.unpack_from(data, offset)
        offset += _STAGE.size
        if sid not in STAGE_NAMES:
            raise CorruptionError(f"object names unknown codec stage {sid}", key=name)
        if sid == STAGE_BYTEGROUP and (arg < 2 or raw_size % arg):
            raise CorruptionError(f"object has an invalid byte-group size {arg}", key=name)
        if sid == STAGE_XOR:
            if base is not None or stages or len(data) < offset + KEY_SIZE:
                raise CorruptionError("object has a malformed delta stage", key=name)
            base = bytes(data[offset:offset + KEY_SIZE])
            offset += KEY_SIZE
        stages.append((sid, arg))
    return Header(raw_size, tuple(stages), offset, base)


def _decompress_into(payload, dest: np.ndarray, name: str) -> None:
    """Decompress one zstd frame into `dest`, which must be filled exactly: no fresh allocation
    per object (fresh memory is slow to touch on this kind of VM), and a frame that holds more
    or less than the header says is refused."""
    view = memoryview(dest)
    filled = 0
    with _zstd_d().stream_reader(payload, read_across_frames=False) as reader:
        while filled < dest.size:
            n = reader.readinto(view[filled:])
            if n == 0:
                break
            filled += n
        extra = reader.read(1)
    if filled != dest.size or extra:
        raise CorruptionError(f"object payload decodes to {'more' if extra else filled} bytes, header says "
                              f"{dest.size}", key=name)


def decode_into(data, key: bytes, out: np.ndarray | None = None,
                resolve_base: Callable[[bytes, int], np.ndarray] | None = None, *, verify: bool = True) -> np.ndarray:
    """Decode an encoded object into `out` (a uint8 array of its raw size, allocated if None)
    and check the result's blake3 against `key` (unless verify=False: only for a delta's base,
    whose errors the delta's own check catches). A delta needs `resolve_base(key, size)`, which
    returns the base's verified raw bytes. Raises CorruptionError, never returns bad data."""
    name = to_hex(key)
    head = parse_header(data, key=key)
    if out is None:
        out = np.empty(head.raw_size, dtype=np.uint8)
    elif out.size != head.raw_size:
        raise CorruptionError(f"object holds {head.raw_size} bytes where {out.size} were expected", key=name)
    payload = memoryview(data)[head.payload_offset:]
    stages = list(head.stages)
    try:
        grouped = len(stages) >= 2 and stages[-2][0] == STAGE_BYTEGROUP
        if stages and stages[-1][0] == STAGE_ZSTD:
            stages.pop()
            # straight into `out`, or into a reused buffer when planes must be interleaved after
            plain = _scratch(head.raw_size, "unzstd") if grouped else out
            _decompress_into(payload, plain, name)
        elif len(payload) != head.raw_size:
            raise CorruptionError(f"object payload holds {len(payload)} bytes, header says {head.raw_size}", key=name)
        else:
            plain = np.frombuffer(payload, dtype=np.uint8)
        if stages and stages[-1][0] == STAGE_BYTEGROUP:
            ungroup_bytes(plain, stages.pop()[1], out)
        elif plain is not out:
            out[:] = plain
        if stages and stages[-1][0] == STAGE_XOR:
            stages.pop()
            if resolve_base is None:
                raise CorruptionError("object is a delta but no base can be read here", key=name)
            base = resolve_base(head.base, head.raw_size)
            if base.size != head.raw_size:
                raise CorruptionError(f"delta base {to_hex(head.base)} has {base.size} bytes, not {head.raw_size}",
                                      key=name)
            np.bitwise_xor(out, base, out=out)
        if stages:
            raise CorruptionError(f"object has codec stages in an order we cannot decode: {head.codec_name}", key=name)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"object's zstd payload is damaged: {exc}", key=name) from None
    if verify and hash_bytes(out) != key:
        raise CorruptionError("object content does not match its hash", key=name)
    return out
