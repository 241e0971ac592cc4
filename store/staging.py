"""Host staging for asynchronous saves: a consistent snapshot of every tensor's bytes.

`save_async` returns as soon as every tensor is copied here; hashing, encoding and writing then
run on these bytes while training goes on. The arena is one reusable byte buffer (pinned when
CUDA is present, so device-to-host copies are non-blocking DMA), grown when a state outgrows
it and reused from one save to the next: fresh large allocations are slow, and pinning is
slower still. Memory: one arena of the state's tensor bytes per save in flight.
"""

from __future__ import annotations

import numpy as np

from .lazytorch import torch
from .tensors import flat_bytes
from .tree import TensorLeaf

ALIGN = 64


class StagingArena:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # release the old one before allocating the larger one
            pin = torch.cuda.is_available()
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cpu", pin_memory=pin)
        return self._buffer

    def stage(self, leaves: list[TensorLeaf]) -> None:
        """Copy every leaf's bytes into the arena and point the leaf at its copy. Outside
        inference mode: an arena made inside it (a save after a validation pass) is an
        inference tensor, and the next save's copy into it outside was a RuntimeError."""
        with torch.inference_mode(False):
            self._stage(leaves)

    def _stage(self, leaves: list[TensorLeaf]) -> None:
        offsets, total = [], 0
        for leaf in leaves:
            offsets.append(total)
            total += -(-leaf.nbytes // ALIGN) * ALIGN
        if total == 0:  # nothing to copy: hold no memory
            self._buffer = None
            for leaf in leaves:
                leaf.staged = np.empty(0, dtype=np.uint8)
            return
        arena = self._reserve(total)
        devices = set()  # the GPUs copies were issued from, each synchronized below
        for leaf, offset in zip(leaves, offsets):
            dst = arena[offset:offset + leaf.nbytes]
            src = leaf.source
            if leaf.lib == "torch" and src.device.type == "cuda" and src.is_contiguous() \
                    and not src.is_conj() and not src.is_neg():
                devices.add(src.device)
                dst.copy_(flat_bytes(src), non_blocking=True)
            elif leaf.nbytes:
                dst.copy_(torch.from_numpy(leaf.bytes_view()))  # a view of CPU tensors, else one copy
            leaf.staged = dst.numpy() if leaf.nbytes else np.empty(0, dtype=np.uint8)
        for device in devices:  # (a bare synchronize() waits for the current device only)
            torch.cuda.synchronize(device)
