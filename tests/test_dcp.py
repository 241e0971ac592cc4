"""torch.distributed.checkpoint through the store: multi-rank saves (gloo on CPU, FSDP2 and
DTensor), loads at other world sizes, dedup across saves and world sizes, failures that commit
nothing, async executors, and the store's own tools (verify, gc, show) over DCP checkpoints.

Process groups cost seconds to start here, so each spawned group (tests/dcp_worker.py) runs a
scenario of several checks once per module; the tests below assert on what it reports and on
the store it leaves. Single-process checks call DCP in-process with no_dist=True.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from dcp_worker import train
from test_delta import FLOATS, _trajectory, chains, next_state
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cas
from cas import cli as cas_cli
from cas import faults
from cas.store import dcp as cdcp
from cas.store.tensors import TORCH_DTYPES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHUNK = 64 << 10
EXTRA = {"epoch": 3, "name": "run-a", "pair": (1, 2.5, "x"), "table": {1: "one", 2: "two"}, "ids": [4, 5]}


# --- spawning rank groups -----------------------------------------------------------------------
@dataclass
class Group:
    store: str
    out: str
    returncodes: list[int]
    ranks: dict[int, dict]  # rank -> the JSON it wrote (absent for a rank that died)
    stderr: list[str]
    seconds: float


def run_group(scenario: str, world: int, store, out, *, env: dict | None = None, timeout: float = 150) -> Group:
    """Start `world` worker processes on one gloo FileStore and wait for all of them."""
    os.makedirs(out, exist_ok=True)
    pg_file = os.path.join(out, f"pg-{scenario}-{time.monotonic_ns()}")
    procs = []
    t0 = time.perf_counter()
    for rank in range(world):
        child_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                         DCP_PG_FILE=pg_file, MASTER_ADDR="127.0.0.1", PYTHONPATH=ROOT, **(env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "dcp_worker.py"), scenario, str(store),
                                       str(out)], env=child_env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = {}
    for rank in range(world):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[rank] = json.load(f)
    return Group(str(store), str(out), [p.returncode for p in procs], ranks, errs, time.perf_counter() - t0)


def require_ok(group: Group) -> Group:
    bad = [r for r, rc in enumerate(group.returncodes) if rc != 0]
    assert not bad, f"ranks {bad} failed:\n" + "\n".join(group.stderr[r][-4000:] for r in bad)
    return group


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Group:
    """2 ranks, FSDP2 + AdamW + extras: steps 1, 2 (unchanged), 3 (thread async), 4 (process async)."""
    base = tmp_path_factory.mktemp("dcp_saved")
    return require_ok(run_group("save", 2, base / "store", base / "out"))


@pytest.fixture(scope="module")
def resharded(saved) -> Group:
    """3 ranks load step 1 of the 2-rank save, compare, and save it as step 10."""
    return require_ok(run_group("reshard", 3, saved.store, saved.out))


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> Group:
    """2 ranks: step 1 commits; step 2 rank 1 raises; step 3 direct dcp.save, rank 1 raises;
    step 4 rank 1 is SIGKILLed."""
    base = tmp_path_factory.mktemp("dcp_failures")
    return run_group("failures", 2, base / "store", base / "out")


def copy_store(group: Group, dest) -> str:
    shutil.copytree(group.store, dest)
    return str(dest)


# --- reference data and comparisons -------------------------------------------------------------
def reference(group: Group, name: str) -> dict:
    return torch.load(os.path.join(group.out, f"{name}.pt"), weights_only=True)


def blank_target(ref: dict) -> dict:
    """A plain-tensor target with the saved layout (model, optim, extra), all zeros."""
    state: dict = {}
    for path, t in ref.items():
        node = state
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = torch.zeros_like(t)
    state["optim"]["param_groups"] = [{"betas": None, "params": None}]
    state["extra"] = {"epoch": 0, "name": "", "pair": (), "table": {1: "", 2: ""}, "ids": []}
    return state


def flat(value, prefix: str = "") -> dict:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    out = {}
    for k, v in value.items() if isinstance(value, dict) else []:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                   b.reshape(-1).view(torch.uint8))


def load_plain(path: str, step: int | None, ref: dict) -> tuple[dict, cas.Checkpoint]:
    state = blank_target(ref)
    ck = cdcp.load(state, path, step, no_dist=True)
    return state, ck


def small_state(seed: int) -> dict:
    """The full tensors of dcp_worker.small_state(world, seed) (same generator order)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 256, generator=g), "r": torch.randn(33, generator=g), "extra": {"seed": seed}}


def leases(path: str) -> list[dict]:
    with cas.open(path, readonly=True) as store, store.index.read() as txn:
        return list(store.index.leases(txn).values())


def object_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(path, "objects")))


