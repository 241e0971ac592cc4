"""cas's DCP writer and reader where DCP's own tests and tools set the expectations: io.BytesIO
values (DCP's carrier for non-tensor objects) without pickle, FileSystemWriter's `overwrite`,
file:// URLs, and the equivalents of dcp_to_torch_save (`cas export --format torch`) and of
reading a DCP folder (`cas import` of FileSystemWriter's output, never unpickling it)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import cas
from cas import faults
from cas.store import dcp as cdcp
from dcp_worker import ECO_LOSSES, ECO_RAW
from helpers import assert_same, tiny_model, train_tiny
from test_dcp import blank_target, flat, reference, require_ok, run_group, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cli(store, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CAS_STORE"}
    return subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(store), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(env, PYTHONPATH=ROOT))


@pytest.fixture(autouse=True)
def _one_process_warnings():
    """DCP warns that it saves or loads in one process when no process group is up: as meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- io.BytesIO values, as DCP's end-to-end tests keep training losses ---------------------------
@dataclass
class TrainState:
    """DCP's end-to-end tests' train state: a Stateful whose losses travel torch.save'd in a BytesIO."""

    step: int = 0
    losses: list = field(default_factory=list)

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save(self.losses, buffer)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "losses": buffer}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        state["losses"].seek(0)
        self.losses = torch.load(state["losses"], weights_only=True)


def trained(seed: int):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_tiny(model, opt, 3, seed)
    return model, opt, TrainState(3, losses)


def test_bytesio_and_bytes_values_round_trip_through_dcp_without_allow_pickle(tmp_path):
    model, opt, train_state = trained(0)
    raw = bytes(range(256)) * 3
    state = {"model": model, "optim": opt, "trainer": train_state, "blob": raw}
    saved_losses = train_state.state_dict()["losses"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "kept as the planner's pickled bytes" warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=cdcp.CasWriter(tmp_path / "s", step=3), no_dist=True)
    with cas.open(tmp_path / "s", readonly=True) as store:
        values = store.load(3)["values"]
    assert [k for k, entry in values.items() if "pickle" in entry] == []
    assert values["trainer.losses"]["bytesio"] == saved_losses.getvalue()

    model2, opt2, blank = trained(1)  # other weights, other losses: everything must come back
    target = {"model": model2, "optim": opt2, "trainer": blank, "blob": b""}
    dcp.load(target, storage_reader=cdcp.CasReader(tmp_path / "s", step=3), no_dist=True)  # allow_pickle False
    assert blank.step == 3 and blank.losses == train_state.losses
    assert target["blob"] == raw and type(target["blob"]) is bytes
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert same_bits(a, b), name
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


def test_a_bytesio_comes_back_with_its_bytes_and_position(tmp_path):
    buffer = io.BytesIO(b"header|payload")
    buffer.seek(7)
    cdcp.save({"w": torch.ones(2), "buf": buffer}, tmp_path / "s", 1, no_dist=True)
    target = {"w": torch.zeros(2), "buf": io.BytesIO()}
    cdcp.load(target, tmp_path / "s", 1, no_dist=True)
    assert isinstance(target["buf"], io.BytesIO)
    assert target["buf"].getvalue() == b"header|payload" and target["buf"].tell() == 7


# --- overwrite, as FileSystemWriter's ------------------------------------------------------------
def dcp_own_refusal(folder) -> str:
    """The text of FileSystemWriter(overwrite=False)'s refusal of an existing checkpoint."""
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(folder), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(folder, overwrite=False), no_dist=True)
    return str(info.value)


