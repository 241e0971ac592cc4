"""The randomized multi-process soak (tests/soak.py), short, with a fixed seed; and what it found."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import cas

SOAK = os.path.join(os.path.dirname(__file__), "soak.py")
OPTS = dict(chunk_size=64 << 10, pack_max=16 << 10)


def test_soak_loses_no_committed_checkpoint(tmp_path):
    """Four writers (plain, delta, async, async with deltas), a collider re-saving pinned steps, a
    gc loop with random retention, verify, repair and index deletions; random SIGKILLs and fault
    points; checked once half way and at the end. About 45 s of soak plus the checks."""
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, SOAK, "--seconds", "40", "--seed", "3", "--store", str(tmp_path / "s"),
                           "--check-every", "20", "--kill-every", "2.5", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["verify_ok"] and figures["exactly_reachable"], figures["problems"]
    assert figures["collisions_committed"] == 0
    assert not figures["failures"], [(f["process"], f["tail"]) for f in figures["failures"]]
    assert figures["checkpoints_checked"] > 0 and figures["kills"] > 0
    assert sum(figures["saves"].values()) > 0
    assert proc.returncode == 0, proc.stdout[-4000:]


FLIPPER = """
import sys, time, cas
with cas.open(sys.argv[1], chunk_size=64 << 10, pack_max=16 << 10) as s:
    s.checkpoints()
    print("ready", flush=True)
    n, deadline = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        s.set_pinned(0, n % 2 == 0)  # a commit (one record log entry) as often as it can
        n += 1
"""


@pytest.mark.xfail(strict=True, reason="found by the soak: after index/*.mdb is deleted under a running process, "
                   "that process and the ones opening afterwards hold two LMDB environments; their commits "
                   "race on the record log alone, and a save (or a retention gc) that loses 5 rounds in a row "
                   "fails with StoreWriteError 'the record log ... kept moving', nothing committed")
def test_saves_commit_beside_a_busy_process_on_a_deleted_index(tmp_path):
    path = tmp_path / "s"
    with cas.open(path, **OPTS) as store:
        store.save({"t": torch.zeros(4)}, step=0)
    child = subprocess.Popen([sys.executable, "-c", FLIPPER, str(path), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for name in ("data.mdb", "lock.mdb"):  # the cache files go while the child has them open
            os.unlink(path / "index" / name)
        refused = []
        with cas.open(path, **OPTS) as store:  # rebuilds a new index beside the child's
            for step in range(1, 21):
                try:
                    store.save({"t": torch.full((4,), float(step))}, step=step)
                except cas.StoreWriteError as exc:
                    assert "kept moving" in str(exc)
                    refused.append(step)
    finally:
        child.kill()
        child.wait()
    with cas.open(path, **OPTS) as store:  # nothing is lost: a refused save committed nothing
        assert [ck.step for ck in store.checkpoints()] == [s for s in range(21) if s not in refused]
    assert refused == []
