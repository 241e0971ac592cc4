"""load(save(x)) == x, bit for bit, for generated nested states."""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas
from cas.store.tensors import TORCH_DTYPES

ALL_DTYPES = sorted(TORCH_DTYPES)
NUMPY_DTYPES = ["<f4", "<f8", "<f2", "<i8", "<i4", "<u2", "|u1", "|i1", "|b1", "<c8", "<c16", ">f4", ">i8"]
_steps = itertools.count()


def make_tensor(dtype_name: str, shape: tuple, seed: int, layout: str) -> torch.Tensor:
    """Random bytes reinterpreted as the dtype (so floats include NaN, inf and -0.0), optionally
    returned as a non-contiguous view."""
    dtype = TORCH_DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    full = list(shape)
    if layout == "strided" and full:
        full[-1] *= 2  # take every other element of the last dim
    numel = int(np.prod(full)) if full else 1
    elsize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        t = torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_))
    else:
        raw = rng.integers(0, 256, numel * elsize, dtype=np.uint8)
        t = torch.from_numpy(raw).view(dtype) if numel else torch.empty(0, dtype=dtype)
    t = t.reshape(full)
    if layout == "strided" and full:
        t = t[..., ::2]
    elif layout == "transposed" and len(full) >= 2:
        t = t.transpose(0, 1)
    return t


def make_array(dtype_str: str, shape: tuple, seed: int) -> np.ndarray:
    dtype = np.dtype(dtype_str)
    numel = int(np.prod(shape)) if shape else 1
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, numel).astype(dtype).reshape(shape)
    return np.frombuffer(rng.integers(0, 256, numel * dtype.itemsize, dtype=np.uint8).tobytes(),
                         dtype=dtype).reshape(shape).copy()


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple) | st.sampled_from([(0,), (), (70_000,), (300, 130)])
tensors = st.builds(make_tensor, st.sampled_from(ALL_DTYPES), shapes, st.integers(0, 2**32 - 1),
                    st.sampled_from(["contiguous", "strided", "transposed"]))
arrays = st.builds(make_array, st.sampled_from(NUMPY_DTYPES), shapes, st.integers(0, 2**32 - 1))
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | texts | st.binary(max_size=30)
           | st.sampled_from([np.float32(1.5), np.int64(-7), np.bool_(True), np.float64("nan"), np.uint8(200)])
           | st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.bool]))
hashables = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | texts | st.binary(max_size=10)
             | st.tuples(texts, st.integers()))  # (no floats: a NaN in a set equals no copy of itself)
scalars = scalars | st.sets(hashables, max_size=4) | st.frozensets(hashables | st.frozensets(texts), max_size=4)
keys = texts | st.integers(-(2**63), 2**63 - 1)
leaves = tensors | arrays | scalars
states = st.recursive(
    leaves,
    lambda children: (st.lists(children, max_size=4)
                      | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(keys, children, max_size=4)
                      | st.dictionaries(keys, children, max_size=4).map(OrderedDict)
                      | st.dictionaries(keys, children, max_size=4).map(Counter)),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    with cas.open(tmp_path_factory.mktemp("prop") / "store", chunk_size=64 << 10) as s:
        yield s


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(state=states)
def test_load_of_save_is_identity(shared_store, state):
    step = next(_steps)
    shared_store.save({"state": state}, step=step)
    assert_same(shared_store.load(step), {"state": state})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.dictionaries(texts, leaves, min_size=1, max_size=5))
def test_partial_load_reads_only_those_keys(shared_store, state):
    step = next(_steps)
    shared_store.save(state, step=step)
    key = random.Random(step).choice(list(state))
    assert_same(shared_store.load(step, keys=[key]), {key: state[key]})


def test_training_states_round_trip(store):
    """A real model's and optimizer's state dicts, and every RNG, round-trip exactly."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    steps_opt = torch.optim.SGD(model.parameters(), lr=1.0)
    steps = torch.optim.lr_scheduler.MultiStepLR(steps_opt, milestones=[2, 4, 4], gamma=0.5)  # milestones: a Counter
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        sched.step()
        steps_opt.step()
        steps.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "multistep": steps.state_dict(), "sgd": steps_opt.state_dict(),
             "py_rng": random.getstate(), "np_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(),
             "step": 3}
    store.save(state, step=3)
    loaded = store.load(3)
    assert_same(loaded, state)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    fresh.load_state_dict(loaded["model"])  # _metadata (BatchNorm's version) came back too
    resumed_opt = torch.optim.SGD(fresh.parameters(), lr=1.0)
    resumed = torch.optim.lr_scheduler.MultiStepLR(resumed_opt, milestones=[9])
    resumed_opt.load_state_dict(loaded["sgd"])
    resumed.load_state_dict(loaded["multistep"])  # it refused the Counter: a TypeError at save
    for _ in range(3):
        steps_opt.step()
        steps.step()
        resumed_opt.step()
        resumed.step()
        assert resumed.get_last_lr() == steps.get_last_lr()
    random.setstate(loaded["py_rng"])
    np.random.set_state(loaded["np_rng"])
    torch.set_rng_state(loaded["torch_rng"])


def test_device_argument_moves_tensors(store):
    store.save({"w": torch.arange(6.0)}, step=1)
    out = store.load(1, device="cpu")
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], torch.arange(6.0))


@pytest.mark.parametrize("dtype", ["float4_e2m1fn_x2", "bits8", "bits16", "float8_e8m0fnu", "bool"])
def test_non_contiguous_views_of_dtypes_torch_cannot_copy(store, dtype):
    t = make_tensor(dtype, (300, 130), 0, "transposed")
    store.save({"t": t}, step=1)
    assert_same(store.load(1), {"t": t})


def test_equal_parts_of_a_loaded_state_are_distinct_objects(store):
    """Two equal entries holding tensors are one manifest node, and a reader caches the nodes it
    parsed: a loaded state's sets and `_metadata` were one object at both places and with the
    reader's cache, so a change to one entry changed the other and the next load (stop 38)."""
    def entry():
        sd = OrderedDict(w=torch.ones(2))
        sd._metadata = {"": {"version": 1}}
        return {"tags": {"x"}, "sd": sd}

    store.save({"a": entry(), "b": entry()}, step=1)
    reader = store.reader(1)
    out = reader.materialize()
    out["a"]["tags"].add("changed")
    out["a"]["sd"]._metadata[""]["version"] = 99
    again = reader.materialize()
    for loaded in (out["b"], again["a"], again["b"]):
        assert loaded["tags"] == {"x"} and loaded["sd"]._metadata == {"": {"version": 1}}


def test_ints_past_pythons_decimal_digit_limit_in_sets_and_keys_round_trip(store):
    """Ints may have up to 32767 bits, but one past Python's limit for str() (4300 digits) in a
    set or as a dict key made save() a bare ValueError (sets are ordered by repr, paths join
    keys as text), and a checkpoint saved where that limit was raised failed every load where it
    was not (stop 38)."""
    import sys

    big = 2**20000
    state = {"s": {big, -big, 1, (big, "x")}, "keys": {big: 1, 2: "two"}, "t": {big: torch.ones(2)}}

    def same(loaded: dict) -> bool:  # (assert_same names paths with str(), which big ints refuse)
        return (loaded["s"] == state["s"] and list(loaded["keys"].items()) == list(state["keys"].items())
                and list(loaded["t"]) == [big] and torch.equal(loaded["t"][big], state["t"][big]))

    store.save(state, step=1)
    assert same(store.load(1))
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        store.save(state, step=2)
    finally:
        sys.set_int_max_str_digits(limit)
    assert same(store.load(2))
