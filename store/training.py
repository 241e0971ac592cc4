"""Training state beyond tensors: stateful objects, every RNG, a resumable sampler.

Anything with `state_dict()` and `load_state_dict()` (modules, optimizers, schedulers,
GradScaler, samplers, torchdata's StatefulDataLoader, user objects) is saved as its state dict
and restored in place.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Iterator

import numpy as np
import torch

from cas.errors import CasError


def is_stateful(value) -> bool:
    return (not isinstance(value, (torch.Tensor, np.ndarray, dict, list, tuple))
            and callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)))


def resolve_stateful(value):
    """The state with every stateful object replaced by its state_dict(), at any depth."""
    if is_stateful(value):
        return value.state_dict()
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, resolve_stateful(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module state dict's versions
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(resolve_stateful(v) for v in value)
    return value


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
    global generator; the state is (seed, epoch, position)."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length = length
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch; `position` counts what was handed out (with a
        DataLoader, use num_workers=0 or a stateful loader so it does not run ahead)."""
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < self.length:
            i = int(order[self.position])
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "length": self.length}

    def load_state_dict(self, state: dict) -> None:
        if state.get("length") != self.length:
            raise CasError(f"sampler state is for a dataset of {state.get('length')} items, this one has {self.length}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