def cli(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cas.cli", "--store", path, *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


# --- multi-rank saves ---------------------------------------------------------------------------
def test_every_rank_sees_the_same_commits_and_the_world_size_is_recorded(saved):
    ids = {step: {r[step]["id"] for r in (saved.ranks[0]["saved"], saved.ranks[1]["saved"])}
           for step in ("1", "2", "3", "4")}
    assert all(len(v) == 1 for v in ids.values()), ids
    with cas.open(saved.store, readonly=True) as store:
        cks = {ck.step: ck for ck in store.checkpoints()}
    assert {1, 2, 3, 4} <= set(cks)
    assert cks[1].id == ids["1"].pop()
    meta = cks[1].provenance["dcp"]  # meta= stays the user's own: a "dcp" key of theirs is kept as given
    assert cks[1].meta == {} and cks[2].meta == {"dcp": "the user's own"}
    assert meta["world_size"] == 2 == cks[1].provenance["world_size"]
    assert meta["sharding"]["model.0.weight"] == "dim0/2"
    assert meta["sharding"]["optim.state.0.weight.exp_avg"] == "dim0/2"
    assert meta["sharding"]["optim.state.0.weight.step"] == "whole"


def test_one_rank_loads_the_two_rank_save_bit_for_bit(saved):
    ref = reference(saved, "ref1")
    state, ck = load_plain(saved.store, 1, ref)
    assert ck.step == 1
    loaded = flat({"model": state["model"], "optim": {"state": state["optim"]["state"]}})
    assert set(loaded) == set(ref)
    assert [k for k in ref if not same_bits(loaded[k], ref[k])] == []
    assert state["extra"] == EXTRA
    assert type(state["extra"]["pair"]) is tuple and list(state["extra"]["table"]) == [1, 2]
    assert state["optim"]["param_groups"][0] == {"betas": (0.9, 0.999),
                                                 "params": ["0.weight", "0.bias", "2.weight", "2.bias"]}


def test_async_saves_commit_a_snapshot_of_the_state_at_the_call(saved):
    """Thread executor (step 3) and process executor (step 4): each holds the state as it was
    when async_save was called, although training went on during the thread executor's save."""
    for step, name in ((3, "ref3"), (4, "ref4")):
        ref = reference(saved, name)
        state, _ = load_plain(saved.store, step, ref)
        model = flat(state["model"], "model")
        assert [k for k in model if not same_bits(model[k], ref[k])] == [], step
    ref3, ref4 = reference(saved, "ref3"), reference(saved, "ref4")
    assert not same_bits(ref3["model.0.weight"], ref4["model.0.weight"])  # training did change it


def test_an_unchanged_second_save_writes_almost_nothing(saved):
    first, second = saved.ranks[0]["saved"]["1"], saved.ranks[0]["saved"]["2"]
    assert first["logical"] > 5 << 20 and first["new"] > first["logical"] // 2
    assert second["logical"] == first["logical"]
    assert second["new"] < 4096, second  # a commit node, nothing else


def test_three_ranks_load_the_two_rank_save_bit_for_bit(resharded):
    r0 = resharded.ranks[0]
    assert r0["compared"] == 16 and r0["mismatches"] == []
    assert [resharded.ranks[r]["local_rows"] for r in range(3)] == [342, 342, 340]  # resharded, unevenly
    expected = repr(EXTRA)
    assert all(resharded.ranks[r]["extra"] == expected and resharded.ranks[r]["loaded_step"] == 1 for r in range(3))


def test_three_ranks_load_a_tensor_as_column_blocks(resharded):
    """Saved as row shards, loaded as Shard(1): each rank narrows both stored shards along dim 1."""
    assert [resharded.ranks[r]["column_block"] for r in range(3)] == [[1024, 86], [1024, 86], [1024, 84]]
    assert resharded.ranks[0]["columns_match"] is True


def test_a_save_after_resharding_dedups_against_the_two_rank_save(resharded):
    """Chunks are cut on each tensor's global byte grid, so the 3-rank save of the same values
    only writes the chunks that straddle the new shard boundaries (about 12% here; cutting at
    each shard's own start would rewrite about two thirds)."""
    step10 = resharded.ranks[0]["saved"]
    assert step10["new"] < 0.25 * step10["logical"], step10
    with cas.open(resharded.store, readonly=True) as store:
        ck = store.get(10)
        assert ck.provenance["dcp"]["world_size"] == 3
        assert ck.provenance["dcp"]["sharding"]["model.0.weight"] == "dim0/3"
        shards = [t for t in store.tensors(10) if t["path"].startswith("tensors.model.0.weight.")]
        before = {k for t in store.tensors(1) for k in t["chunks"]}
    assert [t["shape"] for t in shards] == [[342, 256], [342, 256], [340, 256]]
    keys = [k for t in shards for k in t["chunks"]]
    assert sum(k in before for k in keys) >= len(keys) - 4  # two boundaries, two partial chunks each


def test_store_tensors_verify_and_load_work_on_dcp_checkpoints(saved):
    ref = reference(saved, "ref1")
    with cas.open(saved.store, readonly=True) as store:
        tensors = {t["path"]: t for t in store.tensors(1)}
        assert tensors["tensors.model.0.weight.0"]["shape"] == [512, 256]
        assert tensors["tensors.model.0.weight.1"]["shape"] == [512, 256]
        assert sum(t["bytes"] for t in tensors.values()) == store.get(1).logical_bytes
        report = store.verify()
        assert report.ok and {1, 2, 3, 4} <= set(report.checked_checkpoints)
        plain = store.load(1)  # an ordinary load gives the shards and DCP's metadata as plain values
    weight = torch.cat(plain["tensors"]["model.0.weight"])
    assert same_bits(weight, ref["model.0.weight"])
    assert plain["metadata"]["items"]["model.0.weight"]["chunks"] == [[[0, 0], [512, 256]], [[512, 0], [512, 256]]]
    assert plain["values"]["extra.pair"] == {"v": (1, 2.5, "x")}


def test_cli_show_verify_and_gc_over_dcp_checkpoints(resharded, tmp_path):
    path = copy_store(resharded, tmp_path / "store")
    shown = cli_json(path, "show", "1")
    assert shown["checkpoint"]["provenance"]["dcp"]["world_size"] == 2
    text = cli(path, "show", "1").stdout
    assert 'dcp 2 ranks, sharding {"model.0.weight": "dim0/2"' in text, text
    assert len(shown["tensors"]) == len(cli_json(path, "show", "2")["tensors"])
    verified = cli(path, "verify")
    assert verified.returncode == 0 and verified.stdout.startswith("ok"), verified.stdout + verified.stderr
    files_before = object_files(path)
    collected = cli(path, "gc", "--keep-last", "1")
    assert collected.returncode == 0, collected.stderr
    with cas.open(path, readonly=True) as store:
        assert [ck.step for ck in store.checkpoints()] == [10]
        assert store.verify().ok
    assert object_files(path) < files_before
    ref = reference(resharded, "ref1")  # step 10 holds step 1's values
    state, ck = load_plain(path, None, ref)
    assert ck.step == 10 and same_bits(state["model"]["2"]["weight"], ref["model.2.weight"])


def cli_json(path: str, *args: str) -> dict:
    """`cas ARGS --json`, in this process."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cas_cli.main(["--store", path, *args, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_ordinary_checkpoints_share_the_store_with_dcp_ones(saved, tmp_path):
    path = copy_store(saved, tmp_path / "store")
    ref = reference(saved, "ref1")
    ordinary = {"w": ref["model.0.weight"][:512].clone(), "n": 7}  # rank 0's shard, as a plain tensor
    with cas.open(path) as store:
        ck = store.save(ordinary, step=100)
        assert ck.new_bytes < 64 << 10  # its chunks are the DCP save's
        back = store.load(100)
        assert back["n"] == 7 and same_bits(back["w"], ordinary["w"])
    state, _ = load_plain(path, 1, ref)
    assert same_bits(state["model"]["0"]["weight"], ref["model.0.weight"])


# --- failures -----------------------------------------------------------------------------------
def test_a_rank_that_raises_fails_the_save_on_every_rank_and_commits_nothing(failures):
    assert failures.returncodes[0] == 0, failures.stderr[0][-4000:]
    for rank in (0, 1):
        err = failures.ranks[rank]["wrapped"]
        assert err["cas"] and err["type"] == "InjectedFault" and "dcp.write_data" in err["message"]
    assert failures.ranks[0]["leases_after_wrapped"] == []  # the coordinator's barrier lease ended
    with cas.open(failures.store, readonly=True) as store:
        assert [ck.step for ck in store.checkpoints()] == [1]
    expect = small_state(1)
    target = {"w": torch.zeros(512, 256), "r": torch.zeros(33), "extra": {"seed": 0}}
    cdcp.load(target, failures.store, 1, no_dist=True)
    assert same_bits(target["w"], expect["w"]) and same_bits(target["r"], expect["r"])
    assert target["extra"] == {"seed": 1}


def test_a_direct_dcp_save_raises_dcps_exception_and_dropping_the_writer_ends_its_lease(failures):
    assert failures.returncodes[0] == 0, failures.stderr[0][-4000:]
    for rank in (0, 1):
        assert failures.ranks[rank]["direct"] == {"type": "CheckpointException", "is_exception": False}
    assert failures.ranks[0]["leases_before_drop"] == ["barrier:dcp step 3"]
    assert failures.ranks[0]["leases_after_drop"] == []


def test_a_killed_rank_commits_nothing_and_gc_reclaims_what_was_written(failures):
    assert failures.returncodes == [0, -9], failures.stderr[0][-4000:]
    err = failures.ranks[0]["killed"]
    assert err["cas"] and err["type"] == "DistributedCheckpointError", err
    assert "killed" not in failures.ranks[1]  # rank 1 died in the save
    assert leases(failures.store) == []
    with cas.open(failures.store) as store:
        assert [ck.step for ck in store.checkpoints()] == [1]
        live = {k for t in store.tensors(1) for k in t["chunks"]}
        orphans_before = object_files(failures.store) - len(live)
        assert orphans_before > 0  # the failed saves' chunks are on disk, unreferenced
        report = store.gc()
        assert report.deferred is None and report.objects_swept >= orphans_before
        assert store.verify().ok
    assert object_files(failures.store) == len(live)


def run_solo(tmp_path, step: int, faults_spec: str) -> subprocess.Popen:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", DCP_STEP=str(step), CAS_FAULTS=faults_spec, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, os.path.join(HERE, "dcp_worker.py"), "solo", str(tmp_path / "store"),
                             str(tmp_path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_gc_does_not_sweep_while_a_dcp_save_is_in_progress(tmp_path):
    """The coordinator's barrier lease exists before any rank looks at files: a gc that runs
    while ranks have written chunks, but before the commit, deletes nothing."""
    gate = str(tmp_path / "gate")
    proc = run_solo(tmp_path, 7, f"dcp.rank_written=pause:{gate}")
    try:
        wait_for(gate + ".reached", proc)
        written = object_files(str(tmp_path / "store"))
        assert written > 0
        with cas.open(tmp_path / "store") as store:
            report = store.gc()
        assert report.deferred is not None and "dcp step 7" in report.deferred
        assert report.objects_swept == 0 and object_files(str(tmp_path / "store")) == written
    finally:
        open(gate, "w").close()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    with cas.open(tmp_path / "store") as store:
        assert [ck.step for ck in store.checkpoints()] == [7] and store.verify().ok


def test_a_killed_coordinator_leaves_a_lease_that_gc_reaps(tmp_path):
    proc = run_solo(tmp_path, 8, "dcp.finish=kill")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err
    path = str(tmp_path / "store")
    assert [info["purpose"] for info in leases(path)] == ["barrier:dcp step 8"]
    with cas.open(path) as store:
        assert store.checkpoints() == []
        report = store.gc()
        assert report.leases_reaped == 1 and report.deferred is None and report.objects_swept > 0
    assert leases(path) == [] and object_files(path) == 0


# --- single process (no process group) ----------------------------------------------------------
def plain_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 100, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.arange(5), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
            "extra": {"k": 1, "t": (1, (2, "x")), "d": {3: "c"}, "none": None}}


def zeros_like_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else zeros_like_state(v) if isinstance(v, dict) \
            else type(v)() if isinstance(v, (tuple, list, str)) else None
    return out


def test_single_process_round_trip_keeps_dtypes_tuples_and_int_keys(tmp_path):
    state = plain_state()
    saved = cdcp.save(state, tmp_path / "s", 1, chunk_size=CHUNK, no_dist=True)
    target = zeros_like_state(state)
    target["extra"]["d"] = {3: ""}
    ck = cdcp.load(target, tmp_path / "s", no_dist=True)  # step None: the latest
    assert ck.step == 1 and ck.id == saved.id
    for key in ("w", "b", "i", "scalar", "empty"):
        assert same_bits(target[key], state[key]), key
    assert target["extra"] == state["extra"] and list(target["extra"]["d"]) == [3]
    assert type(target["extra"]["t"][1]) is tuple


def test_dcp_returns_only_a_small_summary_to_every_rank(tmp_path):
    metadata = dcp.save(plain_state(), storage_writer=cdcp.CasWriter(tmp_path / "s", step=1), no_dist=True)
    assert len(pickle.dumps(metadata.storage_data)) < 300
    assert cdcp.SavedCheckpoint.from_storage_data(metadata.storage_data).step == 1


def test_values_never_go_through_pickle_unless_asked(tmp_path):
    from fractions import Fraction

    state = {"w": torch.ones(3), "extra": {"plain": (1, 2), "odd": Fraction(1, 3)}}  # no plain value
    with pytest.warns(UserWarning, match="extra.odd"):
        cdcp.save(state, tmp_path / "s", 1, no_dist=True)
    with cas.open(tmp_path / "s", readonly=True) as store:
        values = store.load(1)["values"]
    assert values["extra.plain"] == {"v": (1, 2)} and set(values["extra.odd"]) == {"pickle"}
    target = {"w": torch.zeros(3), "extra": {"plain": (), "odd": Fraction(0)}}
    with pytest.raises(cas.CasError, match="extra.odd.*allow_pickle=True"):
        cdcp.load(target, tmp_path / "s", 1, no_dist=True)
    cdcp.load(target, tmp_path / "s", 1, no_dist=True, allow_pickle=True)
    assert target["extra"] == {"plain": (1, 2), "odd": Fraction(1, 3)}


def test_missing_and_existing_steps(tmp_path):
    with pytest.raises(cas.NotAStoreError):
        cdcp.load({"w": torch.zeros(3)}, tmp_path / "s", no_dist=True)
    with cas.open(tmp_path / "s") as store:
        with pytest.raises(cas.CheckpointNotFoundError, match="no checkpoint"):
            cdcp.load({"w": torch.zeros(3)}, store, no_dist=True)  # an empty store has no latest
        cdcp.save({"w": torch.ones(3)}, store, 1, no_dist=True)  # the caller's open store is lent
    with pytest.raises(cas.CheckpointNotFoundError, match="step 2"):
        cdcp.load({"w": torch.zeros(3)}, tmp_path / "s", 2, no_dist=True)
    with pytest.raises(cas.CheckpointExistsError):
        cdcp.save({"w": torch.ones(3)}, tmp_path / "s", 1, no_dist=True)
    assert leases(str(tmp_path / "s")) == []
    with pytest.raises(CheckpointException):  # direct use: DCP's own exception (a BaseException)
        dcp.load({"w": torch.zeros(3)}, storage_reader=cdcp.CasReader(tmp_path / "s", step=2), no_dist=True)


def test_an_ordinary_checkpoint_is_refused_by_the_reader(tmp_path):
    with cas.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(3)}, step=1)
    with pytest.raises(cas.CasError, match="not saved through DCP"):
        cdcp.load({"w": torch.zeros(3)}, tmp_path / "s", 1, no_dist=True)


def test_use_collectives_false_is_refused(tmp_path):
    with pytest.raises(cas.CasError, match="use_collectives"):
        dcp.save({"w": torch.ones(3)}, storage_writer=cdcp.CasWriter(tmp_path / "s", step=1), no_dist=True,
                 use_collectives=False)


def test_writer_and_reader_pickle_without_open_handles(tmp_path):
    writer = cdcp.CasWriter(tmp_path / "s", step=1, chunk_size=CHUNK)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)  # the coordinator's lease is open
    try:
        clone = pickle.loads(pickle.dumps(writer))
        assert clone._pending is None and clone.step == 1 and clone.path == writer.path
    finally:
        writer.abort()
    assert leases(str(tmp_path / "s")) == []
    reader = pickle.loads(pickle.dumps(cdcp.CasReader(tmp_path / "s", step=3, allow_pickle=True)))
    assert reader.step == 3 and reader.allow_pickle


def test_a_corrupt_chunk_fails_the_load_and_verify(tmp_path):
    state = {"w": torch.randn(256, 256)}
    cdcp.save(state, tmp_path / "s", 1, chunk_size=CHUNK, no_dist=True)
    with cas.open(tmp_path / "s", readonly=True) as store:
        key = store.tensors(1)[0]["chunks"][1]
    victim = os.path.join(tmp_path, "s", "objects", key.hex()[:2], key.hex())
    data = bytearray(open(victim, "rb").read())
    data[-10] ^= 0xFF
    with open(victim, "wb") as f:
        f.write(data)
    with pytest.raises(cas.CorruptionError) as info:
        cdcp.load({"w": torch.zeros(256, 256)}, tmp_path / "s", 1, no_dist=True)
    assert key.hex() in str(info.value) and "step 1" in str(info.value)
    with cas.open(tmp_path / "s", readonly=True) as store:
        assert store.verify().damaged_steps == [1]


def test_a_dcp_save_of_chunks_stored_as_deltas_by_ordinary_saves_keeps_them_restorable(tmp_path):
    """An ordinary save with delta="forward" may store a chunk as a delta against an older chunk.
    The DCP save of the same bytes references those objects as they are (ranks never change an
    indexed file): once the ordinary checkpoints are gone and gc has run, it still loads and
    verifies, its chunks' bases kept by gc."""
    path = tmp_path / "s"
    w1 = torch.randn(256, 256, generator=torch.Generator().manual_seed(5))
    w2 = w1 + 1e-6 * torch.randn(256, 256, generator=torch.Generator().manual_seed(6))
    with cas.open(path, chunk_size=CHUNK, delta="forward", pack_max=1024) as store:  # objects as files
        store.save({"w": w1}, step=1)
        store.save({"w": w2}, step=2)
        deltas = [k for k in store.tensors(2)[0]["chunks"] if store.objects.record(k).base is not None]
        assert deltas and all(store.objects.files.has(k) for k in deltas)  # the premise: delta files
        cdcp.save({"w": w2}, store, 3, no_dist=True)
        assert set(deltas) <= {k for t in store.tensors(3) for k in t["chunks"]}  # same chunks, by key
        store.delete([1, 2])
        store.gc()
        assert store.verify().ok
    target = {"w": torch.zeros(256, 256)}
    cdcp.load(target, path, 3, no_dist=True)
    assert same_bits(target["w"], w2)


def test_chunks_of_dim0_shards_sit_on_the_global_grid():
    chunk = 64 << 10
    # rows of 1 KiB: a shard starting at row 342 starts 342 KiB in, 22 KiB into a chunk
    assert cdcp.global_skew([342, 0], [342, 256], [1024, 256], 4, chunk) == (342 << 10) % chunk
    assert cdcp.global_skew([0, 0], [512, 256], [1024, 256], 4, chunk) == 0
    assert cdcp.global_skew([0, 128], [1024, 128], [1024, 256], 4, chunk) == 0  # not whole rows: own grid
    assert cdcp.global_skew([], [], [], 4, chunk) == 0  # a 0-d tensor


# --- delta saves ----------------------------------------------------------------------------------
def index_records(path: str) -> dict:
    with cas.open(path, readonly=True) as store, store.index.read() as txn:
        return dict(store.index.iter_records(txn))


@pytest.fixture(scope="module")
def delta_group(tmp_path_factory) -> Group:
    """2 ranks, FSDP2 + AdamW lr 1e-4, delta saves of steps 1-5 at max_chain 2 (5 after a restart)."""
    base = tmp_path_factory.mktemp("dcp_delta")
    return require_ok(run_group("delta", 2, base / "store", base / "out"))


def test_two_rank_delta_saves_restore_every_step_bit_for_bit(delta_group):
    r0, r1 = delta_group.ranks[0]["saved"], delta_group.ranks[1]["saved"]
    assert all(r0[s]["id"] == r1[s]["id"] for s in ("1", "2", "3", "4", "5"))
    with cas.open(delta_group.store, readonly=True) as store:
        assert store.verify().ok
    for step in (1, 2, 3, 4, 5):
        ref = reference(delta_group, f"delta{step}")
        state, _ = load_plain(delta_group.store, step, ref)
        loaded = flat({"model": state["model"], "optim": {"state": state["optim"]["state"]}})
        assert [k for k in ref if not same_bits(loaded[k], ref[k])] == [], step
    records = index_records(delta_group.store)
    deltas = {k: r for k, r in records.items() if r.base is not None}
    assert deltas, "no rank coded anything as a delta"
    assert max(r.depth for r in records.values()) == 2  # 2 of 1, 3 of 2: max_chain 2
    assert all(r.base in records and r.depth == records[r.base].depth + 1 for r in deltas.values())
    with cas.open(delta_group.store, readonly=True) as store:
        first, third, fourth, fifth = ({k for t in store.tensors(s) for k in t["chunks"]} for s in (1, 3, 4, 5))
    # where 3's chain is full, 4 is coded against its root (a step-1 chunk) at depth 1
    coded = [records[k] for k in fourth if records[k].base is not None]
    assert any(r.base in first and r.depth == 1 for r in coded)
    assert all(r.base in third or r.base in first for r in coded)
    # 5 was saved by ranks that had forgotten their bases: the coordinator seeded them with 4's chunks
    restarted = [records[k] for k in fifth if records[k].base is not None]
    assert restarted and all(r.base in fourth for r in restarted)
    # one step apart, the weights' deltas pay (the moments, 2/3 of the bytes, little): ~10% smaller
    assert r0["2"]["new"] < 0.95 * r0["1"]["new"] and r0["4"]["new"] < 0.95 * r0["1"]["new"], r0


def trained_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def snapshot(model, opt) -> dict:
    return {k: v.clone() for k, v in flat({"model": model.state_dict(), "optim": opt.state_dict()["state"]}).items()}


def load_mlp(path: str, step: int, ref: dict) -> dict:
    model, opt = trained_mlp(seed=99)
    train(model, opt, 1, seed=0)  # creates the optimizer state a load fills in
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    cdcp.load(state, path, step, no_dist=True)
    return flat({"model": state["model"], "optim": state["optim"]["state"]})


def test_dcp_delta_saves_survive_gc_of_the_checkpoints_that_hold_their_bases(tmp_path):
    model, opt = trained_mlp()
    path, refs = str(tmp_path / "s"), {}
    for step in range(1, 5):
        train(model, opt, 2, seed=step)
        refs[step] = snapshot(model, opt)
        cdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, step, no_dist=True,
                  chunk_size=CHUNK, delta="forward", max_chain=3)
    records = index_records(path)
    assert max(r.depth for r in records.values()) == 3
    with cas.open(path) as store:
        for step in (1, 2, 3):
            store.delete(step)
        store.gc()
        assert store.verify().ok
    assert max(r.depth for r in index_records(path).values()) == 3  # step 4 still needs its whole chain
    loaded = load_mlp(path, 4, refs[4])
    assert [k for k in refs[4] if not same_bits(loaded[k], refs[4][k])] == []


