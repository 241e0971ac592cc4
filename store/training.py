"""Training state beyond tensors: stateful objects and every RNG.

Anything with `state_dict()` and `load_state_dict()` (modules, optimizers, schedulers,
GradScaler, samplers, torchdata's StatefulDataLoader, user objects) is saved as its state dict
and restored in place. The resumable sampler is in store/sampler.py (a torch Sampler subclass,
so defining it imports torch, which the rest of the store imports on first use).
"""

from __future__ import annotations

import random

import numpy as np

from cas.errors import CasError, UnresumableStateError

from .lazytorch import torch
from .values import MAPPINGS, MAX_DEPTH, remade


def is_stateful(value) -> bool:
    """Whether `value` is an object whose state_dict() is saved in its place (a class is not:
    its state_dict is unbound)."""
    return (not isinstance(value, (torch.Tensor, np.ndarray, dict, list, tuple, type))
            and callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)))


def resolve_stateful(value, where: tuple = (), inside: frozenset = frozenset()):
    """The state with every stateful object replaced by its state_dict(), at any depth. A value
    that refuses to be saved (UnresumableStateError) is named by its path in the state (`where`:
    the keys down to `value`, joined only then). `inside`: the ids of the containers above
    `value`, so that one holding itself is a TypeError naming its path, not a RecursionError."""
    if is_stateful(value):
        try:
            return value.state_dict()
        except UnresumableStateError as exc:
            path = ".".join(map(str, where))
            raise UnresumableStateError(f"state entry {path!r}: {exc}" if path else str(exc)) from None
    if type(value) not in (*MAPPINGS, list, tuple):
        return value
    if id(value) in inside:
        raise TypeError(f"cannot store {'.'.join(map(str, where))!r}: this {type(value).__name__} contains "
                        "itself (a reference cycle), which a checkpoint cannot hold")
    if len(where) > MAX_DEPTH:
        return value  # deeper than a checkpoint holds: plan() refuses it, naming the path
    inside = inside | {id(value)}
    if type(value) in MAPPINGS:
        return remade(value, ((k, resolve_stateful(v, (*where, k), inside)) for k, v in value.items()))
    return type(value)(resolve_stateful(v, (*where, i), inside) for i, v in enumerate(value))


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
