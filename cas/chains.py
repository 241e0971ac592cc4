"""Delta chains: walking an object's chain of bases and decoding it level by level in two
buffers. Shared by the store's reads (cas/objectstore.py) and by readers that see objects
only through their headers (a DCP rank, a transfer)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .codecs import decode_into, parse_header
from .transforms import scratch
from .errors import CorruptionError

MAX_CHAIN_DECODE = 64  # far above any configured chain bound; stops a hostile cycle of bases


def walk_chain(chain: list[bytes], base_of: Callable[[bytes], bytes | None]) -> list[bytes]:
    """Extend `chain` with base_of(its last key) until a full object (from the index, or from
    the objects' headers); refuses cycles and chains deeper than MAX_CHAIN_DECODE."""
    while (base := base_of(chain[-1])) is not None:
        if len(chain) > MAX_CHAIN_DECODE:
            raise CorruptionError(f"delta chain deeper than {MAX_CHAIN_DECODE} (a cycle?)", key=chain[0].hex())
        chain.append(base)
    return chain


def _level_buffer(nbytes: int) -> np.ndarray:
    """The per-thread buffer for the second of the two buffers a chain is decoded in."""
    return scratch(nbytes, "chain level")


def decode_chain(chain: list[bytes], fetch: Callable[[bytes], object], out: np.ndarray | None = None, *,
                 verify: bool = True, check_each: bool = False,
                 decoded: dict[bytes, np.ndarray] | None = None, namer=None) -> np.ndarray:
    """Decode chain[0] from the bottom of its chain ([key, its base, ...]; `fetch(key)` gives
    encoded bytes) up, starting from the highest level found in `decoded`. Levels alternate
    between `out` and a per-thread buffer, the top landing in `out`: each level reads its base
    from one and overwrites the other, which holds its base's base (a `linear` delta reads
    both). Afterwards the per-thread buffer holds chain[1]'s bytes (`last_below`). Only the top
    is hash-checked unless `check_each` (a wrong lower level makes a wrong top, which its check
    refuses); a level's failure is reported against the top's key. `namer`: the store's (cas.hashing)."""
    decoded = decoded or {}
    top = chain[0]
    start = next((i for i, k in enumerate(chain) if i and k in decoded), len(chain) - 1)
    from_decoded = chain[start] in decoded and start > 0
    bufs: list = [out, None]
    if from_decoded:
        size = decoded[chain[start]].size
        bufs = [np.empty(size, dtype=np.uint8) if out is None else out, _level_buffer(size)]
        bufs[start % 2][:] = decoded[chain[start]]
    for i in reversed(range(start if from_decoded else start + 1)):
        key, expected_base = chain[i], chain[i + 1] if i + 1 < len(chain) else None
        try:
            data = fetch(key)
            head = parse_header(data, key=key)
            if head.base != expected_base:
                raise CorruptionError(f"object names delta base {head.base.hex() if head.base else None}, the "
                                      f"index {expected_base.hex() if expected_base else None}", key=key.hex())
            if head.needs_below and from_decoded and i + 2 > start:  # its base's base was never decoded here
                return decode_chain(chain, fetch, out, verify=verify, check_each=check_each, namer=namer)
            if bufs[0] is None:
                bufs[0] = np.empty(head.raw_size, dtype=np.uint8)
            if bufs[1] is None and len(chain) > 1:
                bufs[1] = _level_buffer(bufs[0].size)
            target = bufs[i % 2]
            decode_into(data, key, target, bufs[(i + 1) % 2] if expected_base else None,
                        below=target if head.needs_below and i + 2 < len(chain) else None,
                        verify=check_each or (i == 0 and verify), namer=namer)
        except CorruptionError as exc:
            if i == 0:
                raise
            raise CorruptionError(f"its delta base {exc.key or key.hex()} is unreadable: {exc.detail}",
                                  key=top.hex()) from None
    return bufs[0]


def last_below(nbytes: int) -> np.ndarray:
    """After decode_chain of a chain of two levels or more on this thread: the raw bytes of the
    decoded object's base (chain[1]), in the per-thread buffer (valid until the next decode)."""
    return _level_buffer(nbytes)
