"""Limits that saving and loading must agree on (issue 21, items 9 and 15): what save() accepts
loads back, and what cannot load is refused at the call, before anything is committed.

Real stores on real files, real LMDB, a real forked child and a real tmpfs; nothing is mocked."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas
from cas import faults
from cas.codecs import STAGE_ZSTD, ZSTD_MAX_LEVEL, ZSTD_MIN_LEVEL, parse_header
from cas.errors import CasError, StoreWriteError
from cas.store.values import MAX_DEPTH

KINDS = (dict, list, tuple, OrderedDict)


def open_store(path, **options):
    return cas.open(path, chunk_size=64 << 10, pack_max=16 << 10, **options)


def nested(kinds, leaf):
    """`leaf` inside one container per entry of `kinds`, the first outermost."""
    value = leaf
    for kind in reversed(kinds):
        value = kind({"x": value}) if kind in (dict, OrderedDict) else kind([value])
    return value


def levels(kinds, leaf) -> int:
    """The levels such a state nests (docs/format.md): its node is level 1, and each container and
    a numpy scalar put what they hold one level deeper."""
    return 1 + len(kinds) + isinstance(leaf, np.generic)


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    else:
        assert a == b


def save_or_refuse(store, state, step: int, accept: bool) -> None:
    """Saved and loaded back equal when `accept`; else refused at save with a TypeError naming
    the depth, and nothing committed."""
    before = [ck.step for ck in store.checkpoints()]
    if accept:
        store.save(state, step=step)
        assert_same(store.load(step), state)
    else:
        with pytest.raises(TypeError, match=f"deeper than the {MAX_DEPTH} levels"):
            store.save(state, step=step)
        assert [ck.step for ck in store.checkpoints()] == before


# --- item 9: one nesting limit for save and load --------------------------------------------
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("leaf", [7, np.float32(1.5)], ids=["int", "numpy-scalar"])
def test_nesting_at_the_limit_round_trips_and_one_more_is_refused(store, kind, leaf):
    most = MAX_DEPTH - levels([], leaf)  # containers of `kind` around `leaf` that still fit
    for step, n in enumerate((most - 1, most, most + 1), 1):
        save_or_refuse(store, nested([kind] * n, leaf), step, accept=n <= most)
    store.gc()
    assert store.verify().ok


def test_issue_states_are_refused_at_save(store):
    """The two states of the report: committed, then unloadable (and every gc failed on them)."""
    for step, state in enumerate([nested([tuple] * 63, np.float32(1.0)),
                                  nested([OrderedDict] * 63, np.int64(3))], 1):
        with pytest.raises(TypeError, match=r"'(0\.)+0'|'(x\.)+x'"):
            store.save(state, step=step)
    assert store.checkpoints() == []
    store.gc()
    assert store.verify().ok


def test_nesting_with_tensors_below_counts_the_whole_state(store):
    """Containers holding tensors become nodes of their own; the planner still counts the whole
    state, so the limit does not depend on where node boundaries fall."""
    most = MAX_DEPTH - 1
    tensor = torch.arange(5.0)
    store.save(nested([dict, tuple] * (most // 2), tensor), step=1)
    assert_same(store.load(1), nested([dict, tuple] * (most // 2), tensor))
    with pytest.raises(TypeError, match="deeper than"):
        store.save(nested([OrderedDict] * (most + 1), tensor), step=2)


def test_state_dict_metadata_counts_inside_its_ordered_dict(store):
    """A state dict's `_metadata` is packed inside its OrderedDict's payload: under {"m": ...} it
    sits at level 3, so 61 tuples fit and 63 did commit, then failed every load."""
    for step, depth, accept in ((1, MAX_DEPTH - 1, False), (2, MAX_DEPTH - 3, True)):
        module = OrderedDict(a=1)
        module._metadata = nested([tuple] * depth, 1)
        if not accept:
            with pytest.raises(TypeError, match="_metadata"):
                store.save({"m": module}, step=step)
            continue
        store.save({"m": module}, step=step)
        assert store.load(step)["m"]._metadata == module._metadata
    assert [ck.step for ck in store.checkpoints()] == [2]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=MAX_DEPTH - 4, max_size=MAX_DEPTH + 1),
       leaf=st.sampled_from([7, "s", np.float64(2.5), np.int8(-1), np.complex64(1j)]))
def test_any_mix_of_containers_near_the_limit(kinds, leaf):
    with tempfile.TemporaryDirectory() as tmp, open_store(tmp) as store:
        save_or_refuse(store, nested(kinds, leaf), 1, accept=levels(kinds, leaf) <= MAX_DEPTH)
        if levels(kinds, leaf) <= MAX_DEPTH:
            assert store.verify().ok


# --- item 15a: delta saves of numpy float128 and complex256 --------------------------------
@pytest.mark.parametrize("dtype", ["float128", "complex256"])
def test_delta_saves_of_16_byte_elements_are_written_whole(tmp_path, dtype):
    """`sub` deltas subtract integers of at most 8 bytes; a bytegroup of 16 (numpy float128,
    complex256's parts) made every delta save fail with a bare KeyError: 16."""
    if not hasattr(np, dtype):
        pytest.skip(f"numpy has no {dtype} on this platform")
    rng = np.random.default_rng(0)
    first = (rng.standard_normal(20000) * (1j if dtype == "complex256" else 1)).astype(dtype)  # 320+ KiB
    states = [{"w": first, "t": torch.randn(20000)}]
    states.append({"w": first + np.asarray(1e-6, dtype=dtype), "t": states[0]["t"] + 1e-6})
    with open_store(tmp_path / "s", delta=True) as store:
        for step, state in enumerate(states, 1):
            store.save(state, step=step)
    with open_store(tmp_path / "s", delta=True) as store:  # a resumed run reads its bases back
        states.append({"w": states[1]["w"] * 2, "t": states[1]["t"] * 2})
        store.save(states[2], step=3)
        for step, state in enumerate(states, 1):
            loaded = store.load(step)
            assert loaded["w"].dtype == np.dtype(dtype) and loaded["w"].tobytes() == state["w"].tobytes()
            assert torch.equal(loaded["t"], state["t"])
        assert store.verify().ok
        assert any(name.startswith("sub4") for name in store.codec_usage())  # the float32 tensor still deltas


# --- item 15b: every zstd level, negative ones included -------------------------------------
@pytest.mark.parametrize("level", [-1, -5, -128, -129, ZSTD_MIN_LEVEL, 0, 3, 19])
def test_every_zstd_level_saves_and_records_itself_as_a_signed_byte(tmp_path, level):
    state = {"w": torch.randn(30000), "z": torch.zeros(30000), "i": torch.arange(30000), "note": "x" * 5000}
    with open_store(tmp_path / "s", compression_level=level) as store:
        store.save(state, step=1)
        assert_same(store.load(1), state)
        assert store.verify().ok
        with store.index.read() as txn:
            records = list(store.index.iter_records(txn))
        heads = [bytes(store.objects.fetch(key)) for key, _ in records]  # fetch reuses its read buffer
    args = {arg for head in heads for sid, arg in parse_header(head).stages if sid == STAGE_ZSTD}
    if level == ZSTD_MIN_LEVEL:  # zstd's fastest level shrinks nothing here: every object is stored raw
        assert args <= {0x80}
    else:
        assert args == {max(level, -128) & 0xFF}  # docs/format.md: two's complement, clamped at -128


@pytest.mark.parametrize("level", [ZSTD_MAX_LEVEL + 1, ZSTD_MIN_LEVEL - 1, 1.5, "fast", True, None])
def test_a_level_zstd_refuses_is_refused_at_open(tmp_path, level):
    with pytest.raises(CasError, match="compression_level must be a zstd level"):
        open_store(tmp_path / "s", compression_level=level)
    assert not (tmp_path / "s").exists()  # refused before the store was created


# --- item 15c: str values msgpack cannot write -----------------------------------------------
SURROGATE = "caf\udce9"  # what os.fsdecode leaves of a Latin-1 file name


@pytest.mark.parametrize("where, state, kwargs", [
    ("'cfg.name'", {"cfg": {"name": SURROGATE}, "w": torch.ones(2)}, {}),
    ("a dict key at 'cfg'", {"cfg": {SURROGATE: 1}}, {}),
    ("'seq.1'", {"seq": ("ok", SURROGATE)}, {}),
    ("'m._metadata..version'", {"m": OrderedDict(a=1)}, {}),
    ("a metrics key", {"w": torch.ones(2)}, {"metrics": {SURROGATE: 1.0}}),
    ("'meta.files.0'", {"w": torch.ones(2)}, {"meta": {"files": [SURROGATE]}}),
    ("a dict key at 'meta.by_name'", {"w": torch.ones(2)}, {"meta": {"by_name": {SURROGATE: 1}}}),
], ids=["value", "key", "tuple", "metadata", "metrics-key", "meta-value", "meta-key"])
@pytest.mark.parametrize("call", ["save", "save_async"])
def test_a_lone_surrogate_is_refused_at_the_call(store, where, state, kwargs, call):
    if "m" in state:
        state["m"]._metadata = {"": {"version": SURROGATE}}
    with pytest.raises(TypeError, match="surrogate") as err:
        getattr(store, call)(state, step=1, **kwargs)  # save_async too: at the call, not in its future
    assert where in str(err.value)
    store.wait()
    assert store.checkpoints() == []
    store.save({"w": torch.ones(2)}, step=1, metrics={"loss": 1.0}, meta={"name": "café"})
    assert store.load(1)["w"].tolist() == [1.0, 1.0]


# --- item 15d: a Store used in a child forked after the open ---------------------------------
def test_a_forked_child_is_refused_instead_of_hanging(tmp_path):
    store = open_store(tmp_path / "s")
    store.save({"w": torch.randn(1000)}, step=1)  # the pools have threads now, which a child lacks
    store.save_async({"w": torch.randn(1000)}, step=2).result()
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, use of fork()": the point
        pid = os.fork()
    if pid == 0:  # the child: report and leave without running any of the parent's cleanup
        code = 0
        calls = {"save": lambda: store.save({"w": torch.zeros(3)}, step=3),
                 "save_async": lambda: store.save_async({"w": torch.zeros(3)}, step=3),
                 "load": lambda: store.load(1), "restore": lambda: store.restore({"w": torch.zeros(1000)})}
        for call, run in calls.items():
            try:
                run()
                code |= 1
            except CasError as exc:
                os.write(write, f"{call}: {exc}\n".encode())
            except BaseException:  # noqa: BLE001 - any other outcome fails the test
                code |= 2
        store.close()  # a no-op in the child: never waits on the parent's threads
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in save or load")
    with os.fdopen(read) as pipe:
        report = pipe.read()
    assert os.waitstatus_to_exitcode(status) == 0, report
    assert report.count(f"opened in process {os.getpid()}") == 4 and "open the store again" in report.lower()
    store.save({"w": torch.zeros(3)}, step=3)  # the parent's store is untouched
    assert [ck.step for ck in store.checkpoints()] == [1, 2, 3]
    store.close()


# --- item 15f: LMDB failing inside a write transaction --------------------------------------
def many_tensors(n: int, seed: int) -> dict:
    """Many small tensors: a commit that indexes thousands of objects, so LMDB must grow its file."""
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(8, generator=gen) for i in range(n)}


