"""Interop, integrations and the CLI against odd and hostile input: each case failed before stop 13's fixes
(tracebacks, a refused import leaving a store or steps behind, Lightning losing a checkpoint, an export
writing over the store, non-standard JSON)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cas

CAS = [sys.executable, "-m", "cas.cli"]


def run(*args, store):
    env = dict(os.environ)
    env.pop("CAS_STORE", None)
    return subprocess.run(CAS + ["--store", str(store)] + [str(a) for a in args], capture_output=True, text=True,
                          env=env, timeout=120)


def snapshot(path) -> dict:
    out = {}
    for dp, _, files in os.walk(path):
        for f in files:
            full = os.path.join(dp, f)
            out[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return out


def steps(store) -> list[int]:
    return [c["step"] for c in json.loads(run("ls", "--json", store=store).stdout)]


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


# 1 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [("export", 1, "OUT"), ("diff", 1, 2)])
def test_big_endian_numpy_array_export_and_diff_give_a_clean_error(tmp_path, command):
    """The store accepts a big-endian numpy array (and loads it back); export and diff crashed
    with a ValueError traceback from torch.from_numpy."""
    store = tmp_path / "s"
    with cas.open(store) as s:
        s.save({"be": np.arange(4, dtype=">f4"), "w": torch.ones(2)}, step=1)
        s.save({"be": np.arange(4, dtype=">f4") + 1, "w": torch.ones(2)}, step=2)
    args = [str(tmp_path / "o.safetensors") if a == "OUT" else a for a in command]
    out = run(*args, store=store)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-400:]
    if command[0] == "export":
        from safetensors.torch import load_file
        assert torch.equal(load_file(tmp_path / "o.safetensors")["be"], torch.arange(4, dtype=torch.float32))


# 2 ---------------------------------------------------------------------------------------------
def test_keep_within_too_large_is_a_usage_error(tmp_path):
    store = tmp_path / "s"
    with cas.open(store) as s:
        s.save({"w": torch.ones(2)}, step=1)
    out = run("gc", "--keep-within", "99999999999d", store=store)
    assert out.returncode == 2 and "duration too long" in out.stderr and "Traceback" not in out.stderr


# 3 ---------------------------------------------------------------------------------------------
def test_keep_all_with_another_rule_never_removes_a_checkpoint(tmp_path):
    """--keep-all means 'remove no checkpoint; only reclaim garbage': combined with a rule it was
    silently ignored and checkpoints were removed; the combination is refused now."""
    store = tmp_path / "s"
    with cas.open(store) as s:
        for step in (1, 2, 3):
            s.save({"w": torch.full((4,), float(step))}, step=step)
    out = run("gc", "--keep-last", "1", "--keep-all", store=store)
    assert out.returncode == 2 and steps(store) == [1, 2, 3], (out.returncode, out.stdout)


# 4 ---------------------------------------------------------------------------------------------
def test_a_refused_import_does_not_create_a_store(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil-1.pt"
    torch.save({"e": Payload(str(marker))}, evil)
    out = run("import", evil, store=tmp_path / "new")
    assert out.returncode == 2 and not marker.exists()
    assert not (tmp_path / "new").exists(), os.listdir(tmp_path / "new")


# 5 ---------------------------------------------------------------------------------------------
def test_folder_import_with_a_hostile_file_imports_nothing(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(3)}, folder / "ckpt-1.pt")
    torch.save({"w": torch.ones(3), "e": Payload(str(marker))}, folder / "ckpt-2.pt")
    torch.save({"w": torch.ones(3)}, folder / "ckpt-3.pt")
    with cas.open(tmp_path / "s"):
        pass
    out = run("import", folder, store=tmp_path / "s")
    assert out.returncode == 2 and "ckpt-2.pt" in out.stderr and not marker.exists()
    assert steps(tmp_path / "s") == []  # all or nothing
    assert "nothing was imported" in out.stderr


# 6 ---------------------------------------------------------------------------------------------
def test_malicious_pickle_refusal_names_the_refused_global(tmp_path):
    """torch 2.13's weights-only message is one paragraph starting 'Weights only load failed',
    which was skipped wholesale: the user saw '(unknown reason)'."""
    evil = tmp_path / "evil-1.pt"
    torch.save({"e": Payload(str(tmp_path / "pwned"))}, evil)
    out = run("import", evil, store=tmp_path / "s")
    assert out.returncode == 2
    assert "unknown reason" not in out.stderr and "exec" in out.stderr, out.stderr


# 7 ---------------------------------------------------------------------------------------------
def test_lightning_failed_resave_at_the_same_step_keeps_the_old_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    from cas.store.lightning import CasCheckpointIO

    io = CasCheckpointIO(tmp_path / "s")
    d = tmp_path / "ckpt"  # the plugin writes a marker at each path
    try:
        io.save_checkpoint({"global_step": 50, "state_dict": {"w": torch.ones(3)}}, d / "epoch=0-step=50.ckpt")
        with pytest.raises(TypeError):  # ModelCheckpoint's last.ckpt at the same step, with a bad value
            io.save_checkpoint({"global_step": 50, "state_dict": {"w": torch.ones(3)}, "bad": object()},
                               d / "last.ckpt")
        assert [ck.step for ck in io.store.checkpoints()] == [50]  # the old one stays
        assert torch.equal(io.load_checkpoint(d / "epoch=0-step=50.ckpt")["state_dict"]["w"], torch.ones(3))
    finally:
        io.close()


# 8 ---------------------------------------------------------------------------------------------
def test_read_only_export_refuses_to_overwrite_the_store_itself(tmp_path):
    store = tmp_path / "s"
    with cas.open(store) as s:
        s.save({"w": torch.ones(2)}, step=1)
    before = snapshot(store)
    out = run("export", 1, store / "config", store=store)
    assert out.returncode == 2 and "into the store itself" in out.stderr, out.stdout
    assert run("ls", store=store).returncode == 0
    assert {k: v for k, v in snapshot(store).items() if k != "index/lock.mdb"} == \
           {k: v for k, v in before.items() if k != "index/lock.mdb"}


# 9 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [("ls", "--json"), ("show", 1, "--json"), ("gc", "--keep-all", "--json")])
def test_json_output_is_standard_json_with_nan_metrics(tmp_path, command):
    store = tmp_path / "s"
    with cas.open(store) as s:
        s.save({"w": torch.ones(2)}, step=1, metrics={"loss": float("nan"), "grad_norm": float("inf")})
    out = run(*command, store=store)
    assert out.returncode == 0, out.stderr

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    json.loads(out.stdout, parse_constant=refuse)


def test_a_refused_import_into_an_empty_folder_leaves_the_empty_folder(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    evil = tmp_path / "evil-1.pt"
    torch.save({"e": Payload(str(tmp_path / "pwned"))}, evil)
    out = run("import", evil, store=target)
    assert out.returncode == 2 and target.is_dir() and os.listdir(target) == []


def test_diff_of_checkpoints_whose_0_dim_tensors_changed(tmp_path):
    """AdamW keeps each parameter's step count as a 0-dim float tensor: diff of any two real
    training checkpoints crashed on it."""
    with cas.open(tmp_path / "s") as store:
        store.save({"step": torch.tensor(1.0), "w": torch.ones(3)}, step=1)
        store.save({"step": torch.tensor(2.0), "w": torch.ones(3)}, step=2)
        report = store.diff(1, 2)
    changed = [t for t in report.tensors if t.path == "step"]
    assert changed and changed[0].max_abs_diff == 1.0
    out = run("diff", 1, 2, "--json", store=tmp_path / "s")
    assert out.returncode == 0, out.stderr
