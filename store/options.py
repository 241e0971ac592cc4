"""The options of a store, declared and validated once (as orbax's CheckpointManagerOptions),
and the checks of a save's own arguments (step, metrics, meta).

`cas.open(path, **options)` and DCP's `CasWriter(path, step=..., **options)` take the same
option names with the same meaning; a value either refuses is refused in the same words.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import msgpack
import numpy as np

from cas.codecs import checked_level
from cas.crypt import MasterKey, user_key
from cas.errors import CasError
from cas.objectstore import DEFAULT_PACK_MAX, MAX_CHAIN_DECODE

from . import signing
from .layout import check_chunk_size
from .lazytorch import torch
from .values import check_texts, checked_text, pack

DEFAULT_WINDOW_BYTES = 256 << 20
# bench/bench_delta.py (AdamW every 10 steps, with relinked `linear` deltas): 8 stores fp32 0.718 and
# bf16 0.445 of the torch.save bytes against 0.723 / 0.459 for 4 (the 0.72 / 0.45); the
# newest restores at full speed either way, the deepest (oldest) one 8.4x a full restore against 3.7x.
DEFAULT_MAX_CHAIN = 8
# Forward chains (delta="forward") keep 4: there the newest checkpoint is the deepest, and each
# level costs a resume about half a full decode (docs/architecture.md, "Delta chains").
FORWARD_MAX_CHAIN = 4
# Host memory for copies of a save's tensors, from which the recode of the save before it (or a
# forward delta) reads. Default none: the recode reads both chunks back from the store, in the
# background. Measured (bench/bench_delta.py, fp32 state every 10 steps, quiet): with the copy the
# saves took 1.27x a store without deltas (the copy is on the training path), without it 0.98x,
# and the bytes are the same; a large model's host memory is not doubled either.
DEFAULT_DELTA_MEMORY = 0


@dataclass(frozen=True)
class StoreOptions:
    """How a store is opened and how it saves.

    create: make the store when the path is missing or an empty folder. readonly: change
    nothing. chunk_size: fixed when the store is created (default 4 MiB). compress,
    compression_level: zstd (level 1 by default). workers: hashing and encoding threads
    (default: the CPU count; loads use twice as many). window_bytes: chunk bytes in flight
    while saving. pack_max: None (the default) puts every object into pack files, large ones
    streamed into a few large packs as they are encoded; N gives each encoded object larger than
    N bytes a file of its own under objects/ (the layout before streamed packs). max_inflight:
    save_async calls in flight at once. delta: True (the default) writes every save whole and
    then, in the background, re-encodes the chunks it replaced as deltas of the new ones (the
    newest checkpoint restores at full speed; store/recode.py; stores in a bucket save whole);
    "forward" codes each save's changed chunks against the previous save's instead (the newest
    is the deepest); False: no deltas. max_chain: how deep such chains may grow (default 8; 4
    for "forward", whose newest checkpoint is the deepest); delta_memory:
    bytes of the last save kept in memory for that (default 0: every base is read back from
    the store; None: all of them, which makes forward saves faster).
    cache_dir: where a bucket store's LMDB cache lives (default $CAS_CACHE_DIR, else
    ~/.cache/cas); two processes with different cache folders behave as two hosts.
    signing_key: an ed25519 private key (32 raw bytes, PEM or OpenSSH bytes, a path to such a
    file, or a cryptography key) that signs every checkpoint this store commits.
    key: a passphrase (str) or 32 raw bytes: opens an encrypted store, and makes a new store
    encrypted (cas/crypt.py); None for a plain store.
    """

    create: bool = True
    readonly: bool = False
    chunk_size: int | None = None
    compress: bool = True
    compression_level: int = 1
    workers: int | None = None
    window_bytes: int = DEFAULT_WINDOW_BYTES
    pack_max: int | None = DEFAULT_PACK_MAX
    max_inflight: int = 1
    delta: bool | str = True
    max_chain: int | None = None  # None: DEFAULT_MAX_CHAIN, or FORWARD_MAX_CHAIN for delta="forward"
    delta_memory: int | None = DEFAULT_DELTA_MEMORY
    cache_dir: str | None = None
    signing_key: object = dataclasses.field(default=None, repr=False, compare=False)
    key: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        checked_level(self.compression_level)
        if self.chunk_size is not None:
            check_chunk_size(self.chunk_size)  # refused before a store is made with it (0 or False too)
        if self.key is not None and not isinstance(self.key, MasterKey):
            user_key(self.key)  # refused now, not at the open
        if self.signing_key is not None:
            object.__setattr__(self, "signing_key", signing.private_key(self.signing_key))  # refused now, not at a save
        if self.delta not in (True, False, "forward") or type(self.delta) not in (bool, str):
            raise CasError(f'delta must be True (the newest checkpoint whole, older ones recoded as deltas of newer '
                           f'ones), False (no deltas) or "forward" (each save a delta of the last), got {self.delta!r}')
        if self.max_chain is not None and (type(self.max_chain) is not int
                                           or not 0 <= self.max_chain <= MAX_CHAIN_DECODE):
            # chains deeper than MAX_CHAIN_DECODE are refused on restore, as cycles
            raise CasError(f"max_chain must be an int from 0 to {MAX_CHAIN_DECODE} (or None: the default), "
                           f"got {self.max_chain!r}")
        if self.delta_memory is not None and (type(self.delta_memory) is not int or self.delta_memory < 0):
            raise CasError(f"delta_memory must be a number of bytes (an int >= 0) or None, got {self.delta_memory!r}")
        if type(self.max_inflight) is not int or self.max_inflight < 1:
            raise CasError(f"max_inflight must be an int >= 1 (saves in flight at once), got {self.max_inflight!r}")
        if self.workers is not None and (type(self.workers) is not int or self.workers < 1):
            raise CasError(f"workers must be an int >= 1 or None, got {self.workers!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise CasError(f"cache_dir must be a folder's path or None, got {self.cache_dir!r}")
        for name in ("window_bytes", "pack_max"):
            value = getattr(self, name)
            if name == "pack_max" and value is None:
                continue
            if type(value) is not int or value < 0:
                raise CasError(f"{name} must be a number of bytes (an int >= 0), got {value!r}")

    @classmethod
    def of(cls, options: "StoreOptions | None" = None, **overrides) -> "StoreOptions":
        """`options` (or the defaults) with `overrides` applied; an unknown name is a TypeError
        that names it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown store option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **overrides) if overrides else base

    def chain_limit(self) -> int:
        """max_chain, or its default for this delta scheme (None given)."""
        if self.max_chain is not None:
            return self.max_chain
        return FORWARD_MAX_CHAIN if self.delta == "forward" else DEFAULT_MAX_CHAIN

    def worker_count(self, cap: int | None = None) -> int:
        """The threads to use: `workers`, or the CPU count (at most `cap` when given)."""
        if self.workers is not None:
            return self.workers
        count = os.cpu_count() or 2
        return min(count, cap) if cap is not None else count