def test_a_failed_dcp_save_never_serves_as_a_delta_base(tmp_path):
    """Step 2 is written (and cached as the next bases) but its commit fails: step 3 must not be
    coded against it (its files are there, unindexed, and gc sweeps them), but against step 1."""
    model, opt = trained_mlp()
    path, refs = str(tmp_path / "s"), {}
    for step in (1, 2, 3):
        train(model, opt, 2, seed=step)
        refs[step] = snapshot(model, opt)
        faults.configure("dcp.finish=raise" if step == 2 else "")
        try:
            if step == 2:
                with pytest.raises(faults.InjectedFault):
                    cdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, step, no_dist=True,
                              chunk_size=CHUNK, delta="forward")
                continue
            cdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, step, no_dist=True,
                      chunk_size=CHUNK, delta="forward")
        finally:
            faults.configure("")
        if step == 1:
            with cas.open(path) as store:
                first = set(store.objects.files.iterate())
    with cas.open(path) as store:
        with store.index.read() as txn:
            indexed = {k for k, _ in store.index.iter_records(txn)}
        step2 = set(store.objects.files.iterate()) - indexed - first  # written, never indexed
        assert step2, "the failed save left no chunk files"
        store.gc()
        assert store.verify().ok and [ck.step for ck in store.checkpoints()] == [1, 3]
    records = index_records(path)
    # step 3's cached bases were step 2's chunks: none confirmed, so the coordinator seeded it with
    # the latest committed checkpoint's, step 1's
    with cas.open(path, readonly=True) as store:
        first_chunks = {k for t in store.tensors(1) for k in t["chunks"]}
    coded = [r for r in records.values() if r.base is not None]
    assert coded and all(r.base in first_chunks for r in coded)
    assert not any(r.base in step2 for r in records.values())
    loaded = load_mlp(path, 3, refs[3])
    assert [k for k in refs[3] if not same_bits(loaded[k], refs[3][k])] == []


