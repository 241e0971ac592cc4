"""Resume equivalence: stop at step k, restore in a fresh process, train to N; the losses and the
final parameters and optimizer state equal an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
N, K = 30, 17  # K is mid-epoch (12 batches an epoch), after the LR warmup


def run(*args) -> dict:
    out = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run("full", tmp_path_factory.mktemp("full") / "unused", N)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_resume_in_a_fresh_process_is_bit_for_bit(tmp_path, uninterrupted, how):
    store = tmp_path / "store"
    first = run("first", store, N, K, how)
    assert first["losses"] == uninterrupted["losses"][:K]
    second = run("second", store, N)
    assert first["losses"] + second["losses"] == uninterrupted["losses"]
    assert second["digest"] == uninterrupted["digest"]
    if how == "async":  # the first process trained on to N while its save ran: same end state
        assert first["digest"] == uninterrupted["digest"]
