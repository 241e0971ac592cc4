"""The byte transforms of the codec's stages, and the per-thread buffers they work in.

Byte grouping (floats' sign/exponent bytes side by side, where zstd finds them alike), zigzag
`sub` deltas and the `linear` prediction, each a few numpy passes over whole chunks into caller
buffers: no allocation on the hot path (fresh memory is slow to touch on this kind of VM), so the
scratch buffers are per thread and reused. cas/codecs.py decides which stages an object gets and
writes their header; docs/format.md gives their bytes.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_local = threading.local()

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
INTEGER_SIZES = frozenset(_UNSIGNED)  # element sizes the integer transforms (deltas, shifts) take
# element sizes grouped by integer shifts (little-endian hosts; 8-byte shifts measured slower)
_SHIFTED = (2, 4) if sys.byteorder == "little" else ()


def scratch(nbytes: int, slot: str = "scratch") -> np.ndarray:
    """A per-thread reusable byte buffer, one per `slot` name (each name has one user, so
    buffers in use never alias): fresh large allocations are slow on this kind of VM."""
    buf = getattr(_local, slot, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def group_bytes(raw: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """Byte k of every element together, for each k: floats' sign/exponent bytes compress well
    once they are next to each other. `raw.size` must be a multiple of `element_size`."""
    planes = out.reshape(element_size, -1)
    group_planes(raw, element_size, {k: [(0, planes[k])] for k in range(element_size)})
    return out


def group_planes(raw: np.ndarray, element_size: int, targets: dict[int, list[tuple[int, np.ndarray]]]) -> None:
    """group_bytes for the planes `targets` names, each written where its pieces say: plane k's
    bytes [start, start + dest.size) go to dest, for each (start, dest) in targets[k] (a 2-D
    dest takes them row by row). So a plane can land in another buffer's strided slots (the
    codec writes raw planes straight into zstd raw blocks) with no copy in between."""
    if element_size in _SHIFTED:
        # as integers, plane k is (element >> 8k): 3.4x (2-byte) and 1.8x (4-byte) faster here
        # than numpy's strided byte copy below
        elements = raw.view(_UNSIGNED[element_size])
        for k, pieces in targets.items():
            # (the low byte needs no shift)
            plane = elements if k == 0 else np.right_shift(elements, 8 * k, out=scratch(raw.size, "shift").view(
                _UNSIGNED[element_size]))
            for start, dest in pieces:
                np.copyto(dest, plane[start:start + dest.size].reshape(dest.shape), casting="unsafe")
        return
    elements = raw.reshape(-1, element_size)
    for k, pieces in targets.items():  # one strided pass per plane: ~4 GB/s, 3x numpy's .T copy
        for start, dest in pieces:
            dest[...] = elements[start:start + dest.size, k].reshape(dest.shape)


def ungroup_bytes(grouped: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """Inverse of group_bytes, written straight into `out` (restore's hot loop)."""
    planes = grouped.reshape(element_size, -1)
    if element_size in _SHIFTED:  # element = plane[n-1] << 8 ... | plane[0], built in place
        elements = out.view(_UNSIGNED[element_size])
        np.copyto(elements, planes[element_size - 1])
        for k in range(element_size - 2, -1, -1):
            np.left_shift(elements, 8, out=elements)
            np.bitwise_or(elements, planes[k], out=elements)
        return out
    elements = out.reshape(-1, element_size)
    for k in range(element_size):
        elements[:, k] = planes[k]
    return out


def sub_delta(raw: np.ndarray, base: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """zigzag(raw - base), element by element as wrapping integers of `element_size` bytes.

    Neighbouring checkpoints' floats differ by a few units in the last place: as integers their
    difference is small, its high bytes zero once zigzag moves the sign to the lowest bit. XOR
    smears a carry across every bit below it; measured on AdamW state 10 steps apart this codes
    fp32 weights to 0.69 of raw (XOR 0.72), exp_avg_sq 0.65 (0.73), bf16 weights 0.39 (0.44)."""
    u, i = _UNSIGNED[element_size], _SIGNED[element_size]
    d = np.subtract(raw.view(u), base.view(u), out=out.view(u))
    sign = np.right_shift(d.view(i), 8 * element_size - 1, out=scratch(out.size, "sign").view(i))  # 0 or -1
    np.left_shift(d, 1, out=d)
    np.bitwise_xor(d, sign.view(u), out=d)
    return out


def undo_sub_delta(delta: np.ndarray, base: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """Inverse of sub_delta: out = base + unzigzag(delta). `delta` is overwritten; `out` may be
    `base` itself (a chain is applied level by level in one buffer)."""
    u = _UNSIGNED[element_size]
    d = delta.view(u)
    low = np.bitwise_and(d, 1, out=scratch(delta.size, "sign").view(u))
    np.negative(low, out=low)  # 0 or all ones
    np.right_shift(d, 1, out=d)
    np.bitwise_xor(d, low, out=d)
    np.add(d, base.view(u), out=out.view(u))
    return out


def motion_of(raw: np.ndarray, base: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    """raw - base per element, as wrapping integers: how far an object moved from its base. With
    the motion of a delta's base, the next checkpoint's chunk is predicted by `linear_prediction`."""
    u = _UNSIGNED[element_size]
    np.subtract(raw.view(u), base.view(u), out=out.view(u))
    return out


def linear_prediction(base: np.ndarray, motion: np.ndarray, element_size: int, shift: int,
                      out: np.ndarray) -> np.ndarray:
    """base + motion / 2**shift per element (the quotient rounded toward zero), as wrapping
    signed integers: the base moved by `motion` since its own base, and is predicted to move as
    much again (shift 0) or half as much (1). Training moves weights smoothly, so the raw bytes
    sit closer to this than to the base. Rounding toward zero keeps a one-unit motion at zero
    either way (flooring made bf16 weights 0.2 points larger). `out` may be `motion`."""
    i = _SIGNED[element_size]
    m = motion.view(i)
    if shift:
        fix = np.right_shift(m, 8 * element_size - 1, out=scratch(motion.size, "round").view(i))  # 0 or -1
        np.bitwise_and(fix, (1 << shift) - 1, out=fix)  # what a negative motion needs added to truncate
        step = np.add(m, fix, out=out.view(i))
        np.right_shift(step, shift, out=step)
    else:
        step = m
    np.add(step, base.view(i), out=out.view(i))
    return out