def _rolled_back_states() -> dict[int, torch.Tensor]:
    """Steps 1-3 move a weight; step 4 is step 2's weight again (a rollback), whose chunks are
    stored as deltas, of step 1's, and step 3's chunks are deltas of them."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(128, 256, generator=g)
    w2 = w1 + 1e-4 * torch.randn(128, 256, generator=g)
    w3 = w2 + 1e-4 * torch.randn(128, 256, generator=g)
    return {1: w1, 2: w2, 3: w3, 4: w2.clone()}


def _loads_bit_for_bit(path: str, step: int, want: torch.Tensor) -> bool:
    out = {"w": torch.zeros_like(want)}
    cdcp.load(out, path, step, no_dist=True)
    return same_bits(out["w"], want)


@pytest.mark.parametrize("restarted", [False, True])
def test_a_rollback_resaved_through_dcp_leaves_every_checkpoint_restorable(tmp_path, restarted):
    """Saving an earlier checkpoint's state again: its chunks are stored deltas this rank cannot
    see confirmed. A rank once re-coded them against its current base, over the live files:
    step 3's chunk was a delta of step 2's and step 2's became a delta of step 3's, a cycle that
    broke steps 2 to 5. Indexed files never change now; the save references them as they are."""
    path = str(tmp_path / "s")
    states = _rolled_back_states()
    states[5] = states[3] + 1e-4 * torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    for step, w in states.items():
        if restarted and step == 4:
            cdcp.bases.replace(os.path.abspath(path), None)  # a new process: bases seeded, read back
        cdcp.save({"w": w}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward")
    assert [s for s, w in states.items() if not _loads_bit_for_bit(path, s, w)] == []
    with cas.open(path, readonly=True) as store:
        assert store.verify().ok
        assert store.tensors(4)[0]["chunks"] == store.tensors(2)[0]["chunks"]
        assert all(store.objects.record(k).base is not None for k in store.tensors(2)[0]["chunks"])


def test_a_failed_dcp_save_changes_no_file_of_committed_checkpoints(tmp_path):
    """The rollback save fails at its commit: the stored deltas it would have re-coded (and the
    full objects it would have written in their place) are untouched: the replacements it wrote
    stay temporary files (gc removes them once their process has exited)."""
    path = str(tmp_path / "s")
    states = _rolled_back_states()
    for step in (1, 2, 3):
        cdcp.save({"w": states[step]}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward")
    with cas.open(path, readonly=True) as store:
        before = {k: open(store.objects.files.path(k), "rb").read() for k in store.objects.files.iterate()}
    for delta in (True, False):
        faults.configure("dcp.finish=raise")
        try:
            with pytest.raises(faults.InjectedFault):
                cdcp.save({"w": states[4]}, path, 4, no_dist=True, chunk_size=CHUNK, delta=delta)
        finally:
            faults.configure("")
    with cas.open(path, readonly=True) as store:
        assert {k: open(store.objects.files.path(k), "rb").read() for k in before} == before
    assert [s for s in (1, 2, 3) if not _loads_bit_for_bit(path, s, states[s])] == []
    cdcp.save({"w": states[4]}, path, 4, no_dist=True, chunk_size=CHUNK, delta="forward")
    assert _loads_bit_for_bit(path, 4, states[4])


def test_a_cached_plan_of_another_step_confirms_no_base():
    from cas.store.dcp import bases as dcp_bases
    key = bytes(32)
    root = bytes(range(32))

    def answer(depth):
        return dcp_bases.confirm({dcp_bases.PROPOSAL: [key, "junk"]}, 7, 2, lambda keys: None, lambda k: depth,
                                 lambda keys: {k: root for k in keys})

    assert dcp_bases.confirmed(answer(1), 7) == ({key: 1}, {})
    assert dcp_bases.confirmed(answer(2), 7) == ({key: 2}, {key: root})  # a full chain: its root instead
    assert dcp_bases.confirmed(answer(1), 8) == ({}, {})  # a plan cached from step 7, reused at step 8
    assert dcp_bases.confirmed({dcp_bases.FOR_STEP: 7, dcp_bases.PROPOSAL: [key]}, 7) == ({}, {})  # no depths
    assert dcp_bases.confirmed(answer(None), 7) == ({}, {})  # not stored


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(FLOATS), chain=chains, rows=st.sampled_from([40, 300]), gc_keep=st.integers(1, 3))
def test_any_chain_of_dcp_delta_saves_restores_bit_for_bit_also_after_gc(tmp_path_factory, dtype, chain, rows,
                                                                         gc_keep):
    path = str(tmp_path_factory.mktemp("dcp_delta") / "s")
    torch.manual_seed(0)
    t = torch.randn(rows, 512).to(TORCH_DTYPES[dtype])
    history, prev = {}, None
    for step, spec in enumerate(chain):
        t, prev = next_state(t, prev, *spec), t
        cdcp.save({"w": t, "n": step}, path, step, no_dist=True, chunk_size=64 << 10, delta="forward", max_chain=3)
        history[step] = t.clone()
    with cas.open(path) as store:
        store.gc(keep_last=gc_keep)
        assert store.verify().ok
        kept = [ck.step for ck in store.checkpoints()]
    for step in kept:
        target = {"w": torch.zeros_like(history[step]), "n": -1}
        cdcp.load(target, path, step, no_dist=True)
        assert same_bits(target["w"], history[step]) and target["n"] == step, step


def test_a_process_keeps_delta_bases_for_a_bounded_number_of_stores(tmp_path):
    from cas.store.dcp import bases as dcp_bases
    paths = [str(tmp_path / f"s{i}") for i in range(dcp_bases.MAX_STORES + 2)]
    for path in paths:
        cdcp.save({"w": torch.randn(128, 256)}, path, 1, no_dist=True, delta="forward")
    assert [dcp_bases.cached(p) is not None for p in paths] == [False] * 2 + [True] * dcp_bases.MAX_STORES


def test_an_unchanged_chunk_whose_file_is_damaged_is_rewritten_whole_not_as_a_delta_of_itself(tmp_path):
    path = str(tmp_path / "s")
    state = {"w": torch.randn(256, 256)}
    cdcp.save(state, path, 1, no_dist=True, chunk_size=CHUNK, delta="forward")
    with cas.open(path) as store:
        key = store.tensors(1)[0]["chunks"][0]
        file = store.objects.files.path(key)
    with open(file, "r+b") as f:  # damage the header, keep the size: the index still calls it stored
        f.write(b"XXXX")
    cdcp.save(state, path, 2, no_dist=True, chunk_size=CHUNK, delta="forward")
    with cas.open(path) as store:
        assert store.objects.record(key).base is None
        assert store.verify().ok  # the rewrite repaired it
    target = {"w": torch.zeros(256, 256)}
    cdcp.load(target, path, 1, no_dist=True)
    assert same_bits(target["w"], state["w"])


def test_a_planner_that_caches_plans_gets_whole_chunks_and_a_warning(tmp_path):
    """With enable_plan_caching DCP hands ranks an earlier save's plan, whose confirmation of the
    delta bases is for another step: nothing is coded against them, and the user is told."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    torch.manual_seed(0)
    w, path = torch.randn(512, 512), str(tmp_path / "s")
    for step in (1, 2, 3):
        w = w + 1e-4 * torch.randn_like(w)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cdcp.save({"w": w}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward", planner=planner)
        assert any("no confirmation" in str(x.message) for x in caught) == (step > 1), step
    assert all(r.base is None for r in index_records(path).values())
    target = {"w": torch.zeros(512, 512)}
    cdcp.load(target, path, 3, no_dist=True)
    assert same_bits(target["w"], w)


def test_max_chain_zero_codes_no_dcp_deltas_not_even_against_roots(tmp_path):
    torch.manual_seed(0)
    w, path = torch.randn(512, 512), str(tmp_path / "s")
    for step, max_chain in ((1, 2), (2, 2), (3, 0)):  # step 2 is a delta of 1; step 3 may not be one
        w = w + 1e-4 * torch.randn_like(w)
        cdcp.save({"w": w}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward", max_chain=max_chain)
    with cas.open(path, readonly=True) as store:
        third = store.tensors(3)[0]["chunks"]
    records = index_records(path)
    assert all(records[k].base is None for k in third)


def test_a_restarted_rank_codes_its_first_save_against_the_latest_checkpoint(tmp_path):
    """A fresh process has no bases in memory: the coordinator seeds it with the chunks of the
    latest checkpoint's matching shards, which the rank reads back from their files (chains too)."""
    from cas.store.dcp import bases as dcp_bases
    model, opt = trained_mlp()
    path, refs = str(tmp_path / "s"), {}
    for step in (1, 2, 3):
        train(model, opt, 2, seed=step)
        refs[step] = snapshot(model, opt)
        if step == 3:
            dcp_bases.replace(path, None)  # the process restarted
        cdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, step, no_dist=True,
                  chunk_size=CHUNK, delta="forward", max_chain=3)
    records = index_records(path)
    with cas.open(path, readonly=True) as store:
        second, third = ({k for t in store.tensors(s) for k in t["chunks"]} for s in (2, 3))
        assert store.verify().ok
    coded = [records[k] for k in third if records[k].base is not None]
    assert coded and all(r.base in second and r.depth == 2 for r in coded)  # step 2 is a delta itself
    loaded = load_mlp(path, 3, refs[3])
    assert [k for k in refs[3] if not same_bits(loaded[k], refs[3][k])] == []


def test_dcp_delta_memory_keeps_keys_only_and_reads_bases_back_from_files(tmp_path):
    """delta_memory=0: a rank keeps no bytes of its last save; the same deltas come from bases
    read back from the store's files."""
    from cas.store.dcp import bases as dcp_bases
    sizes = {}
    for memory in (None, 0):
        model, opt = trained_mlp()
        path, refs = str(tmp_path / f"s{memory}"), {}
        for step in (1, 2, 3):
            train(model, opt, 2, seed=step)
            refs[step] = snapshot(model, opt)
            cdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, step, no_dist=True,
                      chunk_size=CHUNK, delta="forward", max_chain=3, delta_memory=memory)
        cache = dcp_bases.cached(os.path.abspath(path))
        assert all((shard.data is None) == (memory == 0) for shard in cache.shards.values())
        records = index_records(path)
        assert max(r.depth for r in records.values()) == 2
        sizes[memory] = sum(r.stored_size for r in records.values())
        loaded = load_mlp(path, 3, refs[3])
        assert [k for k in refs[3] if not same_bits(loaded[k], refs[3][k])] == []
    assert abs(sizes[0] - sizes[None]) < 0.01 * sizes[None]


