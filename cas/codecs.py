"""Object encoding: a small fixed header naming the codec stages, then the payload.

Stages are applied in the order the header lists them when encoding and in reverse when
decoding, so a new stage (a delta against a base object, say) slots in without a format
break. Decoding always ends by checking blake3 of the result against the object's key: a
wrong byte is an error, never data. See docs/format.md, "Object encoding".
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from .errors import CasError, CorruptionError, FormatVersionError
from .hashing import KEY_SIZE, PLAIN, Namer, to_hex
from .transforms import (INTEGER_SIZES, group_bytes, group_planes, linear_prediction, motion_of, scratch, sub_delta,
                         undo_sub_delta, ungroup_bytes)

MAGIC = b"caso"
OBJECT_FORMAT = 3  # the newest written; each object is written with the oldest format that reads it
OBJECT_FORMATS = (1, 2, 3)  # 2 introduced the `sub` stage, 3 the `linear` stage
_HEADER = struct.Struct("<4sBBQ")  # magic, object format, number of stages, raw size
_STAGE = struct.Struct("<BB")  # stage id, stage argument

STAGE_BYTEGROUP = 1  # argument: element size; byte k of every element, for k = 0..size-1
STAGE_ZSTD = 2  # argument: the level it was written with, a signed byte (informational; `_level_field`)
STAGE_XOR = 3  # argument 0; the 32-byte key of the base object follows. Read only: stores made
#                before `sub` hold such deltas; new deltas are `sub`, smaller on every kind measured
STAGE_SUB = 4  # argument: element size; zigzag(raw - base) per element; the base key follows
STAGE_LINEAR = 5  # argument: element size; zigzag(raw - prediction), the prediction extrapolating
#                   the base's own delta (`linear_prediction`). The base key follows, then the shift
STAGE_NAMES = {STAGE_BYTEGROUP: "bytegroup", STAGE_ZSTD: "zstd", STAGE_XOR: "xor", STAGE_SUB: "sub",
               STAGE_LINEAR: "linear"}
STAGE_FORMAT = {STAGE_SUB: 2, STAGE_LINEAR: 3}  # the object format that introduced a stage (else 1)
DELTA_STAGES = (STAGE_XOR, STAGE_SUB, STAGE_LINEAR)
# Extrapolation steps tried per chunk (1: the base moves as much again; 1/2: half as much). Measured
# by bench/bench_delta.py (AdamW, every 10 steps, chains of 4; bytes / torch.save): fp32 state
# 0.724 -> 0.719, bf16 weights 0.456 -> 0.448; offline, other fractions or 1.5 gained nothing.
LINEAR_SHIFTS = (0, 1)
MAX_LINEAR_SHIFT = 7
DELTA_MARGIN = 0.9  # a delta is kept only when its sample codes to under 90% of the plain sample

ZSTD_MIN_LEVEL = -(1 << 17)  # zstd's fastest "fast" level (ZSTD_minCLevel); python-zstandard takes any lower as it
ZSTD_MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL
MAX_OBJECT_RAW = 1 << 31  # refuse headers that claim more; chunks and nodes are far smaller
MAX_STAGES = 4
SAMPLE_BYTES = 64 << 10  # compress this much first; skip zstd when the sample does not shrink
SAMPLE_MAX_RATIO = 0.97
SAMPLE_PIECES = 4

_local = threading.local()


# zstd parameters for byte-grouped floats at level 1 (the default). A float's sign/exponent plane
# has few distinct bytes and almost no repeats longer than a few bytes: level 1's short matches
# cost time on both sides and gain nothing over coding the bytes as Huffman literals. A tiny
# hash table and min_match 7 find almost none of them (runs of zeros still, as repeat matches).
# Measured per 4 MiB chunk, one thread (bench/bench_profile.py --codec): randn fp32 exponent plane
# 0.337 of raw in 1.4-2.0 ms against 0.366 in 4.9 ms; decoding it 0.6 ms against 4.6 ms. Only a
# block repeated whole far inside one chunk codes worse (0.096 against 0.013 of raw).
FLOAT_ZSTD = dict(hash_log=6, min_match=7, search_log=1)


def _zstd_c(level: int, floats: bool = False) -> zstandard.ZstdCompressor:
    """One compressor per thread, level and kind: zstd contexts are not thread-safe, and reusing
    one keeps its working memory warm."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    slot = (level, floats and level == 1)
    if slot not in cache:
        if slot[1]:
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=1, write_checksum=0,
                                                                    **FLOAT_ZSTD)
            cache[slot] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[slot] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[slot]


