"""Transparent huge pages for the fresh tensors a load fills.

A load writes every byte of tensors it has just allocated, so most of its time on a large state
is the kernel faulting in and zeroing 4 KiB pages one by one (on this VM ~1 GB/s, slower than the
decode itself). Asking for huge pages on the 2 MiB-aligned interior of such a tensor
(madvise(MADV_HUGEPAGE), the hint torch's own THP_MEM_ALLOC_ENABLE gives) takes one fault per
2 MiB: a 32 MiB tensor fills in half the time. Only pages wholly inside the tensor are advised, so
no other allocation is touched and no memory is added; where the kernel has THP off, or on another
OS, nothing happens.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE = 2 << 20
ADVISE_FROM = 2 * HUGE  # smaller tensors hold at most one whole huge page: not worth a syscall
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise_huge_pages(t: torch.Tensor) -> None:
    """Hint that a fresh CPU tensor's memory be backed by huge pages (before it is written)."""
    nbytes = t.numel() * t.element_size()
    if _madvise is None or nbytes < ADVISE_FROM or t.device.type != "cpu":
        return
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + nbytes) // HUGE * HUGE
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a refusal (EINVAL where THP is absent) changes nothing
