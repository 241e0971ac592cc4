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
