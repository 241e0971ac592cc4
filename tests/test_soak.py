"""The randomized multi-process soak (tests/soak.py), short, with a fixed seed; and what it found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

import cas

SOAK = os.path.join(os.path.dirname(__file__), "soak.py")
OPTS = dict(chunk_size=64 << 10, pack_max=16 << 10)


def soak(tmp_path, seed: int, *options: str) -> dict:
    """A short soak (tests/soak.py) of a store under tmp_path: its figures, once every check of
    the soak itself held (nothing lost, verify clean, exactly the reachable objects, no worker failed)."""
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, SOAK, "--seconds", "25", "--seed", str(seed), "--store", str(tmp_path / "s"),
                           "--check-every", "12", "--kill-every", "2.5", "--min-saves", "4", "--no-index-deletions",
                           "--json", str(out), *options],
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
    return figures


def test_soak_loses_no_committed_checkpoint(tmp_path):
    """Four writers (plain, delta, async, async with deltas), a collider re-saving pinned steps, a
    gc loop with random retention, verify, repair and index deletions; random SIGKILLs and fault
    points; checked once half way and at the end. About 30 s of soak plus the checks (longer runs:
    docs/robustness.md)."""
    soak(tmp_path, 3)


def test_an_encrypted_soak_loses_nothing_and_every_key_opens_as_journaled(tmp_path):
    """The same soak on an encrypted store, its gc loop also running `cas key add` and `cas key
    remove` under the SIGKILLs (some restarts with a keys.* fault point armed): no committed
    checkpoint lost, and at each check every key added opens the store as itself and every key
    removed is refused."""
    key_file = tmp_path / "key"
    key_file.write_bytes(os.urandom(32))
    figures = soak(tmp_path, 4, "--key-file", str(key_file))
    assert figures["keys_ok"], figures["problems"]
    assert figures["keys"]["added"] > 0 and figures["keys"]["checked"] > 0, figures["keys"]


FLIPPER = """
import sys, time, cas
with cas.open(sys.argv[1], chunk_size=64 << 10, pack_max=16 << 10) as s:
    s.checkpoints()
    print("ready", flush=True)
    n, deadline = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        try:
            s.set_pinned(0, n % 2 == 0)  # a commit (one record log entry) as often as it can
        except cas.StoreWriteError:  # it loses the same race at times: go on
            pass
        n += 1
"""


def test_saves_commit_beside_a_busy_process_on_a_deleted_index(tmp_path):
    """Found by the soak: after index/*.mdb is deleted under running processes, those and the
    ones opening afterwards held two LMDB environments whose commits raced on the record log
    alone, and saves beside a busy process failed with "the record log ... kept moving". A process
    on an orphaned index now opens the index at the path again before its next change."""
    path = tmp_path / "s"
    with cas.open(path, **OPTS) as store:
        store.save({"t": torch.zeros(4)}, step=0)
    children = [subprocess.Popen([sys.executable, "-c", FLIPPER, str(path), "90"], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for name in ("data.mdb", "lock.mdb"):  # the cache files go while the child has them open
            os.unlink(path / "index" / name)
        refused = []
        with cas.open(path, **OPTS) as store:  # rebuilds a new index beside the child's
            for step in range(1, 9):
                try:
                    store.save({"t": torch.full((4,), float(step))}, step=step)
                except cas.StoreWriteError as exc:
                    assert "kept moving" in str(exc)
                    refused.append(step)
    finally:
        for child in children:
            child.kill()
            child.wait()
    with cas.open(path, **OPTS) as store:  # nothing is lost: a refused save committed nothing
        assert [ck.step for ck in store.checkpoints()] == [s for s in range(9) if s not in refused]
    assert refused == []


SAVER = """
import os, sys, time, torch, cas
path, go = sys.argv[1], sys.argv[2]
with cas.open(path, chunk_size=64 << 10, pack_max=16 << 10) as s:
    s.checkpoints()
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    g = torch.Generator().manual_seed(2)
    s.save({"big": torch.randn(64, 1024, generator=g), "small": torch.arange(2, 302)}, step=2)
    print("saved", flush=True)
"""


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(64, 1024, generator=g), "small": torch.arange(step, step + 300)}


def test_a_commit_during_a_rebuild_by_a_process_on_the_deleted_index_loads(tmp_path):
    """Found by the soak (seed 22): a rebuild scanned the objects, then folded the record log; a
    process still on the deleted index committed in between, and the new cache held that
    checkpoint without its objects yet called itself current (unloadable until `cas repair`).
    The rebuild now reads the log first: every entry's objects were durable before it."""
    path, flag, go = tmp_path / "s", str(tmp_path / "flag"), str(tmp_path / "go")
    with cas.open(path, **OPTS) as store:
        store.save(_state(1), step=1)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(path), go], stdout=subprocess.PIPE, text=True)
    assert saver.stdout.readline().strip() == "ready"  # its LMDB environment is the index below
    for name in ("data.mdb", "lock.mdb"):
        os.unlink(path / "index" / name)
    opener = subprocess.Popen([sys.executable, "-c", f"import cas; cas.open({str(path)!r}).close()"],
                              env=dict(os.environ, CAS_FAULTS=f"cache.rebuilding=pause:{flag}"))
    deadline = time.monotonic() + 120
    while not os.path.exists(flag + ".reached"):  # the opener has scanned the objects, not yet the log
        assert time.monotonic() < deadline and opener.poll() is None
        time.sleep(0.01)
    # The saver goes on now. Since a process reopens an index deleted under it before it saves,
    # its commit waits for the opener's rebuild transaction (once it waited out the fault point's
    # two-minute pause here); either order must leave a cache that holds step 2 and its objects.
    open(go, "w").close()
    time.sleep(0.5)
    open(flag, "w").close()
    assert saver.stdout.readline().strip() == "saved"
    assert saver.wait(timeout=120) == 0
    assert opener.wait(timeout=120) == 0
    with cas.open(path, **OPTS) as store:  # the rebuilt cache is current: nothing rebuilds it again
        loaded = store.load(2)  # MissingObjectError: object file is missing (checkpoint step 2, ...)
        assert torch.equal(loaded["big"], _state(2)["big"]) and torch.equal(loaded["small"], _state(2)["small"])
        assert store.verify().ok
        store.gc()