def test_an_existing_step_is_refused_in_dcps_words_unless_overwrite(tmp_path):
    theirs = dcp_own_refusal(tmp_path / "fs")
    path = tmp_path / "s"
    cdcp.save({"w": torch.ones(4)}, path, 1, no_dist=True)
    with pytest.raises(CheckpointException) as info:  # a direct dcp.save: DCP's exception, our text in it
        dcp.save({"w": torch.ones(4)}, storage_writer=cdcp.CasWriter(path, step=1), no_dist=True)
    ours = str(info.value)
    assert "Checkpoint already exists and self.overwrite=False" in theirs
    assert "Checkpoint already exists and overwrite=False" in ours and "overwrite=True" in ours
    with pytest.raises(cas.CheckpointExistsError, match="Checkpoint already exists and overwrite=False") as info:
        cdcp.save({"w": torch.ones(4)}, path, 1, no_dist=True)
    assert isinstance(info.value, RuntimeError)  # as FileSystemWriter's
    with cas.open(path, readonly=True) as store:
        assert store.verify().ok and len(store.checkpoints()) == 1


def test_overwrite_replaces_the_step_in_one_commit_and_a_failed_one_keeps_the_old(tmp_path):
    path = tmp_path / "s"
    first = cdcp.save({"w": torch.ones(4), "n": 1}, path, 1, no_dist=True)
    faults.configure("dcp.nodes_written=raise")  # fails after every object is written, before the commit
    try:
        with pytest.raises(faults.InjectedFault):
            cdcp.save({"w": torch.full((4,), 2.0), "n": 2}, path, 1, no_dist=True, overwrite=True)
    finally:
        faults.configure("")
    target = {"w": torch.zeros(4), "n": 0}
    assert cdcp.load(target, path, 1, no_dist=True).id == first.id and target["n"] == 1
    again = dcp.save({"w": torch.full((4,), 3.0), "n": 3},
                     storage_writer=cdcp.CasWriter(path, step=1, overwrite=True), no_dist=True)
    assert cdcp.SavedCheckpoint.from_storage_data(again.storage_data).id != first.id
    assert cdcp.load(target, path, 1, no_dist=True).step == 1
    assert torch.equal(target["w"], torch.full((4,), 3.0)) and target["n"] == 3
    with cas.open(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [1] and store.verify().ok
        store.pin(1)
    with pytest.raises(cas.CasError, match="pinned"):
        cdcp.save({"w": torch.zeros(4)}, path, 1, no_dist=True, overwrite=True)


# --- file:// URLs --------------------------------------------------------------------------------
def test_file_urls_name_the_folder_for_the_writer_and_the_reader(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    url = f"file://{tmp_path}/s"
    state = {"w": torch.arange(6.0), "b": b"xy"}
    dcp.save(state, storage_writer=cdcp.CasWriter(url, step=1), no_dist=True)
    dcp.save(state, checkpoint_id=url, storage_writer=cdcp.CasWriter(url, step=2), no_dist=True)
    dcp.save(state, storage_writer=cdcp.CasWriter(f"file://localhost{tmp_path}/s", step=3), no_dist=True)
    target = {"w": torch.zeros(6), "b": b""}
    dcp.load(target, storage_reader=cdcp.CasReader(url, step=2), no_dist=True)
    dcp.load(target, checkpoint_id=url, storage_reader=cdcp.CasReader(url, step=1), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and target["b"] == b"xy"
    assert os.listdir(cwd) == []  # no ./file:/... folder
    with cas.open(tmp_path / "s", readonly=True) as store:
        assert [ck.step for ck in store.checkpoints()] == [1, 2, 3]


# --- dcp_to_torch_save's equivalent and DCP folders, from two ranks -------------------------------
@pytest.fixture(scope="module")
def eco(tmp_path_factory):
    """2 ranks, FSDP2 + AdamW + a BytesIO of losses and bytes: OUT/dcp-7 (FileSystemWriter) and
    step 7 of the store (CasWriter)."""
    base = tmp_path_factory.mktemp("dcp_eco")
    return require_ok(run_group("ecosystem", 2, base / "store", base / "out"))


def check_eco_state(state: dict, ref: dict) -> None:
    """The tensors of the two-rank state bit for bit, the BytesIO of losses and the bytes kept."""
    tensors = flat({"model": state["model"], "optim": {"state": state["optim"]["state"]}})
    assert set(tensors) == set(ref)
    assert [k for k in ref if not same_bits(tensors[k], ref[k])] == []
    losses = state["extra"]["losses"]
    assert isinstance(losses, io.BytesIO)
    losses.seek(0)
    assert torch.load(losses, weights_only=True) == ECO_LOSSES
    assert state["extra"]["raw"] == ECO_RAW and state["extra"]["epoch"] == 2


def buffers_as_bytes(value):
    """A state with each io.BytesIO as (its bytes, its position), for assert_same."""
    if isinstance(value, io.BytesIO):
        return value.getvalue(), value.tell()
    if isinstance(value, dict):
        return {k: buffers_as_bytes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(buffers_as_bytes(v) for v in value)
    return value


def test_export_torch_puts_a_two_rank_save_together_for_a_weights_only_load(eco, tmp_path):
    out = tmp_path / "full.pt"
    done = cli(eco.store, "export", "7", out, "--json")  # .pt: the torch format
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["format"] == "torch" and report["needs_safe_globals"] == ["_io.BytesIO"]
    with pytest.raises(pickle.UnpicklingError):  # a BytesIO needs allowing, as the report says
        torch.load(out, weights_only=True)
    with torch.serialization.safe_globals([io.BytesIO]):
        state = torch.load(out, weights_only=True)
    check_eco_state(state, reference(eco, "ref_eco"))
    assert report["tensors"] == len(flat({"model": state["model"], "optim": {"state": state["optim"]["state"]}}))


def test_cas_import_of_a_two_rank_dcp_folder_loads_with_casreader(eco, tmp_path):
    folder = os.path.join(eco.out, "dcp-7")
    done = cli(tmp_path / "s", "import", folder, "--json")  # the step from the folder's name
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["imported"]
    assert row["step"] == 7 and row["meta"]["import_format"] == "dcp"
    ref = reference(eco, "ref_eco")
    target = blank_target(ref)
    target["extra"] = {"losses": io.BytesIO(), "raw": b"", "epoch": 0}
    assert cdcp.load(target, tmp_path / "s", 7, no_dist=True).step == 7
    check_eco_state(target, ref)
    with cas.open(tmp_path / "s", readonly=True) as store:  # the same state as the CasWriter save
        ours = cdcp.state_dict(store, 7)
    with cas.open(eco.store, readonly=True) as store:
        assert_same(buffers_as_bytes(ours), buffers_as_bytes(cdcp.state_dict(store, 7)))
    again = cli(tmp_path / "s", "import", folder)
    assert again.returncode != 0 and "already exists" in again.stderr


# --- never running what a DCP folder holds -------------------------------------------------------
class Touch:
    """Unpickling it creates a marker file: what a hostile checkpoint does."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def hostile_metadata(folder, marker) -> None:
    os.makedirs(folder)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Touch(str(marker)), f)


def hostile_value(folder, marker) -> None:
    """A real DCP folder whose value item is a pickled Touch (DCP pickles what it cannot hold)."""
    dcp.save({"w": torch.ones(3), "hook": Touch(str(marker))}, storage_writer=FileSystemWriter(folder), no_dist=True)


@pytest.mark.parametrize("make", [hostile_metadata, hostile_value])
def test_a_hostile_dcp_folder_is_refused_without_running_it(tmp_path, make):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "dcp-5"
    make(folder, marker)
    assert not marker.exists()
    done = cli(tmp_path / "s", "import", folder)
    assert done.returncode != 0 and "posix.system" in done.stderr and "refused" in done.stderr
    assert not marker.exists() and not os.path.exists(tmp_path / "s")  # nothing ran, no store left behind
    with cas.open(tmp_path / "lib") as store, pytest.raises(cas.CasError, match="posix.system"):
        store.import_dcp(folder)
    assert not marker.exists()


def test_export_torch_refuses_a_value_dcp_pickled_rather_than_unpickle_it(tmp_path):
    from fractions import Fraction

    with pytest.warns(UserWarning, match="pickled bytes"):
        cdcp.save({"w": torch.ones(3), "odd": Fraction(1, 2)}, tmp_path / "s", 1, no_dist=True)  # no plain value
    with cas.open(tmp_path / "s", readonly=True) as store, pytest.raises(cas.CasError, match="odd.*pickle"):
        store.export(1, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