def _zstd_d() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


@dataclass(frozen=True)
class Encoded:
    """An encoded object: [header, payload] parts (written without concatenating), and the key
    of the base object when it was coded as a delta."""

    parts: list
    base: bytes | None = None

    @property
    def size(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


def can_delta(element_size: int) -> bool:
    """Whether elements of this size may be coded as deltas: `sub` and `linear` work on 1-, 2-, 4-
    and 8-byte integers, so wider ones (numpy float128, complex256) are written whole."""
    return element_size in INTEGER_SIZES


def checked_level(level) -> int:
    """A zstd level zstd accepts, refused when a store is opened rather than at every save."""
    if type(level) is not int or not ZSTD_MIN_LEVEL <= level <= ZSTD_MAX_LEVEL:
        raise CasError(f"compression_level must be a zstd level, an int from {ZSTD_MIN_LEVEL} to {ZSTD_MAX_LEVEL} "
                       f"(negative levels are zstd's fast ones), got {level!r}")
    return level


def _level_field(level: int) -> int:
    """The zstd stage's header argument: the level as a signed byte (two's complement), levels
    below -128 written as -128. Readers ignore it; it says how an object was written."""
    return max(level, -128) & 0xFF


@dataclass(frozen=True)
class CodecPolicy:
    """How new objects are encoded. Recorded per object in its header, so it may change freely."""

    compress: bool = True
    level: int = 1  # measured: after byte grouping level 3 is no smaller and 1.3-1.9x slower

    def __post_init__(self) -> None:
        checked_level(self.level)

    def encode(self, raw, element_size: int = 1, base: tuple[bytes, np.ndarray] | None = None,
               below: np.ndarray | None = None, margin: float = DELTA_MARGIN, floats: bool = True) -> Encoded:
        """Encode raw bytes. `element_size` > 1 asks for byte grouping (floating dtypes). With
        `base` = (key, raw bytes of the same size), the difference from it (`sub_delta`) is
        coded instead when a sample says that is smaller by a margin; with `below` too (the raw
        bytes of the base's own delta base: the base must be a delta of exactly that), so may
        the difference from a `linear_prediction`, whichever samples smallest. Raw storage
        when nothing compresses. floats=False codes a whole grouped object with zstd's own
        level-1 parameters instead of FLOAT_ZSTD (slower both ways; smaller for some states:
        the recode's keyframes, which are read rarely)."""
        view = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        n = view.size
        if not self.compress or n == 0:
            return Encoded([_header(n, ()), view])
        group = element_size if element_size > 1 and n % element_size == 0 else 0
        sampled = n > 2 * SAMPLE_BYTES
        planes = None  # per byte plane of the sample: whether zstd shrinks it (grouped and sampled only)
        plain_sample = None
        if sampled or base is not None:
            plain_sample, planes = self._sample_planes(view, group)
        if base is not None and base[1].size == n and can_delta(group or 1):
            shift, delta_sample = self._best_prediction(view, group or 1, base[1], below)
            # against the whole sample coded as the delta's is (plane by plane it is smaller, which
            # kept chunks whole that a delta shrinks)
            if delta_sample < margin * self._sample_size(view, group, floats=False):
                reference = base[1]
                if shift is not None:
                    motion = motion_of(base[1], below, group or 1, scratch(n, "prediction"))
                    reference = linear_prediction(base[1], motion, group or 1, shift, motion)
                delta = sub_delta(view, reference, group or 1, scratch(n, "delta"))
                # zstd's own level-1 parameters: a delta's planes are small integers with long
                # zero runs, not floats (FLOAT_ZSTD made fp32 deltas 2-3 points larger)
                packed = self._pack(delta, group, floats=False)
                if len(packed) < n:
                    first = (STAGE_SUB, group or 1) if shift is None else (STAGE_LINEAR, group or 1)
                    stages = (first,) + self._packed_stages(group)
                    return Encoded([_header(n, stages, base[0], shift), packed], base[0])
        if sampled and plain_sample >= SAMPLE_MAX_RATIO * min(n, SAMPLE_BYTES):
            return Encoded([_header(n, ()), view])
        header = _header(n, self._packed_stages(group))
        if group and sampled and planes is not None and not all(planes):
            parts = self._pack_planes(view, group, planes, header, floats)
        else:
            parts = [header, self._pack(view, group, floats)]
        if parts is None or _size(parts) - len(header) >= n:
            return Encoded([_header(n, ()), view])
        return Encoded(parts)

    def plain_params_sample_smaller(self, raw, element_size: int) -> bool:
        """Whether a sample of a whole float object codes smaller with zstd's own level-1
        parameters than with FLOAT_ZSTD (encode(floats=False) vs the default): two 64 KiB
        compressions that spare a recode full encodes that would not pay (weights mostly)."""
        view = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        group = element_size if element_size > 1 and view.size % element_size == 0 else 0
        if not self.compress or not group or self.level != 1:
            return False
        return self._sample_size(view, group, floats=False) < self._sample_size(view, group)

    def _packed_stages(self, group: int) -> tuple:
        """The header stages of what `_pack` makes: [bytegroup,] zstd."""
        return (((STAGE_BYTEGROUP, group),) if group else ()) + ((STAGE_ZSTD, _level_field(self.level)),)

    def _pack(self, data: np.ndarray, group: int, floats: bool = True) -> bytes:
        if group:
            data = group_bytes(data, group, scratch(data.size))
        return _zstd_c(self.level, floats=floats and bool(group)).compress(data)

    def _pack_planes(self, data: np.ndarray, group: int, planes: list, header: bytes,
                     floats: bool = True) -> list | None:
        """The object (`header`, then one zstd frame holding the grouped bytes) in which only the
        planes from the first to the last that `planes` marks compressible go through zstd; the
        planes outside that run (a float's low mantissa bytes: random, 1.000 of raw) become raw
        blocks of the same frame. Any zstd decoder reads the frame (older cas too); a raw block
        decodes as a copy. When the run ends the object (the usual case: a float's sign/exponent
        plane is its last), the raw planes are grouped straight into their blocks and the whole
        object is one buffer, which an encrypted store seals in single calls (`_framed`).
        None: nothing shrinks."""
        marked = [k for k, ok in enumerate(planes) if ok]
        if not marked:
            return None
        plane = data.size // group
        lo, hi = marked[0] * plane, (marked[-1] + 1) * plane
        cctx = _zstd_c(self.level, floats=floats)
        if lo and hi == data.size:
            run_planes = scratch(hi - lo)
            rows = run_planes.reshape(group - marked[0], plane)
            group_planes(data, group, {k: [(0, rows[k - marked[0]])] for k in range(marked[0], group)})
            framed = _framed(cctx.compress(run_planes), data, group, lo, header)
            if framed is not None:
                return [framed]
        grouped = group_bytes(data, group, scratch(data.size))
        run = cctx.compress(grouped[lo:hi])
        spliced = _splice_frame(run, memoryview(grouped), lo, hi)
        if spliced is None:  # a frame shape we do not splice: the planes as one ordinary frame
            return [header, cctx.compress(grouped)]
        return [header] + spliced

    def _best_prediction(self, view: np.ndarray, element_size: int, base: np.ndarray,
                         below: np.ndarray | None) -> tuple[int | None, int]:
        """(shift, sample size) of the smallest-sampling reference: the base itself (shift None)
        or, given the base's base, a linear prediction with each of LINEAR_SHIFTS."""
        group = element_size if element_size > 1 else 0
        base_sample = _spread_sample(base, element_size)
        best = (None, self._sample_size(view, group, base_sample))
        if below is not None and below.size == view.size:
            motion = motion_of(base_sample, _spread_sample(below, element_size), element_size,
                               np.empty_like(base_sample))
            for shift in LINEAR_SHIFTS:
                guess = linear_prediction(base_sample, motion, element_size, shift, np.empty_like(base_sample))
                size = self._sample_size(view, group, guess)
                if size < best[1]:
                    best = (shift, size)
        return best

    def _sample_planes(self, view: np.ndarray, group: int) -> tuple[int, list | None]:
        """(compressed size of the sample, per byte plane whether zstd shrinks it below
        SAMPLE_MAX_RATIO) for a grouped object; (size, None) for any other. Each plane of the
        sample is compressed alone: a float's random mantissa planes cost full zstd time
        for nothing, the sample says so in a fraction of it."""
        if not group:
            return self._sample_size(view, group), None
        sample = _spread_sample(view, group)
        grouped = group_bytes(sample, group, np.empty(sample.size, dtype=np.uint8)).reshape(group, -1)
        cctx = _zstd_c(self.level, floats=True)
        sizes = [len(cctx.compress(p)) for p in grouped]
        return sum(sizes), [size < SAMPLE_MAX_RATIO * grouped.shape[1] for size in sizes]

    def _sample_size(self, view: np.ndarray, group: int, reference: np.ndarray | None = None,
                     floats: bool = True) -> int:
        """Compressed size of a SAMPLE_BYTES sample (as a delta from `reference`, a sample of
        the same spread, when given): SAMPLE_PIECES slices spread over the object, since one end
        of a tensor can differ from the rest (an embedding's first rows are its most frequent
        tokens)."""
        sample = _spread_sample(view, max(group, 1))
        if reference is not None:
            sample = sub_delta(sample, reference, max(group, 1), np.empty_like(sample))
        if group:
            sample = group_bytes(sample, group, np.empty(sample.size, dtype=np.uint8))
        return len(_zstd_c(self.level, floats=floats and bool(group) and reference is None).compress(sample))


def _size(parts) -> int:
    return sum(memoryview(p).nbytes for p in parts)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_RAW_BLOCK = 128 << 10  # zstd's largest block
_DID_SIZES = (0, 1, 2, 4)


def _run_frame(run: bytes) -> tuple[int, int, int] | None:
    """(window size, where its blocks start, where its last block starts) of `run`, a zstd frame
    (RFC 8878) of one piece; None when it is not a plain frame of one piece (a checksum, a
    skippable frame, a reserved block type): the caller writes an ordinary frame instead."""
    if len(run) < 6 or run[:4] != _ZSTD_MAGIC:
        return None
    fhd = run[4]
    single, checksum, did, fcs_flag = fhd >> 5 & 1, fhd >> 2 & 1, fhd & 3, fhd >> 6
    pos = 5
    if single:
        window = None  # the run's content size, read below
    else:
        wd = run[pos]
        pos += 1
        wlog = 10 + (wd >> 3)
        window = (1 << wlog) + ((1 << wlog) >> 3) * (wd & 7)
    pos += _DID_SIZES[did]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size:
        fcs = int.from_bytes(run[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
        pos += fcs_size
        if window is None:
            window = fcs
    if checksum or window is None:
        return None
    blocks, last = pos, None
    while pos + 3 <= len(run):  # find the last block
        head = int.from_bytes(run[pos:pos + 3], "little")
        btype, bsize = head >> 1 & 3, head >> 3
        if btype == 3:
            return None
        last, pos = pos, pos + 3 + (1 if btype == 1 else bsize)
        if head & 1:
            break
    if last is None or pos != len(run):
        return None
    return window, blocks, last


def _frame_head(total: int, window: int) -> bytes | None:
    """The header of a frame of `total` bytes whose compressed blocks need `window`, with a
    window of at least 128 KiB (raw blocks' size); None beyond what decoders take by default."""
    wlog = max(17, (max(window, 1) - 1).bit_length())
    if wlog > 27:
        return None
    fcs_flag, fcs_size = (3, 8) if total >= 1 << 32 else (2, 4)
    return _ZSTD_MAGIC + bytes([fcs_flag << 6, (wlog - 10) << 3]) + total.to_bytes(fcs_size, "little")


def _raw_block_head(size: int, final: bool) -> bytes:
    return ((size << 3) | final).to_bytes(3, "little")


def _splice_frame(run: bytes, grouped: memoryview, lo: int, hi: int) -> list | None:
    """One zstd frame of all of `grouped`: raw blocks for [0, lo), the blocks of `run` (a frame
    of grouped[lo:hi] alone) for the run, raw blocks for [hi, end). Sound because a frame's
    first compressed block starts from the frame's initial state (repeat offsets 1, 4, 8; no
    tables to repeat) whatever raw blocks precede it, and its matches reach back only into its
    own run. None when `run` is not a frame we splice (`_run_frame`)."""
    shape = _run_frame(run)
    head = _frame_head(len(grouped), shape[0]) if shape is not None else None
    if head is None:
        return None
    _, blocks, last = shape
    total = len(grouped)
    parts: list = [head]
    view = memoryview(run)
    tail = [(hi, total)] if hi < total else []

    def raw_blocks(start: int, end: int, final: bool) -> None:
        for at in range(start, end, _RAW_BLOCK):
            size = min(_RAW_BLOCK, end - at)
            parts.append(_raw_block_head(size, final and at + size == end))
            parts.append(grouped[at:at + size])

    raw_blocks(0, lo, False)
    if tail:  # the run's last block is not the frame's
        parts.append(view[blocks:last])
        parts.append((int.from_bytes(run[last:last + 3], "little") & ~1).to_bytes(3, "little"))
        parts.append(view[last + 3:])
        raw_blocks(hi, total, True)
    else:
        parts.append(view[blocks:])
    return parts


def _framed(run: bytes, data: np.ndarray, group: int, lo: int, header: bytes) -> np.ndarray | None:
    """The whole object in one buffer: `header`, then the frame _splice_frame makes when the
    run ends the object (grouped bytes [lo, end) compressed as `run`), with the raw planes
    [0, lo) grouped from `data` straight into their raw blocks. None: a run we do not splice."""
    shape = _run_frame(run)
    head = _frame_head(data.size, shape[0]) if shape is not None else None
    if head is None:
        return None
    blocks = -(-lo // _RAW_BLOCK)
    at = len(header) + len(head)  # where the raw blocks begin
    end = at + lo + 3 * blocks
    out = scratch(end + len(run) - shape[1], "framed")
    out[:len(header)] = np.frombuffer(header, np.uint8)
    out[len(header):at] = np.frombuffer(head, np.uint8)
    for b in range(blocks):
        size = min(_RAW_BLOCK, lo - b * _RAW_BLOCK)
        out[at + b * (_RAW_BLOCK + 3):][:3] = np.frombuffer(_raw_block_head(size, False), np.uint8)
    plane = data.size // group
    group_planes(data, group, {k: _raw_block_pieces(out, at, k * plane, (k + 1) * plane) for k in range(lo // plane)})
    out[end:] = np.frombuffer(run, np.uint8, offset=shape[1])
    return out


def _raw_block_pieces(out: np.ndarray, at: int, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """Where bytes [lo, hi) of a run of raw blocks written from out[at] (3-byte block headers,
    then up to 128 KiB each) lie: (offset from lo, view) pieces, the whole blocks among them one
    2-D view of rows between the headers."""
    def place(x: int) -> int:
        return at + x // _RAW_BLOCK * (_RAW_BLOCK + 3) + 3 + x % _RAW_BLOCK

    first, last = -(-lo // _RAW_BLOCK) * _RAW_BLOCK, hi // _RAW_BLOCK * _RAW_BLOCK
    if first > last:  # inside one block
        return [(0, out[place(lo):place(lo) + hi - lo])]
    pieces = [(0, out[place(lo):place(lo) + first - lo])] if lo < first else []
    rows = (last - first) // _RAW_BLOCK
    if rows:
        start = out[place(first):]
        pieces.append((first - lo, np.lib.stride_tricks.as_strided(
            start, shape=(rows, _RAW_BLOCK), strides=(_RAW_BLOCK + 3, 1), writeable=True)))
    if last < hi:
        pieces.append((last - lo, out[place(last):place(last) + hi - last]))
    return pieces


def _spread_sample(view: np.ndarray, element_size: int) -> np.ndarray:
    """SAMPLE_PIECES equal slices at evenly spaced offsets, element-aligned (the whole object
    when it is no larger than SAMPLE_BYTES)."""
    n = view.size - view.size % element_size
    if n <= SAMPLE_BYTES:
        return view[:n]
    piece = SAMPLE_BYTES // SAMPLE_PIECES // element_size * element_size
    stride = (n - piece) // (SAMPLE_PIECES - 1) // element_size * element_size
    return np.concatenate([view[i * stride:i * stride + piece] for i in range(SAMPLE_PIECES)])


def _header(raw_size: int, stages: tuple, base: bytes | None = None, shift: int | None = None) -> bytes:
    fmt = max((STAGE_FORMAT.get(sid, 1) for sid, _ in stages), default=1)  # older readers read the rest
    head = _HEADER.pack(MAGIC, fmt, len(stages), raw_size)
    for sid, arg in stages:
        head += _STAGE.pack(sid, arg) + (base if sid in DELTA_STAGES else b"")
        head += bytes([shift]) if sid == STAGE_LINEAR else b""
    return head


@dataclass(frozen=True)
class Header:
    raw_size: int
    stages: tuple  # ((stage id, argument), ...) in encoding order
    payload_offset: int
    base: bytes | None = None  # the base object's key, for a delta
    shift: int | None = None  # for a `linear` delta: the base's motion is divided by 2**shift

    @property
    def codec_name(self) -> str:
        return "+".join(f"{STAGE_NAMES[s]}{a if s in (STAGE_BYTEGROUP, STAGE_SUB, STAGE_LINEAR) else ''}"
                        for s, a in self.stages) or "raw"

    @property
    def element_size(self) -> int:
        """The element size it was coded with (its byte grouping or `sub`/`linear` delta); 1 if none."""
        return next((arg for sid, arg in self.stages if sid in (STAGE_BYTEGROUP, STAGE_SUB, STAGE_LINEAR)), 1)

    @property
    def needs_below(self) -> bool:
        """Decoding needs the base's base too (a `linear` delta)."""
        return self.shift is not None


def parse_header(data, *, key: bytes | None = None) -> Header:
    """Read and bound-check an object header; every problem is a CorruptionError naming the key."""
    name = to_hex(key) if key else None
    if len(data) < _HEADER.size:
        raise CorruptionError(f"object is truncated ({len(data)} bytes, header needs {_HEADER.size})", key=name)
    magic, fmt, nstages, raw_size = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptionError("object does not start with the cas object magic", key=name)
    if fmt < min(OBJECT_FORMATS):  # no format is older than the first: a damaged byte, not a newer cas
        raise CorruptionError(f"object header names object format {fmt}, which no cas wrote", key=name)
    if fmt not in OBJECT_FORMATS:
        raise FormatVersionError(f"object {name} has object format {fmt}; this cas reads formats "
                                 f"{', '.join(map(str, OBJECT_FORMATS))}")
    if nstages > MAX_STAGES or raw_size > MAX_OBJECT_RAW:
        raise CorruptionError(f"object header is implausible ({nstages} stages, {raw_size} raw bytes)", key=name)
    offset = _HEADER.size
    stages, base, shift = [], None, None
    for _ in range(nstages):
        if len(data) < offset + _STAGE.size:
            raise CorruptionError("object is truncated inside its header", key=name)
        sid, arg = _STAGE.unpack_from(data, offset)
        offset += _STAGE.size
        if sid not in STAGE_NAMES:
            raise CorruptionError(f"object names unknown codec stage {sid}", key=name)
        if sid == STAGE_BYTEGROUP and (arg < 2 or raw_size % arg):
            raise CorruptionError(f"object has an invalid byte-group size {arg}", key=name)
        if fmt < STAGE_FORMAT.get(sid, 1):
            raise CorruptionError(f"object of format {fmt} names the {STAGE_NAMES[sid]} stage, which format "
                                  f"{STAGE_FORMAT[sid]} introduced", key=name)
        if sid in (STAGE_SUB, STAGE_LINEAR) and (arg not in INTEGER_SIZES or raw_size % arg):
            raise CorruptionError(f"object has an invalid delta element size {arg}", key=name)
        if sid in DELTA_STAGES:
            if base is not None or stages or len(data) < offset + KEY_SIZE + (sid == STAGE_LINEAR):
                raise CorruptionError("object has a malformed delta stage", key=name)
            base = bytes(data[offset:offset + KEY_SIZE])
            offset += KEY_SIZE
            if sid == STAGE_LINEAR:
                shift = data[offset]
                offset += 1
                if shift > MAX_LINEAR_SHIFT:
                    raise CorruptionError(f"object has an invalid extrapolation shift {shift}", key=name)
        stages.append((sid, arg))
    return Header(raw_size, tuple(stages), offset, base, shift)


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


def decode_into(data, key: bytes, out: np.ndarray | None = None, base: np.ndarray | None = None, *,
                below: np.ndarray | None = None, verify: bool = True, namer: Namer | None = None) -> np.ndarray:
    """Decode an encoded object into `out` (a uint8 array of its raw size, allocated if None)
    and check the result's blake3 against `key` (unless verify=False: for the lower levels of a
    delta chain, whose errors the top's check catches; `namer`: the store's naming, keyed in an
    encrypted store, plain blake3 when None). A delta needs `base`, the raw bytes of
    its base object, and a `linear` delta also `below`, the raw bytes of the base's base; `out`
    may be `base` or `below` itself (a chain is decoded in one or two buffers). Raises
    CorruptionError, never returns bad data."""
    name = to_hex(key)
    head = parse_header(data, key=key)
    if out is None:
        out = np.empty(head.raw_size, dtype=np.uint8)
    elif out.size != head.raw_size:
        raise CorruptionError(f"object holds {head.raw_size} bytes where {out.size} were expected", key=name)
    stages = list(head.stages)
    delta = stages.pop(0) if stages and stages[0][0] in DELTA_STAGES else None
    if delta is not None:
        if base is None:
            raise CorruptionError(f"object is a delta of {to_hex(head.base)} but no base can be read here", key=name)
        if base.size != head.raw_size:
            raise CorruptionError(f"delta base {to_hex(head.base)} has {base.size} bytes, not {head.raw_size}",
                                  key=name)
        if head.needs_below and (below is None or below.size != head.raw_size):
            raise CorruptionError(f"object extrapolates from delta base {to_hex(head.base)}, whose own base is "
                                  f"not available here (is that base a full object?)", key=name)
    # a delta's payload goes to a scratch buffer first: `out` may hold its base
    target = scratch(head.raw_size, "delta") if delta is not None else out
    try:
        _decode_payload(memoryview(data)[head.payload_offset:], stages, target, head, name)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"object's zstd payload is damaged: {exc}", key=name) from None
    if delta is not None and delta[0] == STAGE_XOR:
        np.bitwise_xor(target, base, out=out)
    elif delta is not None:
        reference = base
        if head.needs_below:
            guess = motion_of(base, below, delta[1], scratch(head.raw_size, "prediction"))
            reference = linear_prediction(base, guess, delta[1], head.shift, guess)
        undo_sub_delta(target, reference, delta[1], out)
    if verify and (namer or PLAIN).key(out) != key:
        raise CorruptionError("object content does not match its hash", key=name)
    return out


def _decode_payload(payload, stages: list, out: np.ndarray, head: Header, name: str) -> None:
    """Undo the non-delta stages ([bytegroup], [zstd] or none) into `out`."""
    grouped = len(stages) >= 2 and stages[-2][0] == STAGE_BYTEGROUP
    if stages and stages[-1][0] == STAGE_ZSTD:
        stages.pop()
        # straight into `out`, or into a reused buffer when planes must be interleaved after
        plain = scratch(head.raw_size, "unzstd") if grouped else out
        _decompress_into(payload, plain, name)
    elif len(payload) != head.raw_size:
        raise CorruptionError(f"object payload holds {len(payload)} bytes, header says {head.raw_size}", key=name)
    else:
        plain = np.frombuffer(payload, dtype=np.uint8)
    if stages and stages[-1][0] == STAGE_BYTEGROUP:
        ungroup_bytes(plain, stages.pop()[1], out)
    elif plain is not out:
        out[:] = plain
    if stages:
        raise CorruptionError(f"object has codec stages in an order we cannot decode: {head.codec_name}", key=name)
