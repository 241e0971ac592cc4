"""Bad input gets a clear error naming what is wrong, and changes nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import msgpack
import pytest
import torch

import cas
from cas.store.layout import CONFIG_MAGIC


def _tree(path) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[p] = fh.read()
    return out


def test_folder_that_is_not_a_store_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    before = _tree(tmp_path)
    with pytest.raises(cas.NotAStoreError, match="not a cas store"):
        cas.open(tmp_path)
    assert _tree(tmp_path) == before


def test_missing_path_is_not_created_when_create_is_false(tmp_path):
    with pytest.raises(cas.NotAStoreError):
        cas.open(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()


def test_empty_folder_becomes_a_store(tmp_path):
    with cas.open(tmp_path) as s:
        assert s.checkpoints() == [] and s.latest() is None


def rewrite_config(cfg, field: str, value) -> None:
    """The config with one field changed and its digest made to match, as a cas (a newer one, a
    buggy one) that wrote it would have: a change one byte away is otherwise read as damage and
    undone (store/layout.py)."""
    from cas.hashing import hash_bytes

    body = msgpack.unpackb(cfg.read_bytes()[len(CONFIG_MAGIC):])
    body.pop("digest")
    body[field] = value
    body["digest"] = bytes(32)
    data = CONFIG_MAGIC + msgpack.packb(body, use_bin_type=True)
    cfg.write_bytes(data[:-32] + hash_bytes(data[:-41]))


def test_store_of_a_newer_format_is_refused(store_path):
    cas.open(store_path).close()
    rewrite_config(store_path / "config", "format", 99)
    with pytest.raises(cas.FormatVersionError, match="format version 99"):
        cas.open(store_path)


@pytest.mark.parametrize("field, value", [("format", True), ("format", 2.0), ("format", "2"),
                                          ("chunk_size", float(1 << 20)), ("chunk_size", True),
                                          ("created", "yesterday"), ("created", True), ("store_id", 12345)])
def test_config_fields_of_the_wrong_type_are_refused_and_unchanged(store_path, field, value):
    cas.open(store_path).close()
    cfg = store_path / "config"
    rewrite_config(cfg, field, value)  # format True == 1: read so, the store was "upgraded" (its config rewritten)
    before = cfg.read_bytes()
    with pytest.raises(cas.NotAStoreError, match=f"damaged: its '{field}' is"):
        cas.open(store_path)
    assert cfg.read_bytes() == before


def test_damaged_config_is_not_a_store(store_path):
    cas.open(store_path).close()
    (store_path / "config").write_bytes(CONFIG_MAGIC + b"\xc1garbage")
    with pytest.raises(cas.NotAStoreError, match="damaged"):
        cas.open(store_path)


def test_missing_step_and_empty_store(store):
    with pytest.raises(cas.CheckpointNotFoundError, match="holds no checkpoint"):
        store.load()
    store.save({"x": torch.ones(3)}, step=5)
    with pytest.raises(cas.CheckpointNotFoundError, match="step 6"):
        store.load(6)
    with pytest.raises(cas.CheckpointNotFoundError):
        store.delete(6)
    with pytest.raises(cas.CheckpointNotFoundError, match="no top-level entries"):
        store.load(5, keys=["y"])


def test_existing_step_is_never_overwritten(store):
    store.save({"x": torch.ones(3)}, step=5)
    with pytest.raises(cas.CheckpointExistsError, match="step 5 already exists"):
        store.save({"x": torch.zeros(3)}, step=5)
    assert torch.equal(store.load(5)["x"], torch.ones(3))


@pytest.mark.parametrize("step", ["5", 5.0, None, True])
def test_step_must_be_an_int(store, step):
    with pytest.raises(TypeError, match="step must be an int"):
        store.save({"x": 1}, step=step)


@pytest.mark.parametrize("leaf,what", [
    (object(), "builtins.object"),
    (torch.randn(3).to_sparse(), "layout"),
    ({(1, 2): 3}, "dict key"),
    (bytearray(b"x"), "bytearray"),
    (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "dtype"),
    (__import__("numpy").array([object()]), "dtype object"),
])
def test_unsupported_leaf_raises_type_error_naming_its_path_and_commits_nothing(store, leaf, what):
    with pytest.raises(TypeError, match=f"{what}.*'opt.state.0'|'opt.state.0'.*{what}|{what}") as info:
        store.save({"model": {"w": torch.ones(4)}, "opt": {"state": [leaf]}}, step=1)
    assert "opt.state.0" in str(info.value)
    assert store.checkpoints() == []
    with store.index.read() as txn:
        assert store.index.leases(txn) == {}


def _cyclic_list() -> list:
    loop = [torch.ones(2)]
    loop.append(loop)
    return loop


def _cyclic_dict() -> dict:
    loop = {"w": torch.ones(2)}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize("make,path", [(_cyclic_list, "opt.state.1"), (_cyclic_dict, "opt.state.self")])
def test_a_state_that_contains_itself_is_a_type_error_naming_its_path(store, make, path):
    with pytest.raises(TypeError, match=f"'{path}'.*contains itself"):
        store.save({"opt": {"state": make()}}, step=1)
    with pytest.raises(TypeError, match=f"'{path}'.*contains itself"):
        store.save_async({"opt": {"state": make()}}, step=2).result()
    shared = [torch.ones(2)]
    store.save({"a": shared, "b": [shared, shared]}, step=3)  # shared, not cyclic: saved
    assert [c.step for c in store.checkpoints()] == [3]


def test_a_very_deep_state_is_refused_as_too_deep_not_a_recursion_error(store):
    value = torch.ones(1)
    for _ in range(5000):
        value = [value]
    with pytest.raises(TypeError, match="deeper than the"):
        store.save({"x": value}, step=1)
    assert store.checkpoints() == []


def test_bad_metrics_and_meta(store):
    with pytest.raises(TypeError, match="metric 'loss'"):
        store.save({}, step=1, metrics={"loss": "low"})
    with pytest.raises(TypeError, match="meta"):
        store.save({}, step=1, meta={"x": object()})
    assert store.checkpoints() == []


def test_chunk_size_is_fixed_at_creation(store_path):
    cas.open(store_path, chunk_size=1 << 20).close()
    with pytest.raises(cas.CasError, match="created with chunk_size 1048576"):
        cas.open(store_path, chunk_size=2 << 20)
    with pytest.raises(cas.CasError, match="chunk_size must be"):
        cas.open(store_path.parent / "other", chunk_size=3)


@pytest.mark.parametrize("bad", [0, False, True, 1.5, -1])
def test_a_bad_chunk_size_creates_nothing(tmp_path, bad):
    path = tmp_path / "new"
    with pytest.raises(cas.CasError, match="chunk_size must be"):
        cas.open(path, chunk_size=bad)
    assert not path.exists()


@pytest.mark.parametrize("steps", [1.0, None, "1", True])
def test_delete_of_what_is_not_a_step_is_a_type_error(store, steps):
    store.save({"x": torch.ones(1)}, step=1)
    with pytest.raises(TypeError, match="a step"):
        store.delete(steps)
    assert [c.step for c in store.checkpoints()] == [1]


@pytest.mark.parametrize("device,error,what", [
    ("bogus", ValueError, "cannot load onto device 'bogus'"),
    (1.5, TypeError, "device must be"),
    pytest.param("cuda", ValueError, "cannot load onto device 'cuda'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")),
    pytest.param("cuda:63", ValueError, "cannot load onto device 'cuda:63'",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here")),
])
def test_load_onto_a_device_torch_cannot_use_is_refused_before_reading(store, device, error, what):
    store.save({"x": torch.ones(1)}, step=1)
    with pytest.raises(error, match=what):
        store.load(device=device)
    with pytest.raises(error, match=what):  # before the step is looked up, so before any read
        store.load(7, device=device)
    assert store.load(device="cpu")["x"].device.type == "cpu"


def test_closed_store_refuses_work(store_path):
    s = cas.open(store_path)
    s.close()
    with pytest.raises(cas.StoreClosedError):
        s.checkpoints()


@pytest.mark.parametrize("readonly", [False, True])
def test_a_path_below_a_regular_file_is_refused_naming_it(tmp_path, readonly):
    (tmp_path / "afile").write_bytes(b"hello")
    path = tmp_path / "afile" / "sub" / "store"
    what = "a part of its path is a file, not a folder" if readonly else "cannot create a store at .*Not a directory"
    with pytest.raises(cas.NotAStoreError, match=what):
        cas.open(path, readonly=readonly)
    assert (tmp_path / "afile").read_bytes() == b"hello"


def _as_unprivileged(*argv) -> subprocess.CompletedProcess:
    """Run python with `argv` where file modes apply: as root, without the capabilities that
    override them (a process of another user could not import this checkout)."""
    prefix = []
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    return subprocess.run([*prefix, sys.executable, *argv], capture_output=True, text=True, timeout=120)


_OPEN = """
import sys, cas
try:
    cas.open(sys.argv[1], readonly=sys.argv[2] == "1").close()
