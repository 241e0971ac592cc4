"""The codec stages on their own: byte grouping (two implementations: integer shifts for 2- and
4-byte elements, strided copies otherwise) is the documented plane layout and inverts exactly,
also on unaligned views; the `sub` delta inverts exactly, also in place; the `linear`
prediction is the documented formula, also computed in place of its input."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cas.transforms import group_bytes, linear_prediction, motion_of, sub_delta, undo_sub_delta, ungroup_bytes


def planes_by_definition(raw: np.ndarray, element_size: int) -> np.ndarray:
    """docs/format.md: byte k of every element, for k = 0 .. size-1, one plane after the other."""
    return np.concatenate([raw[k::element_size] for k in range(element_size)])


@settings(max_examples=200, deadline=None)
@given(element_size=st.sampled_from([2, 3, 4, 8, 16]), count=st.integers(1, 3000), offset=st.integers(0, 7),
       seed=st.integers(0, 2**32 - 1))
def test_byte_grouping_is_the_documented_layout_and_inverts(element_size, count, offset, seed):
    n = element_size * count
    backing = np.random.default_rng(seed).integers(0, 256, n + offset, dtype=np.uint8)
    raw = backing[offset:]  # chunks of a tensor need not be aligned
    grouped = group_bytes(raw, element_size, np.empty(n, dtype=np.uint8))
    assert np.array_equal(grouped, planes_by_definition(raw, element_size))
    assert np.array_equal(ungroup_bytes(grouped, element_size, np.empty(n, dtype=np.uint8)), raw)


@settings(max_examples=200, deadline=None)
@given(element_size=st.sampled_from([1, 2, 4, 8]), count=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       spread=st.sampled_from([1, 255, 2**40]))
def test_sub_delta_inverts_exactly_also_in_place(element_size, count, seed, spread):
    rng = np.random.default_rng(seed)
    n = element_size * count
    base = rng.integers(0, 256, n, dtype=np.uint8)
    wide = np.dtype(f"u{element_size}")
    step = rng.integers(-min(spread, 2**(8 * element_size - 2)), min(spread, 2**(8 * element_size - 2)) + 1,
                        count).astype(np.int64)
    raw = (base.view(wide) + step.astype(wide)).view(np.uint8)  # wraps, as the codec does
    delta = sub_delta(raw, base, element_size, np.empty(n, dtype=np.uint8))
    assert np.array_equal(undo_sub_delta(delta.copy(), base, element_size, np.empty(n, dtype=np.uint8)), raw)
    in_place = base.copy()
    assert np.array_equal(undo_sub_delta(delta, in_place, element_size, in_place), raw)


@settings(max_examples=200, deadline=None)
@given(element_size=st.sampled_from([1, 2, 4, 8]), count=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1),
       shift=st.integers(0, 7))
def test_linear_prediction_is_the_documented_formula_also_in_place(element_size, count, seed, shift):
    """docs/format.md: p = base + trunc((base - below) / 2^h), the difference a signed integer of
    the element size (wrapping), p modulo 2^(8e). Encoder and decoder compute it in place of the
    motion: an aliasing bug would still round-trip, so check the values themselves."""
    rng = np.random.default_rng(seed)
    n = element_size * count
    base, below = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
    bits = 8 * element_size
    u = np.dtype(f"u{element_size}")
    signed = lambda v: v - (1 << bits) if v >= 1 << (bits - 1) else v  # noqa: E731
    truncated = lambda m: m >> shift if m >= 0 else -((-m) >> shift)  # noqa: E731  (exact, unlike m / 2**h)
    expected = [(int(b) + truncated(signed((int(b) - int(a)) % (1 << bits)))) % (1 << bits)
                for b, a in zip(base.view(u), below.view(u))]
    motion = motion_of(base, below, element_size, np.empty(n, dtype=np.uint8))
    got = linear_prediction(base, motion, element_size, shift, motion)
    assert [int(v) for v in got.view(u)] == expected


@settings(max_examples=60, deadline=None)
@given(element_size=st.sampled_from([2, 4, 8]), count=st.integers(40_000, 300_000), seed=st.integers(0, 2**32 - 1),
       pattern=st.lists(st.sampled_from(["random", "skewed", "zero"]), min_size=8, max_size=8))
def test_planes_left_raw_make_one_zstd_frame_any_reader_decodes(element_size, count, seed, pattern):
    """An object whose byte planes compress unevenly is one zstd frame in which the planes zstd
    cannot shrink are raw blocks: it decodes exactly, through cas and through a plain zstd
    decoder (what cas before per-plane coding runs), whichever planes are left raw (before,
    between and after the compressed ones)."""
    import zstandard

    from cas.codecs import CodecPolicy, decode_into, parse_header
    from cas.hashing import hash_bytes

    rng = np.random.default_rng(seed)
    planes = []
    for kind in pattern[:element_size]:
        if kind == "random":
            planes.append(rng.integers(0, 256, count, dtype=np.uint8))
        elif kind == "skewed":  # an exponent byte: a few values, unevenly
            planes.append(rng.choice(np.arange(120, 130, dtype=np.uint8), count, p=np.linspace(1, 10, 10) / 55))
        else:
            planes.append(np.zeros(count, dtype=np.uint8))
    raw = np.stack(planes, axis=1).reshape(-1)  # element i's byte k is planes[k][i]
    key = hash_bytes(raw)
    enc = CodecPolicy().encode(raw, element_size)
    blob = b"".join(bytes(p) for p in enc.parts)
    assert np.array_equal(decode_into(blob, key), raw)
    head = parse_header(blob, key=key)
    if head.stages:
        payload = blob[head.payload_offset:]
        grouped = zstandard.ZstdDecompressor().decompress(payload)
        assert grouped == np.concatenate(planes).tobytes()
    if all(kind == "random" for kind in pattern[:element_size]):
        assert head.stages == ()  # nothing to gain: stored raw


def test_a_float_chunk_whose_mantissa_planes_stay_raw_is_one_buffer():
    """A float chunk's random low planes are raw blocks of its frame, grouped straight into
    them: header and frame come out as one buffer (an encrypted store seals its segments in
    single calls, a plain one writes it with no gather list), in the bytes any zstd reads."""
    import torch
    import zstandard

    from cas.codecs import CodecPolicy, decode_into, parse_header
    from cas.hashing import hash_bytes

    g = torch.Generator().manual_seed(0)
    for dtype, count in ((torch.float32, 1 << 20), (torch.float32, 300_007), (torch.bfloat16, 1 << 21),
                         (torch.float16, 777_777), (torch.float64, 1 << 19)):
        t = torch.randn(count, generator=g, dtype=torch.float64).to(dtype)  # (fp64 made from fp32 has 4 zero planes)
        raw = t.view(torch.uint8).numpy()
        enc = CodecPolicy().encode(raw, t.element_size())
        assert len(enc.parts) == 1, (dtype, count)
        blob = bytes(enc.parts[0])
        head = parse_header(blob, key=hash_bytes(raw))
        assert [s[0] for s in head.stages] == [1, 2]  # bytegroup, zstd
        assert np.array_equal(decode_into(blob, hash_bytes(raw)), raw)
        grouped = zstandard.ZstdDecompressor().decompress(blob[head.payload_offset:])
        assert grouped == planes_by_definition(raw, t.element_size()).tobytes()