@pytest.mark.parametrize("memory", [None, 0])
def test_dcp_ranks_code_steady_motion_as_linear_deltas(tmp_path, memory):
    """As Store.save does: once a rank's base is itself a delta, the rank may extrapolate the
    base's motion (`linear`), from the previous bytes it kept (None) or from the chain it reads
    back (0); every step restores bit for bit, also after the checkpoints holding the bases go."""
    from cas.store.dcp import bases as dcp_bases
    states = _trajectory(5, seed=7)
    path = str(tmp_path / "s")
    dcp_bases.replace(os.path.abspath(path), None)
    for step, w in enumerate(states, 1):
        cdcp.save({"w": w, "h": w.to(torch.bfloat16)}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward",
                  max_chain=4, delta_memory=memory)
    with cas.open(path) as store:
        codecs = {s: {store.objects.codec_of(k) for t in store.tensors(s) for k in t["chunks"]} for s in (2, 3, 4)}
        assert codecs[2] == {"sub4+bytegroup4+zstd", "sub2+bytegroup2+zstd"}
        assert codecs[3] == codecs[4] == {"linear4+bytegroup4+zstd", "linear2+bytegroup2+zstd"}
        for step in (1, 2, 3, 4):
            store.delete(step)
        store.gc()
        assert store.verify().ok
    out = {"w": torch.empty_like(states[-1]), "h": torch.empty_like(states[-1], dtype=torch.bfloat16)}
    cdcp.load(out, path, 5, no_dist=True)
    assert out["w"].equal(states[-1])
    assert out["h"].view(torch.uint8).equal(states[-1].to(torch.bfloat16).view(torch.uint8))


