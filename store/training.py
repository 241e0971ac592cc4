"""Training state beyond tensors: stateful objects, every RNG, a resumable sampler.

Anything with `state_dict()` and `load_state_dict()` (modules, optimizers, schedulers,
GradScaler, samplers, torchdata's StatefulDataLoader, user objects) is saved as its state dict
and restored in place.

A DataLoader with worker processes draws its sampler's indices batches ahead of the training
loop, so a sampler's own position is ahead of what the loop consumed. torchdata's
StatefulDataLoader records the sampler's state as of each batch it hands the loop: save that
loader, not the sampler. ResumableRandomSampler refuses to be saved when it sees that a plain
DataLoader with workers iterates it (UnresumableStateError, saying so).
"""

from __future__ import annotations

import inspect
import random
from collections import OrderedDict
from typing import Iterator

import numpy as np
import torch

from cas.errors import CasError, UnresumableStateError

# The modules whose frames lie between a DataLoader and the sampler it iterates.
LOADER_MODULES = ("torch.utils.data", "torchdata")


def is_stateful(value) -> bool:
    return (not isinstance(value, (torch.Tensor, np.ndarray, dict, list, tuple))
            and callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)))


def resolve_stateful(value, where: tuple = ()):
    """The state with every stateful object replaced by its state_dict(), at any depth. A value
    that refuses to be saved (UnresumableStateError) is named by its path in the state (`where`:
    the keys down to `value`, joined only then)."""
    if is_stateful(value):
        try:
            return value.state_dict()
        except UnresumableStateError as exc:
            path = ".".join(map(str, where))
            raise UnresumableStateError(f"state entry {path!r}: {exc}" if path else str(exc)) from None
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, resolve_stateful(v, (*where, k))) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module state dict's versions
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(resolve_stateful(v, (*where, i)) for i, v in enumerate(value))
    return value


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


class RNGState:
    """Every random generator a training step may draw from: Python's `random`, numpy's global
    generator, torch's CPU generator and each CUDA device's. Put one in the saved state and a
    fresh one in the restore targets."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        return state

    def load_state_dict(self, state: dict) -> None:
        try:
            random.setstate(state["python"])
            np.random.set_state(state["numpy"])
            torch.set_rng_state(state["torch"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CasError(f"the saved RNG state cannot be restored: {exc}") from None
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_available():
            for i, s in enumerate(cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


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

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch; `position` counts what was handed out."""
        loader = prefetching_loader(inspect.currentframe())
        self._prefetcher = (loader.num_workers, loader.prefetch_factor or 2) if loader is not None else None
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < self.length:
            i = int(order[self.position])
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

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
