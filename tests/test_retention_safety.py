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
from cas.gc.retention import Retention
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