@pytest.mark.parametrize("damage", ["header", "missing"])
def test_a_rollback_over_a_lost_base_file_codes_no_cycle_of_bases(tmp_path, damage):
    """Step 2's chunks are deltas of step 1's; step 1's file is damaged or gone; step 3 saves
    step 1's state again. The rank used to code the chunk against its base, step 2's chunk,
    whose chain holds that very chunk: a committed cycle no load could follow. The coordinator
    now sends each confirmed delta's chain, and such a chunk is written whole."""
    path = str(tmp_path / "s")
    states = _rolled_back_states()
    for step in (1, 2):
        cdcp.save({"w": states[step]}, path, step, no_dist=True, chunk_size=CHUNK, delta="forward")
    with cas.open(path, readonly=True) as store:
        file = store.objects.files.path(store.tensors(1)[0]["chunks"][0])
    if damage == "header":
        with open(file, "r+b") as f:
            f.write(b"XXXX")
    else:
        os.unlink(file)
    cdcp.save({"w": states[1].clone()}, path, 3, no_dist=True, chunk_size=CHUNK, delta="forward")
    assert _loads_bit_for_bit(path, 3, states[1]) and _loads_bit_for_bit(path, 2, states[2])


def test_a_linear_delta_whose_base_another_writer_made_whole_is_never_committed(tmp_path):
    """A forward-delta rank codes a chunk as a `linear` delta of X, which is a delta of W. Before
    the coordinator's commit another writer saved X's content again and, with the default
    reverse deltas, made X whole: the commit indexed the linear delta anyway, and step 4 was
    committed undecodable (verify: "extrapolates from delta base ... whose own base is not
    available"; audit of stop 38). The commit now checks each adopted linear delta's base's
    base, refuses the save (nothing committed), and a save again succeeds."""
    g = torch.Generator().manual_seed(7)
    w, velocity = torch.randn(256, 1024, generator=g), 1e-3 * torch.randn(256, 1024, generator=g)
    states = []
    for _ in range(4):
        velocity = 0.95 * velocity + 5e-5 * torch.randn(256, 1024, generator=g)
        w = w + velocity
        states.append(w.clone())
    path = tmp_path / "store"
    for step in (1, 2, 3):
        cdcp.save({"w": states[step - 1]}, path, step, no_dist=True, chunk_size=64 << 10, delta="forward")
    torch.save(states[2], tmp_path / "w3.pt")
    other = (f"import torch, cas\nwith cas.open({str(path)!r}) as store:\n"
             f"    store.save({{'w': torch.load({str(tmp_path / 'w3.pt')!r})}}, step=50)\n")

    class Interleaved(cdcp.CasWriter):
        def finish(self, metadata, results):  # another writer, between the ranks' writes and the commit
            subprocess.run([sys.executable, "-c", other], check=True, timeout=120)
            return super().finish(metadata, results)

    writer = Interleaved(path, step=4, delta="forward")
    with pytest.raises(CheckpointException, match="`linear` delta of .* nothing of this save was committed"):
        dcp.save({"w": states[3]}, storage_writer=writer, no_dist=True)
    writer.abort()
    with cas.open(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [1, 2, 3, 50] and store.verify().ok
    cdcp.save({"w": states[3]}, path, 4, no_dist=True, delta="forward")
    out = {"w": torch.zeros_like(states[3])}
    cdcp.load(out, path, 4, no_dist=True)
    assert torch.equal(out["w"], states[3])
    with cas.open(path) as store:
        assert store.verify().ok


def test_a_writer_opened_with_retention_applies_it_after_each_commit(tmp_path):
    """CasWriter(path, retention=...) closed the store it opened before its retention ran, so
    every save only warned "the retention gc after it failed" and nothing was ever removed
    (audit of stop 38)."""
    path = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the failed retention's warning
        for step in (1, 2, 3, 4):
            cdcp.save({"w": torch.randn(1000)}, path, step, no_dist=True, retention=cas.Retention(keep_last=1))
    with cas.open(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [4] and store.verify().ok


Pair = collections.namedtuple("Pair", "a b")  # (module level: pickle finds them by name)


class Color(enum.IntEnum):
    RED = 3


def test_values_msgpack_would_change_are_kept_by_the_pickle_fallback_with_their_types(tmp_path):
    """CasWriter packed every value msgpack took: a namedtuple and a torch.Size came back as
    tuples, an IntEnum as an int, a bytearray as bytes, and a numpy datetime was refused at the
    commit with a CorruptionError. It now keeps as plain data only what Store.save would, and
    the rest as DCP's pickled bytes, as documented (audit of stop 38)."""
    import numpy as np

    values = {"nt": Pair(1, 2), "size": torch.Size([4, 5]), "enum": Color.RED, "ba": bytearray(b"xy"),
              "when": np.datetime64("2024-01-01"), "plain": (1, 2.5, "x")}
    path = tmp_path / "store"
    with pytest.warns(UserWarning, match="'nt' cannot be stored as plain data"):
        cdcp.save({"w": torch.ones(4), **values}, path, 1, no_dist=True)
    out = {"w": torch.zeros(4), **{k: None for k in values}}
    cdcp.load(out, path, 1, no_dist=True, allow_pickle=True)
    for key, value in values.items():
        assert type(out[key]) is type(value) and out[key] == value, key