except cas.CasError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root without setpriv ignores modes")
def test_folders_without_permission_are_refused_by_name(tmp_path):
    for name in ("closed", "closed_log"):
        with cas.open(tmp_path / name) as store:
            store.save({"w": torch.ones(2)}, step=1)
    (tmp_path / "readonly_parent").mkdir()
    modes = {"closed": 0, "closed_log/log": 0, "readonly_parent": 0o555}
    try:
        for where, mode in modes.items():
            os.chmod(tmp_path / where, mode)
        for name, readonly, said in [("closed", "0", "closed is not a readable cas store: .*Permission denied"),
                                     ("closed_log", "0", "cannot open the store at .*Permission denied: .*log"),
                                     ("closed_log", "1", "cannot open the store at .*Permission denied: .*log"),
                                     ("readonly_parent/new", "0", "cannot create a store at .*Permission denied")]:
            out = _as_unprivileged("-c", _OPEN, str(tmp_path / name), readonly)
            assert out.returncode == 0 and out.stdout.startswith("NotAStoreError"), out.stdout + out.stderr
            assert re.search(said, out.stdout), out.stdout
        cli = _as_unprivileged("-m", "cas.cli", "--store", str(tmp_path / "closed_log"), "ls")
        assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
        assert str(tmp_path / "closed_log") in cli.stderr and "Traceback" not in cli.stderr
        assert not (tmp_path / "readonly_parent" / "new").exists()
    finally:
        for where in modes:
            os.chmod(tmp_path / where, 0o755)


