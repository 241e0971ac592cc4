"""Retention and import paths that lost checkpoints (issue 21): an empty policy, a misspelt
metric, retention running in the middle of a folder import, a full disk in the retention gc
after a commit, and a killed folder import that its rerun refused. Real stores, real files,
real processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import cas
from cas import faults
from cas.gc.retention import Retention, RetentionRefusedError
from cas.store.interop import ImportRefusedError

CAS = [sys.executable, "-m", "cas.cli"]


def run(*args, store, faults: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CAS_STORE", "CAS_FAULTS")}
    if faults:
        env["CAS_FAULTS"] = faults
    return subprocess.run(CAS + ["--store", str(store)] + [str(a) for a in args], capture_output=True, text=True,
                          env=env, timeout=120)


def steps_of(store) -> list[int]:
    return [ck.step for ck in store.checkpoints()]


def fill(store, steps=(1, 2, 3, 4), *, milestone: int = 2) -> None:
    """Checkpoints carrying val_loss (lowest at step 1), one of them a milestone."""
    for step in steps:
        store.save({"w": torch.full((8,), float(step))}, step=step, milestone=step == milestone,
                   metrics={"val_loss": float(step)})


@pytest.fixture
def scored(tmp_path):
    path = tmp_path / "s"
    with cas.open(path) as store:
        fill(store)
    return path


# --- item 1: a policy with no rule removes nothing --------------------------------------------
@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_with_an_empty_policy_removes_nothing(scored, dry_run):
    with cas.open(scored) as store:
        report = store.gc(Retention(), dry_run=dry_run)
        assert report.removed == []
        assert sorted(ck.step for ck, _ in report.kept) == [1, 2, 3, 4]
        assert steps_of(store) == [1, 2, 3, 4]


def test_decide_with_no_rule_keeps_every_checkpoint(scored):
    with cas.open(scored) as store:
        assert all(Retention().decide(store.checkpoints()).values())


def test_open_with_an_empty_policy_is_refused_and_creates_nothing(tmp_path):
    path = tmp_path / "new"
    with pytest.raises(cas.CasError, match="no rule"):
        cas.open(path, retention=Retention())
    assert not path.exists()


# --- item 2: a rule naming a metric no checkpoint has is refused ------------------------------
@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_keep_best_of_a_missing_metric_is_refused(scored, dry_run):
    with cas.open(scored) as store:
        with pytest.raises(RetentionRefusedError, match="'val-loss'.*val_loss"):
            store.gc(keep_best="val-loss:min:2", keep_last=1, dry_run=dry_run)
        assert steps_of(store) == [1, 2, 3, 4]


def test_cli_gc_keep_best_of_a_misspelt_metric_is_refused(scored):
    out = run("gc", "--keep-best", "val-loss:min:2", store=scored)
    assert out.returncode == 2, out.stdout
    assert "val-loss" in out.stderr and "val_loss" in out.stderr and "Traceback" not in out.stderr
    assert [c["step"] for c in json.loads(run("ls", "--json", store=scored).stdout)] == [1, 2, 3, 4]
    assert run("gc", "--keep-best", "val_loss:min:1", store=scored).returncode == 0  # spelt right, it works


def test_retention_after_save_before_the_metric_is_logged_warns_and_removes_nothing(tmp_path):
    """A run's first checkpoints may predate its first evaluation: their saves succeed, and
    retention waits for a score instead of removing them."""
    with cas.open(tmp_path / "s", retention=Retention(keep_last=1, keep_best=("val_loss", "min", 1))) as store:
        for step in (1, 2):
            with pytest.warns(RuntimeWarning, match=f"step {step} is committed.*'val_loss'"):
                ck = store.save({"w": torch.full((8,), float(step))}, step=step)
            assert ck.step == step
        assert steps_of(store) == [1, 2]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.save({"w": torch.zeros(8)}, step=3, metrics={"val_loss": 0.5})
            store.save({"w": torch.ones(8)}, step=4, metrics={"val_loss": 0.9})
        assert steps_of(store) == [3, 4]  # the best and the last


# --- item 13: a failing retention gc after a commit ------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill_disk_when_reached(gate: str, filler: str, free: int) -> threading.Thread:
    """Once a save pauses at `gate` (its commit done), fill the filesystem but `free` bytes,
    then let it go on."""
    def fill_then_release() -> None:
        while not os.path.exists(gate + ".reached"):
            threading.Event().wait(0.01)
        try:
            with open(filler, "wb", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while f.write(b"\0" * 4096):
                        pass
                f.truncate(max(f.tell() - free, 0))
        finally:
            open(gate, "w").close()
    thread = threading.Thread(target=fill_then_release, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("free", [0, 48 << 10], ids=["index-write-fails", "pack-rewrite-fails"])
def test_a_full_disk_in_the_retention_gc_after_a_commit_warns_and_returns_the_checkpoint(tiny_fs, free):
    """Step 1's pack holds objects step 2 shares, so dropping step 1 rewrites that pack. On a
    full disk the index's write transaction fails (lmdb.DiskError); with a little space left,
    the index writes fit and the pack rewrite fails (OSError ENOSPC), which the save reported
    as 'nothing was committed' though step 2 was."""
    path, gate, filler = tiny_fs / "s", str(tiny_fs / "gate"), str(tiny_fs / "filler")
    shared = {f"p{i}": torch.randn(1024) for i in range(24)}  # 4 KiB objects: packed
    with cas.open(path, chunk_size=64 << 10, retention=Retention(keep_last=1)) as store:
        store.save({**shared, "own": torch.randn(1024)}, step=1)
        thread = _fill_disk_when_reached(gate, filler, free)
        faults.configure(f"save.committed=pause:{gate}")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ck = store.save({**shared, "own": torch.randn(1024)}, step=2)
        finally:
            faults.configure("")
            thread.join(10)
        assert ck.step == 2 and store.exists(2)
        # A failing gc warns; a pack rewrite that would not fit is no failure: gc plans rewrites
        # against the free space and defers it (tests/test_fs_edges.py). Never an exception.
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert all("step 2 is committed" in m for m in said) and (said or free)
        with pytest.raises(cas.CheckpointExistsError):
            store.save({"w": torch.zeros(1)}, step=2)
        os.unlink(filler)  # space is back: the next save's gc catches up
        store.save({**shared, "own": torch.randn(1024)}, step=3)
        assert steps_of(store) == [3]
        assert store.verify().ok


# --- item 4: a folder import with retention is all or nothing ---------------------------------
def _folder(tmp_path, steps=(10, 20, 30), bad: int | None = None):
    folder = tmp_path / "old_run"
    folder.mkdir()
    for step in steps:
        torch.save({"w": torch.full((16,), float(step))}, folder / f"ckpt-{step}.pt")
    if bad is not None:
        (folder / f"ckpt-{bad}.pt").write_bytes(b"not a torch.save file")
    return folder


def test_folder_import_with_retention_refused_changes_nothing(tmp_path):
    folder = _folder(tmp_path, bad=40)
    with cas.open(tmp_path / "s", retention=Retention(keep_last=2)) as store:
        fill(store, (1, 2))
        with pytest.raises(ImportRefusedError, match="ckpt-40.pt"):
            store.import_folder(folder)
        assert steps_of(store) == [1, 2]
        assert torch.equal(store.load(1)["w"], torch.full((8,), 1.0))


def test_folder_import_with_retention_applies_it_once_at_the_end(tmp_path):
    folder = _folder(tmp_path)
    with cas.open(tmp_path / "s", retention=Retention(keep_last=2)) as store:
        fill(store, (1, 2))
        result = store.import_folder(folder)
        assert [ck.step for _, ck in result.checkpoints] == [10, 20, 30]
        assert steps_of(store) == [20, 30]
        store.save({"w": torch.zeros(8)}, step=31)  # retention after save still applies
        assert steps_of(store) == [30, 31]


# --- item 15e: a killed folder import, run again ---------------------------------------------
def test_a_killed_folder_import_completes_when_run_again(tmp_path):
    folder, store = _folder(tmp_path), tmp_path / "s"
    killed = run("import", folder, store=store, faults="import.file_imported=kill@2")
    assert killed.returncode == -9, killed.stderr
    with cas.open(store) as s:
        assert steps_of(s) == [10, 20]
    again = run("import", folder, "--json", store=store)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert [c["step"] for c in report["imported"]] == [30]
    assert [c["step"] for c in report["already_imported"]] == [10, 20]
    plain = run("import", folder, store=store)
    assert plain.returncode == 0 and "already imported ckpt-10.pt as step 10" in plain.stdout, plain.stdout
    with cas.open(store) as s:
        assert steps_of(s) == [10, 20, 30]
        for step in (10, 20, 30):
            assert torch.equal(s.load(step)["w"], torch.full((16,), float(step)))


def test_a_rerun_with_a_changed_file_at_a_held_step_is_refused(tmp_path):
    folder, store = _folder(tmp_path, steps=(10, 20)), tmp_path / "s"
    assert run("import", folder, store=store).returncode == 0
    torch.save({"w": torch.zeros(16)}, folder / "ckpt-20.pt")
    torch.save({"w": torch.zeros(16)}, folder / "ckpt-30.pt")
    out = run("import", folder, store=store)
    assert out.returncode == 2 and "20" in out.stderr and "never overwritten" in out.stderr, out.stderr
    with cas.open(store) as s:
        assert steps_of(s) == [10, 20]
        assert torch.equal(s.load(20)["w"], torch.full((16,), 20.0))