@pytest.fixture
def index_on_a_tiny_filesystem(tmp_path):
    """A store whose index/ (only) lies on a 4 MiB tmpfs, and a function that fills that tmpfs.
    The index files are copied in whole (not sparse): LMDB's lock file is a shared mapping, and
    touching an unallocated page of it on a full tmpfs would be a SIGBUS, not an error."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.save({"a": torch.randn(1000)}, step=1)
    index = path / "index"
    files = {name: (index / name).read_bytes() for name in os.listdir(index)}
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(index)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    filler = index / "filler"

    def fill() -> None:
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC

    try:
        for name, data in files.items():
            (index / name).write_bytes(data)
        yield path, fill, filler
    finally:
        subprocess.run(["umount", "-l", str(index)], capture_output=True)


def test_a_full_disk_during_the_commit_transaction_is_a_store_write_error(index_on_a_tiny_filesystem):
    """Only the index is on the full filesystem: the record log entry is created (the save is
    committed), and the cache update fails. The save returns its checkpoint (with a warning),
    never "nothing was committed" for a step the store holds; the cache catches up once there is
    space, and the step loads. A write that fails before any entry exists is a StoreWriteError."""
    path, fill, filler = index_on_a_tiny_filesystem
    paused = str(path.parent / "paused")
    with open_store(path) as store:
        faults.configure(f"commit.synced=pause:{paused}")  # every object is durable; the commit is next
        try:
            future = store.save_async(many_tensors(3000, 2), step=2)
            deadline = time.monotonic() + 60
            while not os.path.exists(paused + ".reached") and time.monotonic() < deadline:
                time.sleep(0.01)
            fill()
            open(paused, "w").close()
            assert future.result(timeout=60).step == 2
        finally:
            faults.configure("")
        try:  # still full: refused before its log entry (nothing committed), or committed and warned
            with pytest.warns(RuntimeWarning, match="step 3 is committed"):
                store.save(many_tensors(3000, 3), step=3)
            third = [3]
        except StoreWriteError as exc:
            assert "nothing was committed" in str(exc)
            third = []
        os.unlink(filler)  # space is back
        store.ensure_cache()
        assert [ck.step for ck in store.checkpoints()] == [1, 2, *third]  # what each call said is what stands
        with pytest.raises(cas.CheckpointExistsError):
            store.save(many_tensors(3000, 2), step=2)
        assert_same(store.load(2), many_tensors(3000, 2))
        if not third:
            store.save(many_tensors(3000, 3), step=3)
        assert_same(store.load(3), many_tensors(3000, 3))
        assert store.verify().ok


def test_a_full_disk_in_another_write_is_a_store_write_error_naming_the_store(index_on_a_tiny_filesystem):
    path, fill, filler = index_on_a_tiny_filesystem
    with open_store(path) as store:
        fill()
        with pytest.raises(StoreWriteError, match=f"index of the store at {path}.*nothing of that change"):
            with store.index.write() as txn:  # what every registry change and lease goes through
                for i in range(20000):
                    txn.put(b"test-%d" % i, b"x" * 100, db=store.index.db("meta"))
        os.unlink(filler)
        with store.index.read() as txn:
            assert txn.get(b"test-0", db=store.index.db("meta")) is None
        assert store.load(1)["a"].shape == (1000,)


@pytest.mark.parametrize("save", ["save", "save_async"])
def test_plain_values_that_pack_past_what_an_object_holds_are_refused_before_the_commit(tmp_path, monkeypatch, save):
    """A 2 GiB bytes value packed into a manifest node larger than a reader accepts of one
    object: the save committed a checkpoint that every load refused ("object header is
    implausible"), the newest one at that (audit of stop 38; the repro needs 7 GiB, so the
    limit is lowered here). The save now refuses it naming the value, and commits nothing."""
    from cas.store import tree

    monkeypatch.setattr(tree, "MAX_NODE_BYTES", 1 << 20)
    state = {"w": torch.arange(10.0), "config": {"name": "run", "blob": bytes(2 << 20)}}
    with cas.open(tmp_path / "s") as store:
        with pytest.raises(TypeError, match=r"cannot store '<root>'.* \(the largest, at 'config\.blob', is 2097152 bytes\)"):
            getattr(store, save)(state, step=1).result() if save == "save_async" else store.save(state, step=1)
        assert store.checkpoints() == []
        state["config"]["blob"] = bytes(1000)
        store.save(state, step=1)
        assert store.load(1)["config"]["blob"] == bytes(1000)
