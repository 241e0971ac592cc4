"""Shared test helpers: exact (bit-for-bit, type- and order-preserving) comparison of states."""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict

import numpy as np
import torch


def tmp_files(store) -> list[str]:
    """The store's temporary files, less the owner files of live processes (this one's among
    them: each process that writes keeps one, locked, for as long as it runs)."""
    import os
    return sorted(n for n in os.listdir(store.layout.tmp) if not n.startswith(".owner."))


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if as_int is not None:  # torch cannot copy some dtypes (float4, bits): compare their bits
        t = t.view(as_int)
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a, b, path: str = "<root>") -> None:
    """a and b are equal bit for bit, with the same types, dtypes, shapes and key order."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert tensor_bytes(a) == tensor_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: array bytes differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: numpy scalar differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        if isinstance(a, OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata differs"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
            f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def train_tiny(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    """A few real optimizer steps on synthetic data; returns the losses."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, model[0].in_features, generator=g)
        y = torch.randint(0, model[-1].out_features, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tiny_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def wait_for(marker, seconds: float = 60) -> None:
    """Wait until a fault point's `PATH.reached` marker (or any path) exists."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, f"{marker} never appeared"
        time.sleep(0.01)


def outcome_of(fn, *args):
    """fn(*args), or the exception it raised: for a test thread to hand its result back."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - handed to the test thread
        return exc


def adamw_series(count: int, every: int = 10, width: int = 256) -> list[dict]:
    """`count` checkpoints, `every` steps apart, of a seeded MLP (`width` wide) trained with
    AdamW: weights and both moments (what deltas are for: every value moves a little at every
    step); 12 * width**2 bytes and a little more each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = []
    for _ in range(count):
        train_tiny(model, opt, every, seed=len(states))
        states.append({"model": {k: v.clone() for k, v in model.state_dict().items()},
                       "optim": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                                 for k, v in opt.state_dict()["state"].items()}})
    return states