def test_a_regular_file_is_not_a_store(tmp_path):
    path = tmp_path / "afile"
    path.write_bytes(b"hello")
    with pytest.raises(cas.NotAStoreError, match="is a file, not a folder"):
        cas.open(path)
    assert path.read_bytes() == b"hello"


def test_processes_opening_a_new_path_at_once_create_one_store(tmp_path):
    """Every rank of a job may open the store at start: one creates it, the others wait and
    open it (a process once found the folder half made and was refused)."""
    path, flag = str(tmp_path / "s"), str(tmp_path / "go")
    code = "import sys, cas; cas.open(sys.argv[1], chunk_size=64 << 10).close()"
    first = subprocess.Popen([sys.executable, "-c", code, path], stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, CAS_FAULTS=f"store.creating=pause:{flag}"))
    deadline = time.monotonic() + 60
    while not os.path.exists(flag + ".reached"):  # paused with the folders made, no config yet
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)
    second = subprocess.Popen([sys.executable, "-c", code, path], stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    open(flag, "w").close()
    errors = [first.communicate(timeout=60)[1], second.communicate(timeout=60)[1]]
    assert first.returncode == 0 and second.returncode == 0, errors
    with cas.open(path, create=False) as store:
        assert store.chunk_size == 64 << 10


def test_a_creation_cut_short_is_finished_by_the_next_open(tmp_path):
    path = tmp_path / "s"
    for folder in ("index", "objects", "tmp"):
        (path / folder).mkdir(parents=True)
    with cas.open(path) as store:
        store.save({"x": torch.ones(3)}, step=1)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "objects" / "ab").mkdir(parents=True)  # objects but no config: not ours to touch
    with pytest.raises(cas.NotAStoreError):
        cas.open(tmp_path / "t")


@pytest.mark.parametrize("kind", ["folder", "symlink"])
def test_a_create_lock_that_is_not_a_plain_file_is_refused_and_followed_nowhere(tmp_path, kind):
    root, outside = tmp_path / "s", tmp_path / "outside"
    root.mkdir()
    if kind == "folder":
        (root / "create.lock").mkdir()
    else:
        os.symlink(outside, root / "create.lock")
    with pytest.raises(cas.NotAStoreError):
        cas.open(root)
    assert not outside.exists() and sorted(os.listdir(root)) == ["create.lock"]


def test_an_int_too_large_to_load_back_is_refused_at_save(store):
    """Loaders refuse integers beyond 4096 bytes (a bound against hostile manifests): such a
    value used to save fine and make its checkpoint unloadable."""
    with pytest.raises(TypeError, match="at 'big'"):
        store.save({"big": 2 ** 40000, "w": torch.ones(2)}, step=1)
    with pytest.raises(TypeError, match="int of"):
        store.save({2 ** 40000: 1}, step=1)
    store.save({"big": 2 ** 30000}, step=1)
    assert store.load(1)["big"] == 2 ** 30000


def test_a_failed_index_write_advises_room_for_a_full_disk_and_repair_for_damage():
    """A damaged cache file made LMDB refuse a transaction (MDB_BAD_TXN) and the error told the
    user to free disk space (a black-box audit). The advice now follows the failure."""
    import errno

    import lmdb

    from cas.index import write_advice
    for room in (lmdb.DiskError("mdb_txn_commit", errno.ENOSPC), lmdb.MapFullError("mdb_put"),
                 lmdb.Error("mdb_txn_commit", errno.EROFS)):
        assert write_advice(room).startswith("Free space"), room
    for damage in (lmdb.BadTxnError("mdb_put: MDB_BAD_TXN"), lmdb.CorruptedError("mdb_get"),
                   lmdb.PageNotFoundError("mdb_cursor_get")):
        assert "`cas repair` rebuilds it" in write_advice(damage), damage