MAX_STEP = (1 << 63) - 1  # what a registry key holds


def checked_step(step) -> int:
    """A save's step: a non-negative int. Steps name training progress (a step or sample count);
    "latest" and retention's "last" follow commit order, so a rollback or a restart needs no
    step of its own below zero, and a negative one is most likely an off-by-one (step - 1 at step
    0) or a sentinel (-1) passed where a step was meant. Loading, listing and copying still take
    any step a store already holds (stores written before this rule)."""
    if type(step) is not int:
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise CasError(f"step {step} is refused: a step is an int from 0 to {MAX_STEP} (the training step or "
                       "sample count the state was saved at); nothing was saved")
    return step


def checked_metrics(metrics) -> dict:
    """A save's metrics as the registry record holds them: str keys, one number each."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError("metrics must be a dict with str keys")
    out = {}
    for k, v in metrics.items():
        checked_text(k, "a metrics key")
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
            if v.size != 1 if isinstance(v, (np.ndarray, np.generic)) else v.numel() != 1:
                raise TypeError(f"metric {k!r} must be one number, got a {type(v).__name__} of shape {tuple(v.shape)}")
            v = v.item()
        if type(v) is bool or not isinstance(v, (int, float)):
            raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}")
        if not isinstance(v, float) and not -(1 << 63) <= v < 1 << 64:  # what a registry record holds
            raise TypeError(f"metric {k!r} is an int beyond 64 bits; give it as a float")
        out[k] = float(v) if isinstance(v, float) else int(v)
    return out


def checked_meta(meta) -> dict:
    """A copy of a save's meta, checked to pack as the registry record and commit node hold it
    (the caller of save_async may change its dict once the call returns)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError("meta must be a dict")
    try:
        plain = msgpack.packb(meta, use_bin_type=True)  # as the registry record holds it
        pack(meta)  # and the commit node
        return msgpack.unpackb(plain, raw=False, strict_map_key=False)
    except (TypeError, ValueError, OverflowError) as exc:  # a tuple key comes back unhashable, say
        if isinstance(exc, UnicodeEncodeError):  # a lone surrogate: name where it sits
            check_texts(meta, "meta")  # (msgpack got that far, so this walk stays within its nesting limit)
        raise TypeError(f"meta must hold plain values (str, 64-bit ints, floats, bools, None, lists, dicts "
                        f"with str or int keys): {exc}") from None
