"""A shuffling sampler that resumes mid-epoch, and the check that no loader runs ahead of it.

A DataLoader with worker processes draws its sampler's indices batches ahead of the training
loop, so a sampler's own position is ahead of what the loop consumed. torchdata's
StatefulDataLoader records the sampler's state as of each batch it hands the loop: save that
loader, not the sampler. ResumableRandomSampler refuses to be saved when it sees that a plain
DataLoader with workers iterates it (UnresumableStateError, saying so).
"""

from __future__ import annotations

import inspect
from typing import Iterator

import torch

from cas.errors import CasError, UnresumableStateError

from .training import is_stateful

# The modules whose frames lie between a DataLoader and the sampler it iterates.
LOADER_MODULES = ("torch.utils.data", "torchdata")


def prefetching_loader(frame) -> torch.utils.data.DataLoader | None:
    """The DataLoader that drives the generator `frame` (just started) when that loader has
    worker processes and keeps no state of its own: it draws indices batches ahead of the
    training loop. The loader's own frames, between it and the sampler, are the only place
    that says who iterates a sampler (a DataLoader tells its sampler nothing); the walk stops
    at the first frame outside them, so a loader of the caller's (a validation loader) is never
    taken for it."""
    frame = frame.f_back
    while frame is not None and frame.f_globals.get("__name__", "").startswith(LOADER_MODULES):
        for value in frame.f_locals.values():
            if isinstance(value, torch.utils.data.DataLoader):
                return value if value.num_workers > 0 and not is_stateful(value) else None
        frame = frame.f_back
    return None




class ResumableRandomSampler(torch.utils.data.Sampler):
    """A shuffling sampler that can stop mid-epoch and resume at the same position.

    Each epoch's order is a permutation drawn from `seed + epoch`, so it does not depend on any
    global generator; the state is (seed, epoch, position). `position` counts the indices handed
    out, which is what the training loop consumed with `DataLoader(num_workers=0)` and as of each
    batch that torchdata's StatefulDataLoader hands the loop (save that loader, not the sampler).
    A plain DataLoader with workers prefetches, so the sampler is ahead of the loop: state_dict()
    then raises UnresumableStateError saying what to use instead."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length = length
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._prefetcher: tuple[int, int] | None = None  # (workers, prefetch factor) of a loader running ahead
        self._finished = False  # an iteration of this object handed out the current epoch's last index

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch; `position` counts what was handed out. An epoch
        handed out whole stays the current one (position = length) until an iteration after
        the one that finished it starts the next: a DataLoader exhausts the sampler before it
        yields a partial last batch, so advancing as the indices ran out made a save right
        after that batch say the next epoch, and after a full last batch this one (audit of
        stop 38). A state loaded at an epoch's end iterates its (empty) rest first, as before."""
        if self.position >= self.length and self._finished:
            self.epoch += 1
            self.position = 0
        self._finished = False
        loader = prefetching_loader(inspect.currentframe())
        self._prefetcher = (loader.num_workers, loader.prefetch_factor or 2) if loader is not None else None
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < self.length:
            i = int(order[self.position])
            self.position += 1
            yield i
        self._finished = True

    def state_dict(self) -> dict:
        """The position; refused (UnresumableStateError) while a DataLoader with workers has drawn
        it ahead of the training loop: a resume from it would skip the batches in flight."""
        if self._prefetcher is not None:
            workers, factor = self._prefetcher
            raise UnresumableStateError(
                f"ResumableRandomSampler is iterated by a DataLoader with num_workers={workers}, which draws "
                f"indices up to {workers * factor} batches ahead of the training loop, so its position (epoch "
                f"{self.epoch}, {self.position} of {self.length}) counts batches the loop has not consumed and a "
                "resume would skip them; nothing was saved. Use torchdata's StatefulDataLoader (pip install "
                "torchdata; from torchdata.stateful_dataloader import StatefulDataLoader) with the same "
                "arguments and put the loader, not the sampler, in the saved state and the restore targets "
                "(it records the sampler's state as of each batch the loop takes), or use num_workers=0")
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "length": self.length}

    def load_state_dict(self, state: dict) -> None:
        if state.get("length") != self.length:
            raise CasError(f"sampler state is for a dataset of {state.get('length')} items, this one has {self.length}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._prefetcher = None  # a new position, which no loader has drawn ahead of yet
        self._finished = False  # (its epoch's rest, even if empty, is iterated first)
