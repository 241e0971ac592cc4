"""A Lightning checkpoint dict as a cas store holds it: Lightning's own dict subclasses as plain
dicts, and hyperparameters a store cannot hold as their text (store/lightning.py saves it)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from .values import MAPPINGS, remade


def plain(value):
    """The checkpoint with dict subclasses the store does not hold (Lightning's AttributeDict of
    hyper_parameters) as plain dicts; everything else as it is."""
    if isinstance(value, dict) and type(value) not in MAPPINGS[1:]:
        return {k: plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    return value


_HPARAMS = ("hyper_parameters", "datamodule_hyper_parameters")


def storable(checkpoint: dict) -> dict:
    """The checkpoint as the store holds it (plain), with each hyperparameter the store cannot
    hold (a Path, an Enum, a device, a class, a module) as its text, with a warning naming it:
    Lightning's own file pickles them, a store never unpickles, and refusing them killed fit at
    its first checkpoint (a module became its state dict; audit of stop 38)."""
    out = plain(checkpoint)
    for key in _HPARAMS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _hparam(v, f"{key}.{k}") for k, v in out[key].items()}
    return out


_SCALARS = (type(None), bool, int, float, str, bytes)  # exact types: an IntEnum or a str Enum is no int or str here


def _kept(value) -> bool:
    """Whether a hyperparameter is a value the store holds as it is."""
    if type(value) in _SCALARS or isinstance(value, (torch.Tensor, np.ndarray, np.generic, torch.dtype)):
        return True
    return isinstance(value, (set, frozenset)) and all(type(v) in _SCALARS for v in value)


def _hparam(value, where: str):
    if type(value) in MAPPINGS:
        return remade(value, ((k, _hparam(v, f"{where}.{k}")) for k, v in value.items()))
    if type(value) in (list, tuple):
        return type(value)(_hparam(v, f"{where}.{i}") for i, v in enumerate(value))
    if _kept(value):
        return value
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value) if isinstance(value, torch.device) \
        else f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else repr(value)
    warnings.warn(f"cas: the hyperparameter {where!r} (a {type(value).__qualname__}) is stored as the str {text!r}: a "
                  "cas checkpoint holds no such object (Lightning's own file pickles it); load_from_checkpoint gets "
                  "that str unless you pass the value again", stacklevel=4)
    return text


def same_values(a, b) -> bool:
    """Whether two plain values (a loop's progress) are equal; any doubt (tensors) is no."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False
